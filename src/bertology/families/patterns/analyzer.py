"""Kovaleva et al.'s (2019) five attention patterns, classified per head and sequence (docs/methods.md#patterns).

Classes: ``vertical`` (mass on [CLS]/[SEP] or on another single column), ``diagonal`` (previous /
next token), ``vertical+diagonal``, ``block`` (within-sentence attention on sentence pairs) and
``heterogeneous`` (none of these). The paper hand-labelled about 400 maps and trained a CNN;
neither is public, so the default :class:`RuleClassifier` applies transparent rules to three
measurable features of a map ``a`` with n real tokens:

- ``vertical``: the mass in special-token columns plus the heaviest other single column,
  ``(1/n) sum_i sum_{j in specials} a[i,j] + max_{j not special} (1/n) sum_i a[i,j]``;
- ``diagonal``: the mass on the +-1 diagonals, ``(1/n) sum_i (a[i,i-1] + a[i,i+1])``;
- ``block``: for pairs, the mean over non-special queries of the mass inside the query's own
  sentence (delimiters excluded).

Rules, in order (thresholds in :class:`PatternThresholds`): both vertical >= ``mixed_min`` and
diagonal >= ``mixed_min`` with vertical + diagonal >= ``mixed_total`` -> vertical+diagonal;
vertical >= ``vertical`` -> vertical; diagonal >= ``diagonal`` -> diagonal; a pair with block >=
``block`` -> block; otherwise heterogeneous.

The null: each rule also compares the map with the uniform map of the same sequence, ``U = V / V.sum(-1)`` (each row uniform
over the keys it saw in that layer, :meth:`~bertology.core.engine.LayerMaps.visible`), feature by feature
(:func:`pattern_excess`): the column masses of ``a`` less ``U``'s, column by column (the vertical feature of these
differences), the +-1 diagonals' mass less ``U``'s, the own-sentence mass less ``U``'s. A rule fires only where each feature
it reads also exceeds the uniform map's by at least ``margin`` (0.1 of the map's mass). So ``U`` itself is none of the
classes, on short causal maps too (a uniform causal map of up to nine pieces has vertical mass >= 0.5 on its first two
columns). Any object with the :class:`PatternClassifier`
``classify`` method (a trained CNN, say) can replace the rules.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, is_pair, stack_layers
from bertology.core.model.kinds import ENCODER, uniform_rows
from bertology.core.statistics.stats import keyed_rng, sequence_key

PATTERNS = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")
_GOLDEN = 0.6180339887498949  # spreads one key per sequence over its layer x head maps


@dataclass(frozen=True)
class PatternThresholds:
    """Thresholds of the rule classifier (shares of a map's attention mass)."""

    vertical: float = 0.5
    diagonal: float = 0.5
    mixed_min: float = 0.25
    mixed_total: float = 0.6
    block: float = 0.8
    margin: float = 0.1  # each feature a rule reads must exceed the uniform map's on the same sequence by this much


class PatternClassifier(Protocol):
    """What a pattern classifier provides: one class index (into :data:`PATTERNS`) per map."""

    def classify(self, attention: torch.Tensor, mask: torch.Tensor, special: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        """``attention [batch, head, n, n]`` -> ``[batch, head]`` class indices, each head's map on its own (the
        analyzer passes every layer's heads side by side). A classifier whose ``classify`` takes ``visible`` (the layer's
        visible keys ``[batch, n, n]``) is handed them, as :class:`RuleClassifier` is."""
        ...


def pattern_features(attention: torch.Tensor, mask: torch.Tensor, special: torch.Tensor, segment_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rule classifier's features ``[batch, head]`` (see the module docstring)."""
    return features_from_sums(pattern_sums(attention, segment_ids), mask, special, segment_ids)


def pattern_sums(attention: torch.Tensor, segment_ids: torch.Tensor, rows: slice | None = None) -> dict[str, torch.Tensor]:
    """The sums over query rows the features are made of, in the maps' dtype: ``columns [batch, head, n]``, each key's
    column sum; ``diagonal [batch, head]``, the mass on the +-1 diagonals; ``own [batch, head]``, the summed mass of each
    sentence query on its own sentence. ``rows``: ``attention`` holds only these query rows (``[batch, head, r, n]``, a block
    of a pass by blocks of queries, :attr:`~bertology.core.engine.LayerMaps.rows`): their sums, which add up over blocks."""
    first = 0 if rows is None else rows.start
    segments = segment_ids[:, first : first + attention.shape[-2]]  # the queries'
    diagonal = attention.diagonal(offset=first - 1, dim1=-2, dim2=-1).sum(-1) + attention.diagonal(offset=first + 1, dim1=-2, dim2=-1).sum(-1)
    # attention to the query's own sentence: one product with the sentences' indicator columns, then each query's own
    sentences = torch.stack([segment_ids == 0, segment_ids == 1], dim=-1).to(attention.dtype)  # [batch, n, 2]
    to_sentence = torch.matmul(attention, sentences[:, None])  # [batch, head, r, 2]
    own = torch.where(segments[:, None] == 0, to_sentence[..., 0], torch.where(segments[:, None] == 1, to_sentence[..., 1], 0))
    return {"columns": attention.sum(-2), "diagonal": diagonal, "own": (own * (segments >= 0).to(attention.dtype)[:, None]).sum(-1)}


def features_from_sums(sums: dict[str, torch.Tensor], mask: torch.Tensor, special: torch.Tensor, segment_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rule classifier's features ``[batch, head]`` from a map's :func:`pattern_sums` over every query row."""
    columns = sums["columns"]
    n = mask.sum(1).to(columns.dtype)[:, None]
    column_mass = columns / n[..., None]  # [batch, head, n]
    special_mass = (column_mass * special[:, None].to(columns.dtype)).sum(-1)
    other = column_mass.masked_fill(special[:, None] | ~mask[:, None], 0.0).amax(-1)
    queries = (segment_ids >= 0).to(columns.dtype)[:, None]
    block = sums["own"] / queries.sum(-1).clamp(min=1)
    return {"vertical": special_mass + other, "diagonal": sums["diagonal"] / n,
            "block": torch.where(is_pair(segment_ids)[:, None], block, torch.nan)}


def uniform_pattern_map(mask: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """The uniform map of each sequence, ``U = V / V.sum(-1)`` ``[batch, 1, n, n]`` float64, over the keys each query saw
    (``visible [batch, n, n]``; None: every real token, an encoder's)."""
    return uniform_rows(ENCODER.visible_keys(mask) if visible is None else visible)[:, None]


def pattern_excess(attention: torch.Tensor, mask: torch.Tensor, special: torch.Tensor, segment_ids: torch.Tensor,
                   visible: torch.Tensor | None = None, uniform: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The rule features of ``attention`` over the uniform map ``U`` of the same sequence, ``[batch, head]`` float64.

    ``uniform [batch, 1 or head, n, n]`` is the layer's uniform head in the maps' view
    (:meth:`~bertology.core.engine.LayerMaps.uniform`; None: built from ``visible`` by :func:`uniform_pattern_map`).
    ``vertical``, the special columns' mass less ``U``'s plus the largest excess of one other column,
    ``(1/n) sum_i (a[i,j] - U[i,j])`` (column by column, so a column ``U`` fills anyway counts only past ``U``);
    ``diagonal``, the +-1 diagonals' mass less ``U``'s; ``block``, the own-sentence mass less ``U``'s (NaN for a
    single).
    """
    if uniform is None:
        uniform = uniform_pattern_map(mask, visible)  # on the maps' device: built from their masks
    return excess_from_sums(pattern_sums(attention, segment_ids), pattern_sums(uniform, segment_ids), mask, special, segment_ids)


def excess_from_sums(sums: dict[str, torch.Tensor], uniform_sums: dict[str, torch.Tensor], mask: torch.Tensor, special: torch.Tensor,
                     segment_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`pattern_excess` from the :func:`pattern_sums` of the maps and of the uniform map over every query row."""
    n = mask.sum(1).to(torch.float64)[:, None]
    columns = (sums["columns"].to(torch.float64) - uniform_sums["columns"]) / n[..., None]  # [batch, head, n]
    special_excess = (columns * special[:, None].to(torch.float64)).sum(-1)
    others = columns.masked_fill(special[:, None] | ~mask[:, None], -torch.inf).amax(-1)
    others = torch.where(torch.isfinite(others), others, 0.0)
    mine, theirs = features_from_sums(sums, mask, special, segment_ids), features_from_sums(uniform_sums, mask, special, segment_ids)
    return {"vertical": special_excess + others, "diagonal": mine["diagonal"].to(torch.float64) - theirs["diagonal"],
            "block": mine["block"].to(torch.float64) - theirs["block"]}


class RuleClassifier:
    """Transparent rules on :func:`pattern_features`, each against the uniform map of the same sequence
    (:func:`pattern_excess`; see the module docstring)."""

    def __init__(self, thresholds: PatternThresholds = PatternThresholds()):
        self.thresholds = thresholds

    def classify(self, attention, mask, special, segment_ids, visible: torch.Tensor | None = None,
                 uniform: torch.Tensor | None = None) -> torch.Tensor:
        """Class indices ``[batch, head]``; ``visible [batch, n, n]`` the keys each query saw (None: every real token), or
        ``uniform`` the uniform head's maps in the view the maps are in (:func:`pattern_excess`)."""
        if uniform is None:
            uniform = uniform_pattern_map(mask, visible)
        return self.classify_sums(pattern_sums(attention, segment_ids), pattern_sums(uniform, segment_ids), mask, special, segment_ids)

    def classify_sums(self, sums: dict[str, torch.Tensor], uniform_sums: dict[str, torch.Tensor], mask: torch.Tensor, special: torch.Tensor,
                      segment_ids: torch.Tensor) -> torch.Tensor:
        """Class indices ``[batch, head]`` from the :func:`pattern_sums` over every query row of the maps and of the uniform
        head's (what a pass by blocks of queries folds)."""
        features = features_from_sums(sums, mask, special, segment_ids)
        vertical, diagonal, block = features["vertical"], features["diagonal"], features["block"]
        excess = excess_from_sums(sums, uniform_sums, mask, special, segment_ids)
        t = self.thresholds
        past = {name: torch.nan_to_num(value, nan=-1.0) >= t.margin for name, value in excess.items()}  # beyond the uniform map
        result = torch.full(vertical.shape, PATTERNS.index("heterogeneous"), dtype=torch.long, device=vertical.device)
        rules = [  # applied last to first, so the first rule that matches wins
            ("block", (torch.nan_to_num(block, nan=0.0) >= t.block) & past["block"]),
            ("diagonal", (diagonal >= t.diagonal) & past["diagonal"]),
            ("vertical", (vertical >= t.vertical) & past["vertical"]),
            ("vertical+diagonal", (vertical >= t.mixed_min) & (diagonal >= t.mixed_min) & (vertical + diagonal >= t.mixed_total)
             & past["vertical"] & past["diagonal"]),
        ]
        for name, hit in rules:
            result = torch.where(hit, PATTERNS.index(name), result)  # not result[hit] = ...: a boolean index waits for the device
        return result


@dataclass(order=True)
class _Example:
    key: float  # minus the item's hash: a min-heap on it keeps the smallest hashes
    layer: int
    head: int
    source: str
    text: str
    attention: np.ndarray = field(compare=False)
    tokens: list[str] = field(compare=False)  # the map's rows and columns: each piece's text, [CLS] and [SEP] named


#: How a thumbnail names a special piece that is one of the kind's anchors (docs/methods.md#decoders: a decoder's first
#: token, BOS where the tokenizer adds one, takes [CLS]'s place).
ANCHOR_LABELS = {"cls": "[CLS]", "sep": "[SEP]", "first": "[CLS]"}


def piece_texts(item, anchors: dict[str, np.ndarray]) -> list[str]:
    """Each piece of an encoded sequence as the text it covers (its offsets into the text, or the pair's second text), with
    ``##`` before a piece that goes on a word (it starts where the piece before ends, between two letters or digits);
    special pieces by the anchor they are (``anchors``: the batch row's anchor masks by name), ``[CLS]`` or ``[SEP]``
    (:data:`ANCHOR_LABELS`), whatever the model calls them."""
    texts, last_end = [], None  # (segment, end) of the piece before
    for k, ((begin, end), segment) in enumerate(zip(item.offsets, item.sequence_ids)):
        if segment is None:  # a special token (a decoder's first piece is a word: its own text)
            texts.append(next((ANCHOR_LABELS[name] for name, marks in anchors.items() if marks[k]), ""))
            continue
        source = item.example.text_pair if segment == 1 else item.example.text
        goes_on = last_end == (segment, begin) and begin > 0 and source[begin - 1].isalnum() and source[begin:begin + 1].isalnum()
        texts.append("##" * goes_on + source[begin:end].strip())
        last_end = (segment, end)
    return texts


class HeadPatterns(LayerwiseAnalyzer):
    """Class counts of every head's maps, and a few example maps per class for thumbnails.

    ``result()``: ``layer, head, pattern, share, n, majority``. Examples of a class are maps of ``examples_per_class``
    distinct heads, each head's map with the smallest key (a hash of the sequence spread over layer x head), the heads
    with the smallest such keys, so the same ones are kept whatever the batch order or sharding. Only sequences of
    ``min_example_length`` to ``max_example_length`` pieces give examples, so a thumbnail can name its tokens.
    """

    name = "patterns"

    def __init__(self, classifier: PatternClassifier | None = None, examples_per_class: int = 4, seed: int = 0, min_example_length: int = 8,
                 max_example_length: int = 32):
        self.classifier = classifier or RuleClassifier()
        self.examples_per_class = examples_per_class
        self.seed = seed
        self.min_example_length, self.max_example_length = min_example_length, max_example_length
        self._counts: np.ndarray | None = None
        self._examples: dict[str, list[_Example]] = {p: [] for p in PATTERNS}
        self._eligible: list[int] = []  # the batch's sequences short enough to give an example map
        self._pending: list[torch.Tensor] = []  # this batch's classes so far, one [batch, head] per layer
        self._pending_maps: list[torch.Tensor] = []  # the eligible sequences' maps, one [eligible, head, w, w] per layer
        self._layer_sums: list[dict[str, torch.Tensor]] = []  # the layer's pattern_sums so far (blocks of query rows), the uniform head's

    @property
    def folds_row_blocks(self) -> bool:
        """The rules read sums over query rows, which blocks of rows add up; another classifier reads whole maps."""
        return isinstance(self.classifier, RuleClassifier)

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0 and maps.starts_layer:
            self._pending, self._pending_maps = [], []
            lengths = batch.host_lengths
            self._eligible = [b for b in range(batch.size) if self.min_example_length <= lengths[b] <= self.max_example_length]
        arguments = (batch.mask, batch.anchor_mask, batch.segment_ids)
        if isinstance(self.classifier, RuleClassifier):  # the rules compare each map with the uniform head's, in the same view
            # the uniform head's sums once for the layers that share it
            uniform_sums = maps.uniform_scored(batch, self, lambda head: pattern_sums(head, batch.segment_ids, maps.rows))
            sums = [pattern_sums(maps.attention, batch.segment_ids, maps.rows), uniform_sums]
            if not maps.starts_layer:  # the next block of query rows: its sums add to the layer's so far
                sums = [{name: old[name] + new[name] for name in new} for old, new in zip(self._layer_sums, sums)]
            self._layer_sums = [] if maps.ends_layer else sums
            if maps.ends_layer:
                self._pending.append(self.classifier.classify_sums(*sums, *arguments))  # [batch, head]
        else:
            self._pending.append(self.classifier.classify(maps.attention, *arguments))
        if self._eligible:  # the short sequences' maps, candidates for thumbnails (at most max_example_length square)
            width = min(maps.attention.shape[-1], self.max_example_length)
            first = maps.row_start
            if maps.starts_layer:
                self._pending_maps.append(maps.attention.new_zeros(len(self._eligible), maps.attention.shape[1], width, width, dtype=torch.half))
            block = maps.attention[self._eligible, :, : max(0, width - first), :width]  # the block's rows among the first width
            self._pending_maps[-1][:, :, first : first + block.shape[2]] = block.half()

    def finish_batch(self, batch: Batch) -> None:
        classes = stack_layers(self._pending, batch).cpu().numpy()  # [layer, batch, head]: one copy to the host
        if self._counts is None:
            self._counts = np.zeros((classes.shape[0], classes.shape[2], len(PATTERNS)), dtype=np.int64)
        for k in range(len(PATTERNS)):
            self._counts[..., k] += (classes == k).sum(axis=1)
        short_maps = stack_layers(self._pending_maps, batch, dim=1).cpu().numpy() if self._pending_maps else None  # [eligible, layer, head, w, w]
        self._pending, self._pending_maps = [], []
        self._keep_examples(batch, classes, short_maps)
        self._eligible = []

    def _keep_examples(self, batch: Batch, classes: np.ndarray, short_maps: np.ndarray | None) -> None:
        num_layers, size, num_heads = classes.shape
        offsets = (_GOLDEN * np.arange(num_layers * num_heads)).reshape(num_layers, num_heads)
        if not self._eligible:
            return
        anchors = {name: marks.cpu().numpy() for name, marks in batch.anchors.items()}
        for row, b in enumerate(self._eligible):
            example, n = batch.examples[b], int(batch.host_lengths[b])
            keys = (keyed_rng(self.seed, *sequence_key(example)).random() + offsets) % 1.0
            tokens = piece_texts(batch.items[b], {name: marks[b] for name, marks in anchors.items()})
            for k, pattern in enumerate(PATTERNS):
                kept = self._examples[pattern]
                bound = -kept[0].key if len(kept) >= self.examples_per_class else np.inf  # the largest hash kept
                for layer, head in zip(*np.nonzero((classes[:, b] == k) & (keys < bound))):
                    self._offer(kept, _Example(-float(keys[layer, head]), int(layer), int(head), example.source, example.text,
                                               short_maps[row, layer, head, :n, :n], tokens))

    def _offer(self, kept: list[_Example], item: _Example) -> None:
        """Keep ``item`` in the heap ``kept`` if its head has no map there with a smaller hash and it is among the
        ``examples_per_class`` smallest hashes of distinct heads."""
        same = [k for k, old in enumerate(kept) if (old.layer, old.head) == (item.layer, item.head)]
        if same:
            if item.key > kept[same[0]].key:
                kept[same[0]] = item
                heapq.heapify(kept)
        elif len(kept) < self.examples_per_class:
            heapq.heappush(kept, item)
        elif item.key > kept[0].key:
            heapq.heapreplace(kept, item)

    def merge(self, other: "HeadPatterns") -> "HeadPatterns":
        self._check_mergeable(other)
        if other._counts is not None:
            self._counts = other._counts.copy() if self._counts is None else self._counts + other._counts
        for pattern, items in other._examples.items():
            best: dict[tuple[int, int], _Example] = {}
            for item in sorted(self._examples[pattern] + items, reverse=True):
                best.setdefault((item.layer, item.head), item)  # each head's smallest hash
            merged = list(best.values())[: self.examples_per_class]
            heapq.heapify(merged)
            self._examples[pattern] = merged
        return self

    def result(self) -> pd.DataFrame:
        columns = ["layer", "head", "pattern", "share", "n", "majority"]
        if self._counts is None:
            return pd.DataFrame(columns=columns)
        num_layers, num_heads, _ = self._counts.shape
        totals = self._counts.sum(-1, keepdims=True)
        layer, head, k = np.indices(self._counts.shape)
        majority = np.array(PATTERNS)[self._counts.argmax(-1)]
        return pd.DataFrame({
            "layer": layer.ravel(), "head": head.ravel(), "pattern": np.array(PATTERNS)[k.ravel()],
            "share": (self._counts / totals).ravel(), "n": np.broadcast_to(totals, self._counts.shape).ravel(),
            "majority": np.repeat(majority.ravel(), len(PATTERNS)),
        })[columns]

    def by_layer(self) -> pd.DataFrame:
        """Class shares per layer and overall (``layer = -1``): ``layer, pattern, share``."""
        per_layer = self._counts.sum(1)
        rows = [(layer, PATTERNS[k], per_layer[layer, k] / per_layer[layer].sum()) for layer in range(len(per_layer)) for k in range(len(PATTERNS))]
        overall = per_layer.sum(0)
        rows += [(-1, PATTERNS[k], overall[k] / overall.sum()) for k in range(len(PATTERNS))]
        return pd.DataFrame(rows, columns=["layer", "pattern", "share"])

    def examples(self) -> dict[str, list[_Example]]:
        """The kept example maps per class, in key order."""
        return {pattern: sorted(items, reverse=True) for pattern, items in self._examples.items()}

    def thresholds(self) -> dict | None:
        return asdict(self.classifier.thresholds) if isinstance(self.classifier, RuleClassifier) else None
