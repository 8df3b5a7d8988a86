"""Attention rollout (Abnar & Zuidema 2020, docs/methods.md#rollout).

``R_l = norm_rows(0.5 A_l + 0.5 I) R_{l-1}``, ``R_{-1} = I``, with ``A_l`` the head mean of layer l's maps:
``R_l[i, j]`` says how much input token j reaches position i after layer l. :class:`AttentionRollout`: per
layer and sequence, the rolled-out attention to a token set K from every query,
``(1/n) sum_i sum_{j in K} R_l[i, j]``, and from the [CLS] row alone, ``sum_{j in K} R_l[cls, j]``, for
K = [CLS], [SEP], punctuation (the engine's set) and the token itself; then the mean over sequences with a
95% interval. It reads the maps, so it follows ``weighting`` (weights or norm shares).

On a decoder (docs/methods.md#decoders) the first token's row sees only itself, so the rows are every query but row 0
(``all``) and the last token's row (``last_row``, the position a decoder predicts the next token from), and the targets
the first token (in [CLS]'s place), punctuation and the token itself: :func:`rollout_rows` and :func:`rollout_targets` of
the kind of model (:class:`~bertology.core.model.kinds.Kind`).
"""

from __future__ import annotations

import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, moved_to, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import RunningMoments, interval_frame, merge_moments
from bertology.families.kinds import check_kind, check_same_kind, one_row


def rollout_rows(kind: Kind) -> tuple[str, ...]:
    """The rows of the rollout table on a ``kind`` of model: every query (``all``), then one position's row
    (:func:`~bertology.families.kinds.one_row`): the first anchor's (``cls_row``, [CLS]'s) where that row sees the others,
    else the last token's (``last_row``, the one a decoder predicts the next token from)."""
    return ("all", one_row(kind))


def rollout_targets(kind: Kind) -> tuple[str, ...]:
    """The input token sets the rolled-out attention is measured on: the kind's anchors (``cls``, ``sep``; a decoder's
    ``first``), punctuation and the token itself."""
    return (*kind.anchors, "punct", "self")


def rollout_step(layer_maps: torch.Tensor, rolled: torch.Tensor | None, first: int = 0) -> torch.Tensor:
    """One layer of the rollout: ``R_l = norm_rows(0.5 A_l + 0.5 I) R_{l-1}`` from ``layer_maps[batch, head, n, n]`` and
    ``R_{l-1}`` (None before the first layer, ``R_{-1} = I``); returns ``R_l[batch, n, n]``. With ``layer_maps [batch, head,
    r, n]``, the query rows from ``first`` on (a block of a pass by blocks of queries): those rows of ``R_l``, ``[batch, r, n]``."""
    step = 0.5 * layer_maps.mean(dim=1)
    step.diagonal(offset=first, dim1=-2, dim2=-1).add_(0.5)  # + 0.5 I: row i's own key
    step = step / step.sum(dim=-1, keepdim=True)
    return step if rolled is None else torch.matmul(step, rolled)


def rollout(attentions: torch.Tensor) -> torch.Tensor:
    """Abnar & Zuidema's rollout of ``attentions[layer, batch, head, n, n]``: ``R[layer, batch, n, n]``, where
    ``R_l = norm_rows(0.5 A_l + 0.5 I) R_{l-1}`` and ``A_l`` is the head mean. Padding rows roll out to themselves."""
    rolled, out = None, []
    for layer_maps in attentions:
        rolled = rollout_step(layer_maps, rolled)
        out.append(rolled)
    return torch.stack(out)


class AttentionRollout(LayerwiseAnalyzer):
    """Rolled-out attention to a ``kind`` of model's anchors, punctuation and the token itself per layer (see the module
    docstring). Across the layers of a batch it keeps only the running product ``R_l``; by blocks of query rows
    (:attr:`~bertology.core.engine.LayerMaps.rows`), ``R_{l-1}`` and the rows of ``R_l`` made so far: two ``[batch, n, n]``,
    a layer's maps over half its heads."""

    name = "rollout"
    folds_row_blocks = True

    @staticmethod
    def held_bytes(count: int, width: int) -> int:
        """What a batch of ``count`` sequences of ``width`` pieces holds beside the blocks: ``R_{l-1}`` and ``R_l``, float32
        (the engine leaves the analyzer out of a batch where this exceeds its attention budget)."""
        return 2 * count * width * width * 4

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._moments: RunningMoments | None = None
        self._rolled: torch.Tensor | None = None  # R_l of the batch so far
        self._pending: list[torch.Tensor] = []  # one [batch, row, target] per layer
        self._next: torch.Tensor | None = None  # R_l's rows so far (by blocks of query rows)
        self._parts: torch.Tensor | None = None  # the layer's sums so far over blocks of query rows

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0 and maps.starts_layer:
            check_kind(self, batch)
            self._rolled, self._pending = None, []
        first = maps.row_start
        previous = None if self._rolled is None else moved_to(self._rolled, maps.attention.device)  # R_{l-1}, on this layer's device
        rolled = rollout_step(maps.attention, previous, first)  # [batch, r, n]: R_l's rows of the block
        if maps.rows is not None:  # R_l is made block by block, R_{l-1} read whole until the last block
            if maps.starts_layer:
                self._next = rolled.new_empty(rolled.shape[0], rolled.shape[-1], rolled.shape[-1])
            self._next[:, maps.rows] = rolled
        part = self._statistics(batch, rolled, first)
        self._parts = part if maps.starts_layer else self._parts + part
        if maps.ends_layer:
            self._rolled, self._next = (rolled if maps.rows is None else self._next), None
            self._pending.append(self._parts)
            self._parts = None

    def _statistics(self, batch: Batch, rolled: torch.Tensor, first: int) -> torch.Tensor:
        """``[batch, row, target]``: the part of the layer's statistics that the rows of ``R_l`` from ``first`` on
        (``rolled [batch, r, n]``) give; the parts of every row add up to the statistics of the whole ``R_l``."""
        rows = slice(first, first + rolled.shape[-2])
        queries = batch.query_mask.to(rolled.dtype)  # every real token; a decoder's but row 0
        count = queries.sum(dim=1)
        count = torch.where(count > 0, count, torch.nan)
        queries = queries[:, rows]
        if self.kind.sees_later_keys:  # the first anchor's row ([CLS]'s), NaN where a sequence has none
            anchor = batch.anchors[self.kind.anchors[0]]
            position, present = anchor.to(torch.int8).argmax(dim=1), anchor.any(dim=1)
        else:  # the last token's row, the one that predicts the next token (the first anchor's row sees only itself)
            position, present = batch.lengths - 1, None
        position = position - first  # the row in the block; its values count in the block that holds it, 0 in the others
        inside = ((position >= 0) & (position < rolled.shape[-2]))[:, None]
        position = position.clamp(0, rolled.shape[-2] - 1)
        row = rolled[torch.arange(rolled.shape[0], device=rolled.device), position]  # [batch, n]
        columns = []
        for members in (*(batch.anchors[name] for name in self.kind.anchors), batch.punct_mask):
            members = members.to(rolled.dtype)
            columns.append((torch.einsum("bij,bi,bj->b", rolled, queries, members) / count, (row * members).sum(dim=-1)))
        own = torch.zeros_like(queries)  # [batch, r]: R_l[i, i] of the block's rows
        diagonal = rolled.diagonal(offset=first, dim1=-2, dim2=-1)
        own[:, : diagonal.shape[-1]] = diagonal
        columns.append(((own * queries).sum(dim=-1) / count, own.gather(1, position[:, None])[:, 0]))
        every = torch.stack([pair[0] for pair in columns], dim=-1)
        one_row = torch.where(inside, torch.stack([pair[1] for pair in columns], dim=-1), 0)
        if present is not None:
            one_row = torch.where(present[:, None], one_row, torch.nan)
        return torch.stack([every, one_row], dim=-2)  # [batch, row, target]

    def finish_batch(self, batch: Batch) -> None:
        values = stack_layers(self._pending, batch, dim=1).double().cpu().numpy()  # [batch, layer, row, target]: one copy to the host
        self._rolled, self._pending, self._next, self._parts = None, [], None, None
        if self._moments is None:
            self._moments = RunningMoments(values.shape[1:])
        self._moments.push(values)

    def merge(self, other: "AttentionRollout") -> "AttentionRollout":
        check_same_kind(self, other)
        self._moments = merge_moments(self._moments, other._moments)
        return self

    def result(self) -> pd.DataFrame:
        """``layer, row, target, value, ci_low, ci_high, n``: rolled-out attention to each target set after each layer."""
        if self._moments is None:
            return pd.DataFrame(columns=["layer", "row", "target", "value", "ci_low", "ci_high", "n"])
        index = pd.MultiIndex.from_product([range(self._moments.count.shape[0]), rollout_rows(self.kind), rollout_targets(self.kind)],
                                           names=["layer", "row", "target"])
        return interval_frame(self._moments, index)
