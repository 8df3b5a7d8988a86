"""Fine-tuning an encoder on a GLUE-style classification task, with resumable checkpoints.

Tasks: SST-2 and CoLA (single sentences), MRPC and RTE (pairs), read from a folder with
``train.tsv`` and ``dev.tsv`` in GLUE's format, or any TSV pair with named text and label columns.
Training is a standard loop: AdamW with linear warm-up and decay (``transformers``'
``get_linear_schedule_with_warmup``), length-padded batches in a seeded order. Every
``checkpoint_every`` steps the model, optimiser, scheduler and random states are saved in
``out/checkpoint/``, so an interrupted run started again with the same command resumes where it
stopped; the state holds only tensors and plain values and is read with ``weights_only=True``, so a
planted pickle is refused, never run. The result is a model folder (safetensors, tokenizer, config,
``metrics.json``) that every bertology command accepts as ``--model``; it replaces ``out`` whole at
the end (:class:`~bertology.core.runfolder.RunFolder`), the checkpoint with it.

Metrics on dev, as GLUE reports them: accuracy (SST-2, RTE), F1 and accuracy (MRPC), Matthews
correlation (CoLA), each against the majority-class baseline (the most frequent training label).
"""

from __future__ import annotations

import math
import pickle
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import confusion_matrix
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from bertology.core.corpora import Example, TableLayout, glue_layout, read_table
from bertology.core.errors import BertologyError, CorpusError
from bertology.core.hooks import Hooks
from bertology.core.models import default_model_path, quiet_transformers, require_safetensors, resolve_device
from bertology.core.runfolder import RunFolder, claims_out
from bertology.core.stats import confusion_metric

#: GLUE tasks bertology knows: folder name -> (task, metrics, positive label for F1).
GLUE_TASKS = {
    "sst-2": ("sst2", ("accuracy",), None),
    "cola": ("cola", ("matthews_correlation",), None),
    "mrpc": ("mrpc", ("f1", "accuracy"), "1"),
    "rte": ("rte", ("accuracy",), None),
}


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
            raise BertologyError(f"{train.parent}: not a GLUE task folder bertology knows ({', '.join(GLUE_TASKS)}); name the columns with --text-column and --label-column")
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
    """The task's metrics on label strings, from scikit-learn's confusion matrix (:func:`bertology.core.stats.confusion_metric`)."""
    confusion = confusion_matrix(gold, predicted, labels=list(task.labels))
    return {metric: float(confusion_metric(confusion, metric, positive_index(task))) for metric in task.metrics}


@dataclass
class FinetuneSettings:
    """What a fine-tuning run does (saved with its checkpoints: a resume must match)."""

    model: str
    task: str
    max_length: int = 128
    batch_size: int = 32
    epochs: float = 1.0
    learning_rate: float = 5e-5
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_train_examples: int | None = None
    seed: int = 0


def encode_examples(tokenizer, examples: list[Example], label_ids: dict[str, int], max_length: int) -> list[dict]:
    """Tokenised rows (``input_ids``, ...) with the label's id under ``labels``."""
    texts = [e.text for e in examples]
    pairs = [e.text_pair for e in examples]
    encoded = tokenizer(texts, pairs if any(p is not None for p in pairs) else None, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in encoded]
    return [{**{k: encoded[k][i] for k in keys}, "labels": label_ids[e.label]} for i, e in enumerate(examples)]


def collate_rows(tokenizer, rows: list[dict], device) -> dict[str, torch.Tensor]:
    """Pad rows into a batch of tensors on ``device`` (labels included)."""
    batch = tokenizer.pad([{k: v for k, v in row.items() if k != "labels"} for row in rows], return_tensors="pt")
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


def random_states() -> dict:
    """Python's, NumPy's, torch's and CUDA's random states as tensors and plain values (what a ``weights_only`` load reads)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), position, has_gauss, cached_gaussian],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_random_states(states: dict) -> None:
    """Set the random states saved by :func:`random_states`."""
    random.setstate(states["python"])
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


#: What a fine-tuning state holds (:func:`finetune`); a state without one of them is from an older bertology.
FINETUNE_STATE_KEYS = ("model", "optimizer", "scheduler", "step", "losses", "settings", "random")


def load_training_state(path: Path, keys: tuple[str, ...] = ()) -> dict:
    """A state written by :func:`save_training_state`, loaded on the CPU with ``weights_only=True``: anything else is refused, never run.

    ``keys``: what the state must hold; one missing (a state saved by an older bertology) is a one-line error."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise BertologyError(f"{path}: refused: not a training state of tensors and plain values (loading it could run code); delete it to start over") from exc
    if not isinstance(state, dict):
        raise BertologyError(f"{path}: not a training state; delete it to start over")
    missing = [key for key in keys if key not in state]
    if missing:
        raise BertologyError(f"{path}: a training state from an older bertology (missing {', '.join(missing)}); delete {path.parent} to start again")
    return state


def save_training_state(folder: Path, state: dict, tokenizer=None) -> None:
    """Atomically replace ``folder`` with ``state.pt`` holding ``state`` (tensors and plain values only) and the tokenizer if given."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save(state, partial / "state.pt")
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    partial.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


@claims_out
def finetune(
    task: TaskData,
    out: str | Path,
    *,
    model: str | Path | None = None,
    max_length: int = 128,
    batch_size: int = 32,
    epochs: float = 1.0,
    learning_rate: float = 5e-5,
    warmup: float = 0.1,
    weight_decay: float = 0.01,
    max_train_examples: int | None = None,
    seed: int = 0,
    device: str = "auto",
    checkpoint_every: int = 200,
    max_steps: int | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> dict:
    """Fine-tune ``model`` (default: all-MiniLM-L6-v2) on ``task``; write the model folder ``out`` and return its metrics.

    ``out`` is checked and claimed before anything else. ``max_steps`` stops training early (the run
    can be resumed later: tests use it to interrupt).
    """
    out = Path(out)
    source = str(default_model_path()) if model is None else str(model)
    settings = FinetuneSettings(source, task.name, max_length, batch_size, epochs, learning_rate, warmup, weight_decay, max_train_examples, seed)
    torch_device = resolve_device(device)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    label_ids = {label: i for i, label in enumerate(task.labels)}
    if Path(source).is_dir():
        require_safetensors(source)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
            network = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=len(task.labels), id2label=dict(enumerate(task.labels)), label2id=label_ids,
                trust_remote_code=trust_remote_code, ignore_mismatched_sizes=True, use_safetensors=True,
            )
    except OSError as exc:
        raise BertologyError(f"model {source!r} could not be loaded (no network? pass a local model folder): {str(exc).splitlines()[0]}") from exc
    network.to(torch_device)

    train = seeded_subset(task.train, max_train_examples, seed)
    train_rows = encode_examples(tokenizer, train, label_ids, max_length)
    dev_rows = encode_examples(tokenizer, task.dev, label_ids, max_length)
    steps_per_epoch = math.ceil(len(train_rows) / batch_size)
    total_steps = max(1, math.ceil(steps_per_epoch * epochs))

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {"params": [p for n, p in network.named_parameters() if not n.endswith(no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in network.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(warmup * total_steps), total_steps)

    checkpoint = out / "checkpoint"
    step, losses = 0, []
    if (checkpoint / "state.pt").is_file():
        # Loaded on the CPU: RNG states must stay CPU tensors; load_state_dict moves the rest to the model's device.
        state = load_training_state(checkpoint / "state.pt", FINETUNE_STATE_KEYS)
        if state.get("settings") != asdict(settings):
            raise BertologyError(f"{checkpoint}: a checkpoint of a run with other settings is there; use another --out or delete it")
        network.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, losses = state["step"], state["losses"]
        restore_random_states(state["random"])
    resumed_from = step

    started = time.perf_counter()
    network.train()
    stop_at = total_steps if max_steps is None else min(total_steps, max_steps)
    with tqdm(total=total_steps, initial=step, unit="step", desc="fine-tuning", disable=not progress) as bar:
        while step < stop_at:
            epoch, position = divmod(step, steps_per_epoch)
            order = np.random.default_rng((seed, epoch)).permutation(len(train_rows))
            chunk = order[position * batch_size : (position + 1) * batch_size]
            loss = network(**collate_rows(tokenizer, [train_rows[i] for i in chunk], torch_device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
            if step % checkpoint_every == 0 or step == stop_at:
                save_training_state(checkpoint, {
                    "model": network.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "losses": losses, "settings": asdict(settings), "random": random_states(),
                })
    seconds = time.perf_counter() - started
    if step < total_steps:
        return {"interrupted_at_step": step, "total_steps": total_steps}

    predicted = predict_logits(network, tokenizer, dev_rows, batch_size * 2, torch_device).argmax(-1)
    gold = [e.label for e in task.dev]
    majority = max(task.labels, key=[e.label for e in train].count)
    metrics = {
        "task": task.name,
        "model": source,
        "metric": task_metrics(task, gold, [task.labels[i] for i in predicted]),
        "majority_baseline": task_metrics(task, gold, [majority] * len(gold)),
        "majority_label": majority,
        "train_examples": len(train_rows),
        "dev_examples": len(dev_rows),
        "steps": total_steps,
        "resumed_from_step": resumed_from or None,
        "seconds": round(seconds, 1),
        "loss_curve": [round(float(np.mean(losses[i : i + 50])), 4) for i in range(0, len(losses), 50)],
        "settings": asdict(settings),
    }
    folder = RunFolder(out)  # the model replaces out whole; the checkpoint goes with the previous contents
    network.save_pretrained(folder.path)
    tokenizer.save_pretrained(folder.path)
    folder.write_json("metrics.json", metrics)
    folder.commit()
    return metrics
