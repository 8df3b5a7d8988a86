"""Where attention to [CLS], [SEP] and punctuation (a decoder's: the first token and punctuation) peaks over depth, with
bootstrap replicates over sequences: the analyzer ``track`` runs at each checkpoint for the learning-curve verdict
(docs/methods.md#track-and-the-learning-curve-verdict)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import bootstrap_weights
from bertology.families.kinds import check_kind, check_same_kind
from bertology.families.roles.analyzer import excess_over_uniform


def peak_metrics(kind: Kind) -> tuple[str, ...]:
    """The token sets whose attention peaks at a characteristic depth under the learning-curve hypothesis
    (docs/methods.md#track-and-the-learning-curve-verdict), on a model of ``kind``: its anchors, then punctuation. An
    encoder's [CLS], [SEP] and punctuation; a decoder's first token, the candidate attention sink, in [CLS]'s place (the
    profile's ``first``; [SEP] has no meaning there, docs/methods.md#decoders), and punctuation."""
    return (*kind.anchors, "punct")


class LayerPeaks(LayerwiseAnalyzer):
    """Per-layer attention to [CLS], [SEP] and punctuation (the engine's set, as in :class:`GeneralProfile`),
    with bootstrap replicates over sequences; on a decoder (:func:`peak_metrics`) to the first token and punctuation,
    over the queries of a mean (the batch's ``query_mask``: a decoder's ``i >= 1``, row 0 sees only itself) as the
    profile's ``first`` and ``punct``. It is built for one ``kind`` of model (:attr:`metrics` are :func:`peak_metrics` of
    it) and refuses batches of another.

    A sequence's value for layer l is the mean over its heads of the metric (as in
    :meth:`GeneralProfile.layers`); ``m_l`` is its mean over sequences (a decoder's sequence of one token, with no query,
    takes no part), and the metric peaks at ``argmax_l m_l``. Replicate 0 is the data; replicates 1..B weight each sequence by a Poisson(1)
    draw keyed by the sequence (:func:`~bertology.core.statistics.stats.bootstrap_weights`), so the replicates of
    two checkpoints run on one corpus are paired.

    Beside each sequence's layer value, the uniform head's on the same sequence (:meth:`~bertology.core.engine.LayerMaps.uniform`,
    each row spread evenly over the keys it saw): their difference, float noise counted as 0
    (:func:`~bertology.families.roles.analyzer.excess_over_uniform`), is averaged with the same weights (:meth:`replicate_excess`),
    so that a verdict can ask whether a pattern does more than a uniform head (:mod:`~bertology.studies.track.verdicts`).

    :meth:`result`: ``layer, metric, value, ci_low, ci_high, n, excess, excess_ci_low, excess_ci_high`` (2.5th/97.5th
    percentiles of the replicates). :meth:`peaks`: ``metric, peak_layer, ci_low, ci_high, agreement`` (the replicates'
    peak layers: percentiles, and the share that agree with the data's). :meth:`replicate_means` and :meth:`replicate_excess`:
    ``[1 + B, layer, metric]``.
    """

    name = "layer_peaks"

    def __init__(self, kind: Kind, bootstrap: int = 1000, seed: int = 0):
        self.kind, self.metrics = kind, peak_metrics(kind)
        self.bootstrap = bootstrap
        self.seed = seed
        self._sums: np.ndarray | None = None  # [1 + B, layer, metric]: weighted sums of sequence values
        self._excess: np.ndarray | None = None  # [1 + B, layer, metric]: weighted sums of their excess over the uniform head
        self._weights = np.zeros(1 + bootstrap)  # [1 + B]: summed sequence weights
        self._sequences = 0
        self._pending: list[torch.Tensor] = []  # one [batch, 2 metric] per layer: the heads' mean, then the uniform head's

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            check_kind(self, batch)
            self._pending = []
        sets = {**batch.anchors, "punct": batch.punct_mask}
        members = torch.stack([sets[metric] for metric in self.metrics], dim=-1)  # [batch, n, metric]
        values = self._attention_to_sets(maps.attention, members, batch)  # [batch, head, metric]
        uniform = maps.uniform_scored(batch, self, lambda head: self._attention_to_sets(head, members, batch))  # [batch, 1 or head, metric]
        # a sequence's layer value, the head mean, and the uniform head's: [batch, 2 metric]
        self._pending.append(torch.cat([values.mean(dim=1).double(), uniform.mean(dim=1).double()], dim=-1))

    def _attention_to_sets(self, attention: torch.Tensor, members: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Attention to each set, ``(1/m) sum_{i in Q} sum_{j in K} a[i, j]`` over the m queries Q of a mean, through the column
        sums over Q: the rows from the kind's first query on (padding rows are zero). ``[batch, head, metric]``."""
        columns = attention[..., self.kind.first_query:, :].sum(dim=-2)
        m = batch.query_mask.sum(dim=1).to(attention.dtype)[:, None, None]
        return torch.einsum("bhj,bjk->bhk", columns, members.to(attention.dtype)) / m

    def finish_batch(self, batch: Batch) -> None:
        both = stack_layers(self._pending, batch, dim=1).cpu().numpy()  # [batch, layer, 2 metric]: one copy to the host
        self._pending = []
        values, uniform = np.split(both, 2, axis=-1)
        seen = np.isfinite(values).all(axis=(1, 2))  # NaN: a decoder's sequence of one token (no query i >= 1)
        weights = np.stack([bootstrap_weights(self.seed, self.bootstrap, example) for example in batch.examples]) * seen[:, None]  # [batch, 1 + B]
        sums = np.einsum("br,blm->rlm", weights, np.where(seen[:, None, None], values, 0.0))
        excess = np.einsum("br,blm->rlm", weights, np.where(seen[:, None, None], excess_over_uniform(values, uniform), 0.0))
        self._sums = sums if self._sums is None else self._sums + sums
        self._excess = excess if self._excess is None else self._excess + excess
        self._weights += weights.sum(axis=0)
        self._sequences += int(seen.sum())

    def merge(self, other: "LayerPeaks") -> "LayerPeaks":
        check_same_kind(self, other)
        if other.bootstrap != self.bootstrap or other.seed != self.seed:
            raise ValueError("cannot merge LayerPeaks with different bootstrap sizes or seeds")
        if other._sums is not None:
            self._sums = other._sums.copy() if self._sums is None else self._sums + other._sums
            self._excess = other._excess.copy() if self._excess is None else self._excess + other._excess
            self._weights = self._weights + other._weights
            self._sequences += other._sequences
        return self

    def replicate_means(self) -> np.ndarray:
        """``[1 + B, layer, metric]``: the per-layer means of the data (row 0) and of each replicate."""
        if self._sums is None:
            raise ValueError("LayerPeaks has seen no sequence")
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._sums / self._weights[:, None, None]

    def replicate_excess(self) -> np.ndarray:
        """``[1 + B, layer, metric]``: the per-layer mean excess over the uniform head on the same sequences
        (:func:`~bertology.families.roles.analyzer.excess_over_uniform` per sequence: float noise is 0), of the data (row 0)
        and of each replicate."""
        if self._excess is None:
            raise ValueError("LayerPeaks has seen no sequence")
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._excess / self._weights[:, None, None]

    def result(self) -> pd.DataFrame:
        columns = ["layer", "metric", "value", "ci_low", "ci_high", "n", "excess", "excess_ci_low", "excess_ci_high"]
        if self._sums is None:
            return pd.DataFrame(columns=columns)
        means, excess = self.replicate_means(), self.replicate_excess()
        low, high = np.nanpercentile(means[1:], [2.5, 97.5], axis=0)
        excess_low, excess_high = np.nanpercentile(excess[1:], [2.5, 97.5], axis=0)
        layer, metric = np.indices(means.shape[1:])
        return pd.DataFrame({"layer": layer.ravel(), "metric": np.array(self.metrics)[metric.ravel()], "value": means[0].ravel(),
                             "ci_low": low.ravel(), "ci_high": high.ravel(), "n": self._sequences, "excess": excess[0].ravel(),
                             "excess_ci_low": excess_low.ravel(), "excess_ci_high": excess_high.ravel()})

    def peaks(self) -> pd.DataFrame:
        """Where each metric peaks: the data's layer, the replicates' 95% percentile interval and their agreement."""
        return peak_layers(self.replicate_means(), self.metrics)


def peak_layers(means: np.ndarray, metrics: tuple[str, ...]) -> pd.DataFrame:
    """``means [1 + B, layer, metric]`` (row 0 the data) -> ``metric, peak_layer, ci_low, ci_high, agreement``."""
    peaks = means.argmax(axis=1)  # [1 + B, metric]
    low, high = np.percentile(peaks[1:], [2.5, 97.5], axis=0)
    return pd.DataFrame({"metric": list(metrics), "peak_layer": peaks[0], "ci_low": low, "ci_high": high,
                         "agreement": (peaks[1:] == peaks[0]).mean(axis=0)})
