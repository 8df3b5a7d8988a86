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

    :meth:`result`: ``layer, metric, value, ci_low, ci_high, n`` (2.5th/97.5th percentiles of the
    replicates). :meth:`peaks`: ``metric, peak_layer, ci_low, ci_high, agreement`` (the replicates'
    peak layers: percentiles, and the share that agree with the data's). :meth:`replicate_means`:
    ``[1 + B, layer, metric]``.
    """

    name = "layer_peaks"

    def __init__(self, kind: Kind, bootstrap: int = 1000, seed: int = 0):
        self.kind, self.metrics = kind, peak_metrics(kind)
        self.bootstrap = bootstrap
        self.seed = seed
        self._sums: np.ndarray | None = None  # [1 + B, layer, metric]: weighted sums of sequence values
        self._weights = np.zeros(1 + bootstrap)  # [1 + B]: summed sequence weights
        self._sequences = 0
        self._pending: list[torch.Tensor] = []  # one [batch, metric] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            check_kind(self, batch)
            self._pending = []
        sets = {**batch.anchors, "punct": batch.punct_mask}
        members = torch.stack([sets[metric] for metric in self.metrics], dim=-1).to(maps.attention.dtype)  # [batch, n, metric]
        # attention to each set, (1/m) sum_{i in Q} sum_{j in K} a[i, j] over the m queries Q of a mean, through the column sums
        # over Q: the rows from the kind's first query on (padding rows are zero)
        columns = maps.attention[..., self.kind.first_query:, :].sum(dim=-2)
        m = batch.query_mask.sum(dim=1).to(maps.attention.dtype)[:, None, None]
        values = torch.einsum("bhj,bjk->bhk", columns, members) / m
        self._pending.append(values.mean(dim=1))  # a sequence's layer value, the head mean: [batch, metric]

    def finish_batch(self, batch: Batch) -> None:
        values = stack_layers(self._pending, batch, dim=1).double().cpu().numpy()  # [batch, layer, metric]: one copy to the host
        self._pending = []
        seen = np.isfinite(values).all(axis=(1, 2))  # NaN: a decoder's sequence of one token (no query i >= 1)
        weights = np.stack([bootstrap_weights(self.seed, self.bootstrap, example) for example in batch.examples]) * seen[:, None]  # [batch, 1 + B]
        sums = np.einsum("br,blm->rlm", weights, np.where(seen[:, None, None], values, 0.0))
        self._sums = sums if self._sums is None else self._sums + sums
        self._weights += weights.sum(axis=0)
        self._sequences += int(seen.sum())

    def merge(self, other: "LayerPeaks") -> "LayerPeaks":
        check_same_kind(self, other)
        if other.bootstrap != self.bootstrap or other.seed != self.seed:
            raise ValueError("cannot merge LayerPeaks with different bootstrap sizes or seeds")
        if other._sums is not None:
            self._sums = other._sums.copy() if self._sums is None else self._sums + other._sums
            self._weights = self._weights + other._weights
            self._sequences += other._sequences
        return self

    def replicate_means(self) -> np.ndarray:
        """``[1 + B, layer, metric]``: the per-layer means of the data (row 0) and of each replicate."""
        if self._sums is None:
            raise ValueError("LayerPeaks has seen no sequence")
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._sums / self._weights[:, None, None]

    def result(self) -> pd.DataFrame:
        columns = ["layer", "metric", "value", "ci_low", "ci_high", "n"]
        if self._sums is None:
            return pd.DataFrame(columns=columns)
        means = self.replicate_means()
        low, high = np.nanpercentile(means[1:], [2.5, 97.5], axis=0)
        layer, metric = np.indices(means.shape[1:])
        return pd.DataFrame({"layer": layer.ravel(), "metric": np.array(self.metrics)[metric.ravel()], "value": means[0].ravel(),
                             "ci_low": low.ravel(), "ci_high": high.ravel(), "n": self._sequences})

    def peaks(self) -> pd.DataFrame:
        """Where each metric peaks: the data's layer, the replicates' 95% percentile interval and their agreement."""
        return peak_layers(self.replicate_means(), self.metrics)


def peak_layers(means: np.ndarray, metrics: tuple[str, ...]) -> pd.DataFrame:
    """``means [1 + B, layer, metric]`` (row 0 the data) -> ``metric, peak_layer, ci_low, ci_high, agreement``."""
    peaks = means.argmax(axis=1)  # [1 + B, metric]
    low, high = np.percentile(peaks[1:], [2.5, 97.5], axis=0)
    return pd.DataFrame({"metric": list(metrics), "peak_layer": peaks[0], "ci_low": low, "ci_high": high,
                         "agreement": (peaks[1:] == peaks[0]).mean(axis=0)})
