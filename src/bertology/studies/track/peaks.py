"""Where attention to [CLS], [SEP] and punctuation peaks over depth, with bootstrap replicates over sequences: the
analyzer ``track`` runs at each checkpoint for the learning-curve verdict (docs/methods.md#track-and-the-learning-curve-verdict)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps
from bertology.core.stats import bootstrap_weights
from bertology.families.profile.analyzer import attention_to

#: The token sets whose attention peaks at a characteristic depth under the learning-curve hypothesis (docs/methods.md#track-and-the-learning-curve-verdict).
PEAK_METRICS = ("cls", "sep", "punct")


class LayerPeaks(LayerwiseAnalyzer):
    """Per-layer attention to [CLS], [SEP] and punctuation (the engine's set, as in :class:`GeneralProfile`),
    with bootstrap replicates over sequences.

    A sequence's value for layer l is the mean over its heads of the metric (as in
    :meth:`GeneralProfile.layers`); ``m_l`` is its mean over sequences, and the metric peaks at
    ``argmax_l m_l``. Replicate 0 is the data; replicates 1..B weight each sequence by a Poisson(1)
    draw keyed by the sequence (:func:`~bertology.core.stats.bootstrap_weights`), so the replicates of
    two checkpoints run on one corpus are paired.

    :meth:`result`: ``layer, metric, value, ci_low, ci_high, n`` (2.5th/97.5th percentiles of the
    replicates). :meth:`peaks`: ``metric, peak_layer, ci_low, ci_high, agreement`` (the replicates'
    peak layers: percentiles, and the share that agree with the data's). :meth:`replicate_means`:
    ``[1 + B, layer, metric]``.
    """

    name = "layer_peaks"

    def __init__(self, bootstrap: int = 1000, seed: int = 0):
        self.bootstrap = bootstrap
        self.seed = seed
        self._sums: np.ndarray | None = None  # [1 + B, layer, metric]: weighted sums of sequence values
        self._weights = np.zeros(1 + bootstrap)  # [1 + B]: summed sequence weights
        self._sequences = 0
        self._pending: list[torch.Tensor] = []  # one [batch, metric] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            self._pending = []
        sets = {"cls": batch.cls_mask, "sep": batch.sep_mask, "punct": batch.punct_mask}
        members = torch.stack([sets[metric] for metric in PEAK_METRICS], dim=-1)
        self._pending.append(attention_to(maps.attention, batch.mask, members).mean(dim=1))  # a sequence's layer value, the head mean: [batch, metric]

    def finish_batch(self, batch: Batch) -> None:
        values = torch.stack(self._pending, dim=1).double().cpu().numpy()  # [batch, layer, metric]: one copy to the host
        self._pending = []
        weights = np.stack([bootstrap_weights(self.seed, self.bootstrap, example) for example in batch.examples])  # [batch, 1 + B]
        sums = np.einsum("br,blm->rlm", weights, values)
        self._sums = sums if self._sums is None else self._sums + sums
        self._weights += weights.sum(axis=0)
        self._sequences += len(batch.examples)

    def merge(self, other: "LayerPeaks") -> "LayerPeaks":
        self._check_mergeable(other)
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
        return pd.DataFrame({"layer": layer.ravel(), "metric": np.array(PEAK_METRICS)[metric.ravel()], "value": means[0].ravel(),
                             "ci_low": low.ravel(), "ci_high": high.ravel(), "n": self._sequences})

    def peaks(self) -> pd.DataFrame:
        """Where each metric peaks: the data's layer, the replicates' 95% percentile interval and their agreement."""
        return peak_layers(self.replicate_means())


def peak_layers(means: np.ndarray, metrics=PEAK_METRICS) -> pd.DataFrame:
    """``means [1 + B, layer, metric]`` (row 0 the data) -> ``metric, peak_layer, ci_low, ci_high, agreement``."""
    peaks = means.argmax(axis=1)  # [1 + B, metric]
    low, high = np.percentile(peaks[1:], [2.5, 97.5], axis=0)
    return pd.DataFrame({"metric": list(metrics), "peak_layer": peaks[0], "ci_low": low, "ci_high": high,
                         "agreement": (peaks[1:] == peaks[0]).mean(axis=0)})
