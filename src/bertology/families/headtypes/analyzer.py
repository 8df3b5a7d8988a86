"""Decoder head types: previous-token, duplicate-token and induction heads (Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits"; Olsson et al. 2022, "In-context Learning and Induction Heads"; docs/methods.md#decoder-head-types).

Each role gives query i a set of target keys ``T_i`` among the keys it saw in the layer (``V_i``,
:meth:`~bertology.core.engine.LayerMaps.visible`: causality, padding, a sliding window), as TransformerLens's head detector
builds its 0/1 detection patterns:

- ``previous-token``: ``T_i = {i - 1}``;
- ``duplicate-token``: the earlier occurrences of the query's token, ``{j < i : t_j = t_i}``;
- ``induction``: the keys that followed those occurrences, ``{j + 1 : j < i, t_j = t_i}`` (``i`` itself where ``t_{i-1} = t_i``).

On an encoder only ``duplicate-token`` is measured, over every other occurrence, ``{j != i : t_j = t_i}``. Special tokens
(BOS, [CLS], [SEP]: ``Batch.segment_ids`` -1) are no occurrence of a token: they neither ask nor match in the duplicate and
induction sets (BOS is still row 1's previous token).

The score of a head on one sequence is the mean over the rows that have a target, ``R = {i : T_i != {}}``, of the attention
mass on the targets, ``s = (1 / |R|) sum_{i in R} sum_{j in T_i} a[i, j]`` (1: all of every such row's weight on its
targets); a sequence with no such row gives no score. TransformerLens divides ``sum_{i, j} a[i, j] D[i, j]`` by the mass of
every row instead, so that rows without a target pull its score down. The null: the same score of the uniform head (each
row ``1 / |V_i|`` over the keys it saw), ``u = mean_{i in R} |T_i| / |V_i|``, on the same sequence; the paired excess
``s - u`` (:func:`~bertology.families.roles.analyzer.excess_over_uniform`: float noise counts as 0) gets a one-sided t-test
``H0: mean(s - u) <= 0`` over sequences, corrected within each role over the heads; below ``min_sample`` sequences no
p-value. Olsson et al.'s prefix-matching score is the induction score on the synthetic probe of random tokens repeated
twice (``--synthetic-repeats``, :func:`~bertology.core.text.synthetic.synthetic_repeats`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, moved_to, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import MIN_SAMPLE, RunningMoments, corrected, interval_frame, merge_moments, t_test_greater
from bertology.families.kinds import check_kind, check_same_kind
from bertology.families.roles.analyzer import excess_over_uniform, mean_over_counted

PREVIOUS, DUPLICATE, INDUCTION = "previous-token", "duplicate-token", "induction"
#: Every role, in table order.
HEAD_TYPES = (PREVIOUS, DUPLICATE, INDUCTION)


def head_types(kind: Kind) -> tuple[str, ...]:
    """The roles measured on a ``kind`` of model: all three on a decoder; on an encoder, whose queries see every token,
    ``duplicate-token`` alone (a previous token and what follows a repeat have no causal meaning there)."""
    return (DUPLICATE,) if kind.sees_later_keys else HEAD_TYPES


def second_copies(batch: Batch) -> torch.Tensor | None:
    """``[batch]``: where each sequence's second copy begins among its non-special pieces (:attr:`Example.second_copy
    <bertology.core.text.corpora.Example.second_copy>`, Olsson et al.'s probe; 0 for any other sequence), on the batch's
    device; None where no sequence of the batch is a probe's."""
    starts = [example.second_copy or 0 for example in batch.examples]
    return torch.tensor(starts, device=batch.device) if any(starts) else None


def head_type_targets(input_ids: torch.Tensor, mask: torch.Tensor, words: torch.Tensor, kind: Kind,
                      rows: slice | None = None, second_copy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Each role's targets ``T[b, i, j]`` (bool ``[batch, n, n]``; ``[batch, r, n]`` for the query rows ``rows``, a block of
    them) of a ``kind`` of model (see the module docstring), from the token ids ``[batch, n]``, the real pieces ``mask`` and
    ``words``, the pieces that count as occurrences of a token (the non-special ones, ``Batch.segment_ids >= 0``); the caller
    keeps only the keys each query saw. ``second_copy`` (``[batch]``, :func:`second_copies`): on Olsson et al.'s probe the
    induction targets of the rows before each sequence's second copy are dropped, so its induction score is their
    prefix-matching score, over the second copy (METHODS.md section 13)."""
    rows = slice(None) if rows is None else rows
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    queries = positions[rows]
    real = mask[:, rows, None] & mask[:, None, :]
    same = (input_ids[:, rows, None] == input_ids[:, None, :]) & words[:, rows, None] & words[:, None, :]
    if kind.sees_later_keys:
        return {DUPLICATE: same & (queries[:, None] != positions[None, :])}
    duplicate = same & (positions[None, :] < queries[:, None])  # D[i, j] = [t_j = t_i], j < i
    induction = torch.zeros_like(duplicate)
    induction[..., 1:] = duplicate[..., :-1]  # I[i, j] = D[i, j - 1]: the key after each earlier occurrence
    if second_copy is not None:  # the rows of the probe's second copy: from its second_copy-th non-special piece on
        induction &= (words.cumsum(dim=1) > second_copy[:, None])[:, rows, None]
    previous = real & (queries[:, None] - positions[None, :] == 1)
    return {PREVIOUS: previous, DUPLICATE: duplicate, INDUCTION: induction & real}


def target_mass(attention: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sequence and head (float64 ``[batch, head]``), ``mean_{i in R} sum_{j in T_i} a[i, j]`` over the rows that have a
    target, ``R``; ``attention [batch, head, n, n]`` in its own dtype (each row's sum is taken there, then float64),
    ``targets [batch, n, n]`` bool. NaN for a sequence with no row that has a target."""
    return mean_over_counted(*target_sums(attention, targets))


def target_sums(attention: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`target_mass`'s sum ``sum_{i in R} sum_{j in T_i} a[i, j]`` (float64 ``[batch, head]``) and count ``|R|``
    (float64 ``[batch, 1]``), so that blocks of query rows (``attention [batch, head, r, n]``, ``targets [batch, r, n]``,
    :attr:`~bertology.core.engine.LayerMaps.rows`) add up."""
    inside = torch.einsum("bhij,bij->bhi", attention, targets.to(attention.dtype)).to(torch.float64)
    rows = targets.any(dim=-1).to(torch.float64)  # [batch, r]
    return (inside * rows[:, None]).sum(dim=-1), rows.sum(dim=-1, keepdim=True)


class HeadTypes(LayerwiseAnalyzer):
    """Previous-token, duplicate-token and induction scores of every head of a ``kind`` of model, beside the uniform head's
    on the same sequences, and the paired tests that say which heads hold which role (see the module docstring).

    :meth:`result` gives ``layer, head, role, value, ci_low, ci_high, n, uniform, excess, t_excess, p_excess, p_adj, holds``.
    """

    name = "headtypes"
    #: Each row's targets are keys of that row, and the score is a sum over rows over their count: blocks of query rows add
    #: up (:attr:`~bertology.core.engine.LayerMaps.rows`).
    folds_row_blocks = True

    def __init__(self, kind: Kind, correction: str = "fdr_bh", alpha: float = 0.05) -> None:
        self.kind, self.correction, self.alpha = kind, correction, alpha
        self.roles = head_types(kind)
        self._scores: RunningMoments | None = None  # [layer, head, role]
        self._uniform: RunningMoments | None = None  # [layer, head, role]: the uniform head's on the same sequences
        self._excess: RunningMoments | None = None  # [layer, head, role]: per sequence, the head's less the uniform head's
        self._targets: dict[str, torch.Tensor] | None = None  # this batch's targets before the visible keys (whole maps)
        self._second_copy: torch.Tensor | None = None  # this batch's second_copies
        self._pending: list[torch.Tensor] = []  # one [batch, head, role] per layer
        self._pending_uniform: list[torch.Tensor] = []  # the uniform head's, one [batch, 1 or head, role] per layer
        self._layer_sums: list[torch.Tensor] = []  # the layer's sums so far over blocks of query rows: head's, uniform's, count

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0 and maps.starts_layer:
            check_kind(self, batch)
            self._pending, self._pending_uniform = [], []
            self._second_copy = second_copies(batch)  # once a batch: it reads the examples on the host
            # whole maps: every row's targets, once a batch; by blocks of query rows, each block's as it comes (a whole
            # [batch, n, n] per role would outgrow the attention budget)
            self._targets = None if maps.rows is not None else head_type_targets(batch.input_ids, batch.mask, batch.segment_ids >= 0, self.kind,
                                                                                  second_copy=self._second_copy)
        visible, uniform = maps.visible(batch), maps.uniform(batch)
        made = self._targets
        if made is None:  # by blocks of query rows: this block's, on the layer's device
            second_copy = None if self._second_copy is None else moved_to(self._second_copy, batch.device)
            made = head_type_targets(batch.input_ids, batch.mask, batch.segment_ids >= 0, self.kind, maps.rows, second_copy)
        # the rows' targets among the keys they saw, on the layer's device (a device map may spread the layers)
        targets = [moved_to(made[role], visible.device) & visible for role in self.roles]
        heads, counts = zip(*(target_sums(maps.attention, each) for each in targets))
        sums = [torch.stack(heads, dim=-1), torch.stack([target_sums(uniform, each)[0] for each in targets], dim=-1), torch.stack(counts, dim=-1)]
        self._layer_sums = sums if maps.starts_layer else [old + new for old, new in zip(self._layer_sums, sums)]
        if not maps.ends_layer:
            return
        total, total_uniform, count = self._layer_sums  # [batch, head, role], [batch, 1 or head, role], [batch, 1, role]
        self._layer_sums = []
        self._pending.append(mean_over_counted(total, count))
        self._pending_uniform.append(mean_over_counted(total_uniform, count))

    def finish_batch(self, batch: Batch) -> None:
        heads = batch.num_heads
        # [batch, layer, head + uniform heads, role], one copy to the host
        both = torch.cat([stack_layers(self._pending, batch, dim=1), stack_layers(self._pending_uniform, batch, dim=1)], dim=2).cpu().numpy()
        self._pending, self._pending_uniform, self._targets, self._second_copy = [], [], None, None
        scores = both[:, :, :heads]
        uniform = np.broadcast_to(both[:, :, heads:], scores.shape)
        if self._scores is None:
            self._scores, self._uniform, self._excess = (RunningMoments(scores.shape[1:]) for _ in range(3))
        self._scores.push(scores)
        self._uniform.push(uniform)
        self._excess.push(excess_over_uniform(scores, uniform))

    def merge(self, other: "HeadTypes") -> "HeadTypes":
        check_same_kind(self, other)
        self._scores = merge_moments(self._scores, other._scores)
        self._uniform = merge_moments(self._uniform, other._uniform)
        self._excess = merge_moments(self._excess, other._excess)
        return self

    def test(self, min_sample: int = MIN_SAMPLE, correction: str | None = None, alpha: float | None = None,
             min_mass: float = 0.0) -> pd.DataFrame:
        """``layer, head, role, value, ci_low, ci_high, n, uniform, excess, t_excess, p_excess, p_adj, holds``: per head and role
        the mean score over the ``n`` sequences that have a row with a target, its 95% interval, the uniform head's mean on
        the same sequences and the mean paired excess over it with its one-sided t-test (``H0: mean(s - u) <= 0``; none on
        fewer than ``min_sample`` sequences), ``p_excess`` corrected within each role over its heads into ``p_adj``; a head
        holds the role where that rejects and its mean score is at least ``min_mass`` (a head that puts a hundredth more on
        the targets than a uniform head, over enough sequences, is significant and yet no such head)."""
        columns = ["layer", "head", "role", "value", "ci_low", "ci_high", "n", "uniform", "excess", "t_excess", "p_excess", "p_adj", "holds"]
        if self._scores is None:
            return pd.DataFrame(columns=columns)
        layers, heads, _ = self._scores.count.shape
        index = pd.MultiIndex.from_product([range(layers), range(heads), self.roles], names=["layer", "head", "role"])
        table = interval_frame(self._scores, index)
        t, p = t_test_greater(self._excess, 0.0, min_sample=min_sample)
        table["uniform"], table["excess"] = self._uniform.means().ravel(), self._excess.means().ravel()
        table["t_excess"], table["p_excess"] = t.ravel(), p.ravel()
        table["p_adj"], table["holds"] = np.nan, False
        for role in self.roles:
            rows = table.role == role
            adjusted, holds = corrected(table.p_excess[rows], correction or self.correction, self.alpha if alpha is None else alpha)
            table.loc[rows, "p_adj"], table.loc[rows, "holds"] = adjusted, holds
        table["holds"] = table.holds.astype(bool) & (table.value >= min_mass)
        return table[columns]

    def result(self) -> pd.DataFrame:
        return self.test()
