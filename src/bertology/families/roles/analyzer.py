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

On a decoder (docs/methods.md#decoders) query i sees the keys ``V_i = {0..i}``, so the uniform reference is per row,
``1/|V_i|``, and row 0 (which sees only itself) is no query: ``s = mean_{i >= 1} [(1/|S_i|) sum_{j in S_i} a[i, j]] / (1/|V_i|)``,
with causal sieve sets: ``local`` the keys within the window at or before i, ``delimiter`` the first token (no [CLS] or
[SEP], so no ``cls`` or ``sep`` variants: :func:`role_names`), ``block`` the visible pieces of the query's own sentence;
``syntactic`` only the pairs whose head word precedes the dependent (the others are invisible), each piece row against its
own ``1/|V_i|``. One function serves both kinds of model (:class:`~bertology.core.model.kinds.Kind`): each sieve set is
the visible part of the set, the queries are the kind's (``Kind.query_mask``) and the references its ``|V_i|``.

The keys a query sees, ``V_i``, are the layer's (:meth:`~bertology.core.engine.LayerMaps.visible`: the mask the model applied,
so a sliding window's or a local layer's ``V_i`` is the window), not the kind's formula.

The null (docs/methods.md#roles-and-the-sieve-score): on every sequence and layer, the same score of the uniform head
``U = V / V.sum(-1)`` (each row uniform over the keys it saw; computed, no forward pass) is taken beside each head's. A
uniform head scores 1 on every role but ``block``, whose entropy weights give it about ``ln n`` (Pande et al.'s definition,
kept). Each sieve sum is one sweep over a layer's maps in their own dtype; the scores from those sums on are float64.
Per head and role, two one-sided t-tests over sequences: ``H0: mean(s) <= tau`` (tau = 3 by default;
:func:`~bertology.core.statistics.stats.t_test_greater`: a mean within a relative 1e-6 of tau never passes) and, paired per
sequence, ``H0: mean(s - u) <= 0`` against the uniform head's ``u`` (an excess within :data:`EXCESS_RTOL` of ``u`` is float
noise and counts as 0, so a uniform head's test decides nothing). A head holds the role when both reject: ``max(p, p_excess)``
(an intersection-union test), corrected with statsmodels' ``multipletests`` within each role over its heads, so that a role's
labels do not depend on which other roles ran.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, is_pair, stack_layers
from bertology.core.measures.entropy import x_log_x
from bertology.core.model.kinds import KINDS, Kind
from bertology.core.statistics.stats import MIN_SAMPLE, RunningMoments, corrected, t_test_greater
from bertology.families.kinds import check_kind, check_same_kind

SYNTACTIC = "syntactic"


def role_names(kind: Kind) -> tuple[str, ...]:
    """The base roles (every sequence has them; ``syntactic`` needs trees) on a ``kind`` of model, in table order: ``local``,
    ``delimiter`` (every anchor token), each anchor alone where the kind has several (an encoder's ``cls`` and ``sep``; a
    decoder's first token is its one delimiter), ``block``."""
    return ("local", "delimiter", *(kind.anchors if len(kind.anchors) > 1 else ()), "block")


#: Roles shown in summaries: every kind's base roles, then the pooled syntactic role (per-relation syntactic roles stay in the table).
SUMMARY_ROLES = (*dict.fromkeys(role for kind in KINDS.values() for role in role_names(kind)), SYNTACTIC)


def sieve_mean(inside: torch.Tensor, size: torch.Tensor, queries: torch.Tensor, n: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_{i in Q} n_i w_i mean_{j in S_i} a[i, j]`` per sequence and head, in float64: :func:`sieve_sums`' total over its
    count, NaN for a sequence with no query in Q."""
    return mean_over_counted(*sieve_sums(inside, size, queries, n, weight))


def mean_over_counted(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A per-sequence score from its sum over the rows it counts and their ``count`` (sums that blocks of query rows add up):
    ``total / count``, NaN for a sequence with no such row."""
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)


def sieve_sums(inside: torch.Tensor, size: torch.Tensor, queries: torch.Tensor, n: torch.Tensor, weight: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean_{i in Q} n_i w_i mean_{j in S_i} a[i, j]`` per sequence and head, in float64.

    ``inside [batch, head, n]`` is each query's attention to its sieve set, ``sum_{j in S_i} a[i, j]``; ``size [batch, n]``
    (or ``[batch, 1]`` for the same set for every query) is ``|S_i|``; ``queries [batch, n]`` marks Q; ``n`` the keys a query
    sees, ``[batch, 1]`` (an encoder's real tokens, the same for every query) or ``[batch, n]`` (a decoder's ``|V_i|``, per
    row); ``weight [batch, head, n]`` optional. Returns ``(total, count)``: ``sum_{i in Q} n_i w_i mean_{j in S_i} a[i, j]``
    ``[batch, head]`` and the queries counted ``[batch, 1]``, float64, so that blocks of query rows add up.
    """
    inside = inside.to(torch.float64) / size.clamp(min=1).to(torch.float64)[:, None]
    if weight is not None:
        inside = inside * weight.to(torch.float64)
    per_row = n.shape[-1] > 1
    if per_row:
        inside = inside * n.to(torch.float64)[:, None]
    used = (queries & (size > 0)).to(torch.float64)[:, None]  # [batch, 1, n]
    count = used.sum(-1)
    total = (inside * used).sum(-1) if per_row else n.to(torch.float64) * (inside * used).sum(-1)
    return total, count


def reference_counts(visible: torch.Tensor) -> torch.Tensor:
    """The keys each query saw, ``|V_i|`` ``[batch, n]``, the uniform reference ``1/|V_i|`` of :func:`sieve_mean`, from the
    layer's visible keys ``[batch, n, n]`` (:meth:`~bertology.core.engine.LayerMaps.visible`: padding, causality, a sliding
    window, a local layer)."""
    return visible.sum(-1)


def role_scores(attention: torch.Tensor, mask: torch.Tensor, anchors: dict[str, torch.Tensor], segment_ids: torch.Tensor, kind: Kind,
                window: int = 2, any_pair: bool | None = None, visible: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sieve scores ``[batch, head]`` (float64) of the :func:`role_names` of a ``kind`` of model on one layer's attention
    ``[batch, head, n, n]``: each role's :func:`role_sums` total over its count (see there and the module docstring)."""
    return {role: mean_over_counted(total, count)
            for role, (total, count) in role_sums(attention, mask, anchors, segment_ids, kind, window, any_pair, visible).items()}


def role_sums(attention: torch.Tensor, mask: torch.Tensor, anchors: dict[str, torch.Tensor], segment_ids: torch.Tensor, kind: Kind,
              window: int = 2, any_pair: bool | None = None, visible: torch.Tensor | None = None,
              rows: slice | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Sieve scores ``[batch, head]`` (float64) of the :func:`role_names` of a ``kind`` of model on one layer's attention
    ``[batch, head, n, n]`` (see the module docstring); ``anchors`` the kind's anchor tokens by name (``Batch.anchors``),
    ``any_pair`` whether the batch holds a sentence pair, where the caller knows it without asking the device; ``visible``
    ``[batch, n, n]`` the keys each query saw in this layer (:meth:`~bertology.core.engine.LayerMaps.visible`; None: the kind's
    formula, :meth:`~bertology.core.model.kinds.Kind.visible_keys`, right only without a sliding window).

    The queries are the kind's (:meth:`~bertology.core.model.kinds.Kind.query_mask`), each against ``1/|V_i|``
    (:func:`reference_counts`), and each sieve set is the part of it the query sees (a sliding window's local role: the
    window's keys; an anchor out of the window is no key of that query). Each sieve sum is one sweep over the
    maps in their own dtype: the local window as its diagonals, the anchors and the block's segments as one product with
    their indicator columns; only the reduced sums are float64. The block's entropy weights are computed only for the
    sequences that are pairs.

    Each role's ``(total, count)`` (:func:`sieve_sums`; NaN totals where a sequence has no such role, a single's ``block``).
    ``rows``: ``attention`` (``[batch, head, r, n]``) and ``visible`` (``[batch, r, n]``) hold only these query rows (a block
    of a pass by blocks of queries, :attr:`~bertology.core.engine.LayerMaps.rows`): the sums of consecutive blocks add up."""
    dtype, width = attention.dtype, attention.shape[-1]
    rows = slice(0, attention.shape[-2]) if rows is None else rows
    first, count = rows.start, attention.shape[-2]
    visible = kind.visible_keys(mask, rows) if visible is None else visible
    queries, reference = kind.query_mask(mask)[:, rows], reference_counts(visible)
    positions = torch.arange(width, device=attention.device)
    near = (positions[first : first + count, None] - positions[None, :]).abs() <= window
    local_size = (near[None] & visible).sum(-1)  # [batch, r]: the window's keys the query sees
    local = torch.zeros(attention.shape[:-1], dtype=dtype, device=attention.device)  # [batch, head, r]
    for offset in range(-window, (window if kind.sees_later_keys else 0) + 1):  # padding keys are zero, so the diagonals need no mask
        diagonal = attention.diagonal(offset=first + offset, dim1=-2, dim2=-1)  # a[i, i + offset] of the block's rows that have it
        begin = max(0, -(first + offset))
        local[..., begin : begin + diagonal.shape[-1]] += diagonal
    every = torch.stack(list(anchors.values())).any(dim=0)  # Batch.anchor_mask
    alone = [anchors[name] for name in kind.anchors] if len(kind.anchors) > 1 else []
    key_sets = torch.stack([every, *alone, segment_ids == 0, segment_ids == 1], dim=-1)  # [batch, n, sets]
    inside = torch.matmul(attention, key_sets[:, None].to(dtype))  # [batch, head, n, sets]
    scores = {
        "local": sieve_sums(local, local_size, queries, reference),
        "delimiter": sieve_sums(inside[..., 0], (visible & every[:, None]).sum(-1), queries, reference),
    }
    for k, name in enumerate(kind.anchors if alone else ()):
        scores[name] = sieve_sums(inside[..., 1 + k], (visible & anchors[name][:, None]).sum(-1), queries, reference)
    # block: every query's segment (specials by position: B from the first [SEP] on, where the kind has one); keys: the
    # non-special pieces of that segment the query sees (specials and padding have segment_ids -1), each query weighted by
    # its row's entropy
    pairs = is_pair(segment_ids)
    block = torch.full(scores["local"][0].shape, torch.nan, dtype=torch.float64, device=attention.device)
    block_count = torch.zeros_like(scores["local"][1])
    if any_pair if any_pair is not None else bool(pairs.any()):
        after_sep = (anchors["sep"].cumsum(1) > 0).long() if "sep" in anchors else torch.zeros_like(segment_ids)
        segment = torch.where(segment_ids >= 0, segment_ids, after_sep)[pairs][:, rows]  # [pairs, r]
        own = torch.where(segment[:, None] == 0, inside[pairs][..., -2], inside[pairs][..., -1])
        segments = key_sets[pairs][..., -2:]  # [pairs, n, 2]
        sizes = (visible[pairs][..., None] & segments[:, None]).sum(2)  # [pairs, n, 2]: each segment's keys each query sees
        entropy = -x_log_x(attention[pairs]).sum(-1)  # nats, whole row
        block[pairs], block_count[pairs] = sieve_sums(own, sizes.gather(2, segment[..., None])[..., 0], queries[pairs], reference[pairs],
                                                      weight=entropy)
    scores["block"] = (block, block_count)
    return scores


def syntactic_pairs(word_unit: np.ndarray, heads, relations) -> list[tuple[int, int, str]]:
    """``(dependent's unit, head word's unit, relation)`` of every dependency of a tree (root out) whose two words have
    pieces (:class:`~bertology.core.text.alignment.WordAlignment`'s ``word_unit``; heads 1-based)."""
    return [(int(word_unit[word]), int(word_unit[head - 1]), relation) for word, (head, relation) in enumerate(zip(heads, relations))
            if head != 0 and word_unit[word] >= 0 and word_unit[head - 1] >= 0]


def syntactic_pair_scores(attention: torch.Tensor, assignment: np.ndarray, pairs: list[tuple[int, int, str]],
                          visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pande et al. 2021's syntactic score of each dependency pair on one sequence, on the device.

    Pairs from :func:`syntactic_pairs`. ``values [layer, head, pair]`` float64, the mean over the dependent's pieces
    ``p`` of ``|V_p|`` times their mean attention to the head word's pieces (the uniform reference of row p is
    ``1/|V_p|``: ``n`` on an encoder, as in the paper); and ``seen [pair]`` bool, whether every piece of the dependent
    saw every piece of its head word in the layer (``visible [n, n]``,
    :meth:`~bertology.core.engine.LayerMaps.visible`): on a decoder the head words that end before the dependent begins,
    within a sliding window only those it reaches. A pair not seen says nothing of the head and counts nowhere.
    """
    values, reach = syntactic_pair_sums(attention, assignment, pairs, visible)
    return values, pairs_seen(reach, assignment, pairs)


def syntactic_pair_sums(attention: torch.Tensor, assignment: np.ndarray, pairs: list[tuple[int, int, str]], visible: torch.Tensor,
                        first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums over query rows behind :func:`syntactic_pair_scores`, of the rows ``attention [layer, head, r, n]`` and
    ``visible [r, n]`` hold from row ``first`` on (every row, or a block of a pass by blocks of queries): ``values [layer,
    head, pair]`` and ``reach [pair, n]``, how many of each dependent's pieces see key j (:func:`pairs_seen`). Blocks add up."""
    attention = attention.to(torch.float64)
    seen = visible.to(attention.dtype)
    covered = torch.as_tensor(assignment, dtype=attention.dtype, device=attention.device)  # [u, n]: the pieces of each unit
    pieces = covered / covered.sum(1, keepdim=True)
    dependents = torch.as_tensor([pair[0] for pair in pairs], dtype=torch.long, device=attention.device)
    targets = torch.as_tensor([pair[1] for pair in pairs], dtype=torch.long, device=attention.device)
    block = slice(first, first + attention.shape[-2])
    rows = pieces[dependents][:, block] * seen.sum(-1)  # [pair, r]: each dependent piece's weight 1/m times |V_p|
    values = torch.einsum("pi,lhij,pj->lhp", rows, attention, pieces[targets])
    return values, covered[dependents][:, block] @ seen


def pairs_seen(reach: torch.Tensor, assignment: np.ndarray, pairs: list[tuple[int, int, str]]) -> torch.Tensor:
    """``[pair]`` bool: whether every piece of each pair's dependent saw every piece of its head word, from ``reach [pair, n]``
    (:func:`syntactic_pair_sums`)."""
    covered = torch.as_tensor(assignment, dtype=reach.dtype, device=reach.device)
    dependents = torch.as_tensor([pair[0] for pair in pairs], dtype=torch.long, device=reach.device)
    targets = torch.as_tensor([pair[1] for pair in pairs], dtype=torch.long, device=reach.device)
    size = covered.sum(1)
    return (reach * covered[targets]).sum(-1) == size[dependents] * size[targets]


def relation_means(values: np.ndarray, seen: np.ndarray, relations: list[str]) -> dict[str, np.ndarray]:
    """Per relation (and pooled as ``syntactic``): the mean of ``values [..., pair]`` over the pairs ``seen [..., pair]``
    (broadcast), NaN where a relation has no seen pair; only the relations seen somewhere are returned."""
    seen = np.broadcast_to(seen, values.shape)
    names = np.array(relations)
    means = {}
    for role, chosen in [(SYNTACTIC, np.ones(len(names), dtype=bool))] + [(f"{SYNTACTIC}:{r}", names == r) for r in dict.fromkeys(relations)]:
        counted = seen & chosen
        if counted.any():
            with np.errstate(invalid="ignore"):
                means[role] = np.where(counted, values, 0.0).sum(-1) / counted.sum(-1)
    return means


def syntactic_scores(attention: torch.Tensor, assignment: np.ndarray, word_unit: np.ndarray, heads, relations, kind: Kind,
                     visible: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per relation (and pooled as ``syntactic``): the mean over the dependency pairs the dependent sees of their syntactic
    scores (:func:`syntactic_pair_scores`), in float64, on one sequence of a ``kind`` of model; ``attention [layer, head, n,
    n]``, ``visible [n, n]`` (None: the kind's formula). The one-sequence form of what :class:`HeadRoles` folds per batch."""
    n = attention.shape[-1]
    if visible is None:
        visible = kind.visible_keys(torch.ones(1, n, dtype=torch.bool, device=attention.device))[0]
    pairs = syntactic_pairs(word_unit, heads, relations)
    if not pairs:
        return {}
    values, seen = syntactic_pair_scores(attention, assignment, pairs, visible)
    means = relation_means(values.cpu().numpy(), seen.cpu().numpy(), [pair[2] for pair in pairs])
    return {role: torch.as_tensor(value) for role, value in means.items()}


#: Per sequence, a head's excess over the uniform head within this relative band of the uniform score,
#: ``|s - u| <= rtol * max(1, |u|)``, is float noise and counts as 0 (the maps' sums are taken in their own dtype).
EXCESS_RTOL = 1e-5


def excess_over_uniform(scores: np.ndarray, uniform: np.ndarray, rtol: float = EXCESS_RTOL) -> np.ndarray:
    """``s - u`` per sequence (float64), 0 where it is within :data:`EXCESS_RTOL` of the uniform score (float noise: a uniform
    head's excess is exactly 0, so its test decides nothing); NaN where either is."""
    difference = np.asarray(scores, dtype=np.float64) - np.asarray(uniform, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        noise = np.abs(difference) <= rtol * np.maximum(1.0, np.abs(uniform))
    return np.where(noise, 0.0, difference)


class HeadRoles(LayerwiseAnalyzer):
    """Sieve scores of every head of a ``kind`` of model for every role, the uniform head's scores on the same sequences, and
    the tests that say which heads hold which role.

    ``result()`` gives ``layer, head, role, mean, ci_low, ci_high, uniform, excess, t, p, t_excess, p_excess, p_adj, has_role, n``
    for the analyzer's ``tau``, ``correction`` and ``alpha``; :meth:`test` recomputes it for others.
    """

    name = "roles"
    #: Every score is a sum over query rows: blocks of rows add up (:attr:`~bertology.core.engine.LayerMaps.rows`).
    folds_row_blocks = True

    def __init__(self, kind: Kind, tau: float = 3.0, window: int = 2, correction: str = "fdr_bh", alpha: float = 0.05):
        self.kind = kind
        self.tau, self.window, self.correction, self.alpha = tau, window, correction, alpha
        self._moments: dict[str, RunningMoments] = {}  # the heads' scores
        self._uniform: dict[str, RunningMoments] = {}  # the uniform head's scores on the same sequences (one per layer, per head)
        self._excess: dict[str, RunningMoments] = {}  # per sequence, each head's score less the uniform head's (paired)
        self._shape: tuple[int, int] | None = None
        self._pending: list[torch.Tensor] = []  # this batch's base-role scores so far, one [batch, head, role] per layer
        self._pending_uniform: list[torch.Tensor] = []  # the uniform head's, one [batch, 1 or head, role] per layer
        self._trees: list = []  # the batch's sequences with a tree, and their dependency pairs (syntactic_pairs)
        self._tree_pending: list[torch.Tensor] = []  # one [head + uniform heads + 1, pair] per layer
        self._layer_sums: list = []  # the layer's sums so far (blocks of query rows): [roles' (total, count) of heads, of uniform, trees']

    def _push(self, role: str, values: np.ndarray, uniform: np.ndarray | None = None) -> None:
        """Fold scores ``values [k, layer, head]`` and the uniform head's on the same sequences (broadcast to them) into the
        role's moments; without ``uniform`` (scores pushed by hand) no excess is known and only the tau test decides."""
        if role not in self._moments:
            self._moments[role] = RunningMoments(self._shape)
            self._uniform[role] = RunningMoments(self._shape)
            self._excess[role] = RunningMoments(self._shape)
        self._moments[role].push(values)
        if uniform is not None:
            uniform = np.broadcast_to(uniform, np.shape(values))
            self._uniform[role].push(uniform)
            self._excess[role].push(excess_over_uniform(values, uniform))

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0 and maps.starts_layer:
            check_kind(self, batch)
            self._pending, self._pending_uniform, self._tree_pending = [], [], []
            self._trees = [(b, syntactic_pairs(batch.alignments[b].word_unit, example.heads, example.relations))
                           for b, example in enumerate(batch.examples) if example.has_tree]
            self._trees = [(b, pairs) for b, pairs in self._trees if pairs]
        visible = maps.visible(batch)
        uniform = maps.uniform(batch)  # the layer's uniform head (one, or each head's under the norm view), scored alike
        arguments = (batch.mask, batch.anchors, batch.segment_ids, self.kind, self.window, batch.any_pair, visible, maps.rows)
        # the uniform head's sums once for the layers that share it (a copy: a block's sums are added to the layer's in place)
        sums = [role_sums(maps.attention, *arguments), dict(maps.uniform_scored(batch, self, lambda head: role_sums(head, *arguments)))]
        first = maps.row_start
        trees = []  # per sequence with a tree: its pairs' sums over the block's real rows (None: the block has none)
        for b, pairs in self._trees:
            n = int(batch.host_lengths[b])
            m = max(0, min(n - first, maps.attention.shape[-2]))
            both = torch.cat([maps.attention[b, :, :m, :n].to(torch.float64), uniform[b, :, :m, :n].to(torch.float64)])[None]
            trees.append(syntactic_pair_sums(both, batch.alignments[b].assignment, pairs, visible[b, :m, :n], first) if m else None)
        if maps.starts_layer:
            self._layer_sums = [*sums, trees]
        else:  # the next block of the layer's query rows: its sums add to those so far
            for mine, block in zip(self._layer_sums[:2], sums):
                for role, (total, count) in block.items():
                    mine[role] = (mine[role][0] + total, mine[role][1] + count)
            self._layer_sums[2] = [old if new is None else new if old is None else (old[0] + new[0], old[1] + new[1])
                                   for old, new in zip(self._layer_sums[2], trees)]
        if maps.ends_layer:
            self._end_layer(batch)

    def _end_layer(self, batch: Batch) -> None:
        """The layer's scores from its sums over every query row."""
        heads, uniform, trees = self._layer_sums
        self._layer_sums = []

        def scores(sums: dict) -> torch.Tensor:  # [batch, head, role]: each role's total over its count
            return torch.stack([torch.where(sums[role][1] > 0, sums[role][0] / sums[role][1].clamp(min=1), torch.nan)
                                for role in role_names(self.kind)], dim=-1)

        self._pending.append(scores(heads))  # [batch, head, role]
        self._pending_uniform.append(scores(uniform))  # [batch, 1 or head, role]
        tree_columns = []  # per sequence with a tree: [head + uniform heads + 1, pair] at this layer, whether each pair is seen last
        for (b, pairs), (values, reach) in zip(self._trees, trees):
            seen = pairs_seen(reach, batch.alignments[b].assignment, pairs)
            tree_columns.append(torch.cat([values[0], seen[None].to(values.dtype)]))
        if tree_columns:
            self._tree_pending.append(torch.cat(tree_columns, dim=1))  # [head + uniform heads + 1, every sequence's pairs]

    def finish_batch(self, batch: Batch) -> None:
        self._shape = (batch.num_layers, batch.num_heads)
        heads = batch.num_heads
        # [batch, layer, head + uniform heads, role]: the heads' scores and the uniform head's (one, or one per head under a
        # view that reads each head's own vectors) after them, one copy to the host
        both = torch.cat([stack_layers(self._pending, batch, dim=1).double(), stack_layers(self._pending_uniform, batch, dim=1).double()], dim=2).cpu().numpy()
        for k, role in enumerate(role_names(self.kind)):
            self._push(role, both[:, :, :heads, k], both[:, :, heads:, k])
        if self._tree_pending:
            # [layer, head + uniform heads + 1, pair]: every sequence's pairs side by side, whether each is seen last, one copy
            columns = stack_layers(self._tree_pending, batch).cpu().numpy()
            start = 0
            for _, pairs in self._trees:
                part = columns[..., start : start + len(pairs)]
                start += len(pairs)
                means = relation_means(part[:, :-1], part[:, -1:] > 0, [pair[2] for pair in pairs])  # [layer, head + uniform heads]
                for role, value in means.items():
                    self._push(role, value[None, :, :heads], value[None, :, heads:])
        self._pending, self._pending_uniform, self._tree_pending, self._trees = [], [], [], []

    def merge(self, other: "HeadRoles") -> "HeadRoles":
        check_same_kind(self, other)
        for mine, theirs in ((self._moments, other._moments), (self._uniform, other._uniform), (self._excess, other._excess)):
            for role, moments in theirs.items():
                if role in mine:
                    mine[role].merge(moments)
                else:
                    mine[role] = moments
        self._shape = self._shape or other._shape
        return self

    def roles(self) -> list[str]:
        """Roles seen, the base and pooled syntactic roles first, then relations by name."""
        order = {role: k for k, role in enumerate(SUMMARY_ROLES)}
        return sorted(self._moments, key=lambda role: (order.get(role, len(order)), role))

    def test(self, tau: float | None = None, correction: str | None = None, alpha: float | None = None,
             min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
        """Per head and role, two one-sided t-tests over sequences: ``H0: mean <= tau`` (``t``, ``p``) and, paired per
        sequence, ``H0: mean(s - u) <= 0`` against the uniform head's score ``u`` on the same sequence (``t_excess``,
        ``p_excess``). A head holds a role when both reject: the intersection-union test ``max(p, p_excess)``, corrected
        within each role over its heads (the heads of one role are one family) into ``p_adj``. ``uniform`` is the uniform
        head's mean score, ``excess`` the mean excess. A cell seen in fewer than ``min_sample`` sequences is not tested (no
        ``t``, ``p``, ``p_adj``; ``has_role`` false)."""
        tau = self.tau if tau is None else tau
        columns = ["layer", "head", "role", "mean", "ci_low", "ci_high", "uniform", "excess", "t", "p", "t_excess", "p_excess", "p_adj",
                   "has_role", "n"]
        if not self._moments:
            return pd.DataFrame(columns=columns)
        frames = []
        for role in self.roles():
            moments, excess = self._moments[role], self._excess[role]
            low, high = moments.interval()
            t, p = t_test_greater(moments, tau, min_sample=min_sample)
            t_excess, p_excess = t_test_greater(excess, 0.0, min_sample=min_sample)
            layer, head = np.indices(moments.count.shape)
            frame = pd.DataFrame({
                "layer": layer.ravel(), "head": head.ravel(), "role": role, "mean": moments.means().ravel(),
                "ci_low": low.ravel(), "ci_high": high.ravel(), "uniform": self._uniform[role].means().ravel(),
                "excess": excess.means().ravel(), "t": t.ravel(), "p": p.ravel(), "t_excess": t_excess.ravel(),
                "p_excess": p_excess.ravel(), "n": moments.count.ravel().astype(np.int64),
            })
            both = frame.p.where(frame.p.isna(), np.fmax(frame.p, frame.p_excess))  # no excess known (scores pushed by hand): p
            frame["p_adj"], frame["has_role"] = corrected(both, correction or self.correction, self.alpha if alpha is None else alpha)
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
