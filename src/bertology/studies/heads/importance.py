"""Which heads matter for a task: leave-one-out disabling, gradient importance and pruning.

The task is a classifier's (a fine-tuned model and its dev examples) or, for a decoder, next-token prediction on a text
corpus (:class:`~bertology.core.learning.tasks.LanguageModel`: the causal LM loss, its metrics ``lm_loss`` and ``perplexity``).

* :class:`LeaveOneOut` (Kovaleva et al. 2019; Michel et al. 2019's exact ablation): the task metric with
  each single head, and each whole layer, masked or made uniform. The hidden state entering layer ``l``
  does not depend on an intervention at layer ``l``, so it is computed once per batch and the ``H + 1``
  variants of layer ``l`` run from there, stacked into one batch. For first-token classifiers the last
  layer is computed for the first token only. Each change comes with a paired bootstrap interval over
  examples and an FDR-corrected p (:func:`bertology.core.statistics.stats.paired_bootstrap`).
* :class:`GradientImportance` (Michel et al. 2019): ``I_h = E_x |dL(x)/d xi_h|``, the absolute gradient
  of the task loss (a classifier's, or a decoder's causal LM loss) with respect to a per-example head gate, averaged over examples;
  :func:`normalise_importance` then divides it by its layer's l2 norm (or as ``--normalise`` says).
* :func:`pruning_curve`: mask the least important heads by normalised importance (10% of all heads per
  step by default), recompute the importance, evaluate, repeat down to one head per layer.
  :func:`prune_and_time` removes the heads of one point of the curve physically, saves the smaller model
  and times it against the full one.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from statsmodels.stats.multitest import multipletests
from tqdm.auto import tqdm

from bertology.core.errors import BertologyError
from bertology.core.learning.tasks import (
    NEXT_TOKEN_LOSS,
    LanguageModel,
    TaskData,
    TaskModel,
    collate_rows,
    length_batches,
    load_language_model,
    load_task_model,
    positive_index,
    seeded_subset,
    task_score,
)
from bertology.core.model.hooks import Hooks
from bertology.core.model.interventions import INTERVENTIONS, HeadGates, Intervention, LayerReplay, attach_variants, prune_heads, reads_first_token_only
from bertology.core.options import check_seed
from bertology.core.statistics.stats import MIN_SAMPLE, corrected, paired_bootstrap
from bertology.core.storage.runfolder import claims_out
from bertology.core.text.corpora import open_corpus
from bertology.studies import get_study
from bertology.studies.heads import DEFAULT_IMPORTANCE_SPLIT


def _variants(kind: str, layer: int, num_heads: int) -> list[Intervention]:
    """Each head of ``layer`` alone, then the whole layer."""
    return [Intervention.of(kind, layer, head) for head in range(num_heads)] + [Intervention.of(kind, layer)]


class LeaveOneOut:
    """Predictions with each head, and each layer, disabled on its own.

    ``reuse=False`` is the naive way (a full forward pass per variant), kept for checking and benchmarks.
    ``first_token_only`` (with reuse, for first-token classifiers) computes the last layer for the first token only.
    """

    def __init__(self, task_model: TaskModel, intervention: str = "mask", *, batch_size: int = 16, reuse: bool = True,
                 first_token_only: bool = True, progress: bool = True):
        if intervention not in INTERVENTIONS:
            raise ValueError(f"unknown intervention {intervention!r}; known: {', '.join(INTERVENTIONS)}")
        self.task_model, self.intervention, self.batch_size, self.reuse, self.progress = task_model, intervention, batch_size, reuse, progress
        self.first_token_only = reuse and first_token_only and reads_first_token_only(task_model.model)

    def variants(self) -> pd.DataFrame:
        """``layer, head`` of each variant in the order of :meth:`predict`'s output (head -1: the whole layer)."""
        heads = self.task_model.num_heads
        return pd.DataFrame([(layer, head) for layer in range(self.task_model.num_layers) for head in [*range(heads), -1]], columns=["layer", "head"])

    def predict(self, rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """Logits without intervention ``[n, C]`` and with each variant ``[variants, n, C]``."""
        tm = self.task_model
        layers, heads = tm.num_layers, tm.num_heads
        base, variants = None, None
        replay = LayerReplay(tm.model) if self.reuse else None
        batches = length_batches(rows, self.batch_size)
        with torch.inference_mode(), tqdm(total=len(rows), unit="ex", desc=f"leave-one-out ({self.intervention})", disable=not self.progress) as bar:
            for chunk in batches:
                inputs = collate_rows(tm.tokenizer, [rows[i] for i in chunk], tm.device)
                inputs.pop("labels")
                if self.reuse:
                    with replay.record() as hidden:
                        clean = tm.model(**inputs).logits
                else:
                    clean = tm.model(**inputs).logits
                if base is None:
                    base = np.empty((len(rows), clean.shape[1]), dtype=np.float32)
                    variants = np.empty((layers * (heads + 1), len(rows), clean.shape[1]), dtype=np.float32)
                base[chunk] = clean.float().cpu().numpy()
                for layer in range(layers):
                    block = _variants(self.intervention, layer, heads)
                    span = slice(layer * (heads + 1), (layer + 1) * (heads + 1))
                    if self.reuse:
                        stacked = {k: v.repeat(len(block), *([1] * (v.dim() - 1))) for k, v in inputs.items()}
                        start = hidden[layer - 1].repeat(len(block), 1, 1) if layer > 0 else None
                        hooks = attach_variants(Hooks(), block, heads)
                        with replay.start_at(layer, start, first_token_only=self.first_token_only), hooks.attach(tm.model):
                            logits = tm.model(**stacked).logits
                        variants[span, chunk] = logits.view(len(block), len(chunk), -1).float().cpu().numpy()
                    else:
                        for index, variant in zip(range(span.start, span.stop), block):
                            with variant.attach_to(Hooks(), heads).attach(tm.model):
                                variants[index, chunk] = tm.model(**inputs).logits.float().cpu().numpy()
                bar.update(len(chunk))
        return base, variants


def ablation_table(task: TaskData, gold: np.ndarray, base: np.ndarray, variants: np.ndarray, layout: pd.DataFrame, intervention: str,
                   *, replicates: int = 10000, seed: int = 0, correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """``layer, head, intervention, metric, value, delta, ci_low, ci_high, p, p_adj`` per variant and task metric.

    ``p_adj`` is corrected (statsmodels ``multipletests``, ``correction``) across all variants of one metric.
    A bootstrap p is at least 2/(B + 1), so with 78 tests Benjamini-Hochberg can only reach 0.05 if
    B is in the thousands: hence 10,000 replicates by default. On fewer than ``min_sample`` examples no p is reported.
    """
    tables = []
    for metric in task.metrics:
        scores = paired_bootstrap(gold, base.argmax(-1), variants.argmax(-1), len(task.labels), metric, positive_index(task), replicates, seed,
                                  min_sample)
        scores["p_adj"] = corrected(scores.p, correction)[0]
        tables.append(pd.concat([layout.reset_index(drop=True), scores], axis=1).assign(intervention=intervention, metric=metric))
    columns = ["layer", "head", "intervention", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj"]
    return pd.concat(tables, ignore_index=True)[columns]


class GradientImportance:
    """Michel et al. (2019): ``I_h = E_x |dL(x)/d xi_h|`` with ``L(x)`` the model's loss on example ``x`` (its ``losses``): a
    classifier's cross-entropy of the gold label, or a decoder's causal LM loss, the mean next-token cross-entropy over the
    sequence's real pieces (:func:`~bertology.core.learning.tasks.next_token_losses`; padding takes no part).

    ``MHA(x) = sum_h xi_h Att_h(x)`` with a gate ``xi_h = 1`` per example, so ``dL(x)/d xi_h`` is example
    ``x``'s own gradient: its absolute value is taken per example, then averaged over the ``N`` examples.

    The Hugging Face bertology script (``examples/research_projects/bertology/run_bertology.py``) adds
    ``|head_mask.grad|`` once per *batch*, for one gate shared by the batch and the batch's mean loss, so
    signs cancel within a batch (``sum_b |mean_{x in b} dL(x)/d xi_h|``); it never zeroes
    ``head_mask.grad``, so batch ``b`` adds the absolute gradient summed over batches ``1..b``; and it
    divides by the number of tokens, not of examples. With batch size 1 (its default) and the gradient
    zeroed per batch, its importance is ``N / tokens`` times this one, so the two agree once normalised per
    layer. A gate per token would give ``E_x sum_t |dL(x)/d xi_{h,t}|``, at least this value since
    ``dL(x)/d xi_h = sum_t dL(x)/d xi_{h,t}``, and larger wherever a head's tokens pull the loss in
    opposite directions.
    """

    def __init__(self, task_model: TaskModel | LanguageModel, *, batch_size: int = 32, progress: bool = True):
        self.task_model, self.batch_size, self.progress = task_model, batch_size, progress

    def attribute(self, rows: list[dict], head_mask: np.ndarray | None = None) -> np.ndarray:
        """Mean absolute gradient per ``[layer, head]``; masked heads (``head_mask == 0``) stay gated at 0."""
        tm = self.task_model
        mask = torch.ones(tm.num_layers, tm.num_heads) if head_mask is None else torch.as_tensor(head_mask, dtype=torch.float32)
        total = torch.zeros(tm.num_layers, tm.num_heads, dtype=torch.float64)
        dtype = next(tm.model.parameters()).dtype
        with tqdm(total=len(rows), unit="ex", desc="head importance", disable=not self.progress) as bar:
            for chunk in length_batches(rows, self.batch_size):
                gates = mask[:, None, :].expand(-1, len(chunk), -1).to(tm.device, dtype).clone().requires_grad_(True)
                loss = tm.losses([rows[i] for i in chunk], HeadGates(gates).attach_to(Hooks())).sum()  # sum: each example's own gradient
                (gradient,) = torch.autograd.grad(loss, gates)
                total += gradient.abs().sum(1).double().cpu()
                bar.update(len(chunk))
        return (total / len(rows)).numpy()


NORMALISATIONS = ("layer", "global", "layer+global", "none")


def _check_normalisation(how: str) -> None:
    if how not in NORMALISATIONS:
        raise BertologyError(f"unknown normalisation {how!r}; use {', '.join(NORMALISATIONS)}")


def normalise_importance(importance: np.ndarray, how: str = "layer") -> np.ndarray:
    """Normalised ``[layer, head]`` importances; ``how`` matches the Hugging Face bertology script's flags.

    * ``layer`` (Michel et al. 2019): ``I_lh / sqrt(sum_h' I_lh'^2)``, each layer by its l2 norm
      (the script with ``--dont_normalize_global_importance``);
    * ``global``: ``(I - min I) / (max I - min I)`` over all heads (the script with
      ``--dont_normalize_importance_by_layer``); the order of the heads is the raw one;
    * ``layer+global``: ``layer``, then ``global`` (the script's default); the order is that of ``layer``;
    * ``none``: the raw importance (the script with both flags).

    A layer whose importances are all 0 stays 0, and so does every head when all importances are equal
    (where the script gives 0 and NaN).
    """
    _check_normalisation(how)
    if how.startswith("layer"):
        norms = np.linalg.norm(importance, axis=1, keepdims=True)
        importance = importance / np.where(norms > 0, norms, 1.0)
    if how.endswith("global"):
        spread = importance.max() - importance.min()
        importance = (importance - importance.min()) / spread if spread > 0 else np.zeros_like(importance)
    return importance


def importance_table(importance: np.ndarray, normalise: str = "layer") -> pd.DataFrame:
    """``layer, head, importance, importance_normalised`` (normalised as :func:`normalise_importance` says)."""
    layers, heads = importance.shape
    return pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers),
                         "importance": importance.ravel(), "importance_normalised": normalise_importance(importance, normalise).ravel()})


@dataclass
class PruningCurve:
    """The metric after each pruning step, and the head mask (1 kept, 0 pruned) of every step. ``table``: ``heads_pruned,
    share_pruned, metric, value, removed`` (the heads that step removed, ``layer-head`` ids, 0-based, space-separated)."""

    table: pd.DataFrame
    masks: dict[int, np.ndarray] = field(repr=False)


def pruning_curve(task_model: TaskModel | LanguageModel, importance_rows: list[dict], score: Callable[[Intervention | None], dict[str, float]], *,
                  step: float = 0.1, keep_at: int | None = None, normalise: str = "layer", batch_size: int = 32, progress: bool = True) -> PruningCurve:
    """Michel et al.'s iterative pruning: mask the ``step`` share (of all heads) least important by normalised
    importance (:func:`normalise_importance`; per layer by default, so a layer with large raw importances
    still loses heads), recompute the importance on ``importance_rows``, evaluate (``score(masking)``: the metrics
    with those heads masked, e.g. :func:`task_scorer`); repeat until each layer has one head. ``keep_at`` makes one
    step stop exactly at that many heads left."""
    layers, heads = task_model.num_layers, task_model.num_heads
    total = layers * heads
    per_step = max(1, math.ceil(step * total))
    mask = np.ones((layers, heads))
    scorer = GradientImportance(task_model, batch_size=batch_size, progress=False)
    rows, masks = [], {}

    def record(pruned: int) -> None:
        values = score(_masking(mask))
        before = masks[max(masks)] if masks else np.ones_like(mask)
        removed = " ".join(f"{layer}-{head}" for layer, head in zip(*np.nonzero((before == 1) & (mask == 0))))
        rows.extend({"heads_pruned": pruned, "share_pruned": pruned / total, "metric": metric, "value": value, "removed": removed}
                    for metric, value in values.items())
        masks[pruned] = mask.copy()

    record(0)
    with tqdm(total=total - layers, unit="head", desc="pruning", disable=not progress) as bar:
        while (mask.sum(1) > 1).any():
            importance = normalise_importance(scorer.attribute(importance_rows, mask), normalise)
            left = int(mask.sum())
            count = per_step if keep_at is None or left <= keep_at else min(per_step, left - keep_at)
            for layer, head in sorted(zip(*np.nonzero(mask)), key=lambda lh: importance[lh]):
                if count == 0:
                    break
                if mask[layer].sum() > 1:
                    mask[layer, head] = 0
                    count -= 1
            bar.update(left - int(mask.sum()))
            record(total - int(mask.sum()))
    return PruningCurve(pd.DataFrame(rows), masks)


def task_scorer(task_model: TaskModel, task: TaskData, rows: list[dict], gold: np.ndarray, batch_size: int) -> Callable[[Intervention | None], dict]:
    """The task's metrics on ``rows`` under an intervention (None: the intact model), for :func:`pruning_curve`."""
    return lambda intervention: task_score(task, gold, task_model.logits(rows, batch_size, intervention))


def _masking(mask: np.ndarray) -> Intervention | None:
    pruned = frozenset((int(layer), int(head)) for layer, head in zip(*np.nonzero(mask == 0)))
    return Intervention(masked=pruned) if pruned else None


def _seconds(task_model: TaskModel, rows: list[dict], batch_size: int) -> float:
    started = time.perf_counter()
    task_model.logits(rows, batch_size)
    return time.perf_counter() - started


def prune_and_time(task_model: TaskModel, task: TaskData, mask: np.ndarray, rows: list[dict], gold: np.ndarray, out: Path, *,
                   batch_size: int = 64, repeats: int = 3) -> dict:
    """Remove the heads that ``mask`` prunes, save the smaller model to ``out``, and compare it with the full
    model on ``rows``: metric of each, and the best of ``repeats`` timed passes of each, interleaved."""
    small = TaskModel(copy.deepcopy(task_model.model), task_model.tokenizer, str(out), task_model.labels, task_model.device,
                      task_model.num_layers, task_model.num_heads, task_model.max_length)
    prune_heads(small.model, {layer: list(np.nonzero(mask[layer] == 0)[0]) for layer in range(mask.shape[0])})
    full_logits, small_logits = task_model.logits(rows, batch_size), small.logits(rows, batch_size)
    times = {"full": [], "pruned": []}
    for _ in range(repeats):
        times["full"].append(_seconds(task_model, rows, batch_size))
        times["pruned"].append(_seconds(small, rows, batch_size))
    out.mkdir(parents=True, exist_ok=True)
    small.model.save_pretrained(out)
    task_model.tokenizer.save_pretrained(out)
    parameters = [sum(p.numel() for p in m.parameters()) for m in (task_model.model, small.model)]
    return {
        "heads_kept": int(mask.sum()), "heads_pruned": int(mask.size - mask.sum()), "model": str(out),
        "metric_full": task_score(task, gold, full_logits), "metric_pruned": task_score(task, gold, small_logits),
        "max_logit_difference_vs_masked": float(np.abs(small_logits - task_model.logits(rows, batch_size, _masking(mask))).max()),
        "parameters_full": parameters[0], "parameters_pruned": parameters[1],
        "seconds_full": min(times["full"]), "seconds_pruned": min(times["pruned"]),
        "speedup": min(times["full"]) / min(times["pruned"]), "examples": len(rows), "repeats": repeats,
        "pruned_heads": {str(k): v for k, v in small.model.config.bertology_pruned_heads.items()},
    }


@dataclass
class HeadStudy:
    """What an ``ablate``, ``importance`` or ``prune`` run found. Tables are tidy; :meth:`save` writes the run folder.

    ``task`` names the task, or the corpus of a decoder's next-token task (then ``corpus`` describes it); ``loss`` names
    the loss the importance differentiates. ``examples`` dev examples (texts of the corpus) were evaluated; the importance
    was measured on ``importance_examples`` examples of ``settings["importance_split"]`` (of the corpus; None: not
    measured). ``settings`` holds only the options that applied.
    """

    model: dict
    task: str
    examples: int
    baseline: dict[str, float]
    settings: dict
    loss: str
    corpus: dict | None = None
    importance_examples: int | None = None
    ablation: pd.DataFrame | None = None
    importance: pd.DataFrame | None = None
    pruning: pd.DataFrame | None = None
    pruned: dict | None = None

    @property
    def unit(self) -> str:
        """What one evaluated example is: a dev example of the task, or a text of the corpus."""
        return "dev examples" if self.corpus is None else "texts"

    @claims_out
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write every table there is, figures, ``report.html`` and ``manifest.json``, replacing ``out`` whole; returns the report path."""
        from bertology.core.storage.runfolder import RunFolder, complete_run
        from bertology.render.html import Report
        from bertology.studies.heads.report import importance_section

        folder = RunFolder(out)
        for name in ("ablation", "importance", "pruning"):
            if getattr(self, name) is not None:
                folder.write_table(name, getattr(self, name))
        if self.pruned is not None:
            folder.write_json("pruned.json", self.pruned)
        summary = {"model": self.model["name"], "task" if self.corpus is None else "corpus": self.task, "loss": self.loss, self.unit: self.examples,
                   **{f"{metric} (no intervention)": f"{value:.4f}" for metric, value in self.baseline.items()}}
        section = importance_section(folder, self)
        report = Report(f"bertology: which heads matter for {self.task}", summary, [section]).render()
        return complete_run(folder, {"model": self.model, "task": self.task, "corpus": self.corpus, "loss": self.loss, "examples": self.examples,
                               "importance_examples": self.importance_examples, "baseline": self.baseline, "settings": self.settings},
                      report=report, command=command) / "report.html"


def _defaults(command: str, names: tuple[str, ...]) -> dict:
    """The defaults of ``names`` as the study's command ``command`` declares them (one declaration for the API and the CLI)."""
    return {option.name: option.default for option in get_study(command).options if option.name in names}


ABLATE_DEFAULTS = _defaults("ablate", ("intervention", "bootstrap", "correction", "min_sample"))
#: The command line leaves ``importance_split`` None, so that a corpus run can refuse it; a task's default is train.
IMPORTANCE_DEFAULTS = {**_defaults("importance", ("importance_split", "importance_examples", "normalise")), "importance_split": DEFAULT_IMPORTANCE_SPLIT}
PRUNE_DEFAULTS = _defaults("prune", ("step", "prune_to"))


def _applying(given: dict, defaults: dict, applies: bool, where: str) -> dict:
    """``defaults`` with the options ``given`` (not None) when they apply; given where they do not: refused."""
    given = {name: value for name, value in given.items() if value is not None}
    if given and not applies:
        raise BertologyError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only to {where}")
    return {**defaults, **given} if applies else {}


def _check_settings(settings: dict) -> None:
    """Refuse impossible values of the options that apply, before any computing."""
    if "intervention" in settings:
        if settings["intervention"] not in INTERVENTIONS:
            raise BertologyError(f"unknown intervention {settings['intervention']!r}; use {' or '.join(INTERVENTIONS)}")
        try:
            multipletests([0.5], method=settings["correction"])
        except ValueError:
            raise BertologyError(f"unknown correction {settings['correction']!r} (statsmodels multipletests: fdr_bh, bonferroni, holm, ...)") from None
    if "normalise" in settings:
        if "importance_split" in settings and settings["importance_split"] not in ("train", "dev"):
            raise BertologyError(f"importance split must be train or dev, not {settings['importance_split']!r}")
        if settings["importance_examples"] < 1:
            raise BertologyError("importance_examples must be at least 1")
        _check_normalisation(settings["normalise"])
    if "step" in settings and not 0 < settings["step"] <= 1:
        raise BertologyError(f"step must be in (0, 1], not {settings['step']}")


def _check_request(task: TaskData | None, corpus, ablate: bool, importance_split: str | None, prune_to: int | None) -> None:
    """Refuse a request that gives both a task and a corpus or neither, or asks a corpus for what only a task has."""
    if (task is None) == (corpus is None):
        raise BertologyError("give a task (for a fine-tuned classifier) or a corpus (for a causal language model), one of the two")
    if corpus is not None and ablate:
        raise BertologyError("ablate measures a task's dev metric: give a task, or run importance or prune on the corpus")
    if corpus is not None and importance_split is not None:
        raise BertologyError("importance_split applies only to a task (a corpus has no splits)")
    if corpus is not None and prune_to is not None:
        raise BertologyError("--prune-to removes heads physically, which bertology knows for encoders (BERT, RoBERTa, ELECTRA, DistilBERT), "
                             "not decoders; leave it out to draw the pruning curve with the heads masked")


def _load_model(model: str | Path | TaskModel | LanguageModel, corpus, device: str | None, max_length: int | None,
                prune_to: int | None) -> TaskModel | LanguageModel:
    """``model`` as given (already loaded) or loaded from its path (a classifier for a task, a decoder for a corpus);
    refused where it does not fit the request, has had heads removed, or cannot be pruned to ``prune_to`` heads."""
    loaded = isinstance(model, (TaskModel, LanguageModel))
    loading = _applying({"device": device, "max_length": max_length}, {"device": "auto", "max_length": 128}, not loaded,
                        "a model given by its path (a loaded model keeps its own)")
    task_model = model if loaded else (load_task_model if corpus is None else load_language_model)(model, **loading)
    if isinstance(task_model, LanguageModel) != (corpus is not None):
        raise BertologyError("a corpus needs a LanguageModel (a decoder with its LM head), a task a TaskModel (a fine-tuned classifier)")
    if task_model.info()["pruned_heads"]:
        raise BertologyError(f"{task_model.name}: heads were removed from this model; disabling and pruning start from a model with all its heads")
    if prune_to is not None and not task_model.num_layers <= prune_to < task_model.num_layers * task_model.num_heads:
        raise BertologyError(f"--prune-to must be between {task_model.num_layers} (one head per layer) and {task_model.num_layers * task_model.num_heads - 1}")
    return task_model


@dataclass
class _Evaluation:
    """What a head study evaluates on: the encoded examples (a seeded subset of a task's dev split, or of a corpus's texts),
    their gold labels (a task's), the metrics of a head intervention, and the words for the task and its loss."""

    rows: list[dict]
    gold: np.ndarray | None
    score: Callable[[Intervention | None], dict]
    name: str
    loss: str
    corpus_info: dict | None = None
    texts: list[str] | None = None  # a corpus's texts, from which the importance subset is drawn too


def _evaluation(task_model: TaskModel | LanguageModel, task: TaskData | None, corpus, format: str, max_examples: int | None, seed: int,
                batch_size: int) -> _Evaluation:
    """The examples the metrics are measured on and the metric function: a task's dev subset and its task metric, or a
    corpus's texts and the causal LM metrics (refused where no text has a next token to predict)."""
    if corpus is None:
        rows, gold = task_model.encode(seeded_subset(task.dev, max_examples, seed), "dev")
        return _Evaluation(rows, gold, task_scorer(task_model, task, rows, gold, batch_size * 2), task.name, f"{task.name} cross-entropy of the gold label")
    texts, corpus_info = open_corpus(corpus, format)
    texts = list(texts)
    corpus_info["examples"] = len(texts)
    rows = task_model.encode(seeded_subset(texts, max_examples, seed))
    if not rows:
        raise BertologyError(f"{corpus_info['name']}: no text of two pieces or more, so no next token to predict")
    return _Evaluation(rows, None, partial(task_model.score, rows, batch_size * 2), corpus_info["name"], NEXT_TOKEN_LOSS, corpus_info, texts)


def _ablation(task_model: TaskModel, task: TaskData, evaluation: _Evaluation, settings: dict, batch_size: int, seed: int,
              progress: bool) -> pd.DataFrame:
    """The leave-one-out table: the task metric with each head, and each layer, disabled as ``settings`` say."""
    loo = LeaveOneOut(task_model, settings["intervention"], batch_size=batch_size, progress=progress)
    base, variants = loo.predict(evaluation.rows)
    return ablation_table(task, evaluation.gold, base, variants, loo.variants(), settings["intervention"], replicates=settings["bootstrap"],
                          seed=seed, correction=settings["correction"], min_sample=settings["min_sample"])


def _importance(study: HeadStudy, task_model: TaskModel | LanguageModel, task: TaskData | None, evaluation: _Evaluation, settings: dict,
                batch_size: int, seed: int, progress: bool, folder) -> list[dict]:
    """Measure each head's gradient importance on a seeded subset of the importance split (or of the corpus's texts) into
    ``study`` (and ``folder``); returns the subset's encoded examples, which the pruning curve reuses."""
    if evaluation.texts is None:
        split = settings["importance_split"]
        importance_rows, _ = task_model.encode(seeded_subset(task.dev if split == "dev" else task.train, settings["importance_examples"], seed), split)
    else:
        importance_rows = task_model.encode(seeded_subset(evaluation.texts, settings["importance_examples"], seed))
    study.importance_examples = len(importance_rows)
    scores = GradientImportance(task_model, batch_size=batch_size, progress=progress).attribute(importance_rows)
    study.importance = importance_table(scores, settings["normalise"])
    if folder is not None:
        folder.write_table("importance", study.importance)
    return importance_rows


def _prune(study: HeadStudy, task_model: TaskModel | LanguageModel, task: TaskData | None, evaluation: _Evaluation, importance_rows: list[dict],
           settings: dict, prune_to: int | None, batch_size: int, progress: bool, folder, out: str | Path | None) -> None:
    """Draw the pruning curve into ``study`` (and ``folder``); with ``prune_to``, remove that point's heads physically, save
    the smaller model (in ``folder``, or ``pruned-N-heads`` here) and time it."""
    curve = pruning_curve(task_model, importance_rows, evaluation.score, step=settings["step"], keep_at=prune_to, normalise=settings["normalise"],
                          batch_size=batch_size, progress=progress)
    study.pruning = curve.table
    if folder is not None:
        folder.write_table("pruning", study.pruning)
    if prune_to is not None:
        target = folder.path / f"pruned-{prune_to}-heads" if folder is not None else Path(f"pruned-{prune_to}-heads")
        study.pruned = prune_and_time(task_model, task, curve.masks[task_model.num_layers * task_model.num_heads - prune_to], evaluation.rows,
                                      evaluation.gold, target, batch_size=batch_size * 2)
        if folder is not None:  # saved in the staging folder, which becomes out
            study.pruned["model"] = str(Path(out) / target.name)


@claims_out(words=("intervention", "correction", "importance_split", "normalise", "format", "device"))
def study_heads(model: str | Path | TaskModel | LanguageModel, task: TaskData | None = None, *, corpus=None, format: str = "auto",
                ablate: bool = False, importance: bool = False, prune: bool = False, intervention: str | None = None, max_examples: int | None = None,
                importance_split: str | None = None, importance_examples: int | None = None, normalise: str | None = None, bootstrap: int | None = None,
                correction: str | None = None, min_sample: int | None = None, step: float | None = None, prune_to: int | None = None, batch_size: int = 16,
                max_length: int | None = None, seed: int = 0, device: str | None = None, out: str | Path | None = None, progress: bool = True,
                command: list[str] | None = None) -> HeadStudy:
    """Evaluate ``model`` on ``task``'s dev split with heads disabled (``ablate``), measure each head's gradient
    importance (``importance``) and draw the pruning curve (``prune``; ``prune_to`` also removes heads physically).

    Ablation options (``intervention`` mask, ``bootstrap`` 10000, ``correction`` fdr_bh, ``min_sample`` 10), importance options
    (``importance_split`` train, ``importance_examples`` 1000, ``normalise`` layer) and pruning options (``step``
    0.1, ``prune_to``) take their defaults when left None; one given for a study that is not run is refused, and
    so are ``device`` and ``max_length`` (defaults auto, 128) with an already loaded ``TaskModel`` or ``LanguageModel``.

    Importance is measured on a seeded subset of ``importance_examples`` examples of ``importance_split``
    (all of the split if it has fewer; train by default, so that the pruning order is not chosen on the examples
    it is evaluated on). With ``out``, each table is written as soon as it is computed, then the report.

    Instead of a task, a ``corpus`` (a text file read as ``format`` says, or texts) and a decoder (a causal language model,
    loaded with its LM head): the loss is the causal LM loss, each text's mean next-token cross-entropy over its real pieces
    (docs/methods.md#decoders), and the metrics ``lm_loss`` (per predicted piece over all texts) and ``perplexity``.
    The importance is measured on a seeded subset of ``importance_examples`` texts and the curve evaluated on one of
    ``max_examples`` (all by default): the corpus has no splits, so the two overlap. ``ablate``, ``importance_split``
    and ``prune_to`` (physical removal, which bertology knows for encoders only) do not apply.
    """
    from bertology.core.storage.runfolder import RunFolder

    check_seed(seed)
    _check_request(task, corpus, ablate, importance_split, prune_to)
    settings = {**_applying({"intervention": intervention, "bootstrap": bootstrap, "correction": correction, "min_sample": min_sample},
                            ABLATE_DEFAULTS, ablate, "ablate"),
                **_applying({"importance_split": importance_split, "importance_examples": importance_examples, "normalise": normalise},
                            IMPORTANCE_DEFAULTS, importance or prune, "importance or prune"),
                **_applying({"step": step, "prune_to": prune_to}, PRUNE_DEFAULTS, prune, "prune")}
    if corpus is not None:
        settings.pop("importance_split", None)
    _check_settings(settings)
    task_model = _load_model(model, corpus, device, max_length, prune_to)
    torch.manual_seed(seed)
    evaluation = _evaluation(task_model, task, corpus, format, max_examples, seed, batch_size)
    baseline = evaluation.score(None)
    settings.update(max_examples=max_examples, batch_size=batch_size, max_length=task_model.max_length, seed=seed, device=str(task_model.device))
    study = HeadStudy(task_model.info(), evaluation.name, len(evaluation.rows), baseline, settings, evaluation.loss, evaluation.corpus_info)
    folder = RunFolder(out) if out is not None else None
    if ablate:
        study.ablation = _ablation(task_model, task, evaluation, settings, batch_size, seed, progress)
        if folder is not None:
            folder.write_table("ablation", study.ablation)
    if importance or prune:
        importance_rows = _importance(study, task_model, task, evaluation, settings, batch_size, seed, progress, folder)
        if prune:
            _prune(study, task_model, task, evaluation, importance_rows, settings, prune_to, batch_size, progress, folder, out)
    if out is not None:
        study.save(out, command)
    return study
