"""Task data and the models that score it: GLUE-style classification, and a decoder's next-token prediction on a corpus.

A classification task is read from TSV files and scored by a fine-tuned classifier; its metrics on dev are GLUE's:
accuracy (SST-2, RTE), F1 and accuracy (MRPC), Matthews correlation (CoLA). A causal language model's are its causal LM
loss (nats per predicted piece) and perplexity.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import confusion_matrix
from torch.nn.utils.rnn import pad_sequence
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
)
from transformers.utils import logging as hf_logging

from bertology.core.errors import BertologyError, CorpusError, ModelError
from bertology.core.model.hooks import ATTN_IMPLEMENTATION, Hooks, register_attention
from bertology.core.model.interventions import (
    Intervention,
    shrink_to_config,
)
from bertology.core.model.models import (
    LoadedModel,
    load_model,
    load_tokenizer,
    loading_errors,
    require_safetensors,
    require_usable,
    resolve_device,
)
from bertology.core.statistics.stats import confusion_metric, keyed_rng, sequence_key
from bertology.core.text.corpora import Example, TableLayout, glue_layout, read_table

#: GLUE tasks bertology knows: folder name -> (task, metrics, positive label for F1).
GLUE_TASKS = {
    "sst-2": ("sst2", ("accuracy",), None),
    "cola": ("cola", ("matthews_correlation",), None),
    "mrpc": ("mrpc", ("f1", "accuracy"), "1"),
    "rte": ("rte", ("accuracy",), None),
}


#: The share of pieces the masked-LM loss masks unless ``mask_share`` says otherwise.
DEFAULT_MASK_SHARE = 0.15


def masked_positions(item, share: float, seed: int) -> np.ndarray:
    """The pieces to mask in one encoded sequence (:class:`~bertology.core.engine.Encoded`: its ``sequence_ids`` and
    ``example``): ``max(1, round(share * m))`` of its ``m`` non-special pieces, drawn without replacement from a generator
    keyed by the seed and the sequence (so every checkpoint and every run sees the same masks)."""
    candidates = np.array([p for p, segment in enumerate(item.sequence_ids) if segment is not None])
    if len(candidates) == 0:
        return candidates
    count = max(1, int(round(share * len(candidates))))
    return np.sort(keyed_rng(seed, "mask", *sequence_key(item.example)).choice(candidates, size=count, replace=False))


@dataclass(frozen=True)
class TaskData:
    """A classification task: its name, metrics, label names and train/dev examples."""

    name: str
    metrics: tuple[str, ...]
    labels: tuple[str, ...]
    train: list[Example]
    dev: list[Example]
    positive_label: str | None = None


def _check_labels(examples: list[Example], labels: tuple[str, ...], split: str) -> None:
    for example in examples:
        if example.label is None or example.label == "":
            raise CorpusError(split, example.line, "missing label")
        if example.label not in labels:
            raise CorpusError(split, example.line, f"label {example.label!r} does not occur in the training data ({', '.join(labels)})")


def load_task(folder: str | Path | None = None, *, train: str | Path | None = None, dev: str | Path | None = None,
              text_column: str | None = None, text_pair_column: str | None = None, label_column: str | None = None) -> TaskData:
    """A GLUE folder (``train.tsv``, ``dev.tsv``; the task from the folder's name), or user TSVs with named columns."""
    if folder is not None:
        folder = Path(folder)
        train, dev = folder / "train.tsv", folder / "dev.tsv"
        for path in (train, dev):
            if not path.is_file():
                raise CorpusError(path, None, "no such file (a task folder needs train.tsv and dev.tsv)")
    if train is None or dev is None:
        raise BertologyError("give a task folder, or --train and --dev files")
    train, dev = Path(train), Path(dev)
    if text_column is not None:
        if label_column is None:
            raise BertologyError("--text-column needs --label-column")
        layout = TableLayout(text_column, text_pair_column, label_column)
        train_examples, dev_examples = list(read_table(train, layout)), list(read_table(dev, layout))
        name, metrics, positive = train.parent.name or "custom", ("accuracy", "macro_f1"), None
    else:
        try:
            layouts = glue_layout(train), glue_layout(dev)
        except CorpusError as exc:
            raise CorpusError(exc.path, exc.line, f"{exc.message}; for another TSV name its columns with --text-column and --label-column") from exc
        train_examples, dev_examples = list(read_table(train, layouts[0])), list(read_table(dev, layouts[1]))
        key = train.parent.name.lower()
        if key not in GLUE_TASKS:
            raise BertologyError(f"{train.parent}: not a GLUE task folder bertology knows ({', '.join(GLUE_TASKS)}); "
                                 "name the columns with --text-column and --label-column")
        name, metrics, positive = GLUE_TASKS[key]
    labels = tuple(sorted({e.label for e in train_examples if e.label}))
    if len(labels) < 2:
        raise CorpusError(train, None, f"the training data has {len(labels)} label(s); classification needs at least 2")
    _check_labels(train_examples, labels, str(train))
    _check_labels(dev_examples, labels, str(dev))
    return TaskData(name, metrics, labels, train_examples, dev_examples, positive)


def seeded_subset(examples: list[Example], limit: int | None, seed: int) -> list[Example]:
    """A seeded random subset of ``limit`` examples, kept in file order (all of them when ``limit`` is None or larger)."""
    if limit is None or limit >= len(examples):
        return examples
    keep = np.random.default_rng(seed).permutation(len(examples))[:limit]
    return [examples[i] for i in sorted(keep)]


def positive_index(task: TaskData) -> int | None:
    """Index of the positive label (for F1) in ``task.labels``."""
    return task.labels.index(task.positive_label) if task.positive_label is not None else None


def task_metrics(task: TaskData, gold: list[str], predicted: list[str]) -> dict[str, float]:
    """The task's metrics on label strings, from scikit-learn's confusion matrix (:func:`bertology.core.statistics.stats.confusion_metric`)."""
    confusion = confusion_matrix(gold, predicted, labels=list(task.labels))
    return {metric: float(confusion_metric(confusion, metric, positive_index(task))) for metric in task.metrics}


def encode_examples(tokenizer, examples: list[Example], label_ids: dict[str, int] | None, max_length: int) -> list[dict]:
    """Tokenised rows (``input_ids``, ...) with the label's id under ``labels`` (none with ``label_ids`` None: unlabelled texts)."""
    texts = [e.text for e in examples]
    pairs = [e.text_pair for e in examples]
    encoded = tokenizer(texts, pairs if any(p is not None for p in pairs) else None, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in encoded]
    return [{**{k: encoded[k][i] for k in keys}, **({"labels": label_ids[e.label]} if label_ids is not None else {})} for i, e in enumerate(examples)]


def collate_rows(tokenizer, rows: list[dict], device) -> dict[str, torch.Tensor]:
    """Pad rows into a batch of tensors on ``device`` (labels included, where the rows have them)."""
    batch = tokenizer.pad([{k: v for k, v in row.items() if k != "labels"} for row in rows], return_tensors="pt")
    if rows and "labels" in rows[0]:
        batch["labels"] = torch.tensor([row["labels"] for row in rows])
    return {k: v.to(device) for k, v in batch.items()}


def length_batches(rows: list[dict], batch_size: int) -> list[list[int]]:
    """Row indices in batches of similar length (less padding)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def predict_logits(model, tokenizer, rows: list[dict], batch_size: int, device, hooks: Hooks | None = None) -> np.ndarray:
    """Logits ``[rows, classes]`` of a sequence classifier, with ``hooks`` (e.g. interventions) attached if given."""
    model.eval()
    logits = None
    with torch.inference_mode(), (hooks.attach(model) if hooks is not None else nullcontext()):
        for chunk in length_batches(rows, batch_size):
            inputs = collate_rows(tokenizer, [rows[i] for i in chunk], device)
            inputs.pop("labels")
            scores = model(**inputs).logits.float().cpu().numpy()
            logits = np.empty((len(rows), scores.shape[1]), dtype=np.float32) if logits is None else logits
            logits[chunk] = scores
    return logits


@dataclass
class TaskModel:
    """A fine-tuned sequence classifier, loaded with bertology's attention hook points."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    labels: tuple[str, ...]
    device: torch.device
    num_layers: int
    num_heads: int
    max_length: int = 128

    def encode(self, examples: list[Example], source: str) -> tuple[list[dict], np.ndarray]:
        """Tokenised rows and label ids; a label the model does not know is a ``FILE:LINE`` error."""
        ids = {label: i for i, label in enumerate(self.labels)}
        for example in examples:
            if example.label not in ids:
                name = example.source.rpartition(":")[0] if example.line is not None else example.source  # NAME:LINE
                raise CorpusError(name or source, example.line, f"label {example.label!r} is not one of the model's labels ({', '.join(self.labels)})")
        rows = encode_examples(self.tokenizer, examples, ids, self.max_length)
        return rows, np.array([row["labels"] for row in rows], dtype=np.int64)

    def logits(self, rows: list[dict], batch_size: int = 64, intervention: Intervention | None = None) -> np.ndarray:
        hooks = intervention.attach_to(Hooks(), self.num_heads) if intervention is not None else None
        return predict_logits(self.model, self.tokenizer, rows, batch_size, self.device, hooks)

    def losses(self, rows: list[dict], hooks: Hooks | None = None) -> torch.Tensor:
        """Each row's loss ``[rows]``, the cross-entropy of its gold label, with ``hooks`` attached (in the graph: differentiable)."""
        inputs = collate_rows(self.tokenizer, rows, self.device)
        labels = inputs.pop("labels")
        with hooks.attach(self.model) if hooks is not None else nullcontext():
            logits = self.model(**inputs).logits
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none")

    def info(self) -> dict:
        return {"name": self.name, "model_type": self.model.config.model_type, "architecture": type(self.model).__name__,
                "layers": self.num_layers, "heads": self.num_heads, "labels": list(self.labels), "device": str(self.device),
                "pruned_heads": getattr(self.model.config, "bertology_pruned_heads", None) or {}}


def load_task_model(path: str | Path, *, device: str | torch.device = "auto", max_length: int = 128, trust_remote_code: bool = False) -> TaskModel:
    """Load a sequence classifier (e.g. a folder written by ``bertology finetune`` or ``bertology prune``)."""
    register_attention()
    hf_logging.disable_progress_bar()
    source = str(Path(path).expanduser()) if Path(path).expanduser().exists() else str(path)
    torch_device = device if isinstance(device, torch.device) else resolve_device(device)
    if Path(source).is_dir():
        require_safetensors(source)
    with loading_errors(source):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        if config.architectures and not any(name.endswith("ForSequenceClassification") for name in config.architectures):
            raise ModelError(f"{source}: a {config.architectures[0]}, not a sequence classifier: a task needs one (fine-tune one with "
                             "`bertology finetune`); a decoder's heads are scored on a text corpus with --corpus instead of a task")
        if getattr(config, "bertology_pruned_heads", None):
            model, loading = _load_pruned(source, config, trust_remote_code)
        else:
            model, loading = AutoModelForSequenceClassification.from_pretrained(
                source, config=config, attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=trust_remote_code, use_safetensors=True,
                output_loading_info=True, ignore_mismatched_sizes=True)  # reported, then refused by require_whole_weights
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code)
    if "ForSequenceClassification" not in type(model).__name__:
        raise ModelError(f"{source}: not a sequence classifier (fine-tune one with `bertology finetune`)")
    require_usable(model, loading, tokenizer, source)
    labels = tuple(str(model.config.id2label[i]) for i in range(model.config.num_labels))
    model.to(torch_device).eval()
    return TaskModel(model, tokenizer, source, labels, torch_device, model.config.num_hidden_layers,
                     model.config.num_attention_heads, max_length)


def _load_pruned(source: str, config, trust_remote_code: bool) -> tuple[torch.nn.Module, dict]:
    """A pruned classifier (heads removed, as its config records) and its loading report in ``from_pretrained``'s form."""
    from safetensors.torch import load_file

    model = AutoModelForSequenceClassification.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=trust_remote_code)
    shrink_to_config(model)
    stored = load_file(str(Path(source) / "model.safetensors"))
    own = model.state_dict()
    mismatched = [(key, stored[key].shape, own[key].shape) for key in stored if key in own and stored[key].shape != own[key].shape]
    if not mismatched:
        model.load_state_dict(stored, strict=False)
    persistent = set(own)
    return model, {"missing_keys": sorted(persistent - set(stored)), "unexpected_keys": sorted(set(stored) - persistent), "mismatched_keys": mismatched}


def task_score(task: TaskData, gold: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    return task_metrics(task, [task.labels[i] for i in gold], [task.labels[i] for i in logits.argmax(-1)])


#: The metrics of :meth:`LanguageModel.score`; both are better lower.
LM_METRICS = ("lm_loss", "perplexity")
#: How reports and manifests name a causal language model's loss.
NEXT_TOKEN_LOSS = "causal LM loss (next-token cross-entropy)"


def next_token_losses(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal LM loss of each sequence of a right-padded batch: position ``i`` predicts piece ``i + 1``,
    ``-log softmax(logits[i])[input_ids[i + 1]]``, wherever both are real pieces (no loss on or from padding).

    Returns the summed cross-entropy ``[batch]`` (in the graph) and the count of predicted pieces ``[batch]``; their ratio
    is the sequence's mean, what transformers' ``model(input_ids, labels=input_ids).loss`` gives for the sequence alone."""
    predicted = mask[:, 1:] & mask[:, :-1]
    targets = input_ids[:, 1:].masked_fill(~predicted, -100)  # -100: cross_entropy's ignore_index, a loss of 0
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
    return losses.sum(dim=1), predicted.sum(dim=1)


@dataclass
class LanguageModel:
    """A decoder with its language-model head (docs/methods.md#decoders), scored by its causal LM loss on a text corpus: the
    next-token task of ``importance`` and ``prune``, with the interface of :class:`TaskModel` they use (``losses``, ``info``)."""

    loaded: LoadedModel
    max_length: int = 128

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def num_layers(self) -> int:
        return self.loaded.num_layers

    @property
    def num_heads(self) -> int:
        return self.loaded.num_heads

    def encode(self, examples: list[Example]) -> list[dict]:
        """Tokenised rows (``input_ids``), cut at ``max_length``; a text of fewer than two pieces predicts nothing and is left out."""
        texts, pairs = [e.text for e in examples], [e.text_pair for e in examples]
        encoded = self.tokenizer(texts, pairs if any(p is not None for p in pairs) else None, truncation=True, max_length=self.max_length)
        return [{"input_ids": ids} for ids in encoded["input_ids"] if len(ids) >= 2]

    def collate(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` right-padded into one batch on the model's device: ``input_ids`` and the mask of real pieces (bool)."""
        input_ids = pad_sequence([torch.tensor(row["input_ids"]) for row in rows], batch_first=True, padding_value=self.tokenizer.pad_token_id or 0)
        mask = pad_sequence([torch.ones(len(row["input_ids"]), dtype=torch.bool) for row in rows], batch_first=True)
        return input_ids.to(self.device), mask.to(self.device)

    def _summed_losses(self, rows: list[dict], hooks: Hooks | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`next_token_losses` of ``rows``, right-padded into one batch."""
        input_ids, mask = self.collate(rows)
        with hooks.attach(self.model) if hooks is not None else nullcontext():
            logits = self.model(input_ids=input_ids, attention_mask=mask.long()).logits
        return next_token_losses(logits, input_ids, mask)

    def losses(self, rows: list[dict], hooks: Hooks | None = None) -> torch.Tensor:
        """Each row's loss ``[rows]``, its mean next-token cross-entropy, with ``hooks`` attached (in the graph: differentiable)."""
        summed, predicted = self._summed_losses(rows, hooks)
        return summed / predicted

    def score(self, rows: list[dict], batch_size: int = 64, intervention: Intervention | None = None) -> dict[str, float]:
        """:data:`LM_METRICS` over ``rows``: ``lm_loss``, the next-token cross-entropy averaged over every predicted piece (nats),
        and ``perplexity``, ``exp(lm_loss)``."""
        hooks = intervention.attach_to(Hooks(), self.num_heads) if intervention is not None else None
        total, count = 0.0, 0
        with torch.inference_mode():
            for chunk in length_batches(rows, batch_size):
                summed, predicted = self._summed_losses([rows[i] for i in chunk], hooks)
                total += float(summed.double().sum())
                count += int(predicted.sum())
        return {"lm_loss": total / count, "perplexity": math.exp(total / count)}

    def info(self) -> dict:
        return {**self.loaded.info(), "pruned_heads": getattr(self.model.config, "bertology_pruned_heads", None) or {}}


def load_language_model(path: str | Path, *, device: str | torch.device = "auto", max_length: int = 128) -> LanguageModel:
    """Load a decoder with its language-model head (an encoder is refused in one line), texts cut at ``max_length`` pieces."""
    loaded = load_model(path, device=device, head="causal-lm")
    return LanguageModel(loaded, min(max_length, loaded.max_length))
