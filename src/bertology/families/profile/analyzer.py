"""The general head profile (Clark et al. 2019, "What Does BERT Look At?", docs/methods.md#head-profile).

Per head and sequence, with ``a[i, j]`` the attention from query i to key j and n real tokens
(special tokens included, padding excluded):

- ``cls``, ``sep``, ``punct``: attention to a token set K, ``(1/n) sum_i sum_{j in K} a[i, j]``;
  punctuation is the engine's set (``Engine(punct=...)``, :data:`~bertology.core.model.models.PUNCT_SETS`):
  ``upos`` (default), every token whose text without a continuation marker (``##``, ``Ġ``) is only
  Unicode punctuation (category P*); ``clark``, the tokens "." and "," only, as in Clark et al.'s code;
- ``self``, ``prev``, ``next``: ``(1/n) sum_i a[i, i]``, ``(1/n) sum_{i>=1} a[i, i-1]``,
  ``(1/n) sum_{i<n-1} a[i, i+1]`` (Clark's convention: divide by n);
- ``entropy``: smooth ``a <- 0.9999 a + 0.0001/n``, then ``mean_i -sum_j a[i,j] ln a[i,j]`` (nats);
  ``cls_entropy``: the same for the [CLS] row alone;
- ``distance``: ``(1/n) sum_i sum_j a[i, j] |i - j|`` (in tokens).

Each metric is averaged over sequences, with a 95% Student-t interval over sequences.

On a decoder (docs/methods.md#decoders) query i sees keys ``j <= i`` only, so row 0 (which sees only itself) is left
out of every mean over queries, ``m = n - 1`` queries: ``first`` (the first token, BOS where the tokenizer adds one, the
candidate attention sink, in [CLS]'s place) ``(1/m) sum_{i>=1} a[i, 0]``; ``punct``, ``self``, ``prev`` and ``distance`` the
same sums over ``i >= 1``; the entropy smoothed per row over the keys it sees, ``a <- 0.9999 a + 0.0001/(i + 1)``, whose
uniform reference is ``ln(i + 1)``. [SEP] and ``next`` have no meaning there (no [SEP]; the next token is never seen),
nor the entropy of row 0 (always 0): those metrics are left out (:data:`DECODER_PROFILE_METRICS`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps
from bertology.core.statistics.stats import RunningMoments, interval_frame, keyed_rng, sequence_key

PROFILE_METRICS = ("cls", "sep", "punct", "self", "prev", "next", "entropy", "cls_entropy", "distance")
#: The metrics with a meaning on a decoder (causal attention), ``first`` in place of ``cls`` (docs/methods.md#decoders).
DECODER_PROFILE_METRICS = ("first", "punct", "self", "prev", "entropy", "distance")
ENTROPY_SMOOTHING = 1e-4  # Clark et al.: a <- (1 - eps) a + eps / n


def attention_to(attention: torch.Tensor, mask: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Attention to token sets K, ``(1/n) sum_i sum_{j in K} a[i, j]`` (Clark et al. 2019), through the column sums
    ``c[j] = sum_i a[i, j]`` as ``(1/n) sum_{j in K} c[j]``: one sweep over the maps, however many sets.

    ``attention`` is ``[..., batch, head, n, n]`` (any leading dimensions, e.g. layers), ``mask`` is ``[batch, n]``,
    ``members`` ``[batch, n, sets]`` booleans. Returns ``[..., batch, head, sets]``.
    """
    n = mask.sum(dim=1).to(attention.dtype)[:, None, None]
    return torch.einsum("...bhj,bjk->...bhk", attention.sum(dim=-2), members.to(attention.dtype)) / n


def profile_metrics(
    attention: torch.Tensor,
    mask: torch.Tensor,
    cls_mask: torch.Tensor,
    sep_mask: torch.Tensor,
    punct_mask: torch.Tensor,
) -> torch.Tensor:
    """The :data:`PROFILE_METRICS` of every head on every sequence, in the maps' dtype on their device.

    ``attention`` is ``[batch, head, n, n]`` (one layer, padding rows and columns zero), the masks
    are ``[batch, n]`` booleans. Returns ``[batch, head, len(PROFILE_METRICS)]``. Each metric is one sweep over
    the maps: the token sets through the column sums (:func:`attention_to`), the distance as one product with
    ``|i - j|``, the entropy as one smoothed copy.
    """
    dtype = attention.dtype
    real = mask.to(dtype)
    n = real.sum(dim=1)[:, None]  # [batch, 1]
    width = attention.shape[-1]

    positions = torch.arange(width, device=attention.device)
    gap = (positions[:, None] - positions[None, :]).abs().to(dtype)
    smoothed = torch.add((ENTROPY_SMOOTHING / n)[:, :, None, None] * real[:, None, None, :], attention, alpha=1 - ENTROPY_SMOOTHING)
    row_entropy = -torch.xlogy(smoothed, smoothed, out=smoothed).sum(dim=-1) * real[:, None, :]  # [batch, head, n]
    del smoothed
    cls_position = cls_mask.to(torch.int8).argmax(dim=1)
    cls_entropy = row_entropy.gather(2, cls_position[:, None, None].expand(-1, attention.shape[1], 1))[..., 0]
    cls_entropy = torch.where(cls_mask.any(dim=1)[:, None], cls_entropy, torch.nan)
    to_sets = attention_to(attention, mask, torch.stack([cls_mask, sep_mask, punct_mask], dim=-1))  # [batch, head, 3]
    columns = {
        "cls": to_sets[..., 0],
        "sep": to_sets[..., 1],
        "punct": to_sets[..., 2],
        "self": attention.diagonal(dim1=-2, dim2=-1).sum(-1) / n,
        "prev": attention.diagonal(offset=-1, dim1=-2, dim2=-1).sum(-1) / n,
        "next": attention.diagonal(offset=1, dim1=-2, dim2=-1).sum(-1) / n,
        "entropy": row_entropy.sum(-1) / n,
        "cls_entropy": cls_entropy,
        "distance": torch.matmul(attention.flatten(-2), gap.flatten()) / n,
    }
    return torch.stack([columns[name] for name in PROFILE_METRICS], dim=-1)


def causal_profile_metrics(attention: torch.Tensor, mask: torch.Tensor, first_mask: torch.Tensor, punct_mask: torch.Tensor) -> torch.Tensor:
    """The :data:`DECODER_PROFILE_METRICS` of every head on every sequence of a decoder (see the module docstring): the
    means over queries ``i >= 1`` (``m = n - 1`` of them; NaN for a sequence of one token), the entropy smoothed per row
    over the ``i + 1`` keys it sees. ``attention`` is ``[batch, head, n, n]`` (lower triangular, padding zero), the masks
    ``[batch, n]`` (``first_mask``: position 0, ``Batch.cls_mask`` of a decoder). Returns ``[batch, head, len(DECODER_PROFILE_METRICS)]`` in the maps' dtype."""
    dtype, width = attention.dtype, attention.shape[-1]
    real = mask.to(dtype)
    queries = real.sum(dim=1)[:, None] - 1  # [batch, 1]: m = n - 1
    queries = torch.where(queries > 0, queries, torch.nan)
    positions = torch.arange(width, device=attention.device)
    visible = (positions[None, :] <= positions[:, None]).to(dtype)[None] * real[:, None, :]  # [batch, i, j]: j <= i, j real
    smoothing = ENTROPY_SMOOTHING / (positions + 1).to(dtype)  # eps / |S_i|, |S_i| = i + 1
    smoothed = torch.add((visible * smoothing[None, :, None])[:, None], attention, alpha=1 - ENTROPY_SMOOTHING)
    row_entropy = -torch.xlogy(smoothed, smoothed, out=smoothed).sum(dim=-1) * real[:, None, :]  # [batch, head, n]
    del smoothed
    later_rows = attention[..., 1:, :].sum(dim=-2)  # [batch, head, n]: column sums over the queries i >= 1
    to_sets = torch.einsum("bhj,bjk->bhk", later_rows, torch.stack([first_mask, punct_mask], dim=-1).to(dtype)) / queries[:, :, None]
    gap = (positions[:, None] - positions[None, :]).abs().to(dtype)
    columns = {
        "first": to_sets[..., 0],
        "punct": to_sets[..., 1],
        "self": attention.diagonal(dim1=-2, dim2=-1)[..., 1:].sum(-1) / queries,
        "prev": attention.diagonal(offset=-1, dim1=-2, dim2=-1).sum(-1) / queries,
        "entropy": row_entropy[..., 1:].sum(-1) / queries,
        "distance": torch.matmul(attention.flatten(-2), gap.flatten()) / queries,  # row 0's distance is 0
    }
    return torch.stack([columns[name] for name in DECODER_PROFILE_METRICS], dim=-1)


class GeneralProfile(LayerwiseAnalyzer):
    """Clark et al.'s general attention profile of every head (see the module docstring).

    :meth:`result` gives one row per ``layer, head, metric`` (0-based layer and head) with the mean
    over sequences ``value``, its 95% interval ``ci_low``/``ci_high`` and the number of sequences
    ``n``. :meth:`layers` gives the same per layer, where a sequence's layer value is the mean of
    its heads. On a decoder the metrics are :data:`DECODER_PROFILE_METRICS` (``causal``, known from the first batch).
    """

    name = "heads"

    def __init__(self) -> None:
        self.causal = False
        self._heads: RunningMoments | None = None
        self._layers: RunningMoments | None = None
        self._log_lengths = 0.0  # sum over sequences of ln n (n: the sequence's tokens), for the entropy's ceiling
        self._sequences = 0
        self._pending: list[torch.Tensor] = []  # this batch's metrics so far, one [batch, head, metric] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            self._pending = []
            self.causal = batch.causal
        if batch.causal:
            self._pending.append(causal_profile_metrics(maps.attention, batch.mask, batch.cls_mask, batch.punct_mask))
        else:
            self._pending.append(profile_metrics(maps.attention, batch.mask, batch.cls_mask, batch.sep_mask, batch.punct_mask))

    def finish_batch(self, batch: Batch) -> None:
        values = torch.stack(self._pending, dim=1).double().cpu().numpy()  # [batch, layer, head, metric]: one copy to the host
        self._pending = []
        if batch.causal:  # the uniform reference of a decoder's mean entropy: mean_{i=1..n-1} ln(i + 1) = ln(n!) / (n - 1)
            lengths = batch.host_lengths[batch.host_lengths > 1]  # a sequence of one token has no query i >= 1
            self._log_lengths += float(sum(math.lgamma(n + 1) / (n - 1) for n in lengths))
            self._sequences += len(lengths)
        else:
            self._log_lengths += float(np.log(batch.host_lengths).sum())
            self._sequences += batch.size
        if self._heads is None:
            self._heads = RunningMoments(values.shape[1:])
            self._layers = RunningMoments((values.shape[1], values.shape[3]))
        self._heads.push(values)
        self._layers.push(values.mean(axis=2))

    def merge(self, other: "GeneralProfile") -> "GeneralProfile":
        self._check_mergeable(other)
        self.causal = self.causal or other.causal
        self._log_lengths += other._log_lengths
        self._sequences += other._sequences
        if other._heads is None:
            return self
        if self._heads is None:
            self._heads, self._layers = other._heads, other._layers
            return self
        self._heads.merge(other._heads)
        self._layers.merge(other._layers)
        return self

    def result(self) -> pd.DataFrame:
        if self._heads is None:
            return pd.DataFrame(columns=["layer", "head", "metric", "value", "ci_low", "ci_high", "n"])
        num_layers, num_heads, _ = self._heads.count.shape
        index = pd.MultiIndex.from_product([range(num_layers), range(num_heads), self.metrics], names=["layer", "head", "metric"])
        return interval_frame(self._heads, index)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics of the table: :data:`PROFILE_METRICS`, or on a decoder :data:`DECODER_PROFILE_METRICS`."""
        return DECODER_PROFILE_METRICS if self.causal else PROFILE_METRICS

    def entropy_ceiling(self) -> float:
        """The largest mean entropy any head can have on this corpus: the mean over sequences of ln n, the entropy of
        uniform attention over a sequence's n tokens (a decoder's: the mean over its queries ``i >= 1`` of ``ln(i + 1)``;
        NaN before any sequence)."""
        return self._log_lengths / self._sequences if self._sequences else float("nan")

    def layers(self) -> pd.DataFrame:
        """Per-layer aggregates: ``layer, metric, value, ci_low, ci_high, n``."""
        if self._layers is None:
            return pd.DataFrame(columns=["layer", "metric", "value", "ci_low", "ci_high", "n"])
        index = pd.MultiIndex.from_product([range(self._layers.count.shape[0]), self.metrics], names=["layer", "metric"])
        return interval_frame(self._layers, index)


JS_ROWS_AT_ONCE = 16  # rows of every head at a time: one head against all later heads fits in the cache


def pairwise_js(rows: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Summed Jensen-Shannon divergence (nats) between every pair of heads, over matching rows.

    ``rows`` is ``[heads, r, n]`` (r attention rows of n keys per head; all-zero padding rows add
    nothing), or a list of such parts whose heads follow each other (a layer's each: never copied whole).
    Uses ``JS(p, q) = H((p + q) / 2) - (H(p) + H(q)) / 2``, equal to scipy's ``jensenshannon(p, q) ** 2``; one
    head against all later heads at a time (upper triangle), over :data:`JS_ROWS_AT_ONCE` rows at a time. The terms
    are computed in the rows' dtype, their sums in float64 (the difference of entropies cancels). Returns ``[heads, heads]`` float64.
    """
    parts = [rows] if isinstance(rows, torch.Tensor) else rows
    heads, device = sum(part.shape[0] for part in parts), parts[0].device
    neg_entropy = torch.cat([torch.special.xlogy(part, part).sum(dim=(1, 2), dtype=torch.float64) for part in parts])  # -sum_r H(p_r)
    mass = torch.cat([part.sum(dim=(1, 2), dtype=torch.float64) for part in parts])  # sum_r sum_j p (the number of real rows)
    # sum m log m with m = t / 2, t = p + q: (1/2) sum t log t - (ln 2 / 2) sum t, so t log t needs no halving pass
    t_log_t = torch.zeros(heads, heads, dtype=torch.float64, device=device)
    for start in range(0, parts[0].shape[1], JS_ROWS_AT_ONCE):
        block = torch.cat([part[:, start : start + JS_ROWS_AT_ONCE] for part in parts])
        for first in range(heads - 1):
            total = block[first] + block[first + 1 :]
            t_log_t[first, first + 1 :] += torch.xlogy(total, total, out=total).sum(dim=(1, 2), dtype=torch.float64)
    mixed = 0.5 * t_log_t - 0.5 * math.log(2) * (mass[:, None] + mass[None, :])
    upper = torch.triu(0.5 * (neg_entropy[:, None] + neg_entropy[None, :]) - mixed, diagonal=1)
    return upper + upper.T


class HeadDistance(LayerwiseAnalyzer):
    """Head-to-head Jensen-Shannon distance and its 2-D MDS map (Clark et al. 2019, section 6).

    ``d(A, B) = sum_docs sum_i JS(A_i, B_i)`` over the rows i of the sampled sequences, reported
    divided by the number of rows (the mean JS divergence per row, in nats). A sequence is sampled
    if a hash of its line and text (:func:`~bertology.core.statistics.stats.sequence_key`) and the seed falls below
    ``sample``, so the sample is the same whatever the batch size, order, sharding or file name.
    """

    name = "head_distance"

    def __init__(self, sample: float = 0.1, seed: int = 0):
        if not 0 < sample <= 1:
            raise ValueError("sample must be in (0, 1]")
        self.sample = sample
        self.seed = seed
        self._total: np.ndarray | None = None
        self._rows = 0
        self._shape: tuple[int, int] | None = None
        self._sampled: list[int] = []  # the batch's sampled sequences
        self._pending: list[torch.Tensor] = []  # their real rows so far, one [head, r, n] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            self._sampled = [b for b, e in enumerate(batch.examples) if keyed_rng(self.seed, *sequence_key(e)).random() < self.sample]
            self._pending = []
        if self._sampled:
            # The sampled sequences' real rows side by side (padding rows are zero and would add nothing but work), cut by
            # the lengths the host knows: [head, rows, n]
            lengths = batch.host_lengths
            self._pending.append(torch.cat([maps.attention[b, :, : lengths[b]] for b in self._sampled], dim=1))

    def finish_batch(self, batch: Batch) -> None:
        self._shape = (batch.num_layers, batch.num_heads)
        if self._total is None:
            self._total = np.zeros((batch.num_layers * batch.num_heads,) * 2)
        rows, self._pending = self._pending, []
        if not rows:
            return
        self._total += pairwise_js(rows).cpu().numpy()  # every layer's [head, r, n] in: one copy of [heads, heads] out
        self._rows += int(batch.host_lengths[self._sampled].sum())
        self._sampled = []

    def merge(self, other: "HeadDistance") -> "HeadDistance":
        self._check_mergeable(other)
        if other._total is not None:
            self._total = other._total.copy() if self._total is None else self._total + other._total
            self._rows += other._rows
            self._shape = other._shape
        return self

    def matrix(self) -> np.ndarray:
        """``[layer*head, layer*head]`` mean JS divergence per row (heads in layer-major order)."""
        if self._total is None or self._rows == 0:
            raise ValueError("no sequence was sampled for the head distance: raise `sample` or give more data")
        return self._total / self._rows

    def result(self) -> pd.DataFrame:
        """Long table ``layer_a, head_a, layer_b, head_b, distance, rows`` over all ordered pairs."""
        matrix = self.matrix()
        num_layers, num_heads = self._shape
        layer, head = np.divmod(np.arange(num_layers * num_heads), num_heads)
        a, b = np.meshgrid(np.arange(len(layer)), np.arange(len(layer)), indexing="ij")
        return pd.DataFrame(
            {
                "layer_a": layer[a.ravel()],
                "head_a": head[a.ravel()],
                "layer_b": layer[b.ravel()],
                "head_b": head[b.ravel()],
                "distance": matrix.ravel(),
                "rows": self._rows,
            }
        )

    def embedding(self) -> pd.DataFrame:
        """2-D multidimensional scaling of the distance matrix: ``layer, head, x, y``."""
        matrix = self.matrix()
        num_layers, num_heads = self._shape
        from sklearn.manifold import MDS  # scikit-learn loads in about 0.7 s: only when the map is drawn

        mds = MDS(n_components=2, metric="precomputed", random_state=self.seed, n_init=4, init="random")
        coordinates = mds.fit_transform(matrix)
        layer, head = np.divmod(np.arange(num_layers * num_heads), num_heads)
        return pd.DataFrame({"layer": layer, "head": head, "x": coordinates[:, 0], "y": coordinates[:, 1]})


#: Clark et al.'s labels: a head is "broad" if its mean entropy exceeds 3.8 nats, "prev"/"next" if
#: over half its attention goes to that neighbour, "cls"/"sep"/"punct" above 0.6. They depend on
#: the sequence length n, so they are parameters.
CLARK_THRESHOLDS = {"entropy": 3.8, "prev": 0.5, "next": 0.5, "cls": 0.6, "sep": 0.6, "punct": 0.6}
#: The same on a decoder: the first token in [CLS]'s place, no [SEP] or next token (docs/methods.md#decoders).
DECODER_CLARK_THRESHOLDS = {"entropy": 3.8, "prev": 0.5, "first": 0.6, "punct": 0.6}
_LABEL_NAMES = {"entropy": "broad"}


def clark_thresholds(entropy_ceiling: float, thresholds: dict[str, float] | None = None) -> pd.DataFrame:
    """Each of Clark's thresholds beside the largest value the corpus allows: ``label, metric, threshold, corpus_max,
    reachable``. A share of attention can reach 1; the mean entropy only ``entropy_ceiling`` (the mean of ln n), so on
    short sequences no head can be "broad" (3.8 nats needs a geometric-mean length over e^3.8 = 45 tokens)."""
    thresholds = CLARK_THRESHOLDS if thresholds is None else thresholds
    rows = [(_LABEL_NAMES.get(metric, metric), metric, value, entropy_ceiling if metric == "entropy" else 1.0) for metric, value in thresholds.items()]
    table = pd.DataFrame(rows, columns=["label", "metric", "threshold", "corpus_max"])
    return table.assign(reachable=table.corpus_max > table.threshold)


def clark_labels(heads: pd.DataFrame, thresholds: dict[str, float] | None = None) -> pd.DataFrame:
    """Heads whose mean metric exceeds Clark's threshold: ``layer, head, label, metric, value, threshold``."""
    thresholds = CLARK_THRESHOLDS if thresholds is None else thresholds
    rows = heads[heads.metric.isin(thresholds)].copy()
    rows["threshold"] = rows.metric.map(thresholds)
    rows = rows[rows.value > rows.threshold]
    rows["label"] = rows.metric.map(lambda m: _LABEL_NAMES.get(m, m))
    return rows[["layer", "head", "label", "metric", "value", "threshold"]].sort_values(["layer", "head", "label"]).reset_index(drop=True)
