"""Attention rollout (Abnar & Zuidema 2020, docs/methods.md#rollout).

``R_l = norm_rows(0.5 A_l + 0.5 I) R_{l-1}``, ``R_{-1} = I``, with ``A_l`` the head mean of layer l's maps:
``R_l[i, j]`` says how much input token j reaches position i after layer l. :class:`AttentionRollout`: per
layer and sequence, the rolled-out attention to a token set K from every query,
``(1/n) sum_i sum_{j in K} R_l[i, j]``, and from the [CLS] row alone, ``sum_{j in K} R_l[cls, j]``, for
K = [CLS], [SEP], punctuation (the engine's set) and the token itself; then the mean over sequences with a
95% interval. It reads the maps, so it follows ``weighting`` (weights or norm shares).

On a decoder (docs/methods.md#decoders) the first token's row sees only itself, so the rows are every query but row 0
(``all``) and the last token's row (``last_row``, the position a decoder predicts the next token from), and the targets
the first token (in [CLS]'s place), punctuation and the token itself: :data:`DECODER_ROLLOUT_ROWS`, :data:`DECODER_ROLLOUT_TARGETS`.
"""

from __future__ import annotations

import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps
from bertology.core.statistics.stats import RunningMoments, interval_frame, merge_moments

#: The rows of the rollout table: every query (``all``), or the [CLS] row alone (``cls_row``).
ROLLOUT_ROWS = ("all", "cls_row")
#: The input token sets the rolled-out attention is measured on.
ROLLOUT_TARGETS = ("cls", "sep", "punct", "self")
DECODER_ROLLOUT_ROWS = ("all", "last_row")
DECODER_ROLLOUT_TARGETS = ("first", "punct", "self")


def rollout_step(layer_maps: torch.Tensor, rolled: torch.Tensor | None) -> torch.Tensor:
    """One layer of the rollout: ``R_l = norm_rows(0.5 A_l + 0.5 I) R_{l-1}`` from ``layer_maps[batch, head, n, n]`` and
    ``R_{l-1}`` (None before the first layer, ``R_{-1} = I``); returns ``R_l[batch, n, n]``."""
    identity = torch.eye(layer_maps.shape[-1], dtype=layer_maps.dtype, device=layer_maps.device)
    step = 0.5 * layer_maps.mean(dim=1) + 0.5 * identity
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
    """Rolled-out attention to [CLS], [SEP], punctuation and the token itself per layer (see the module docstring).
    Across the layers of a batch it keeps only the running product ``R_l``."""

    name = "rollout"

    def __init__(self) -> None:
        self.causal = False
        self._moments: RunningMoments | None = None
        self._rolled: torch.Tensor | None = None  # R_l of the batch so far
        self._pending: list[torch.Tensor] = []  # one [batch, row, target] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            self._rolled, self._pending = None, []
        rolled = self._rolled = rollout_step(maps.attention, self._rolled)  # [batch, n, n]
        self.causal = batch.causal
        if batch.causal:
            self._pending.append(self._causal_rows(batch, rolled))
            return
        real = batch.mask.to(rolled.dtype)
        n = real.sum(dim=1)
        cls_position = batch.cls_mask.to(torch.int8).argmax(dim=1)
        rows = rolled[torch.arange(rolled.shape[0]), cls_position]  # [batch, n]: each sequence's [CLS] row
        columns = []
        for members in (batch.cls_mask, batch.sep_mask, batch.punct_mask):
            members = members.to(rolled.dtype)
            every = torch.einsum("bij,bi,bj->b", rolled, real, members) / n
            columns.append((every, (rows * members).sum(dim=-1)))
        own = rolled.diagonal(dim1=-2, dim2=-1)  # [batch, n]
        columns.append(((own * real).sum(dim=-1) / n, own.gather(1, cls_position[:, None])[:, 0]))
        every = torch.stack([pair[0] for pair in columns], dim=-1)
        cls_row = torch.stack([pair[1] for pair in columns], dim=-1)
        cls_row = torch.where(batch.cls_mask.any(dim=1)[:, None], cls_row, torch.nan)
        self._pending.append(torch.stack([every, cls_row], dim=-2))  # [batch, row, target]

    @staticmethod
    def _causal_rows(batch: Batch, rolled: torch.Tensor) -> torch.Tensor:
        """A decoder's ``[batch, row, target]``: from every query but row 0 and from the last token's row, to the first token,
        punctuation and the token itself."""
        queries = batch.query_mask.to(rolled.dtype)
        count = queries.sum(dim=1)
        count = torch.where(count > 0, count, torch.nan)
        last = (batch.lengths - 1)[:, None, None].expand(-1, 1, rolled.shape[-1])
        last_row = rolled.gather(1, last)[:, 0]  # [batch, n]
        columns = []
        for members in (batch.cls_mask, batch.punct_mask):  # cls_mask: a decoder's first token
            members = members.to(rolled.dtype)
            columns.append((torch.einsum("bij,bi,bj->b", rolled, queries, members) / count, (last_row * members).sum(dim=-1)))
        own = rolled.diagonal(dim1=-2, dim2=-1)
        columns.append(((own * queries).sum(dim=-1) / count, own.gather(1, last[:, 0, :1])[:, 0]))
        return torch.stack([torch.stack([pair[0] for pair in columns], dim=-1), torch.stack([pair[1] for pair in columns], dim=-1)], dim=-2)

    def finish_batch(self, batch: Batch) -> None:
        values = torch.stack(self._pending, dim=1).double().cpu().numpy()  # [batch, layer, row, target]: one copy to the host
        self._rolled, self._pending = None, []
        if self._moments is None:
            self._moments = RunningMoments(values.shape[1:])
        self._moments.push(values)

    def merge(self, other: "AttentionRollout") -> "AttentionRollout":
        self._check_mergeable(other)
        self.causal = self.causal or other.causal
        self._moments = merge_moments(self._moments, other._moments)
        return self

    def result(self) -> pd.DataFrame:
        """``layer, row, target, value, ci_low, ci_high, n``: rolled-out attention to each target set after each layer."""
        if self._moments is None:
            return pd.DataFrame(columns=["layer", "row", "target", "value", "ci_low", "ci_high", "n"])
        rows, targets = (DECODER_ROLLOUT_ROWS, DECODER_ROLLOUT_TARGETS) if self.causal else (ROLLOUT_ROWS, ROLLOUT_TARGETS)
        index = pd.MultiIndex.from_product([range(self._moments.count.shape[0]), rows, targets], names=["layer", "row", "target"])
        return interval_frame(self._moments, index)
