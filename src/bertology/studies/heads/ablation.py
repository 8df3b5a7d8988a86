"""Leave-one-out ablation: the task metric, or a decoder's causal LM loss, with each head and each layer ablated.

Kovaleva et al. 2019; Michel et al. 2019's exact ablation; Wang et al. 2022's mean and Heimersheim & Nanda 2024's
resample ablation.

Zero (``mask``), mean and resample ablation replace the head's output ``z_h`` (:mod:`~bertology.studies.heads.replacements`);
``uniform`` makes its attention uniform. The hidden state entering layer ``l`` does not depend on an ablation at layer
``l``, so it is computed once per batch and the variants of layer ``l`` run from there, stacked into one batch with one
unablated copy: each variant's output is measured against that copy, computed the same way, and added to the intact run's,
so batched arithmetic (float32's last bits) is never taken for an effect. For first-token classifiers the last layer is
computed for the first token only. Each change comes with a paired bootstrap interval over examples and a corrected p.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext

import numpy as np
import pandas as pd
import torch

from bertology.core.learning.tasks import LanguageModel, TaskData, TaskModel, positive_index
from bertology.core.model.head_outputs import HeadOutputs, replace_chosen
from bertology.core.model.hooks import Hooks
from bertology.core.model.interventions import Intervention, LayerReplay, attach_variants, reads_first_token_only
from bertology.core.statistics.stats import (
    MIN_SAMPLE,
    beyond_float_noise,
    bootstrap_interval,
    corrected,
    paired_bootstrap,
    resampled_counts,
    withheld,
)
from bertology.studies.heads.method import HeadMethod
from bertology.studies.heads.replacements import ABLATIONS, MEAN_OVER, Replacement, replacement

#: The level a corrected p must be below, with an interval that excludes 0, for an ablation to matter (as for patching).
ALPHA = 0.05
#: The columns of ``ablation.csv``: the change of each metric with its interval, p, corrected p, whether it matters and on how
#: many examples.
COLUMNS = ["layer", "head", "intervention", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj", "matters", "n"]
#: The most logits one stacked pass of a decoder holds (copies x pieces x vocabulary): 2^27 floats, 512 MiB in float32.
LOGITS_BUDGET = 2**27


def _chosen(num_heads: int, unablated: bool) -> np.ndarray:
    """Which heads each copy of a layer's stack ablates, ``[copies, heads]``: each head alone, the whole layer, and (with
    ``unablated``) none."""
    rows = [np.eye(num_heads, dtype=bool), np.ones((1, num_heads), dtype=bool)]
    return np.concatenate(rows + ([np.zeros((1, num_heads), dtype=bool)] if unablated else []))


class LeaveOneOut(HeadMethod):
    """A classifier's logits, or a decoder's summed next-token cross-entropy per text, with each head, and each layer,
    ablated on its own.

    ``intervention``: one of :data:`~bertology.studies.heads.replacements.ABLATIONS`; mean and resample ablation take ``z_h``
    from ``reference`` (encoded rows; None: the evaluated rows), the mean ``mean_over`` positions or examples, resample
    ablation ``resamples`` donors per example drawn with ``seed``.
    ``reuse=False`` is the naive way (a full forward pass per variant), kept for checking and benchmarks.
    ``first_token_only`` (with reuse, for first-token classifiers) computes the last layer for the first token only.
    """

    def __init__(self, task_model: TaskModel | LanguageModel, intervention: str = "zero", *, reference: list[dict] | None = None,
                 mean_over: str = "positions", resamples: int = 5, seed: int = 0, batch_size: int = 16, reuse: bool = True,
                 first_token_only: bool = True, progress: bool = True):
        if intervention not in ABLATIONS or mean_over not in MEAN_OVER or resamples < 1:
            raise ValueError(f"intervention must be one of {', '.join(ABLATIONS)}, mean_over one of {', '.join(MEAN_OVER)} and resamples "
                             f"at least 1, not {intervention!r}, {mean_over!r}, {resamples}")
        super().__init__(task_model, batch_size=batch_size, progress=progress)
        self.intervention, self.reuse = intervention, reuse
        self.reference, self.mean_over, self.resamples, self.seed = reference, mean_over, resamples, seed
        self.first_token_only = reuse and first_token_only and reads_first_token_only(task_model.model)
        self.heads = HeadOutputs(task_model.model) if intervention != "uniform" else None
        self.replay = LayerReplay(task_model.model) if reuse else None
        self.replacement: Replacement | None = None  # what the last predict put in place of z_h (the mean, the donors drawn)

    def variants(self) -> pd.DataFrame:
        """``layer, head`` of each variant in the order of :meth:`predict`'s output (head -1: the whole layer)."""
        heads = self.task_model.num_heads
        return pd.DataFrame([(layer, head) for layer in range(self.task_model.num_layers) for head in [*range(heads), -1]], columns=["layer", "head"])

    def _rows_per_batch(self, rows: list[dict]) -> int:
        """The batch size, for a decoder no more rows than keep one stacked pass's logits within :data:`LOGITS_BUDGET`."""
        if not self.is_language_model:
            return self.batch_size
        per_row = (self.task_model.num_heads + 2) * max(len(row["input_ids"]) for row in rows) * self.task_model.model.config.vocab_size
        return max(1, min(self.batch_size, LOGITS_BUDGET // per_row))

    def predict(self, rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's readout (:meth:`~bertology.studies.heads.method.HeadMethod.readout`) without ablation ``[n, R]`` and
        with each variant in each draw ``[variants, draws, n, R]`` (one draw but for resample ablation), float64."""
        tm = self.task_model
        layers, heads = tm.num_layers, tm.num_heads
        if self.heads is not None:
            self.replacement = replacement(self, self.heads, self.intervention, rows, self.reference, self.mean_over, self.resamples, self.seed)
        values = self.replacement
        draws = values.draws if values is not None else 1
        chosen = _chosen(heads, unablated=self.reuse)
        base = variants = None
        with torch.inference_mode():
            for chunk in self.batches(rows, f"leave-one-out ({self.intervention})", self._rows_per_batch(rows)):
                inputs = self.model_inputs([rows[i] for i in chunk])
                with self.replay.record() if self.reuse else nullcontext() as hidden:
                    clean = self.readout(inputs, tm.model(**inputs).logits).cpu().numpy()
                if base is None:
                    base = np.empty((len(rows), clean.shape[1]))
                    variants = np.empty((layers * (heads + 1), draws, len(rows), clean.shape[1]))
                base[chunk] = clean
                for draw in range(draws):
                    replaced = values.values(chunk, inputs, draw) if values is not None else None
                    for layer in range(layers):
                        variants[layer * (heads + 1) : (layer + 1) * (heads + 1), draw, chunk] = self._layer(inputs, hidden, layer, chosen, replaced, clean)
        return base, variants

    def _layer(self, inputs: dict, hidden: list | None, layer: int, chosen: np.ndarray, replaced: list | None, clean: np.ndarray) -> np.ndarray:
        """``[heads + 1, batch, R]``: each variant of ``layer``, with reuse one stacked pass measured against its unablated copy."""
        if not self.reuse:
            return np.concatenate([self._pass(inputs, None, layer, chosen[i : i + 1], replaced) for i in range(len(chosen))])
        out = self._pass(inputs, hidden, layer, chosen, replaced)
        return out[:-1] - out[-1] + clean

    def _pass(self, inputs: dict, hidden: list | None, layer: int, chosen: np.ndarray, replaced: list | None) -> np.ndarray:
        """One pass of ``len(chosen)`` stacked copies of the batch, copy ``c`` with ``layer``'s heads ``chosen[c]`` ablated (from
        layer ``layer`` on, the layers below replayed from ``hidden``, where given): ``[copies, batch, R]``."""
        copies = len(chosen)
        stacked = {k: v.repeat(copies, *([1] * (v.dim() - 1))) for k, v in inputs.items()}
        with ExitStack() as stack:
            if hidden is not None:
                start = hidden[layer - 1].repeat(copies, 1, 1) if layer > 0 else None
                stack.enter_context(self.replay.start_at(layer, start, first_token_only=self.first_token_only))
            if self.intervention == "uniform":
                flat = [Intervention(uniform=frozenset((layer, int(head)) for head in np.flatnonzero(row))) for row in chosen]
                stack.enter_context(attach_variants(Hooks(), flat, self.task_model.num_heads).attach(self.task_model.model))
            else:
                which = torch.from_numpy(chosen)
                stack.enter_context(self.heads.replaced(lambda at, z: replace_chosen(z, which, replaced[at]), layers=range(layer, layer + 1)))
            logits = self.task_model.model(**stacked).logits
        out = self.readout(stacked, logits).cpu().numpy()
        return out.reshape(copies, -1, out.shape[1])


def _tidy(scores: pd.DataFrame, layout: pd.DataFrame, intervention: str, metric: str, n: int, correction: str) -> pd.DataFrame:
    """``scores`` (``value, delta, ci_low, ci_high, p``) with ``p_adj`` over the variants, ``matters`` (interval excludes 0,
    ``p_adj`` below :data:`ALPHA` and a change beyond float rounding of the metric, :func:`beyond_float_noise`) and ``n``,
    beside the variants' ``layer, head``."""
    scores["p_adj"] = corrected(scores.p, correction)[0]
    excludes_zero = (scores.ci_low > 0) | (scores.ci_high < 0)
    scores["matters"] = excludes_zero & (scores.p_adj < ALPHA) & beyond_float_noise(scores.delta, scores.value - scores.delta)
    return pd.concat([layout.reset_index(drop=True), scores], axis=1).assign(intervention=intervention, metric=metric, n=n)


def ablation_table(task: TaskData, gold: np.ndarray, base: np.ndarray, variants: np.ndarray, layout: pd.DataFrame, intervention: str,
                   *, replicates: int = 10000, seed: int = 0, correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """:data:`COLUMNS` per variant and task metric, from a classifier's logits ``base`` ``[n, C]`` and ``variants``
    ``[V, n, C]`` or ``[V, draws, n, C]`` (the metric of the confusion matrix averaged over the draws).

    ``p_adj`` is corrected (statsmodels ``multipletests``, ``correction``) across all variants of one metric.
    A bootstrap p is at least 2/(B + 1), so with 78 tests Benjamini-Hochberg can only reach 0.05 if
    B is in the thousands: hence 10,000 replicates by default. On fewer than ``min_sample`` examples no p is reported.
    """
    tables = []
    for metric in task.metrics:
        scores = paired_bootstrap(gold, base.argmax(-1), variants.argmax(-1), len(task.labels), metric, positive_index(task), replicates, seed,
                                  min_sample)
        tables.append(_tidy(scores, layout, intervention, metric, len(gold), correction))
    return pd.concat(tables, ignore_index=True)[COLUMNS]


def loss_ablation_table(base: np.ndarray, variants: np.ndarray, pieces: np.ndarray, layout: pd.DataFrame, intervention: str, *,
                        replicates: int = 10000, seed: int = 0, correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """:data:`COLUMNS` per variant for a decoder's ``lm_loss`` (nats per predicted piece, ``sum_x s(x) / sum_x pieces(x)``
    with ``s(x)`` a text's summed next-token cross-entropy) and ``perplexity`` (``exp(lm_loss)``), from each text's ``s``
    without ablation ``base`` ``[n]`` and with each variant ``[V, draws, n]`` (averaged over the draws) and its predicted
    ``pieces`` ``[n]``. A paired bootstrap over texts: each replicate resamples the texts once and recomputes every ratio."""
    summed = np.concatenate([np.asarray(base, dtype=np.float64)[None], np.asarray(variants, dtype=np.float64).mean(1)])  # [1 + V, n]
    pieces = np.asarray(pieces, dtype=np.float64)
    whole = summed.sum(1) / pieces.sum()
    samples = np.concatenate([(counts @ summed.T).T / (counts @ pieces) for counts in resampled_counts(len(pieces), replicates, seed)], axis=1)
    tables = []
    for metric, scale in (("lm_loss", lambda loss: loss), ("perplexity", np.exp)):
        low, high, p = bootstrap_interval(scale(samples[1:]) - scale(samples[:1]))
        scores = pd.DataFrame({"value": scale(whole[1:]), "delta": scale(whole[1:]) - scale(whole[0]), "ci_low": low, "ci_high": high,
                               "p": withheld(p, len(pieces), min_sample)})
        tables.append(_tidy(scores, layout, intervention, metric, len(pieces), correction))
    return pd.concat(tables, ignore_index=True)[COLUMNS]
