"""Attention rollout (Abnar & Zuidema 2020, docs/methods.md#rollout).

``R_l = norm_rows(0.5 A_l + 0.5 I) R_{l-1}``, ``R_{-1} = I``, with ``A_l`` the head mean of layer l's maps:
``R_l[i, j]`` says how much input token j reaches position i after layer l. :class:`AttentionRollout`: per
layer and sequence, the rolled-out attention to a token set K from every query,
``(1/n) sum_i sum_{j in K} R_l[i, j]``, and from the [CLS] row alone, ``sum_{j in K} R_l[cls, j]``, for
K = [CLS], [SEP], punctuation (the engine's set) and the token itself; then the mean over sequences with a
95% interval. It reads the maps, so it follows ``weighting`` (weights or norm shares).
"""

from __future__ import annotations

import pandas as pd
import torch

from bertology.core.analyzer import Analyzer
from bertology.core.engine import Batch
from bertology.core.stats import RunningMoments, interval_frame, merge_moments

#: The rows of the rollout table: every query (``all``), or the [CLS] row alone (``cls_row``).
ROLLOUT_ROWS = ("all", "cls_row")
#: The input token sets the rolled-out attention is measured on.
ROLLOUT_TARGETS = ("cls", "sep", "punct", "self")


def rollout(attentions: torch.Tensor) -> torch.Tensor:
    """Abnar & Zuidema's rollout of ``attentions[layer, batch, head, n, n]``: ``R[layer, batch, n, n]``, where
    ``R_l = norm_rows(0.5 A_l + 0.5 I) R_{l-1}`` and ``A_l`` is the head mean. Padding rows roll out to themselves."""
    width = attentions.shape[-1]
    identity = torch.eye(width, dtype=attentions.dtype, device=attentions.device)
    rolled, out = None, []
    for layer_maps in attentions:
        step = 0.5 * layer_maps.mean(dim=1) + 0.5 * identity
        step = step / step.sum(dim=-1, keepdim=True)
        rolled = step if rolled is None else torch.matmul(step, rolled)
        out.append(rolled)
    return torch.stack(out)


class AttentionRollout(Analyzer):
    """Rolled-out attention to [CLS], [SEP], punctuation and the token itself per layer (see the module docstring)."""

    name = "rollout"

    def __init__(self) -> None:
        self._moments: RunningMoments | None = None

    def update(self, batch: Batch) -> None:
        rolled = rollout(batch.attentions)  # [layer, batch, n, n]
        real = batch.mask.to(rolled.dtype)
        n = real.sum(dim=1)
        cls_position = batch.cls_mask.to(torch.int8).argmax(dim=1)
        rows = rolled[:, torch.arange(rolled.shape[1]), cls_position]  # [layer, batch, n]: each sequence's [CLS] row
        columns = []
        for members in (batch.cls_mask, batch.sep_mask, batch.punct_mask):
            members = members.to(rolled.dtype)
            every = torch.einsum("lbij,bi,bj->lb", rolled, real, members) / n
            columns.append((every, (rows * members).sum(dim=-1)))
        own = rolled.diagonal(dim1=-2, dim2=-1)  # [layer, batch, n]
        columns.append(((own * real).sum(dim=-1) / n, own.gather(2, cls_position[None, :, None].expand(own.shape[0], -1, 1))[..., 0]))
        every = torch.stack([pair[0] for pair in columns], dim=-1)
        cls_row = torch.stack([pair[1] for pair in columns], dim=-1)
        cls_row = torch.where(batch.cls_mask.any(dim=1)[None, :, None], cls_row, torch.nan)
        values = torch.stack([every, cls_row], dim=-2).permute(1, 0, 2, 3).double().cpu().numpy()  # [batch, layer, row, target]
        if self._moments is None:
            self._moments = RunningMoments(values.shape[1:])
        self._moments.push(values)

    def merge(self, other: "AttentionRollout") -> "AttentionRollout":
        self._check_mergeable(other)
        self._moments = merge_moments(self._moments, other._moments)
        return self

    def result(self) -> pd.DataFrame:
        """``layer, row, target, value, ci_low, ci_high, n``: rolled-out attention to each target set after each layer."""
        if self._moments is None:
            return pd.DataFrame(columns=["layer", "row", "target", "value", "ci_low", "ci_high", "n"])
        index = pd.MultiIndex.from_product([range(self._moments.count.shape[0]), ROLLOUT_ROWS, ROLLOUT_TARGETS], names=["layer", "row", "target"])
        return interval_frame(self._moments, index)
