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
nor the entropy of row 0 (always 0): those metrics are left out. One function serves both kinds of model
(:class:`~bertology.core.model.kinds.Kind`): :func:`profile_metric_names` names a kind's metrics, :func:`profile_metrics`
computes them.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, moved_to, stack_layers
from bertology.core.measures.entropy import x_log_x
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import RunningMoments, interval_frame, keyed_rng, sequence_key
from bertology.families.kinds import check_kind, check_same_kind
from bertology.families.profile import HEAD_DISTANCE_BUDGET

ENTROPY_SMOOTHING = 1e-4  # Clark et al.: a <- (1 - eps) a + eps / n


def profile_metric_names(kind: Kind) -> tuple[str, ...]:
    """The profile's metrics on a ``kind`` of model, in table order: the attention to each of the kind's anchors
    (``cls``, ``sep``; a decoder's ``first``), ``punct``, ``self``, ``prev``, ``next`` (where a query sees the keys after it),
    ``entropy``, the first anchor's own row's entropy (``cls_entropy``, where that row sees more than itself) and ``distance``."""
    later = kind.sees_later_keys
    return (*kind.anchors, "punct", "self", "prev", *(("next",) if later else ()), "entropy",
            *((f"{kind.anchors[0]}_entropy",) if later else ()), "distance")


#: Map cells a sweep over maps takes at a time (2 MB of float32), so what it makes of them stays in the cache: the entropy's
#: smoothed copy (one of a whole layer went to memory and back, half the entropy's time at 1,024 tokens, 32 heads) and the
#: head distance's sums of two heads (16 rows at a time took 13.5 ms against 7.1 for MiniLM's 72 heads x 55 rows x 40 keys;
#: 9 MB at a time, 2.4x as long as 2 MB for 144 heads x 128 rows x 128 keys)
CELLS_AT_ONCE = 1 << 19


def smoothed_row_entropy(attention: torch.Tensor, floor: torch.Tensor, causal_from: int | None = None) -> torch.Tensor:
    """Each row's entropy (nats) after Clark et al.'s smoothing, ``-sum_j s_j ln s_j`` with ``s = (1 - eps) a + floor``:
    ``attention [batch, head, r, n]``, ``floor [batch, r, n]`` (``eps / |S_i|`` on the keys row i sees, 0 elsewhere).
    Returns ``[batch, head, r]``, :data:`CELLS_AT_ONCE` cells at a time. ``causal_from``: the maps are causal and
    their first row is row ``causal_from`` of the sequence, so a row ``i`` sees no key past ``i`` and the cells there (0,
    adding 0) are left out: half the work of a whole map."""
    batch, heads, count, width = attention.shape
    step = max(1, CELLS_AT_ONCE // (batch * heads * width))
    entropy = attention.new_empty(batch, heads, count)
    for start in range(0, count, step):
        rows = slice(start, min(start + step, count))
        keys = width if causal_from is None else min(width, causal_from + rows.stop)
        smoothed = torch.add(floor[:, None, rows, :keys], attention[:, :, rows, :keys], alpha=1 - ENTROPY_SMOOTHING)
        entropy[:, :, rows] = x_log_x(smoothed, out=smoothed).sum(dim=-1)
    return entropy.neg_()


def profile_metrics(attention: torch.Tensor, mask: torch.Tensor, anchors: dict[str, torch.Tensor], punct_mask: torch.Tensor, kind: Kind,
                    rows: slice | None = None) -> torch.Tensor:
    """The :func:`profile_metric_names` of every head on every sequence of a ``kind`` of model, in the maps' dtype on their
    device (see the module docstring): the means over the kind's queries (every real token; a decoder's ``i >= 1``, NaN for
    a sequence of one token), the entropy smoothed per row over the keys the row sees, ``a <- (1 - eps) a + eps / |S_i|``.

    ``attention`` is ``[batch, head, n, n]`` (one layer, padding rows and columns zero), ``mask`` and ``punct_mask`` are
    ``[batch, n]`` booleans and ``anchors`` the kind's anchor tokens by name (``Batch.anchors``). Returns
    ``[batch, head, len(profile_metric_names(kind))]``. Each metric is one sweep over the maps: the token sets through the
    column sums, the distance as one product with ``|i - j|``, the entropy as one smoothed copy.

    ``rows``: ``attention`` holds only these query rows of the maps (``[batch, head, r, n]``, a block of a pass by blocks of
    queries, :attr:`~bertology.core.engine.LayerMaps.rows`): the result is their part of each metric, every mean over queries
    a sum over rows divided by the sequence's query count, so the parts of consecutive blocks add up to the whole maps'
    metrics (the anchor row's entropy counts in the block that holds it, 0 in the others).
    """
    dtype, width = attention.dtype, attention.shape[-1]
    rows = slice(0, attention.shape[-2]) if rows is None else rows
    first, count = rows.start, attention.shape[-2]
    real = mask.to(dtype)
    start = max(kind.first_query - first, 0)  # rows before the kind's first query enter no mean
    queries = real.sum(dim=1)[:, None] - kind.first_query  # [batch, 1]: the queries of kind.query_mask
    queries = torch.where(queries > 0, queries, torch.nan)
    positions = torch.arange(width, device=attention.device)
    smoothing = ENTROPY_SMOOTHING / kind.visible_counts(mask)[:, rows].clamp(min=1).to(dtype)  # [batch, r]: eps / |S_i|
    floor = kind.visible_keys(mask, rows).to(dtype) * smoothing[:, :, None]  # [batch, r, n]: eps / |S_i| on the keys row i sees
    row_entropy = smoothed_row_entropy(attention, floor, None if kind.sees_later_keys else first) * real[:, None, rows]
    members = torch.stack([*(anchors[name] for name in kind.anchors), punct_mask], dim=-1).to(dtype)  # [batch, n, sets]
    to_sets = torch.einsum("bhj,bjk->bhk", attention[..., start:, :].sum(dim=-2), members) / queries[:, :, None]  # via the column sums
    gap = (positions[first : first + count, None] - positions[None, :]).abs().to(dtype)  # [r, n]: |i - j|
    columns = dict(zip((*kind.anchors, "punct"), to_sets.unbind(dim=-1)))
    columns.update({  # a[i, i + k] of row i of the block: its diagonal at offset first + k
        "self": attention.diagonal(offset=first, dim1=-2, dim2=-1)[..., start:].sum(-1) / queries,
        "prev": attention.diagonal(offset=first - 1, dim1=-2, dim2=-1).sum(-1) / queries,
        "entropy": row_entropy[..., start:].sum(-1) / queries,
        "distance": torch.matmul(attention.flatten(-2), gap.flatten()) / queries,  # a decoder's row 0 has distance 0
    })
    if kind.sees_later_keys:  # the next token, and the first anchor's own row (a decoder's row 0 sees only itself)
        anchor = anchors[kind.anchors[0]]
        position = anchor.to(torch.int8).argmax(dim=1) - first  # [batch]: the anchor's row in the block
        inside = (position >= 0) & (position < count)
        row = row_entropy.gather(2, position.clamp(0, count - 1)[:, None, None].expand(-1, attention.shape[1], 1))[..., 0]
        columns["next"] = attention.diagonal(offset=first + 1, dim1=-2, dim2=-1).sum(-1) / queries
        columns[f"{kind.anchors[0]}_entropy"] = torch.where(anchor.any(dim=1)[:, None], torch.where(inside[:, None], row, 0), torch.nan)
    return torch.stack([columns[name] for name in profile_metric_names(kind)], dim=-1)


#: How far a head's mean excess over the uniform head's must clear 0 (its 95% interval's lower end) for a label: beyond
#: the rounding of a head that is uniform (the null model's maps, float32, against the exact uniform rows).
EXCESS_TOLERANCE = 1e-6


class GeneralProfile(LayerwiseAnalyzer):
    """Clark et al.'s general attention profile of every head on a ``kind`` of model (see the module docstring).

    :meth:`result` gives one row per ``layer, head, metric`` (0-based layer and head; the metrics :func:`profile_metric_names`
    of the kind) with the mean over sequences ``value``, its 95% interval ``ci_low``/``ci_high`` and the number of sequences
    ``n``; ``uniform``, the same metric of the layer's uniform head (each row spread evenly over the keys it sees, computed
    from the layer's visible keys, no forward pass) on the same sequences; ``excess``, the mean over sequences of the head's
    value minus the uniform head's, and its 95% interval ``excess_ci_low``/``excess_ci_high``. :meth:`layers` gives
    ``value``, its interval, ``n`` and ``uniform`` per layer, where a sequence's layer value is the mean of its heads.
    """

    name = "heads"
    #: Each layer's metrics are sums over query rows: blocks of rows add up (:attr:`~bertology.core.engine.LayerMaps.rows`).
    folds_row_blocks = True

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._heads: RunningMoments | None = None
        self._layers: RunningMoments | None = None
        self._uniform: RunningMoments | None = None  # [layer, 1 or head, metric]: the uniform head's metrics
        self._excess: RunningMoments | None = None  # [layer, head, metric]: each head's minus the uniform head's, per sequence
        self._log_lengths = 0.0  # sum over sequences of their uniform entropy (an encoder's ln n), for the entropy's ceiling
        self._sequences = 0
        self._pending: list[torch.Tensor] = []  # this batch's metrics so far, one [batch, head + 1 or 2 head, metric] per layer, the uniform heads last

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0 and maps.starts_layer:
            check_kind(self, batch)
            self._pending = []
        arguments = (batch.mask, batch.anchors, batch.punct_mask, self.kind, maps.rows)
        values = profile_metrics(maps.attention, *arguments)
        uniform = maps.uniform_scored(batch, self, lambda head: profile_metrics(head, *arguments))  # once for the layers that share it
        part = torch.cat([values.double(), uniform.double()], dim=1)  # a block's part of the layer's metrics: they add up
        if maps.starts_layer:
            self._pending.append(part)
        else:
            self._pending[-1] += part

    def finish_batch(self, batch: Batch) -> None:
        # [batch, layer, head + uniform heads, metric], one copy to the host: the uniform head's metrics after the heads' (one,
        # or one per head under a view that reads each head's own vectors, LayerMaps.uniform)
        values = stack_layers(self._pending, batch, dim=1).double().cpu().numpy()
        self._pending = []
        values, uniform = values[:, :, : batch.num_heads], values[:, :, batch.num_heads :]
        ceilings = self.kind.uniform_entropies(batch.host_lengths)  # NaN where a sequence has no query (a decoder's one token)
        ceilings = ceilings[~np.isnan(ceilings)]
        self._log_lengths += float(ceilings.sum())
        self._sequences += len(ceilings)
        if self._heads is None:
            self._heads = RunningMoments(values.shape[1:])
            self._layers = RunningMoments((values.shape[1], values.shape[3]))
            self._uniform = RunningMoments(uniform.shape[1:])
            self._excess = RunningMoments(values.shape[1:])
        self._heads.push(values)
        self._layers.push(values.mean(axis=2))
        self._uniform.push(uniform)
        self._excess.push(values - uniform)

    def merge(self, other: "GeneralProfile") -> "GeneralProfile":
        check_same_kind(self, other)
        self._log_lengths += other._log_lengths
        self._sequences += other._sequences
        if other._heads is None:
            return self
        if self._heads is None:
            self._heads, self._layers, self._uniform, self._excess = other._heads, other._layers, other._uniform, other._excess
            return self
        self._heads.merge(other._heads)
        self._layers.merge(other._layers)
        self._uniform.merge(other._uniform)
        self._excess.merge(other._excess)
        return self

    def result(self) -> pd.DataFrame:
        columns = ["layer", "head", "metric", "value", "ci_low", "ci_high", "n", "uniform", "excess", "excess_ci_low", "excess_ci_high"]
        if self._heads is None:
            return pd.DataFrame(columns=columns)
        num_layers, num_heads, _ = self._heads.count.shape
        index = pd.MultiIndex.from_product([range(num_layers), range(num_heads), self.metrics], names=["layer", "head", "metric"])
        table = interval_frame(self._heads, index)
        table["uniform"] = np.broadcast_to(self._uniform.means(), self._heads.count.shape).ravel()
        excess = interval_frame(self._excess, index)
        table["excess"], table["excess_ci_low"], table["excess_ci_high"] = excess.value, excess.ci_low, excess.ci_high
        return table[columns]

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics of the table: :func:`profile_metric_names` of the analyzer's kind."""
        return profile_metric_names(self.kind)

    def entropy_ceiling(self) -> float:
        """The largest mean entropy any head can have on this corpus: the mean over sequences of the entropy of uniform
        attention over the keys each query sees (:meth:`~bertology.core.model.kinds.Kind.uniform_entropy`: an encoder's
        ln n; a decoder's mean over its queries ``i >= 1`` of ``ln(i + 1)``; NaN before any sequence)."""
        return self._log_lengths / self._sequences if self._sequences else float("nan")

    def layers(self) -> pd.DataFrame:
        """Per-layer aggregates: ``layer, metric, value, ci_low, ci_high, n, uniform``."""
        columns = ["layer", "metric", "value", "ci_low", "ci_high", "n", "uniform"]
        if self._layers is None:
            return pd.DataFrame(columns=columns)
        index = pd.MultiIndex.from_product([range(self._layers.count.shape[0]), self.metrics], names=["layer", "metric"])
        table = interval_frame(self._layers, index)
        table["uniform"] = self._uniform.means().mean(axis=1).ravel()  # as a layer's value: the mean of its heads'
        return table[columns]


def pairwise_js(rows: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Summed Jensen-Shannon divergence (nats) between every pair of heads, over matching rows.

    ``rows`` is ``[heads, r, n]`` (r attention rows of n keys per head; all-zero padding rows add
    nothing), or a list of such parts whose heads follow each other (a layer's each: never copied whole).
    Uses ``JS(p, q) = H((p + q) / 2) - (H(p) + H(q)) / 2``, equal to scipy's ``jensenshannon(p, q) ** 2``; one
    head against all later heads at a time (upper triangle), over the rows of :data:`CELLS_AT_ONCE` cells of every head at a
    time. The terms are computed in the rows' dtype, their sums in float64 (the difference of entropies cancels). Returns
    ``[heads, heads]`` float64.
    """
    parts = [rows] if isinstance(rows, torch.Tensor) else rows
    heads, device = sum(part.shape[0] for part in parts), parts[0].device
    neg_entropy = torch.cat([x_log_x(part).sum(dim=(1, 2), dtype=torch.float64) for part in parts])  # -sum_r H(p_r)
    mass = torch.cat([part.sum(dim=(1, 2), dtype=torch.float64) for part in parts])  # sum_r sum_j p (the number of real rows)
    # sum m log m with m = t / 2, t = p + q: (1/2) sum t log t - (ln 2 / 2) sum t, so t log t needs no halving pass
    t_log_t = torch.zeros(heads, heads, dtype=torch.float64, device=device)
    step = max(1, CELLS_AT_ONCE // (heads * parts[0].shape[2]))
    for start in range(0, parts[0].shape[1], step):
        block = torch.cat([part[:, start : start + step] for part in parts])
        for first in range(heads - 1):
            total = block[first] + block[first + 1 :]
            t_log_t[first, first + 1 :] += x_log_x(total, out=total).sum(dim=(1, 2), dtype=torch.float64)
    mixed = 0.5 * t_log_t - 0.5 * math.log(2) * (mass[:, None] + mass[None, :])
    upper = torch.triu(0.5 * (neg_entropy[:, None] + neg_entropy[None, :]) - mixed, diagonal=1)
    return upper + upper.T


#: How the head distance of a pair was computed (the ``method`` column): over every row of the sampled sequences ...
EXACT = "exact"
#: ... or, past :data:`HEAD_DISTANCE_BUDGET`, by the approximation over a keyed sample of each long sequence's rows.
SAMPLED_ROWS = "approximation: sampled rows"


def sampled_row_counts(budget: int, length: int, layers: int, heads: int, draw: float) -> tuple[int, int]:
    """How many of a ``length``-token sequence's rows enter the cross-layer and the within-layer head pairs of a model of
    ``layers`` x ``heads``: every row where all pairs over all rows fit ``budget`` JS terms (pairs x rows x keys, keys =
    ``length``); otherwise ``budget / (pairs x length)`` rows for each kind of pair (at most ``length``), its fraction
    rounded up where ``draw`` (uniform in [0, 1)) falls below it, so the expected cost of each kind is at most the budget.
    The within-layer pairs are fewer (``layers x heads (heads - 1) / 2``), so they get at least as many rows."""
    total = layers * heads
    all_pairs, within_pairs = total * (total - 1) // 2, layers * heads * (heads - 1) // 2
    if all_pairs * length * length <= budget:
        return length, length

    def rows(pairs: int) -> int:
        share = budget / (pairs * length)
        return min(length, math.floor(share) + (draw < share % 1))

    cross = rows(all_pairs)
    return cross, max(cross, rows(within_pairs)) if within_pairs else cross


class HeadDistance(LayerwiseAnalyzer):
    """Head-to-head Jensen-Shannon distance and its 2-D MDS map (Clark et al. 2019, section 6).

    ``d(A, B) = sum_docs sum_i JS(A_i, B_i)`` over the rows i of the sampled sequences, reported divided by the number of
    rows (the mean JS divergence per row, in nats). A sequence is sampled if a hash of its line and text
    (:func:`~bertology.core.statistics.stats.sequence_key`) and the seed falls below ``sample``, so the sample is the same
    whatever the batch size, order, sharding or file name.

    Exact (:data:`EXACT`, Clark's distance) on every sequence whose all head pairs x rows x keys fit ``budget``
    (:data:`HEAD_DISTANCE_BUDGET`). On a longer sequence, the approximation :data:`SAMPLED_ROWS`: its rows are shuffled by a
    generator keyed by the seed and the sequence, the first :func:`sampled_row_counts` of them enter the cross-layer pairs
    and the first, more, the within-layer pairs, each pair's sum then divided by its own number of rows (an unbiased
    estimate of the mean JS per row). The within-layer pairs are folded layer by layer as the pass goes; only the
    cross-layer rows wait for the last layer, so the memory held is about ``2 budget / (layers x heads)`` values per
    sequence, whatever its length. bench/head_distance.py measures the approximation's error against the exact distance.
    """

    name = "head_distance"
    #: The sampled rows are gathered block by block of query rows (:attr:`~bertology.core.engine.LayerMaps.rows`), in the
    #: same order in every layer of a batch.
    folds_row_blocks = True

    def __init__(self, sample: float = 0.1, seed: int = 0, budget: int = HEAD_DISTANCE_BUDGET):
        if not 0 < sample <= 1:
            raise ValueError("sample must be in (0, 1]")
        if budget < 1:
            raise ValueError("budget must be at least 1 JS term")
        self.sample = sample
        self.seed = seed
        self.budget = budget
        self._total: np.ndarray | None = None
        self._rows = 0  # the real rows of the sampled sequences (the exact distance's divisor)
        self._within_rows = 0  # the rows summed into the within-layer pairs
        self._cross_rows = 0  # the rows summed into the cross-layer pairs
        self._shape: tuple[int, int] | None = None
        self._sampled: list[int] = []  # the batch's sampled sequences
        self._cross: list[slice | torch.Tensor] = []  # each one's rows for every pair of heads
        self._within_only: list[torch.Tensor] = []  # each one's further rows for the within-layer pairs alone
        self._pending: list[torch.Tensor] = []  # the cross rows so far, one [head, r, n] per layer
        self._within: list[torch.Tensor] = []  # the within-layer sums over the further rows so far, one [head, head] per layer
        self._blocks: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # the layer's cross and further rows, block by block

    def _plan_rows(self, batch: Batch) -> None:
        """Choose the batch's sampled sequences and, for each, its rows (see the class docstring)."""
        self._sampled = [b for b, e in enumerate(batch.examples) if keyed_rng(self.seed, *sequence_key(e)).random() < self.sample]
        self._cross, self._within_only = [], []  # each sequence's rows, as a slice (every row) or sorted positions on the host
        for b in self._sampled:
            length = int(batch.host_lengths[b])
            rng = keyed_rng(self.seed, "head distance rows", *sequence_key(batch.examples[b]))
            cross, within = sampled_row_counts(self.budget, length, batch.num_layers, batch.num_heads, rng.random())
            if cross == length:  # exact: every row, as the slice the maps already hold
                self._cross.append(slice(None, length))
                self._within_only.append(np.arange(0))
                continue
            order = rng.permutation(length)
            self._cross.append(np.sort(order[:cross]))
            self._within_only.append(np.sort(order[cross:within]))

    @staticmethod
    def _in_block(rows: slice | np.ndarray, block: slice, device: torch.device) -> slice | torch.Tensor:
        """The positions among ``rows`` of a sequence that fall in the block of query rows ``block``, counted from its start."""
        if isinstance(rows, slice):
            return slice(0, max(0, min(rows.stop, block.stop) - block.start))
        return torch.as_tensor(rows[(rows >= block.start) & (rows < block.stop)] - block.start, device=device)

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0 and maps.starts_layer:
            self._plan_rows(batch)
            self._pending, self._within = [], []
        if not self._sampled:
            return
        block = slice(maps.row_start, maps.row_start + maps.attention.shape[-2])
        # The sampled sequences' chosen real rows of this block side by side (padding rows are zero and would add nothing but
        # work): [head, rows, n]; a layer's blocks in order, so every layer's rows come in the same order
        cross, further = self._blocks if not maps.starts_layer else ([], [])
        device = maps.attention.device
        cross.append(torch.cat([maps.attention[b, :, self._in_block(rows, block, device)] for b, rows in zip(self._sampled, self._cross)], dim=1))
        further.append(torch.cat([maps.attention[b, :, self._in_block(rows, block, device)] for b, rows in zip(self._sampled, self._within_only)],
                                 dim=1))
        self._blocks = (cross, further)
        if maps.ends_layer:
            self._blocks = ([], [])
            self._pending.append(torch.cat(cross, dim=1))
            further = torch.cat(further, dim=1)
            if further.shape[1]:
                self._within.append(pairwise_js(further))

    def finish_batch(self, batch: Batch) -> None:
        self._shape = (batch.num_layers, batch.num_heads)
        if self._total is None:
            self._total = np.zeros((batch.num_layers * batch.num_heads,) * 2)
        rows, within, self._pending, self._within = self._pending, self._within, [], []
        further_rows, self._cross, self._within_only = self._within_only, [], []  # the batch's plan (slices: not a state)
        if not rows:
            return
        # every layer's [head, r, n] in, on the batch's device (a device map may spread the layers): one copy of [heads, heads] out
        total = pairwise_js([moved_to(part, batch.device) for part in rows])
        if within:
            total += torch.block_diag(*(moved_to(part, batch.device) for part in within))
        self._total += total.cpu().numpy()
        self._rows += int(batch.host_lengths[self._sampled].sum())
        self._cross_rows += rows[0].shape[1]
        self._within_rows += rows[0].shape[1] + sum(len(further) for further in further_rows)
        self._sampled = []

    def merge(self, other: "HeadDistance") -> "HeadDistance":
        self._check_mergeable(other)
        if other._total is not None:
            self._total = other._total.copy() if self._total is None else self._total + other._total
            self._rows += other._rows
            self._within_rows += other._within_rows
            self._cross_rows += other._cross_rows
            self._shape = other._shape
        return self

    def _pair_rows(self) -> np.ndarray:
        """``[layer*head, layer*head]``: the rows each pair's sum runs over (within-layer pairs, cross-layer pairs)."""
        num_layers, num_heads = self._shape
        layer = np.arange(num_layers * num_heads) // num_heads
        return np.where(layer[:, None] == layer[None, :], self._within_rows, self._cross_rows)

    def matrix(self) -> np.ndarray:
        """``[layer*head, layer*head]`` mean JS divergence per row (heads in layer-major order)."""
        if self._total is None or self._rows == 0:
            raise ValueError("no sequence was sampled for the head distance: raise `sample` or give more data")
        if self._cross_rows == 0 and self._shape[0] > 1:
            raise ValueError("no row was sampled for the head distance between layers: raise the budget or give more data")
        return self._total / self._pair_rows()

    def result(self) -> pd.DataFrame:
        """Long table ``layer_a, head_a, layer_b, head_b, distance, rows, method`` over all ordered pairs: ``rows`` the
        rows the pair's mean runs over, ``method`` :data:`EXACT` where that is every row of the sampled sequences, else
        :data:`SAMPLED_ROWS`."""
        matrix, rows = self.matrix(), self._pair_rows()
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
                "rows": rows.ravel(),
                "method": np.where(rows.ravel() == self._rows, EXACT, SAMPLED_ROWS),
            }
        )

    def embedding(self) -> pd.DataFrame:
        """2-D metric multidimensional scaling of the distance matrix (scikit-learn's SMACOF, as Clark et al.'s map), started
        from classical (Torgerson) scaling: one run, the same stress as four random starts on MiniLM (0.212 against 0.211)
        in a tenth of the time, and the same map whatever the seed. ``layer, head, x, y``."""
        matrix = self.matrix()
        num_layers, num_heads = self._shape
        from sklearn.manifold import MDS  # scikit-learn loads in about 0.7 s: only when the map is drawn

        mds = MDS(n_components=2, metric="precomputed", random_state=self.seed, n_init=1, init="classical_mds")
        coordinates = mds.fit_transform(matrix)
        layer, head = np.divmod(np.arange(num_layers * num_heads), num_heads)
        return pd.DataFrame({"layer": layer, "head": head, "x": coordinates[:, 0], "y": coordinates[:, 1]})


#: Clark et al.'s labels: a head is "broad" if its mean entropy exceeds 3.8 nats, "prev"/"next" if over half its attention
#: goes to that neighbour, "cls"/"sep"/"punct" above 0.6. They depend on the sequence length n, so they are parameters.
BROAD_ENTROPY, NEIGHBOUR_SHARE, SET_SHARE = 3.8, 0.5, 0.6


def clark_threshold_values(kind: Kind) -> dict[str, float]:
    """Clark's thresholds by metric on a ``kind`` of model: ``entropy`` 3.8 nats, ``prev`` (and ``next``, where a query sees
    the keys after it) 0.5, each anchor (``cls``, ``sep``; a decoder's ``first``, docs/methods.md#decoders) and ``punct`` 0.6."""
    later = {"next": NEIGHBOUR_SHARE} if kind.sees_later_keys else {}
    return {"entropy": BROAD_ENTROPY, "prev": NEIGHBOUR_SHARE, **later, **dict.fromkeys(kind.anchors, SET_SHARE), "punct": SET_SHARE}


_LABEL_NAMES = {"entropy": "broad"}


def clark_thresholds(entropy_ceiling: float, thresholds: dict[str, float]) -> pd.DataFrame:
    """Each of Clark's ``thresholds`` (:func:`clark_threshold_values`) beside the largest value the corpus allows: ``label,
    metric, threshold, corpus_max, reachable``. A share of attention can reach 1; the mean entropy only ``entropy_ceiling``
    (the mean of ln n), so on short sequences no head can be "broad" (3.8 nats needs a geometric-mean length over e^3.8 = 45 tokens)."""
    rows = [(_LABEL_NAMES.get(metric, metric), metric, value, entropy_ceiling if metric == "entropy" else 1.0) for metric, value in thresholds.items()]
    table = pd.DataFrame(rows, columns=["label", "metric", "threshold", "corpus_max"])
    return table.assign(reachable=table.corpus_max > table.threshold)


def clark_labels(heads: pd.DataFrame, thresholds: dict[str, float]) -> pd.DataFrame:
    """Heads whose mean metric exceeds its threshold of ``thresholds`` (:func:`clark_threshold_values`): ``layer, head,
    label, metric, value, threshold, uniform``. Every label but ``broad`` also needs the head to do more than the uniform
    head on the same sequences: the 95% interval of its excess (``excess_ci_low``) above 0 (beyond
    :data:`EXCESS_TOLERANCE`), so a head that spreads its attention evenly is never a ``first`` or ``prev`` head because
    short rows give a key a large share. (``broad`` is the uniform head's own property: high entropy.)"""
    rows = heads[heads.metric.isin(thresholds)].copy()
    rows["threshold"] = rows.metric.map(thresholds)
    keep = rows.value > rows.threshold
    if "excess_ci_low" in rows:
        keep &= (rows.metric == "entropy") | (rows.excess_ci_low > EXCESS_TOLERANCE)
    else:
        rows["uniform"] = np.nan
    rows = rows[keep]
    rows["label"] = rows.metric.map(lambda m: _LABEL_NAMES.get(m, m))
    return rows[["layer", "head", "label", "metric", "value", "threshold", "uniform"]].sort_values(["layer", "head", "label"]).reset_index(drop=True)
