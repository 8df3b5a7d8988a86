"""[SEP] as a no-op: each layer's attention beside the loss's gradient on it (Clark et al. 2019, section 3.2).

See docs/methods.md#sep-as-a-no-op.

Per layer, the mean attention to [SEP] (and to [CLS], punctuation and every key) beside the mean magnitude of the
gradient of the loss with respect to those attention weights, ``|dL/da[i, j]|``: high attention with a small gradient
means that attending to the token changes little, the "no-op" reading of Clark et al.'s Figure 3.

- The loss: the masked-LM loss, with a share (15%) of each sequence's non-special pieces replaced by the mask token,
  chosen by a generator keyed by the sequence and the seed (:func:`~bertology.core.statistics.stats.keyed_rng`), the mean
  cross-entropy over them; for a decoder (docs/methods.md#decoders), which has no masked-LM loss, the causal LM loss, the
  mean next-token cross-entropy over the sequence's real pieces (:func:`~bertology.core.learning.tasks.next_token_losses`; none on
  padding); or, for a sequence classifier and a task (``--task``), the cross-entropy of the gold label.
  Each sequence's own loss is differentiated (the batch's loss is their sum).
- The gradient: the attention weights are taken at the ``pattern`` hook point, and ``dL/da`` is the derivative of the loss
  along every path from them (through the later layers' attention too), with the model in eval mode.
- Per sequence, layer and token set K: attention ``(1/(H n)) sum_h sum_i sum_{j in K} a[h, i, j]`` (docs/methods.md#head-profile,
  averaged over heads), and gradient ``(1/(H n |K|)) sum_h sum_i sum_{j in K} |dL/da[h, i, j]|``, the mean magnitude per
  weight to K; ``all`` (every key) is the reference a set's gradient is small or large against. Then the mean over
  sequences with 95% intervals.
- The token sets are the model kind's anchors (:func:`gradient_targets`): a decoder has no [CLS] or [SEP], its sets are
  the first token (in [CLS]'s place), punctuation and every key. Both kinds are one computation over the queries of a mean
  (:meth:`~bertology.core.model.kinds.Kind.query_mask`) and the keys each sees (:meth:`~bertology.core.model.kinds.Kind.visible_keys`):
  attention ``(1/(H m)) sum_h sum_{i in Q} sum_{j in K, j seen by i} a[h, i, j]`` over the ``m = |Q|`` queries, and the
  gradient averaged over the weights that exist, those pairs. On an encoder Q is every token and every key is seen (the
  formulas above); on a decoder Q leaves out row 0 (``m = n - 1``) and query ``i`` sees ``j <= i`` (``dL/da[i, j]`` of a
  masked key ``j > i`` is no weight's: ``a[i, j]`` is 0 whatever the scores).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from bertology.core.engine import MIN_PIECES, Encoded, Engine, PassSettings, RunStats
from bertology.core.errors import BertologyError
from bertology.core.learning.tasks import DEFAULT_MASK_SHARE, NEXT_TOKEN_LOSS, masked_positions, next_token_losses
from bertology.core.model.hooks import Hooks
from bertology.core.model.kinds import DECODER, Kind, kind_named
from bertology.core.model.models import LANGUAGE_MODEL, LoadedModel, load_model
from bertology.core.statistics.stats import RunningMoments
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run
from bertology.core.text.corpora import open_corpus

#: The anchor whose attention the study reads as a possible no-op, by the model's kind: Clark et al.'s [SEP]; a decoder's
#: first token (the candidate attention sink, docs/methods.md#decoders).
NO_OP_ANCHOR = {"encoder": "sep", "decoder": "first"}


def gradient_targets(kind: Kind) -> tuple[str, ...]:
    """The key sets whose attention and gradient are measured on a model of ``kind``: its anchors (an encoder's [CLS] and
    [SEP]; a decoder's first token, in [CLS]'s place, docs/methods.md#decoders), punctuation, and ``all``, every real key.
    The last anchor comes first: an encoder's [SEP], the token of Clark et al.'s gradient figure."""
    return (*reversed(kind.anchors), "punct", "all")


def keep_patterns(hooks: Hooks, patterns: list[torch.Tensor]) -> Hooks:
    """Keep each layer's weights from the ``pattern`` hook point in ``patterns``, still in the graph, so that
    ``torch.autograd.grad(loss, patterns)`` is ``dL/da`` along every path, later layers' attention included."""
    return hooks.add("pattern", lambda layer, pattern: patterns.append(pattern))


class AttentionGradients:
    """Mean attention and mean ``|dL/da|`` to [CLS], [SEP], punctuation and every key, per layer (see the module docstring);
    on a decoder to the first token, punctuation and every key (:attr:`targets`, :func:`gradient_targets`).

    ``labels`` (a classifier's task): the gold label index of each example, by its position in the corpus; without
    it, the loss is the masked-LM loss with ``mask_share`` of the pieces masked, or a decoder's causal LM loss.
    """

    def __init__(self, engine: Engine, *, mask_share: float = DEFAULT_MASK_SHARE, seed: int = 0, labels: dict[int, int] | None = None):
        self.engine, self.mask_share, self.seed, self.labels = engine, mask_share, seed, labels
        self.targets = gradient_targets(engine.model.kind)
        self.moments = RunningMoments((engine.model.num_layers, len(self.targets), 2))

    @property
    def masked_lm(self) -> bool:
        """Whether the loss is the masked-LM loss (no task labels, an encoder: a decoder has none, its loss is the next-token one)."""
        return self.labels is None and self.engine.model.kind is not DECODER

    def update(self, items: list[Encoded]) -> None:
        engine, model = self.engine, self.engine.model
        tensors = engine.collate(items)
        input_ids, mask = tensors["input_ids"].clone(), tensors["mask"]
        if self.masked_lm:
            targets = torch.full_like(input_ids, -100)
            mask_id = model.tokenizer.mask_token_id
            if mask_id is None:
                raise BertologyError(f"{model.name}: the tokenizer has no mask token for the masked-LM loss")
            for b, item in enumerate(items):
                chosen = torch.as_tensor(masked_positions(item, self.mask_share, self.seed), dtype=torch.long, device=input_ids.device)
                targets[b, chosen] = input_ids[b, chosen]
                input_ids[b, chosen] = mask_id
        inputs = engine.model_inputs(tensors, input_ids)
        patterns: list[torch.Tensor] = []
        with torch.enable_grad(), keep_patterns(Hooks(), patterns).attach(model.model):
            logits = model.model(**inputs).logits
            if self.labels is not None:
                gold = torch.tensor([self.labels[item.index] for item in items], device=logits.device)
                loss = torch.nn.functional.cross_entropy(logits, gold, reduction="sum")
            elif not self.masked_lm:  # a decoder's: each sequence's mean next-token cross-entropy, summed over sequences
                summed, predicted = next_token_losses(logits, input_ids, mask)
                loss = (summed / predicted.clamp(min=1)).sum()
            else:  # each sequence's mean cross-entropy over its masked pieces, summed over sequences
                losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
                loss = (losses.sum(dim=1) / (targets != -100).sum(dim=1).clamp(min=1)).sum()
            gradients = torch.autograd.grad(loss, patterns)
        attentions = torch.stack([pattern.detach() for pattern in patterns]).double()  # [layer, batch, head, n, n]
        magnitudes = torch.stack(gradients).abs().double()
        original = tensors["input_ids"]  # the token sets are the input's, masked pieces included
        kind = model.kind
        sets = kind.anchor_masks(original, mask, model.cls_token_id, model.sep_token_id)
        sets.update(punct=engine.punctuation(original) & mask, all=mask)
        heads = attentions.shape[2]
        queries = kind.query_mask(mask)  # the weights there are: the queries of a mean, each with the keys it sees
        visible = kind.visible_keys(mask) & queries[:, :, None]
        count = queries.sum(dim=1)
        rows = []
        for name in self.targets:
            pairs = (visible & sets[name][:, None, :]).double()
            size = pairs.sum(dim=(1, 2))
            weight = torch.einsum("lbhij,bij->lb", attentions, pairs) / (heads * count)
            gradient = torch.einsum("lbhij,bij->lb", magnitudes, pairs) / (heads * size)
            gradient = torch.where(size > 0, gradient, torch.nan)
            weight = torch.where(size > 0, weight, torch.nan)
            rows.append(torch.stack([weight, gradient], dim=-1))  # [layer, batch, 2]
        self.moments.push(torch.stack(rows, dim=1).permute(2, 0, 1, 3).cpu().numpy())  # [batch, layer, target, 2]

    def result(self) -> pd.DataFrame:
        """``layer, target, attention, attention_ci_low, attention_ci_high, gradient, gradient_ci_low, gradient_ci_high, n``."""
        means, (low, high) = self.moments.means(), self.moments.interval()
        layer, target = np.indices(means.shape[:2])
        table = pd.DataFrame({"layer": layer.ravel(), "target": np.array(self.targets)[target.ravel()]})
        for k, quantity in enumerate(("attention", "gradient")):
            table[quantity] = means[..., k].ravel()
            table[f"{quantity}_ci_low"] = low[..., k].ravel()
            table[f"{quantity}_ci_high"] = high[..., k].ravel()
        table["n"] = self.moments.count[..., 1].ravel().astype(np.int64)
        return table


@dataclass
class GradientStudy:
    """The result of :func:`attention_gradients`: the ``gradients`` table and what the run folder needs."""

    gradients: pd.DataFrame
    model: dict
    corpus: dict
    stats: RunStats
    settings: dict

    @claims_out
    def save(self, out, command: list[str] | None = None):
        """Write ``gradients.csv``/``.parquet``, the figure, ``report.html`` and ``manifest.json``, replacing ``out`` whole."""
        from bertology.render.html import Report
        from bertology.studies.gradients.report import gradients_section

        folder = RunFolder(out)
        folder.write_table("gradients", self.gradients)
        section = gradients_section(folder, self.gradients, self.settings["loss"], kind_named(self.model["kind"]))
        stats = self.stats.as_dict()
        summary = {"model": self.model["name"], "corpus": f"{self.corpus['name']} ({self.corpus['format']})", "loss": self.settings["loss"],
                   "sequences": stats["sequences"], "truncated": stats["truncated"], f"skipped (fewer than {MIN_PIECES} pieces)": stats["degenerate"],
                   "time": f"{stats['seconds']} s"}
        report = Report(f"bertology: attention and its gradient, {self.model['name']}", summary, [section]).render()
        manifest = {"model": self.model, "corpus": self.corpus, "settings": self.settings, "stats": stats}
        return complete_run(folder, manifest, report=report, command=command) / "report.html"


@claims_out(words=("format", "punct", "device"))
def attention_gradients(model=None, corpus=None, *, task=None, format: str = "auto", out=None, batch_size: int = 16,
                        max_length: int | None = None, limit: int | None = None, mask_share: float | None = None, punct: str = "upos",
                        seed: int = 0, device: str = "auto", trust_remote_code: bool = False, progress: bool = True,
                        command: list[str] | None = None, dtype: str = "auto") -> GradientStudy:
    """Attention to [SEP], [CLS] and punctuation per layer beside the gradient of the loss with respect to it.

    ``model``: a model with a masked-LM head (hub name, folder or :class:`~bertology.core.model.models.LoadedModel`;
    one without is refused in one line), a decoder (a causal language model: its loss is the next-token cross-entropy, and
    the first token stands in [CLS]'s place, docs/methods.md#decoders), or with ``task`` (a
    :class:`~bertology.core.learning.tasks.TaskData`) a sequence classifier, whose loss is the cross-entropy of the task's gold labels
    on its dev examples (then ``corpus`` must be None). ``mask_share``: the share of pieces masked for the masked-LM loss
    (0.15 when None; given for another loss, refused). ``dtype``: the weights' precision, as
    :func:`~bertology.core.model.models.load_model`'s (the attention and its gradient are float32 whatever it is).
    """
    if mask_share is not None and not 0 < mask_share <= 1:
        raise BertologyError(f"--mask-share must be in (0, 1], not {mask_share}")
    if task is not None:
        if corpus is not None:
            raise BertologyError("--task brings its own dev examples: give --task or --corpus, not both")
        examples, corpus_info = task.dev, {"name": f"{task.name} dev", "path": None, "format": "task", "sha256": None}
        examples = examples[:limit] if limit is not None else examples
    else:
        examples, corpus_info = open_corpus(corpus, format, limit)
    examples = list(examples)
    if not examples:
        raise BertologyError("the corpus has no examples")
    corpus_info["examples"] = len(examples)
    if isinstance(model, LoadedModel):
        loaded = model
    else:
        loaded = load_model(model, device=device, trust_remote_code=trust_remote_code, head="classifier" if task is not None else LANGUAGE_MODEL,
                            dtype=dtype)
    masked_lm = task is None and loaded.kind is not DECODER
    if mask_share is not None and not masked_lm:
        raise BertologyError("--mask-share applies to the masked-LM loss, not a task's" if task is not None else f"--mask-share applies to the "
                             f"masked-LM loss: {loaded.name} is a decoder, which has none (its loss is the next-token cross-entropy)")
    share = DEFAULT_MASK_SHARE if mask_share is None else mask_share
    labels = None
    if task is not None:
        names = [str(loaded.model.config.id2label[i]) for i in range(loaded.model.config.num_labels)]
        if sorted(names) != sorted(task.labels):
            raise BertologyError(f"{loaded.name}: its labels {names} are not the task's {list(task.labels)}: was it fine-tuned on {task.name}?")
        labels = {index: names.index(example.label) for index, example in enumerate(examples)}
    engine = Engine(loaded, PassSettings(batch_size=batch_size, max_length=max_length, seed=seed, device=device, punct=punct, dtype=dtype,
                                         trust_remote_code=trust_remote_code), progress=False)
    study = AttentionGradients(engine, mask_share=share, seed=seed, labels=labels)
    stats = RunStats()
    started = time.perf_counter()
    with tqdm(total=len(examples), unit="seq", desc="attention gradients", disable=not progress) as bar:
        for items in engine.batches(engine.encode(enumerate(examples), stats)):
            study.update(items)
            stats.sequences += len(items)
            stats.tokens += sum(len(item) for item in items)
            stats.batches += 1
            bar.update(len(items))
    stats.seconds = time.perf_counter() - started
    stats.check_counted(engine.settings.max_length)
    loss = f"masked LM ({share:.0%} of pieces masked)" if masked_lm else NEXT_TOKEN_LOSS if task is None else f"{task.name} cross-entropy"
    result = GradientStudy(study.result(), loaded.info(), corpus_info, stats,
                           {"loss": loss, **asdict(engine.settings), "mask_share": share if masked_lm else None, "limit": limit})
    if out is not None:
        result.save(out, command=command)
    return result
