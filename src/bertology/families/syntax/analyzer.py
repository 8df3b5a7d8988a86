"""Syntactic heads (Clark et al. 2019, section 4; docs/methods.md#syntactic-heads-and-the-parsing-probe).

For every head and both directions, each word's parent is predicted as the argmax of its
word-level attention, over the other words the row sees in the head's layer ([CLS]/[SEP] and the word itself excluded):

- ``dep->head``: the row of the word-level map ``W`` (the word the dependent attends to most);
- ``head->dep``: the row of ``W^T`` (the word that attends most to the dependent).

A row whose maximum is tied among t candidates scores ``1/t`` if the gold head is among them, else 0 (a uniform row
has no best key: it scores what a random pick among its tied keys would, never a tie-break's position).

Accuracy for relation r is the share of dependents with relation r whose predicted parent is the
gold head; ``all`` pools every relation (punctuation included). The root word is no dependent
anywhere, ``all`` included: its gold head is no word, so no attention argmax could be right.
(Clark et al.'s code counts it in ``all`` as a miss for every head, which scales a head's ``all``
accuracy by ``N / (N + R)``, N dependents and R roots, and lets an offset baseline clipped to the
sentence's start hit it.) Dependents whose word or gold head lost its pieces to truncation are
left out too. Fixed-offset baselines predict the word at offset k (k in -3..+3 without 0).

Every accuracy, the head's, the offsets' and the uniform head's, is taken over the same (dependent, head) pairs: those
whose target the direction's row sees in the layer (``LayerMaps.visible``: the mask the model applied; dep->head: the
dependent's row sees a piece of its head; head->dep: the head's row sees a piece of the dependent), and ``n`` is that
count of pairs, per layer and direction. On an encoder that is every dependent; on a decoder (docs/methods.md#decoders)
dep->head sees the pairs whose head precedes, head->dep those whose dependent precedes (and a sliding window drops the
far ones). The uniform head (``uniform``) spreads each row evenly over the keys it sees, ``1 / |S_i|``; its word-level
map is computed from the visible keys, without a forward pass, and scored by the same rule.

Uncertainty comes from a Poisson bootstrap over sentences (Hanley & MacGibbon 2006; Chamandy et
al. 2012): each sentence carries ``B`` fixed weights drawn from Poisson(1) and keyed by its line
and text (:func:`~bertology.core.statistics.stats.sequence_key`, never the file's name), so replicate counts
stream, merge across shards and do not depend on batch order.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import bootstrap_weights, corrected
from bertology.core.text.alignment import to_word_level
from bertology.families.kinds import check_kind, check_same_kind

DIRECTIONS = ("dep->head", "head->dep")
OFFSETS = (-3, -2, -1, 1, 2, 3)
ALL_RELATIONS = "all"


def tree_targets(example, word_unit: np.ndarray):
    """Dependents that can be scored: gold heads that are words, both ends aligned to pieces.

    Returns (dependent word indices, their gold head word indices, their relations), 0-based.
    """
    heads = np.asarray(example.heads)
    words = len(heads)
    units = word_unit[:words]
    dependents = np.flatnonzero(heads > 0)
    dependents = dependents[(units[dependents] >= 0) & (units[heads[dependents] - 1] >= 0)]
    relations = [example.relations[i] for i in dependents]
    return dependents, heads[dependents] - 1, relations


def parent_hits(word_maps: torch.Tensor, dependent_units: torch.Tensor, gold_units: torch.Tensor, is_word: torch.Tensor,
                sees: torch.Tensor, tie_rtol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's hit on each dependent in both directions, and which pairs the directions see.

    ``word_maps`` is ``[head, u, u]``, ``sees[u, v]`` whether some piece of unit u's row saw some piece of unit v in this
    layer. A row's candidates are the word units it sees other than the dependent (``dep->head``: the dependent's row;
    ``head->dep``: the column of the dependent in every row that sees it). The hit is ``1 / t`` when the gold head is among
    the ``t`` candidates tied at the row's maximum (within ``tie_rtol`` of it, relative; default 16 ulps of the maps'
    dtype), else 0: a uniform row scores its chance, never a tie-break's. Returns ``hits [direction, head, dependent]`` (0 where the pair is unseen) and
    ``seen [direction, dependent]`` (dep->head: the dependent's row sees its head; head->dep: the head's row sees the dependent).
    """
    count = len(dependent_units)
    rows = torch.arange(count, device=word_maps.device)
    allowed = torch.stack([sees[dependent_units], sees[:, dependent_units].T]) & is_word[None, None, :]  # [direction, dep, u]
    allowed[:, rows, dependent_units] = False
    scores = torch.stack([word_maps[:, dependent_units, :], word_maps[:, :, dependent_units].transpose(-1, -2)])  # [dir, head, dep, u]
    allowed = allowed[:, None].expand_as(scores)
    top = scores.masked_fill(~allowed, -torch.inf).amax(dim=-1, keepdim=True)
    tie_rtol = 16 * torch.finfo(scores.dtype).eps if tie_rtol is None else tie_rtol
    tolerance = tie_rtol * top.abs().nan_to_num(posinf=0.0)
    tied = allowed & (scores >= top - tolerance)
    gold = tied.gather(-1, gold_units[None, None, :, None].expand(*scores.shape[:3], 1))[..., 0]
    seen = torch.stack([sees[dependent_units, gold_units], sees[gold_units, dependent_units]])  # [direction, dep]
    # 1/t in one dtype whatever the maps' (float64; float32 on MPS, which has none, as the uniform head): a float32 head's 1/3
    # rounds up, and a null head tied with the uniform head would beat it in every replicate that draws that sentence
    exact = torch.float32 if scores.device.type == "mps" else torch.float64
    hits = gold.to(exact) / tied.sum(dim=-1).clamp(min=1).to(exact) * seen[:, None].to(exact)
    return hits, seen


def uniform_word_maps(uniform: torch.Tensor, visible: torch.Tensor, alignment) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uniform [1, u, u], sees [u, u])`` of one sequence's uniform head ``[1, n, n]`` (rows ``1 / |S_i|`` over its
    ``visible [n, n]`` keys, :meth:`~bertology.core.engine.LayerMaps.uniform`): its word-level map, and which units' rows
    see which units."""
    return to_word_level(uniform, alignment), to_word_level(visible.to(uniform.dtype), alignment) > 0


class RelationHeads(LayerwiseAnalyzer):
    """Per relation, head and direction: how often the attention argmax is the gold parent, on the (dependent, head) pairs
    the direction's row sees in the head's layer (see the module docstring), beside the uniform head's accuracy on the
    same pairs and the fixed offsets' on the same pairs.

    ``result()``: ``relation, direction, layer, head, accuracy, n, uniform`` for every head; ``baselines()``: ``relation,
    direction, offset, accuracy, n`` (on the first layer's pairs); ``best()``: one row per relation with the best head
    and direction among the directions with at least ``min_dependents`` pairs (and every head tied with it), a bootstrap
    95% interval over sentences, the best offset baseline and the uniform head on the best head's pairs, and a one-sided
    paired bootstrap p-value (head better than both), corrected across the tested relations with statsmodels' ``multipletests``.
    """

    name = "syntax"

    def __init__(self, kind: Kind, bootstrap: int = 1000, seed: int = 0):
        self.kind = kind
        self.bootstrap = bootstrap
        self.seed = seed
        # relation -> [1 + B, L*H*2 heads (layer, head, direction) + L*U*2 uniform heads (layer, 1 or head, direction) + L*2*6
        # offsets]: one uniform head a layer, or one per head under a view that reads each head's own vectors (LayerMaps.uniform)
        self._correct: dict[str, np.ndarray] = {}
        self._count: dict[str, np.ndarray] = {}  # relation -> [1 + B]: dependents
        self._seen: dict[str, np.ndarray] = {}  # relation -> [1 + B, L*2]: the pairs each layer's direction sees
        self._shape: tuple[int, int, int] | None = None  # layers, heads, uniform heads a layer
        self._uniform_heads = 1  # the uniform heads of the view the maps are in (LayerMaps.uniform): 1, or one per head
        self._trees: list[tuple] = []  # the batch's sentences with dependents
        self._pending: list[torch.Tensor] = []  # per layer, [dependent, H*2 + U*2 + 2]: head hits, uniform hits, pairs seen

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            check_kind(self, batch)
            self._pending = []
            self._trees = []  # (sequence, dependents, gold heads, relations) of each sentence with a dependent
            for b, example in enumerate(batch.examples):
                if example.has_tree:
                    dependents, gold, relations = tree_targets(example, batch.alignments[b].word_unit)
                    if len(dependents):
                        self._trees.append((b, dependents, gold, relations))
        self._uniform_heads = 1 if maps.uniform_view is None else batch.num_heads
        if not self._trees:
            return
        visible = maps.visible(batch)
        # The uniform head's ties are exact: its rows are exact in the weights, but a view computed from each head's vectors
        # (ALTI, value zeroing) rounds them in the model's dtype, far below the square root of its epsilon.
        tie_rtol = None if maps.uniform_view is None else math.sqrt(torch.finfo(maps.attention.dtype).eps)
        columns = []
        for b, dependents, gold, _ in self._trees:
            alignment, n = batch.alignments[b], int(batch.host_lengths[b])
            word_maps = maps.word_attention(batch, b)  # [head, u, u]
            device = word_maps.device
            is_word = torch.as_tensor(alignment.unit_is_word, device=device)
            units = torch.as_tensor(alignment.word_unit[dependents], device=device)
            gold_units = torch.as_tensor(alignment.word_unit[gold], device=device)
            uniform, sees = uniform_word_maps(maps.uniform(batch)[b, :, :n, :n], visible[b, :n, :n], alignment)
            hits, seen = parent_hits(word_maps, units, gold_units, is_word, sees)  # [direction, head, dep], [direction, dep]
            uniform_hits, _ = parent_hits(uniform, units, gold_units, is_word, sees, tie_rtol)  # [direction, 1 or head, dep]
            columns.append(torch.cat([hits.permute(2, 1, 0).flatten(1).double(), uniform_hits.permute(2, 1, 0).flatten(1).double(),
                                      seen.T.double()], dim=1))
        self._pending.append(torch.cat(columns))  # every sentence's dependents one under the other

    def finish_batch(self, batch: Batch) -> None:
        self._shape = (batch.num_layers, batch.num_heads, self._uniform_heads)
        if not self._trees:
            return
        every = stack_layers(self._pending, batch, dim=1).cpu().numpy()  # [dependent, layer, H*2 + U*2 + 2]: one copy to the host
        trees, self._pending, self._trees = self._trees, [], []
        heads, uniform_heads = batch.num_heads * 2, self._uniform_heads * 2
        offsets = np.array(OFFSETS)
        weights: dict[str, list[np.ndarray]] = {}
        sums: dict[str, list[np.ndarray]] = {}
        counts: dict[str, list[int]] = {}
        seens: dict[str, list[np.ndarray]] = {}
        start = 0
        for b, dependents, gold, relations in trees:
            rows = every[start : start + len(dependents)]
            start += len(dependents)
            seen = rows[:, :, heads + uniform_heads :].reshape(len(dependents), -1)  # [dep, layer*direction]
            offset_hits = ((dependents[:, None] + offsets[None, :]) == gold[:, None]).astype(np.float64)  # [dep, offset]
            hits = np.concatenate([rows[:, :, :heads].reshape(len(dependents), -1),
                                   rows[:, :, heads : heads + uniform_heads].reshape(len(dependents), -1),
                                   (seen[:, :, None] * offset_hits[:, None, :]).reshape(len(dependents), -1)], axis=1)
            relations = np.array(relations)
            sentence_weights = bootstrap_weights(self.seed, self.bootstrap, batch.examples[b])
            for relation in [ALL_RELATIONS, *np.unique(relations)]:
                chosen = slice(None) if relation == ALL_RELATIONS else relations == relation
                weights.setdefault(relation, []).append(sentence_weights)
                sums.setdefault(relation, []).append(hits[chosen].sum(axis=0))
                counts.setdefault(relation, []).append(len(hits[chosen]))
                seens.setdefault(relation, []).append(seen[chosen].sum(axis=0))
        for relation in weights:
            replicate_weights = np.stack(weights[relation], axis=1)  # [1 + B, sentences]
            correct = replicate_weights @ np.stack(sums[relation])
            count = replicate_weights @ np.array(counts[relation], dtype=np.float64)
            seen = replicate_weights @ np.stack(seens[relation])
            if relation in self._correct:
                self._correct[relation] += correct
                self._count[relation] += count
                self._seen[relation] += seen
            else:
                self._correct[relation], self._count[relation], self._seen[relation] = correct, count, seen

    def merge(self, other: "RelationHeads") -> "RelationHeads":
        check_same_kind(self, other)
        if other.bootstrap != self.bootstrap or other.seed != self.seed:
            raise ValueError("cannot merge RelationHeads with different bootstrap sizes or seeds")
        for relation, correct in other._correct.items():
            if relation in self._correct:
                self._correct[relation] = self._correct[relation] + correct
                self._count[relation] = self._count[relation] + other._count[relation]
                self._seen[relation] = self._seen[relation] + other._seen[relation]
            else:
                self._correct[relation], self._count[relation] = correct.copy(), other._count[relation].copy()
                self._seen[relation] = other._seen[relation].copy()
        self._shape = self._shape or other._shape
        return self

    def _accuracies(self, relation: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(heads [1 + B, L, H, 2], uniform [1 + B, L, H, 2], offsets [1 + B, L, 2, 6], pairs [1 + B, L, 2])``: each accuracy
        on the pairs its layer's direction sees (NaN where it sees none), and that count of pairs; each head's uniform head
        (the layer's one, or its own under a view that reads each head's vectors)."""
        num_layers, num_heads, uniform_heads = self._shape
        replicates = 1 + self.bootstrap
        correct, pairs = self._correct[relation], self._seen[relation].reshape(replicates, num_layers, 2)
        width, uniform_width = num_layers * num_heads * 2, num_layers * uniform_heads * 2
        with np.errstate(invalid="ignore", divide="ignore"):
            heads = correct[:, :width].reshape(replicates, num_layers, num_heads, 2) / pairs[:, :, None, :]
            uniform = correct[:, width : width + uniform_width].reshape(replicates, num_layers, uniform_heads, 2) / pairs[:, :, None, :]
            uniform = np.broadcast_to(uniform, heads.shape)
            offsets = correct[:, width + uniform_width :].reshape(replicates, num_layers, 2, len(OFFSETS)) / pairs[..., None]
        return heads, uniform, offsets, pairs

    def _relations(self) -> list[str]:
        """Relations by number of dependents (most first), ``all`` first."""
        return sorted(self._count, key=lambda r: (r != ALL_RELATIONS, -self._count[r][0], r))

    def result(self) -> pd.DataFrame:
        columns = ["relation", "direction", "layer", "head", "accuracy", "n", "uniform"]
        if not self._count:
            return pd.DataFrame(columns=columns)
        num_layers, num_heads, _ = self._shape
        layer, head, direction = np.unravel_index(np.arange(num_layers * num_heads * 2), (num_layers, num_heads, 2))
        frames = []
        for relation in self._relations():
            heads, uniform, _, pairs = self._accuracies(relation)
            frames.append(pd.DataFrame({"relation": relation, "direction": np.array(DIRECTIONS)[direction], "layer": layer, "head": head,
                                        "accuracy": heads[0].ravel(), "n": pairs[0][layer, direction].astype(np.int64),
                                        "uniform": uniform[0][layer, head, direction]}))
        return pd.concat(frames, ignore_index=True)

    def best_accuracy_replicates(self, min_dependents: int = 25) -> np.ndarray:
        """``[1 + B]``: the mean over relations (``all`` excluded, at least ``min_dependents`` dependents) of the best head's accuracy.

        The best head is chosen within each replicate (row 0: the data), as :meth:`best` chooses it
        on the data; NaN if no relation has enough dependents.
        """
        relations = [r for r in self._relations() if r != ALL_RELATIONS and self._count[r][0] >= min_dependents]
        if not relations:
            return np.full(1 + self.bootstrap, np.nan)
        best = [np.fmax.reduce(self._accuracies(r)[0].reshape(1 + self.bootstrap, -1), axis=1) for r in relations]  # NaN: no pair seen
        return np.mean(best, axis=0)

    def baselines(self) -> pd.DataFrame:
        """Accuracy of each fixed offset baseline per relation and direction, on the pairs that direction sees in the first
        layer (:meth:`best` scores each head's baseline on its own layer's pairs): ``relation, direction, offset, accuracy, n``."""
        rows = []
        for relation in self._relations():
            _, _, offsets, pairs = self._accuracies(relation)
            for d, direction in enumerate(DIRECTIONS):
                for k, offset in enumerate(OFFSETS):
                    rows.append((relation, direction, offset, offsets[0, 0, d, k], int(pairs[0, 0, d])))
        return pd.DataFrame(rows, columns=["relation", "direction", "offset", "accuracy", "n"])

    def best(self, min_dependents: int = 25, correction: str = "fdr_bh", alpha: float = 0.05) -> pd.DataFrame:
        """One row per relation: the best head against the best offset baseline and the uniform head, on the same pairs.

        The best head is chosen among the (layer, head, direction) whose direction sees at least ``min_dependents`` pairs
        (on a decoder each direction sees only the pairs whose target precedes; among every head with a pair where no
        direction has enough). ``n_ties``: how many share the best accuracy, all listed in ``ties`` as ``layer-head
        direction`` (``"7-5 dep->head; 8-1 head->dep"``, 0-based, in layer, head, direction order); ``layer``, ``head``,
        ``direction``, the interval and the p-value are those of the first of them. (Clark et al.'s code keeps the last of
        its sorted list.) ``n``: the pairs the best head is scored on. The baseline is the best offset on those pairs (the
        first of -3..+3 on a tie); ``uniform``: the uniform head's accuracy on those pairs (its row spread evenly over the
        keys it sees in the best head's layer, ties scored 1/t). ``ci_low``/``ci_high``: 2.5th and 97.5th percentiles of
        the head's bootstrap accuracies; ``p_value``: ``(1 + #{b: acc_head(b) - max(acc_baseline(b), acc_uniform(b)) <= 0})
        / (1 + B)``; ``p_adj`` corrected across the tested relations (``correction`` is a ``multipletests`` method:
        fdr_bh, bonferroni, holm, ...): a head is significant only when it beats both. ``few``: no direction has
        ``min_dependents`` pairs, a relation that is not tested: its interval, ``p_value``, ``p_adj`` are empty and
        ``significant`` is false (no claim on too little data).
        """
        columns = ["relation", "n", "layer", "head", "direction", "accuracy", "ci_low", "ci_high", "baseline_offset",
                   "baseline_accuracy", "p_value", "p_adj", "uniform", "significant", "few", "n_ties", "ties"]
        if not self._count:
            return pd.DataFrame(columns=columns)
        rows = [self._best_row(relation, min_dependents) for relation in self._relations()]
        table = pd.DataFrame(rows)
        table["few"] = table.n < min_dependents
        table.loc[table.few, ["ci_low", "ci_high", "p_value"]] = np.nan
        table["p_adj"], table["significant"] = corrected(table.p_value, correction, alpha)
        return table[columns]

    def _best_row(self, relation: str, min_dependents: int) -> dict:
        """:meth:`best`'s row of ``relation`` before the correction: the best head, its ties, its interval and its p against
        the larger of the best offset and the uniform head, replicate by replicate."""
        num_layers, num_heads, _ = self._shape
        heads, uniform, offsets, pairs = self._accuracies(relation)
        flat = heads.reshape(1 + self.bootstrap, -1)
        n = np.broadcast_to(pairs[0][:, None, :], (num_layers, num_heads, 2)).ravel()
        candidates = n >= min_dependents
        if not candidates.any():
            candidates = n > 0
        scores = np.where(candidates, flat[0], np.nan)
        top = np.fmax.reduce(scores)
        # fractional hits: equal accuracies agree to rounding
        tied = np.flatnonzero(candidates & np.isclose(scores, top, rtol=1e-9, atol=1e-12))
        if not len(tied):  # no pair seen in any layer or direction (a window shorter than every pair)
            tied = np.array([0])
        best = int(tied[0])
        layer, head, direction = np.unravel_index(tied, (num_layers, num_heads, 2))
        at = (layer[0], direction[0])
        base = int(np.argmax(np.nan_to_num(offsets[0][at], nan=-1.0)))
        reference = np.fmax(offsets[1:, at[0], at[1], base], uniform[1:, at[0], head[0], at[1]])
        replicates = flat[1:, best]
        valid = ~np.isnan(replicates) & ~np.isnan(reference)
        difference = replicates[valid] - reference[valid]
        return {
            "relation": relation,
            "n": int(n[best]),
            "layer": int(layer[0]),
            "head": int(head[0]),
            "direction": DIRECTIONS[direction[0]],
            "accuracy": flat[0, best],
            "ci_low": np.percentile(replicates[valid], 2.5) if valid.any() else np.nan,
            "ci_high": np.percentile(replicates[valid], 97.5) if valid.any() else np.nan,
            "baseline_offset": OFFSETS[base],
            "baseline_accuracy": offsets[0, at[0], at[1], base],
            "uniform": uniform[0, at[0], head[0], at[1]],
            "p_value": (1 + np.sum(difference <= 0)) / (1 + len(difference)),
            "n_ties": len(tied),
            "ties": "; ".join(f"{tl}-{th} {DIRECTIONS[td]}" for tl, th, td in zip(layer, head, direction)),
        }
