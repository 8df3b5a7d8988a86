"""Attention sinks of a decoder: how much each head attends to the first token, and what marks that token.

Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"; Gu et al. 2025, "When Attention Sink
Emerges in Language Models"; Sun et al. 2024, "Massive Activations in Large Language Models"; docs/methods.md#decoders.

For head (l, h) of a decoder, whose query i sees keys ``j <= i``, and position k of one sequence of n tokens,
``alpha_k = mean over queries i > k of a[i, k]`` (the column sum below the diagonal, ``sum_{i>k} a[i, k]``, over ``n - 1 - k``).
:class:`AttentionSinks` gathers per head and sequence:

- ``attention``: ``alpha_0``, the mean attention to the first token (BOS where the tokenizer adds one);
- ``norm_share``: the same for Kobayashi et al.'s (2020) norm shares, ``w[i, j] = a[i, j] ||f(x_j)|| / sum_k a[i, k] ||f(x_k)||``:
  a sink is expected to take much weight and give little;
- ``key_norm_ratio`` and ``value_norm_ratio``: the first token's key (value) vector norm over the mean norm of the others';
- per layer, the largest hidden-state magnitude at position 0, ``max_d |h_0[d]|``, and elsewhere, ``max_{j>0, d} |h_j[d]|``
  (massive activations, Sun et al. 2024): layer l's output, l = 0 the embeddings, the last as transformers returns it;
- secondary sinks: per piece of the vocabulary, per head, the sum and count of ``alpha_k`` over its occurrences at ``k > 0``
  (those with a later query), so that a piece whose mean exceeds eps (often "\\n" or ".") is reported by its text.

Means over sequences come with 95% Student-t intervals (float64 from the per-sequence values on).

The null (docs/methods.md#decoders): beside ``attention`` and ``norm_share``, the same statistic of the uniform head
``U = V / V.sum(-1)`` on the same sequence (each row uniform over the keys it saw in that layer,
:meth:`~bertology.core.engine.LayerMaps.visible`; computed, no forward pass; ``uniform``), e.g. ``alpha_0`` of U is
``mean_{i>0} 1/(i+1)`` on a causal sequence, about 0.16 on typical lines and above 0.3 on five pieces or fewer. The paired
per-sequence excess ``s - u`` (``excess``; float noise within a relative 1e-5 counts as 0) gets a one-sided t-test,
``H0: mean(s - u) <= 0`` (``t_excess``, ``p_excess``). A head is a sink head at threshold eps when its mean
``alpha_0 > eps`` (strictly) AND its excess over the uniform head is significant, corrected over the heads
(:func:`sink_mask`); ``Sink_eps`` is the share of such heads, per layer and overall (eps = 0.3, as in Gu et al.). A secondary
sink's mean must exceed eps and the uniform head's mean on the same occurrences.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import RunningMoments, corrected, interval_frame, merge_moments, t_test_greater
from bertology.families.kinds import check_kind, check_same_kind
from bertology.families.roles.analyzer import excess_over_uniform

#: The per-head quantities of the ``sinks`` table, in order.
SINK_QUANTITIES = ("attention", "norm_share", "key_norm_ratio", "value_norm_ratio")
#: The per-layer quantities of the ``massive_activations`` table.
ACTIVATION_QUANTITIES = ("first_max", "rest_max", "ratio")
SINK_EPS = 0.3  # Gu et al. 2025
#: The quantities that depend on the attention map, and so have a uniform head's value beside them.
WITH_UNIFORM = ("attention", "norm_share")


def received_attention(attention: torch.Tensor, mask: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """``alpha_k = (1 / (n - 1 - k)) sum_{i>k} a[i, k]`` of every head and position of a causal map ``[batch, head, n, n]``
    (the column sum less the diagonal, since rows ``i < k`` cannot see k); NaN where no query follows k (the last real
    token, padding). Returns ``[batch, head, n]`` in the maps' dtype. ``rows``: ``attention`` holds only these query rows
    (``[batch, head, r, n]``, a block of a pass by blocks of queries): their part of each ``alpha_k``; blocks add up."""
    width, first = attention.shape[-1], 0 if rows is None else rows.start
    own = attention.diagonal(offset=first, dim1=-2, dim2=-1)  # a[i, i] of the block's rows
    later = attention.sum(dim=-2)
    later[..., first : first + own.shape[-1]] -= own
    followers = mask.sum(dim=1, keepdim=True) - 1 - torch.arange(width, device=mask.device)[None]  # [batch, n]: n - 1 - k
    followers = torch.where(mask & (followers > 0), followers, 0).to(attention.dtype)[:, None]
    return torch.where(followers > 0, later / torch.where(followers > 0, followers, 1), torch.nan)


def first_token_norm_share(attention: torch.Tensor, transformed: torch.Tensor, mask: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """``mean_{i>=1} w[i, 0]`` with Kobayashi's norm shares ``w[i, 0] = a[i, 0] ||f(x_0)|| / sum_k a[i, k] ||f(x_k)||``;
    ``transformed[batch, head, n]`` is ``||f_h(x_j)||``. Returns ``[batch, head]`` (NaN for a sequence of one token).
    ``rows``: ``attention`` holds only these query rows (a block of a pass by blocks of queries): their part; blocks add up."""
    if attention.shape[1] == 1:  # one map for every head (the uniform head's): one product with every head's norms, not a map per head
        row_totals = torch.matmul(attention[:, 0], transformed.transpose(1, 2)).transpose(1, 2)
    else:
        row_totals = torch.matmul(attention, transformed[..., None])[..., 0]  # [batch, head, n]: sum_k a[i, k] ||f(x_k)||
    shares = attention[..., 0] * transformed[..., :1] / torch.where(row_totals > 0, row_totals, 1)
    queries = (mask.sum(dim=1, keepdim=True) - 1).to(attention.dtype)
    start = 1 if rows is None else max(1 - rows.start, 0)  # rows i >= 1
    return shares[..., start:].sum(dim=-1) / torch.where(queries > 0, queries, torch.nan)


def first_token_norm_ratio(norms: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """``||v_0|| / mean_{j>=1} ||v_j||`` over a sequence's real tokens; ``norms[batch, head, n]``, ``others [batch, n]`` the real
    tokens after the first (``Batch.query_mask``). Returns ``[batch, head]``."""
    count = others.sum(dim=1, keepdim=True).to(norms.dtype)
    mean_others = (norms * others[:, None]).sum(dim=-1) / torch.where(count > 0, count, torch.nan)
    return norms[..., 0] / mean_others


def massive_activations(hidden_states: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """``[batch, layer, 2]``: the largest magnitude of position 0's hidden state and of every other real position's (``others
    [batch, n]``, ``Batch.query_mask``), per layer output ``hidden_states[layer, batch, n, dim]`` (Sun et al. 2024)."""
    magnitude = torch.linalg.vector_norm(hidden_states, ord=math.inf, dim=-1)  # [layer, batch, n]: max |h|, no copy of |h|
    first = magnitude[..., 0]
    rest = torch.where(others[None], magnitude, -torch.inf).amax(dim=-1)
    rest = torch.where(others.any(dim=1)[None], rest, torch.nan)
    return torch.stack([first, rest], dim=-1).transpose(0, 1)


class AttentionSinks(LayerwiseAnalyzer):
    """Attention sinks per head, massive activations per layer and secondary sinks per piece (see the module docstring).

    :meth:`result` gives ``layer, head, quantity, value, ci_low, ci_high, n`` (:data:`SINK_QUANTITIES`); :meth:`activations`
    ``layer, quantity, value, ci_low, ci_high, n``; :meth:`secondary` the pieces whose mean received attention exceeds eps.
    ``kind``: a decoder's (a kind whose queries see the keys after them is refused: an encoder's [CLS] is in the profile).
    """

    name = "sinks"
    needs = frozenset({"vectors", "hidden_states"})
    #: Every map quantity is a sum over query rows: blocks of rows add up (:attr:`~bertology.core.engine.LayerMaps.rows`).
    folds_row_blocks = True

    def __init__(self, kind: Kind) -> None:
        if kind.sees_later_keys:
            raise ValueError(f"attention sinks are measured on decoders (causal attention), not on an {kind.name}: its "
                             f"{kind.anchor_words} are in the profile")
        self.kind = kind
        self._heads: RunningMoments | None = None  # [layer, head, quantity]
        self._uniform: RunningMoments | None = None  # [layer, head, quantity]: the uniform head's (NaN: no uniform value)
        self._excess: RunningMoments | None = None  # [layer, head, quantity]: per sequence, the head's less the uniform head's
        self._token_uniform = np.zeros((0, 0, 0))  # [piece, layer, head]: the uniform head's alpha_k over the same occurrences
        self._activations: RunningMoments | None = None  # [layer, quantity]
        self._token_rows: dict[int, int] = {}  # vocabulary id -> row of the sums below
        self._token_sums = np.zeros((0, 0, 0))  # [piece, layer, head]: sum of alpha_k over the piece's occurrences k > 0
        self._token_counts = np.zeros(0)  # [piece]: its occurrences with a later query
        self._pending: list[torch.Tensor] = []  # one [batch, head, quantity] per layer
        self._pending_received: list[torch.Tensor] = []  # one [batch, head, n] per layer
        self._pending_uniform: list[torch.Tensor] = []  # the uniform head's, one [batch, head, quantity] per layer
        self._pending_uniform_received: list[torch.Tensor] = []  # the uniform head's alpha_k, one [batch, 1, n] per layer
        self._layer_parts: list[torch.Tensor] = []  # the layer's sums so far over blocks of query rows

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0 and maps.starts_layer:
            check_kind(self, batch)
            self._pending, self._pending_received, self._pending_uniform, self._pending_uniform_received = [], [], [], []
        attention, mask, rows = maps.attention, batch.mask, maps.rows
        key_norms, value_norms, transformed = maps.vector_norms.unbind(dim=2)
        uniform = maps.uniform(batch)  # [batch, 1, n, n] float64: the same statistics of the uniform head
        # the block's parts (every row's, or a block of query rows'): alpha_k and the first token's norm share, which add up
        parts = [received_attention(attention, mask, rows), first_token_norm_share(attention, transformed, mask, rows),
                 received_attention(uniform, mask, rows), first_token_norm_share(uniform, transformed.to(torch.float64), mask, rows)]
        if maps.starts_layer:
            self._layer_parts = parts
        else:
            self._layer_parts = [old + new for old, new in zip(self._layer_parts, parts)]
        if not maps.ends_layer:
            return
        received, share, uniform_received, uniform_share = self._layer_parts
        self._layer_parts = []
        missing = torch.full_like(uniform_share, torch.nan)
        self._pending_uniform.append(torch.stack([uniform_received[..., 0].expand_as(uniform_share), uniform_share, missing, missing], dim=-1))
        self._pending_uniform_received.append(uniform_received)
        self._pending.append(torch.stack([received[..., 0], share, first_token_norm_ratio(key_norms, batch.query_mask),
                                          first_token_norm_ratio(value_norms, batch.query_mask)], dim=-1))
        self._pending_received.append(received)

    def finish_batch(self, batch: Batch) -> None:
        heads = stack_layers(self._pending, batch, dim=1)  # [batch, layer, head, quantity]
        received = stack_layers(self._pending_received, batch, dim=1)  # [batch, layer, head, n]
        activations = massive_activations(batch.hidden_states, batch.query_mask)  # [batch, layer + 1, 2]
        uniform = stack_layers(self._pending_uniform, batch, dim=1)  # [batch, layer, head, quantity]
        uniform_received = stack_layers(self._pending_uniform_received, batch, dim=1).expand_as(received)  # [batch, layer, head, n]
        heads, received, activations, uniform, uniform_received = (part.double().cpu().numpy() for part in
                                                                   (heads, received, activations, uniform, uniform_received))
        self._pending, self._pending_received, self._pending_uniform, self._pending_uniform_received = [], [], [], []
        if self._heads is None:
            self._heads = RunningMoments(heads.shape[1:])
            self._uniform = RunningMoments(heads.shape[1:])
            self._excess = RunningMoments(heads.shape[1:])
            self._activations = RunningMoments((activations.shape[1], len(ACTIVATION_QUANTITIES)))
        self._heads.push(heads)
        self._uniform.push(uniform)
        self._excess.push(excess_over_uniform(heads, uniform))
        with np.errstate(divide="ignore", invalid="ignore"):
            self._activations.push(np.concatenate([activations, activations[..., :1] / activations[..., 1:]], axis=-1))
        self._add_pieces(batch, received, uniform_received)

    def _add_pieces(self, batch: Batch, received: np.ndarray, uniform: np.ndarray) -> None:
        """Fold ``alpha_k`` of every position ``k > 0`` with a later query into its piece's sums, and the uniform head's."""
        ids, values, uniform_values = [], [], []
        for b, item in enumerate(batch.items):
            last = len(item.input_ids) - 1  # positions 1 .. n - 2 have a later query
            ids += item.input_ids[1:last]
            values.append(received[b, :, :, 1:last].transpose(2, 0, 1))  # [k, layer, head]
            uniform_values.append(uniform[b, :, :, 1:last].transpose(2, 0, 1))
        if not ids:
            return
        for piece in dict.fromkeys(ids):
            self._token_rows.setdefault(piece, len(self._token_rows))
        grow = len(self._token_rows) - len(self._token_counts)
        if grow:
            self._token_sums = np.concatenate([self._token_sums.reshape(-1, *received.shape[1:3]), np.zeros((grow, *received.shape[1:3]))])
            self._token_uniform = np.concatenate([self._token_uniform.reshape(-1, *received.shape[1:3]), np.zeros((grow, *received.shape[1:3]))])
            self._token_counts = np.concatenate([self._token_counts, np.zeros(grow)])
        rows = np.array([self._token_rows[piece] for piece in ids])
        np.add.at(self._token_sums, rows, np.concatenate(values))
        np.add.at(self._token_uniform, rows, np.concatenate(uniform_values))
        np.add.at(self._token_counts, rows, 1)

    def merge(self, other: "AttentionSinks") -> "AttentionSinks":
        check_same_kind(self, other)
        self._heads = merge_moments(self._heads, other._heads)
        self._uniform = merge_moments(self._uniform, other._uniform)
        self._excess = merge_moments(self._excess, other._excess)
        self._activations = merge_moments(self._activations, other._activations)
        if len(other._token_counts):
            shape = other._token_sums.shape[1:]
            for piece, row in other._token_rows.items():
                self._token_rows.setdefault(piece, len(self._token_rows))
            grow = len(self._token_rows) - len(self._token_counts)
            self._token_sums = np.concatenate([self._token_sums.reshape(-1, *shape), np.zeros((grow, *shape))])
            self._token_uniform = np.concatenate([self._token_uniform.reshape(-1, *shape), np.zeros((grow, *shape))])
            self._token_counts = np.concatenate([self._token_counts, np.zeros(grow)])
            rows = np.array([self._token_rows[piece] for piece in other._token_rows])
            self._token_sums[rows] += other._token_sums
            self._token_uniform[rows] += other._token_uniform
            self._token_counts[rows] += other._token_counts
        return self

    def result(self, min_sample: int = 2) -> pd.DataFrame:
        """``layer, head, quantity, value, ci_low, ci_high, n, uniform, excess, t_excess, p_excess``: each of
        :data:`SINK_QUANTITIES`' mean over sequences, the uniform head's mean on the same sequences (:data:`WITH_UNIFORM`; NaN
        for the norm ratios), the mean paired excess over it and its one-sided t-test, ``H0: mean(s - u) <= 0`` (not tested
        on fewer than ``min_sample`` sequences: the family passes ``--min-sample``; :func:`sink_mask` leaves a head seen in
        fewer than its own ``min_sample`` undecided whatever the table holds)."""
        columns = ["layer", "head", "quantity", "value", "ci_low", "ci_high", "n", "uniform", "excess", "t_excess", "p_excess"]
        if self._heads is None:
            return pd.DataFrame(columns=columns)
        layers, heads, _ = self._heads.count.shape
        index = pd.MultiIndex.from_product([range(layers), range(heads), SINK_QUANTITIES], names=["layer", "head", "quantity"])
        table = interval_frame(self._heads, index)
        t, p = t_test_greater(self._excess, 0.0, min_sample=min_sample)
        tested = self._excess.count > 0
        table["uniform"], table["excess"] = self._uniform.means().ravel(), self._excess.means().ravel()
        table["t_excess"], table["p_excess"] = np.where(tested, t, np.nan).ravel(), np.where(tested, p, np.nan).ravel()
        return table[columns]

    def activations(self) -> pd.DataFrame:
        """``layer, quantity, value, ci_low, ci_high, n``: the largest hidden-state magnitude at position 0 (``first_max``),
        elsewhere (``rest_max``) and their ratio per sequence, per layer output (layer 0: the embeddings)."""
        if self._activations is None:
            return pd.DataFrame(columns=["layer", "quantity", "value", "ci_low", "ci_high", "n"])
        index = pd.MultiIndex.from_product([range(self._activations.count.shape[0]), ACTIVATION_QUANTITIES], names=["layer", "quantity"])
        return interval_frame(self._activations, index)

    def secondary(self, tokenizer, eps: float = SINK_EPS, min_occurrences: int = 1) -> pd.DataFrame:
        """Secondary sinks: ``piece, layer, head, attention, occurrences`` for every piece (at positions ``k > 0``) and head
        whose mean received attention over the piece's ``occurrences`` exceeds ``eps`` and the uniform head's on the same
        occurrences (a uniform head's last pieces of a short line take more than eps), pieces seen fewer than
        ``min_occurrences`` times left out (no claim on a piece seen once); strongest first."""
        columns = ["piece", "layer", "head", "attention", "occurrences"]
        if not len(self._token_counts):
            return pd.DataFrame(columns=columns)
        means = self._token_sums / self._token_counts[:, None, None]
        uniform = self._token_uniform / self._token_counts[:, None, None]
        beyond = (means > eps) & (excess_over_uniform(means, uniform) > 0)  # and more than the uniform head, beyond float noise
        rows, layers, heads = np.nonzero(beyond & (self._token_counts >= min_occurrences)[:, None, None])
        pieces = np.array(list(self._token_rows))[rows] if len(rows) else np.zeros(0, dtype=np.int64)
        table = pd.DataFrame({"piece": tokenizer.convert_ids_to_tokens(pieces.tolist()), "layer": layers, "head": heads,
                              "attention": means[rows, layers, heads], "occurrences": self._token_counts[rows].astype(np.int64)}, columns=columns)
        return table.sort_values(["attention", "layer", "head"], ascending=[False, True, True]).reset_index(drop=True)


def sink_mask(attention: pd.DataFrame, eps: float = SINK_EPS, min_sample: int = 1, correction: str = "fdr_bh",
              alpha: float = 0.05) -> pd.Series:
    """Which rows of ``attention`` (the ``attention`` rows of :meth:`AttentionSinks.result`) are sink heads: seen in at least
    ``min_sample`` sequences, mean ``alpha_0 > eps`` (strictly), and, where the table has ``p_excess``, an excess over the
    uniform head significant after ``correction`` over these heads (one family). A table without ``p_excess`` (one with no
    uniform head beside it) is judged by eps alone."""
    decided = attention.n >= min_sample
    sink = decided & (attention.value > eps)
    if "p_excess" in attention.columns:
        _, beyond = corrected(attention.p_excess.where(decided), correction, alpha)
        sink = sink & beyond.astype(bool)
    return sink


def sink_rates(sinks: pd.DataFrame, eps: float = SINK_EPS, min_sample: int = 1, correction: str = "fdr_bh", alpha: float = 0.05) -> pd.DataFrame:
    """``Sink_eps`` (Gu et al. 2025): per layer and over all layers (``layer = "all"``; the column is text), the share of heads
    that are sink heads (:func:`sink_mask`: mean attention to the first token above ``eps`` and significantly above the
    uniform head's, corrected over all heads): ``layer, eps, sink_heads, heads, rate``. Heads whose mean rests on fewer than
    ``min_sample`` sequences count as undecided: no rate is claimed for a layer with any."""
    attention = sinks[sinks.quantity == "attention"]
    attention = attention.assign(sink=sink_mask(attention, eps, min_sample, correction, alpha))
    rows = []
    for layer, part in [*attention.groupby("layer"), ("all", attention)]:
        decided = part.n >= min_sample
        sink = int(part.sink.sum())
        rows.append((str(layer), eps, sink, len(part), sink / len(part) if decided.all() and len(part) else np.nan))
    return pd.DataFrame(rows, columns=["layer", "eps", "sink_heads", "heads", "rate"])
