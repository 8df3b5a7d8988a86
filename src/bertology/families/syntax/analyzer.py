"""Syntactic heads (Clark et al. 2019, section 4; docs/methods.md#syntactic-heads-and-the-parsing-probe).

For every head and both directions, each word's parent is predicted as the argmax of its
word-level attention, over the other words ([CLS]/[SEP] and the word itself excluded):

- ``dep->head``: the row of the word-level map ``W`` (the word the dependent attends to most);
- ``head->dep``: the row of ``W^T`` (the word that attends most to the dependent).

Accuracy for relation r is the share of dependents with relation r whose predicted parent is the
gold head; ``all`` pools every relation (punctuation included). The root word is no dependent
anywhere, ``all`` included: its gold head is no word, so no attention argmax could be right.
(Clark et al.'s code counts it in ``all`` as a miss for every head, which scales a head's ``all``
accuracy by ``N / (N + R)``, N dependents and R roots, and lets an offset baseline clipped to the
sentence's start hit it.) Dependents whose word or gold head lost its pieces to truncation are
left out too. Fixed-offset baselines predict the word at offset k (k in -3..+3 without 0).

On a decoder (docs/methods.md#decoders) a word sees only the words before it: a dependent can attend to its head only
when the head precedes it (``dep->head``), and the head to the dependent only when the dependent precedes (``head->dep``).
Each direction's accuracy is taken over the pairs where its target is visible, and ``n`` is that count of pairs, per
direction; the offset baselines over every dependent.

Uncertainty comes from a Poisson bootstrap over sentences (Hanley & MacGibbon 2006; Chamandy et
al. 2012): each sentence carries ``B`` fixed weights drawn from Poisson(1) and keyed by its line
and text (:func:`~bertology.core.statistics.stats.sequence_key`, never the file's name), so replicate counts
stream, merge across shards and do not depend on batch order.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import bootstrap_weights, corrected
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


def predicted_parents(word_maps: torch.Tensor, dependent_units: torch.Tensor, is_word: torch.Tensor) -> torch.Tensor:
    """Argmax parents in both directions: ``[direction, layer, head, dependent]`` unit indices.

    ``word_maps`` is ``[layer, head, u, u]``; candidates are word units other than the dependent.
    """
    units = word_maps.shape[-1]
    allowed = is_word[None, :].expand(len(dependent_units), units).clone()
    allowed[torch.arange(len(dependent_units)), dependent_units] = False
    dep_to_head = word_maps[:, :, dependent_units, :]
    head_to_dep = word_maps[:, :, :, dependent_units].transpose(-1, -2)
    scores = torch.stack([dep_to_head, head_to_dep]).masked_fill(~allowed, -torch.inf)
    return scores.argmax(dim=-1)


class RelationHeads(LayerwiseAnalyzer):
    """Per relation, head and direction: how often the attention argmax is the gold parent, on a ``kind`` of model (where a
    word does not see the words after it, each direction is scored on the pairs whose target it sees: see the module docstring).

    ``result()``: ``relation, direction, layer, head, accuracy, n`` for every head;
    ``baselines()``: ``relation, offset, accuracy, n``; ``best()``: one row per relation with the
    best head and direction (and every head tied with it), a bootstrap 95% interval over
    sentences, the best offset baseline, and a one-sided paired bootstrap p-value (head better than
    baseline), corrected across the tested relations (at least ``min_dependents``) with statsmodels' ``multipletests``.
    """

    name = "syntax"

    def __init__(self, kind: Kind, bootstrap: int = 1000, seed: int = 0):
        self.kind = kind
        self.bootstrap = bootstrap
        self.seed = seed
        self._correct: dict[str, np.ndarray] = {}  # relation -> [1 + B, 2 * L * H + len(OFFSETS)]
        self._count: dict[str, np.ndarray] = {}  # relation -> [1 + B]
        self._visible_count: dict[str, np.ndarray] = {}  # a decoder's: relation -> [1 + B, columns], the pairs each column sees
        self._shape: tuple[int, int] | None = None
        self._trees: list[tuple] = []  # the batch's sentences with dependents
        self._pending: list[torch.Tensor] = []  # their predicted parents, one [direction, head, dependent] per layer

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
        predicted = []
        for b, dependents, _, _ in self._trees:
            alignment = batch.alignments[b]
            word_maps = maps.word_attention(batch, b)[None]  # [1, head, u, u]
            is_word = torch.as_tensor(alignment.unit_is_word, device=word_maps.device)
            units = torch.as_tensor(alignment.word_unit[dependents], device=word_maps.device)
            predicted.append(predicted_parents(word_maps, units, is_word)[:, 0])  # [direction, head, dependent]
        if predicted:
            self._pending.append(torch.cat(predicted, dim=-1))  # every sentence's dependents side by side

    def finish_batch(self, batch: Batch) -> None:
        self._shape = (batch.num_layers, batch.num_heads)
        if not self._trees:
            return
        every = torch.stack(self._pending, dim=1).cpu()  # [direction, layer, head, dependent]: one copy to the host
        trees, self._pending, self._trees = self._trees, [], []
        offsets = torch.tensor(OFFSETS)
        # Per relation: each sentence's bootstrap weights, hit counts and number of dependents.
        weights: dict[str, list[np.ndarray]] = {}
        sums: dict[str, list[np.ndarray]] = {}
        counts: dict[str, list[int]] = {}
        visible_counts: dict[str, list[np.ndarray]] = {}
        start = 0
        for b, dependents, gold, relations in trees:
            example, units = batch.examples[b], torch.as_tensor(batch.alignments[b].word_unit)
            predicted = every[..., start : start + len(dependents)]
            start += len(dependents)
            head_hits = (predicted == units[gold]).permute(3, 1, 2, 0).reshape(len(dependents), -1)  # [dep, layer*head*direction]
            offset_hits = (torch.as_tensor(dependents)[:, None] + offsets[None, :]) == torch.as_tensor(gold)[:, None]
            hits = torch.cat([head_hits, offset_hits], dim=1).double().numpy()
            visible = None
            if not self.kind.sees_later_keys:  # a column sees the pair where its target precedes: dep->head the head, head->dep the dependent
                head_first = (units[gold] < units[dependents]).numpy()
                by_direction = np.stack([head_first, ~head_first], axis=1).astype(np.float64)  # [dep, direction]
                visible = np.concatenate([np.tile(by_direction, self._shape[0] * self._shape[1]), np.ones((len(dependents), len(OFFSETS)))], axis=1)
                hits = hits * visible
            relations = np.array(relations)
            sentence_weights = bootstrap_weights(self.seed, self.bootstrap, example)
            for relation in [ALL_RELATIONS, *np.unique(relations)]:
                chosen = slice(None) if relation == ALL_RELATIONS else relations == relation
                rows = hits[chosen]
                weights.setdefault(relation, []).append(sentence_weights)
                sums.setdefault(relation, []).append(rows.sum(axis=0))
                counts.setdefault(relation, []).append(len(rows))
                if visible is not None:
                    visible_counts.setdefault(relation, []).append(visible[chosen].sum(axis=0))
        for relation in weights:
            replicate_weights = np.stack(weights[relation], axis=1)  # [1 + B, sentences]
            if relation not in self._correct:
                self._correct[relation] = np.zeros((1 + self.bootstrap, len(sums[relation][0])))
                self._count[relation] = np.zeros(1 + self.bootstrap)
            self._correct[relation] += replicate_weights @ np.stack(sums[relation])
            self._count[relation] += replicate_weights @ np.array(counts[relation], dtype=np.float64)
            if relation in visible_counts:
                seen = replicate_weights @ np.stack(visible_counts[relation])
                self._visible_count[relation] = self._visible_count[relation] + seen if relation in self._visible_count else seen

    def merge(self, other: "RelationHeads") -> "RelationHeads":
        check_same_kind(self, other)
        if other.bootstrap != self.bootstrap or other.seed != self.seed:
            raise ValueError("cannot merge RelationHeads with different bootstrap sizes or seeds")
        for relation, correct in other._correct.items():
            if relation in self._correct:
                self._correct[relation] = self._correct[relation] + correct
                self._count[relation] = self._count[relation] + other._count[relation]
            else:
                self._correct[relation], self._count[relation] = correct.copy(), other._count[relation].copy()
        for relation, seen in other._visible_count.items():
            self._visible_count[relation] = self._visible_count[relation] + seen if relation in self._visible_count else seen.copy()
        self._shape = self._shape or other._shape
        return self

    def _pairs(self, relation: str) -> np.ndarray:
        """``[1 + B, columns]`` (or ``[1 + B, 1]``, the same for every column): the dependents each column is scored on; on a
        decoder, those whose target its direction sees."""
        return self._visible_count[relation] if relation in self._visible_count else self._count[relation][:, None]

    def _relations(self) -> list[str]:
        """Relations by number of dependents (most first), ``all`` first."""
        return sorted(self._count, key=lambda r: (r != ALL_RELATIONS, -self._count[r][0], r))

    def result(self) -> pd.DataFrame:
        columns = ["relation", "direction", "layer", "head", "accuracy", "n"]
        if not self._count:
            return pd.DataFrame(columns=columns)
        num_layers, num_heads = self._shape
        layer, head, direction = np.unravel_index(np.arange(num_layers * num_heads * 2), (num_layers, num_heads, 2))
        frames = []
        for relation in self._relations():
            n = np.broadcast_to(self._pairs(relation)[0, : len(layer)], len(layer))
            with np.errstate(invalid="ignore", divide="ignore"):
                accuracy = self._correct[relation][0, : len(layer)] / n
            frames.append(pd.DataFrame({"relation": relation, "direction": np.array(DIRECTIONS)[direction], "layer": layer, "head": head,
                                        "accuracy": accuracy, "n": n.astype(np.int64)}))
        return pd.concat(frames, ignore_index=True)

    def best_accuracy_replicates(self, min_dependents: int = 25) -> np.ndarray:
        """``[1 + B]``: the mean over relations (``all`` excluded, at least ``min_dependents`` dependents) of the best head's accuracy.

        The best head is chosen within each replicate (row 0: the data), as :meth:`best` chooses it
        on the data; NaN if no relation has enough dependents.
        """
        width = self._shape[0] * self._shape[1] * 2 if self._shape else 0
        relations = [r for r in self._relations() if r != ALL_RELATIONS and self._count[r][0] >= min_dependents]
        if not relations:
            return np.full(1 + self.bootstrap, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            best = [np.fmax.reduce(self._correct[r][:, :width] / self._pairs(r)[:, :width], axis=1) for r in relations]  # NaN: no pair seen
        return np.mean(best, axis=0)

    def baselines(self) -> pd.DataFrame:
        """Accuracy of each fixed offset baseline per relation: ``relation, offset, accuracy, n``."""
        rows = []
        for relation in self._relations():
            n = self._count[relation][0]  # the offsets are scored on every dependent
            for k, offset in enumerate(OFFSETS):
                rows.append((relation, offset, self._correct[relation][0, -len(OFFSETS) + k] / n, int(n)))
        return pd.DataFrame(rows, columns=["relation", "offset", "accuracy", "n"])

    def best(self, min_dependents: int = 25, correction: str = "fdr_bh", alpha: float = 0.05) -> pd.DataFrame:
        """One row per relation: the best head against the best offset baseline.

        ``n_ties``: how many (layer, head, direction) share the best accuracy, all listed in
        ``ties`` as ``layer-head direction`` (``"7-5 dep->head; 8-1 head->dep"``, 0-based, in
        layer, head, direction order); ``layer``, ``head``, ``direction``, the interval and the
        p-value are those of the first of them. (Clark et al.'s code keeps the last of its sorted
        list.) The baseline is the best offset, the first of -3..+3 on a tie.
        ``ci_low``/``ci_high``: 2.5th and 97.5th percentiles of the head's bootstrap accuracies;
        ``p_value``: ``(1 + #{b: acc_head(b) - acc_baseline(b) <= 0}) / (1 + B)``; ``p_adj``
        corrected across the tested relations (``correction`` is a ``multipletests`` method: fdr_bh,
        bonferroni, holm, ...); ``few``: fewer than ``min_dependents`` dependents, a relation that is not tested: its
        interval, ``p_value``, ``p_adj`` are empty and ``significant`` is false (no claim on too little data).
        """
        columns = ["relation", "n", "layer", "head", "direction", "accuracy", "ci_low", "ci_high", "baseline_offset",
                   "baseline_accuracy", "p_value", "p_adj", "significant", "few", "n_ties", "ties"]
        if not self._count:
            return pd.DataFrame(columns=columns)
        num_layers, num_heads = self._shape
        width = num_layers * num_heads * 2
        rows = []
        for relation in self._relations():
            with np.errstate(invalid="ignore", divide="ignore"):
                accuracy = self._correct[relation] / self._pairs(relation)  # [1 + B, width + offsets]
            # hit counts are whole numbers over one denominator: equal accuracies are exactly equal (a decoder's column
            # without a visible pair has none: NaN, never the best)
            tied = np.flatnonzero(accuracy[0, :width] == np.fmax.reduce(accuracy[0, :width]))
            best = int(tied[0])
            base = int(np.argmax(accuracy[0, width:]))
            replicates = accuracy[1:, best], accuracy[1:, width + base]
            valid = ~np.isnan(replicates[0])
            layer, head, direction = np.unravel_index(tied, (num_layers, num_heads, 2))
            difference = replicates[0][valid] - replicates[1][valid]
            rows.append(
                {
                    "relation": relation,
                    "n": int(np.broadcast_to(self._pairs(relation)[0], accuracy.shape[1])[best]),
                    "layer": int(layer[0]),
                    "head": int(head[0]),
                    "direction": DIRECTIONS[direction[0]],
                    "accuracy": accuracy[0, best],
                    "ci_low": np.percentile(replicates[0][valid], 2.5),
                    "ci_high": np.percentile(replicates[0][valid], 97.5),
                    "baseline_offset": OFFSETS[base],
                    "baseline_accuracy": accuracy[0, width + base],
                    "p_value": (1 + np.sum(difference <= 0)) / (1 + len(difference)),
                    "n_ties": len(tied),
                    "ties": "; ".join(f"{tl}-{th} {DIRECTIONS[td]}" for tl, th, td in zip(layer, head, direction)),
                }
            )
        table = pd.DataFrame(rows)
        table["few"] = table.n < min_dependents
        table.loc[table.few, ["ci_low", "ci_high", "p_value"]] = np.nan
        table["p_adj"], table["significant"] = corrected(table.p_value, correction, alpha)
        return table[columns]
