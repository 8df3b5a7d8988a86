"""Statistical role tests for every head: the heads hypothesis (Pande et al. 2021, docs/methods.md#roles-and-the-sieve-score).

The sieve score of one head on one sequence, for a role whose sieve set for query i is ``S_i``,
over the queries Q that have one, is

    s = mean_{i in Q} [ (1/|S_i|) sum_{j in S_i} a[i, j] ] / (1/n)

the attention per sieve token relative to uniform attention (1 means uniform). Roles:

- ``local``: ``S_i = {i-w, ..., i+w}`` clipped to the sequence (self included), ``w = 2``;
- ``delimiter``: the [CLS] and [SEP] tokens; ``cls`` and ``sep`` the variants with one kind;
- ``block`` (pairs only), as Pande et al. and their code define it: every token i, specials included
  ([CLS] and the pieces up to the first [SEP] are segment A, the first [SEP] and the rest segment B),
  with ``S_i`` the non-special pieces of i's segment, and each query's term weighted by the entropy in
  nats of its whole row, ``H(a_i) = -sum_j a[i, j] ln a[i, j]`` (0 ln 0 = 0), so that a head on one
  token of the block does not pass; a head spread evenly over its own segment of m pieces scores
  ``(n / m) ln m`` (about ``2 ln m``), and uniform attention ``ln n``;
- ``syntactic`` (sequences with a tree): for dependency pairs (dependent w1, head w2), the mean
  over w1's pieces of the mean over w2's pieces of ``a``, over ``1/n``, averaged over pairs; per
  relation (``syntactic:nsubj``, ...) and pooled (``syntactic``).

Scores are computed in float64. Per head and role, a one-sided one-sample t-test over sequences,
``H0: mean(s) <= tau`` (tau = 3 by default; :func:`~bertology.core.stats.t_test_greater`: a mean within a
relative 1e-6 of tau never passes), corrected with statsmodels' ``multipletests`` within each role
over its heads, so that a role's labels do not depend on which other roles ran.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import Analyzer
from bertology.core.engine import Batch, is_pair
from bertology.core.stats import MIN_SAMPLE, RunningMoments, corrected, t_test_greater

BASE_ROLES = ("local", "delimiter", "cls", "sep", "block")
SYNTACTIC = "syntactic"
#: Roles shown in summaries (per-relation syntactic roles stay in the table).
SUMMARY_ROLES = (*BASE_ROLES, SYNTACTIC)


def sieve_mean(attention: torch.Tensor, sieve: torch.Tensor, queries: torch.Tensor, n: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``n * mean_{i in Q} w_i mean_{j in S_i} a[i, j]`` per sequence and head.

    ``attention [batch, head, n, n]``; ``sieve [batch, n, n]`` (or ``[batch, 1, n]`` for the same
    set for every query) marks ``S_i``; ``queries [batch, n]`` marks Q; ``n [batch, 1]`` real
    tokens per sequence; ``weight [batch, head, n]`` optional. NaN for a sequence with no query in Q.
    """
    sieve = sieve.to(attention.dtype)
    size = sieve.sum(-1)  # [batch, n or 1]
    inside = (attention * sieve[:, None]).sum(-1) / size.clamp(min=1)[:, None]  # [batch, head, n]
    if weight is not None:
        inside = inside * weight
    used = (queries & (size > 0)).to(attention.dtype)[:, None]  # [batch, 1, n]
    count = used.sum(-1)
    return torch.where(count > 0, n * (inside * used).sum(-1) / count.clamp(min=1), torch.nan)


def role_scores(attention: torch.Tensor, mask: torch.Tensor, cls_mask: torch.Tensor, sep_mask: torch.Tensor,
                segment_ids: torch.Tensor, window: int = 2) -> dict[str, torch.Tensor]:
    """Sieve scores ``[batch, head]`` (float64) of the :data:`BASE_ROLES` on one layer's attention."""
    attention = attention.to(torch.float64)
    width = attention.shape[-1]
    positions = torch.arange(width, device=attention.device)
    near = (positions[:, None] - positions[None, :]).abs() <= window
    local = near[None] & mask[:, None, :] & mask[:, :, None]
    special = cls_mask | sep_mask
    n = mask.sum(1, keepdim=True).to(attention.dtype)
    # block: every query's segment (specials by position: B from the first [SEP] on); keys: the non-special
    # pieces of that segment (specials and padding have segment_ids -1)
    segment = torch.where(segment_ids >= 0, segment_ids, (sep_mask.cumsum(1) > 0).long())
    own_segment = segment[:, :, None] == segment_ids[:, None, :]
    entropy = -torch.special.xlogy(attention, attention).sum(-1)  # nats, whole row
    block = sieve_mean(attention, own_segment, mask, n, weight=entropy)
    return {
        "local": sieve_mean(attention, local, mask, n),
        "delimiter": sieve_mean(attention, special[:, None, :], mask, n),
        "cls": sieve_mean(attention, cls_mask[:, None, :], mask, n),
        "sep": sieve_mean(attention, sep_mask[:, None, :], mask, n),
        "block": torch.where(is_pair(segment_ids)[:, None], block, torch.nan),
    }


def syntactic_scores(attention: torch.Tensor, assignment: np.ndarray, word_unit: np.ndarray, heads, relations) -> dict[str, torch.Tensor]:
    """Per relation (and pooled as ``syntactic``): ``n`` times the mean over dependency pairs of the
    mean-over-pieces attention from the dependent to its head, in float64. ``attention [layer, head, n, n]``."""
    attention = attention.to(torch.float64)
    n = attention.shape[-1]
    pieces = torch.as_tensor(assignment / assignment.sum(1, keepdims=True), dtype=attention.dtype, device=attention.device)
    pair_attention = pieces @ attention @ pieces.T  # mean over pieces in both directions: [layer, head, u, u]
    by_relation: dict[str, list[torch.Tensor]] = {}
    for word, (head, relation) in enumerate(zip(heads, relations)):
        if head == 0 or word_unit[word] < 0 or word_unit[head - 1] < 0:
            continue
        value = n * pair_attention[:, :, word_unit[word], word_unit[head - 1]]
        by_relation.setdefault(f"{SYNTACTIC}:{relation}", []).append(value)
        by_relation.setdefault(SYNTACTIC, []).append(value)
    return {role: torch.stack(values).mean(0) for role, values in by_relation.items()}


class HeadRoles(Analyzer):
    """Sieve scores of every head for every role, and the t-tests that say which heads hold which role.

    ``result()`` gives ``layer, head, role, mean, ci_low, ci_high, t, p, p_adj, has_role, n`` for the
    analyzer's ``tau``, ``correction`` and ``alpha``; :meth:`test` recomputes it for others.
    """

    name = "roles"

    def __init__(self, tau: float = 3.0, window: int = 2, correction: str = "fdr_bh", alpha: float = 0.05):
        self.tau, self.window, self.correction, self.alpha = tau, window, correction, alpha
        self._moments: dict[str, RunningMoments] = {}
        self._shape: tuple[int, int] | None = None

    def _push(self, role: str, values: np.ndarray) -> None:
        if role not in self._moments:
            self._moments[role] = RunningMoments(self._shape)
        self._moments[role].push(values)

    def update(self, batch: Batch) -> None:
        num_layers, size, num_heads, width, _ = batch.attentions.shape
        self._shape = (num_layers, num_heads)
        # Every layer's heads side by side as the "heads" of one call: [batch, layer * head, n, n].
        every_head = batch.attentions.permute(1, 0, 2, 3, 4).reshape(size, num_layers * num_heads, width, width)
        scores = role_scores(every_head, batch.mask, batch.cls_mask, batch.sep_mask, batch.segment_ids, self.window)
        for role in BASE_ROLES:
            self._push(role, scores[role].reshape(size, num_layers, num_heads).cpu().numpy())
        for b, example in enumerate(batch.examples):
            if not example.has_tree:
                continue
            alignment = batch.alignments[b]
            n = int(batch.lengths[b])
            scores = syntactic_scores(batch.attentions[:, b, :, :n, :n], alignment.assignment, alignment.word_unit, example.heads, example.relations)
            for role, values in scores.items():
                self._push(role, values.cpu().numpy()[None])

    def merge(self, other: "HeadRoles") -> "HeadRoles":
        self._check_mergeable(other)
        for role, moments in other._moments.items():
            if role in self._moments:
                self._moments[role].merge(moments)
            else:
                self._moments[role] = moments
        self._shape = self._shape or other._shape
        return self

    def roles(self) -> list[str]:
        """Roles seen, the base and pooled syntactic roles first, then relations by name."""
        order = {role: k for k, role in enumerate(SUMMARY_ROLES)}
        return sorted(self._moments, key=lambda role: (order.get(role, len(order)), role))

    def test(self, tau: float | None = None, correction: str | None = None, alpha: float | None = None,
             min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
        """One-sided one-sample t-tests ``H0: mean <= tau`` for every head and role, corrected within each role
        over its heads (the heads of one role are one family); a cell seen in fewer than ``min_sample`` sequences is
        not tested (no ``t``, ``p``, ``p_adj``; ``has_role`` false)."""
        tau = self.tau if tau is None else tau
        columns = ["layer", "head", "role", "mean", "ci_low", "ci_high", "t", "p", "p_adj", "has_role", "n"]
        if not self._moments:
            return pd.DataFrame(columns=columns)
        frames = []
        for role in self.roles():
            moments = self._moments[role]
            low, high = moments.interval()
            t, p = t_test_greater(moments, tau, min_sample=min_sample)
            layer, head = np.indices(moments.count.shape)
            frame = pd.DataFrame({
                "layer": layer.ravel(), "head": head.ravel(), "role": role, "mean": moments.means().ravel(),
                "ci_low": low.ravel(), "ci_high": high.ravel(), "t": t.ravel(), "p": p.ravel(), "n": moments.count.ravel().astype(np.int64),
            })
            frame["p_adj"], frame["has_role"] = corrected(frame.p, correction or self.correction, self.alpha if alpha is None else alpha)
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)[columns]

    def result(self) -> pd.DataFrame:
        return self.test()


def role_shares(roles: pd.DataFrame, by_layer: bool = False) -> pd.DataFrame:
    """Share of the tested heads holding each summary role (overall, or per layer): ``share`` over the ``tested`` heads
    (a head seen in fewer than ``min_sample`` sequences is no evidence either way); NaN where no head was tested."""
    rows = roles[roles.role.isin(SUMMARY_ROLES)].assign(tested=lambda table: table.p.notna())
    keys = ["layer", "role"] if by_layer else ["role"]
    grouped = rows.groupby(keys, sort=False)
    shares = pd.DataFrame({"held": grouped.has_role.sum(), "tested": grouped.tested.sum()})
    shares["share"] = np.where(shares.tested > 0, shares.held / shares.tested.where(shares.tested > 0, 1), np.nan)
    return shares.reset_index()[[*keys, "share", "tested"]]


def role_colocation(roles: pd.DataFrame) -> pd.DataFrame:
    """How many heads hold role A and role B at once (diagonal: heads holding A)."""
    held = roles[roles.role.isin(SUMMARY_ROLES)].pivot_table(index=["layer", "head"], columns="role", values="has_role", aggfunc="first")
    held = held.reindex(columns=[r for r in SUMMARY_ROLES if r in held.columns]).fillna(False).astype(int)
    return held.T @ held
