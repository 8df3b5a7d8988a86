"""Attention to token classes (Kovaleva et al. 2019, "attention to linguistic features"; docs/methods.md#token-classes).

A class is a set of words (:class:`TokenClass`): a UPOS tag or a dependency relation (gold trees or spaCy), a word
list (matched without regard to case), or a regular expression that must match the whole word. On each sequence's
word-level map ``W`` (docs/methods.md#notation-and-word-level-attention: attention to a word sums its pieces, from a word averages them), with
``C`` the units of the class's words and ``u`` the number of units ([CLS]/[SEP] included, as queries are in
section 1):

- every query: ``value = (1/u) sum_i sum_{j in C} W[i, j]``, the mean over queries of the attention to the class;
- the [CLS] row: ``value = sum_{j in C} W[cls, j]``;
- the uniform baseline: ``|C| / w``, the class's share of the sequence's ``w`` words (what a head that spread its
  attention evenly over the words would give); ``ratio = value / baseline`` (means over the same sequences);
- the uniform head (``uniform``): the same value of the head that spreads each row evenly over the keys it sees in the
  layer (``1 / |S_i|``, [CLS]/[SEP] and each piece included), computed per sequence from the layer's visible keys
  (:meth:`~bertology.core.engine.LayerMaps.visible`) without a forward pass; ``excess`` is the mean over sequences of
  the head's value minus the uniform head's, with a 95% t interval (``excess_ci_low``/``excess_ci_high``). A claim that
  a head attends to a class (the heads the summary names) is on the excess: its interval above 0.

Only sequences with at least one word of the class count for it (``n``); values get a 95% t interval over them.
Words whose pieces were cut by truncation belong to no class and are not counted in ``w``.

On a decoder (docs/methods.md#decoders) unit i sees the units ``j <= i`` only: the queries are the units ``i >= 1`` (unit 0
sees only itself), each against its own uniform baseline, the class's share of the words it sees,
``|C ∩ {j <= i}| / |words ∩ {j <= i}|``, averaged over the same queries (rows that see no word left out); and the last
unit's row (``last_row``, the one that predicts) takes the [CLS] row's place: :func:`class_rows` of the kind of model
(:class:`~bertology.core.model.kinds.Kind`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import RunningMoments, interval_frame, merge_moments
from bertology.core.text.alignment import WordAlignment, default_word_spans, to_word_level
from bertology.core.text.corpora import Example
from bertology.families.kinds import check_kind, check_same_kind, one_row

#: What a class's words are chosen by: a UPOS tag, a dependency relation, a word list or a regular expression.
CLASS_KINDS = ("upos", "deprel", "words", "regex")


def class_rows(kind: Kind) -> tuple[str, ...]:
    """The rows of the table on a ``kind`` of model: every query's attention (``all``), and one position's row alone
    (:func:`~bertology.families.kinds.one_row`): [CLS]'s (``cls_row``), a decoder's last unit's (``last_row``)."""
    return ("all", one_row(kind))


@lru_cache(maxsize=None)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


@dataclass(frozen=True, repr=False)
class TokenClass:
    """One class of words: ``name``, ``kind`` (one of :data:`CLASS_KINDS`), ``value`` (the tag, relation or
    pattern) and, for ``words``, the casefolded ``words`` themselves.

    ``deprel:nsubj`` also takes the relation's subtypes (``nsubj:pass``): a relation matches when it, or the part
    before its colon, equals ``value``.
    """

    name: str
    kind: str
    value: str
    words: frozenset[str] = frozenset()

    @property
    def needs_trees(self) -> bool:
        return self.kind in ("upos", "deprel")

    @property
    def spec(self) -> str:
        return f"{self.name}={self.kind}:{self.value}"

    def __repr__(self) -> str:  # the same in every process (a frozenset's order is not): run fingerprints and manifests use it
        listed = f", {len(self.words)} words {hashlib.sha256(repr(sorted(self.words)).encode()).hexdigest()[:12]}" if self.words else ""
        return f"TokenClass({self.spec!r}{listed})"

    def members(self, texts: list[str], upos: tuple[str, ...] | None, relations: tuple[str, ...] | None) -> np.ndarray:
        """Which of the words (``texts``; ``upos``/``relations`` cover the first words, sentence A's) are in the class."""
        if self.kind == "words":
            return np.array([text.casefold() in self.words for text in texts], dtype=bool)
        if self.kind == "regex":
            pattern = _compiled(self.value)
            return np.array([pattern.fullmatch(text) is not None for text in texts], dtype=bool)
        tags = upos if self.kind == "upos" else relations
        found = np.zeros(len(texts), dtype=bool)
        if tags is not None:
            found[:len(tags)] = [tag == self.value or (self.kind == "deprel" and tag.partition(":")[0] == self.value) for tag in tags]
        return found


def word_texts(example: Example) -> list[str]:
    """The text of every word the alignment numbers: sentence A's (gold words where given), then sentence B's."""
    texts = list(example.words) if example.words is not None else [example.text[a:b] for a, b in default_word_spans(example.text)]
    if example.text_pair is not None:
        texts += [example.text_pair[a:b] for a, b in default_word_spans(example.text_pair)]
    return texts


def class_units(example: Example, alignment: WordAlignment, classes: tuple[TokenClass, ...]) -> tuple[np.ndarray, int]:
    """``(members[unit, class], words)``: which units hold a word of each class, and how many words are aligned."""
    texts = word_texts(example)
    units = alignment.word_unit[:len(texts)]
    aligned = units >= 0
    members = np.zeros((alignment.num_units, len(classes)))
    for k, token_class in enumerate(classes):
        chosen = token_class.members(texts, example.upos, example.relations) & aligned
        members[units[chosen], k] = 1.0
    return members, int(aligned.sum())


class ClassAttention(LayerwiseAnalyzer):
    """Per head and class: attention to the class's words from every query and from one position's row ([CLS]'s, a
    decoder's last unit's), against the class's share of words, on a ``kind`` of model (see the module docstring)."""

    name = "classes"

    def __init__(self, kind: Kind, classes: tuple[TokenClass, ...]):
        self.kind = kind
        self.classes = tuple(classes)
        self._attention: RunningMoments | None = None  # [layer, head, class, row]
        self._uniform: RunningMoments | None = None  # [layer, 1 or head, class, row]: the uniform head's
        self._excess: RunningMoments | None = None  # [layer, head, class, row]: each head's minus the uniform head's, per sequence
        self._baseline = RunningMoments((len(self.classes),))
        self._kept: list[tuple] = []  # the batch's sequences with a class: (sequence, members, present, baseline, row unit)
        self._pending: list[torch.Tensor] = []  # one [sequence, head, class, row] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        start = self.kind.first_query  # the first unit that is a query (a decoder's unit 0 sees only itself)
        if maps.layer == 0:
            check_kind(self, batch)
            self._pending, self._kept = [], []
            anchor = batch.anchors[self.kind.anchors[0]].cpu().numpy() if self.kind.sees_later_keys else None
            for b, example in enumerate(batch.examples):
                alignment = batch.alignments[b]
                members, words = class_units(example, alignment, self.classes)
                present = members.sum(axis=0)
                if words == 0 or not present.any():
                    continue
                if self.kind.sees_later_keys:  # every query sees every word: the baseline is the class's share of them, the row [CLS]'s
                    anchor_pieces = np.flatnonzero(anchor[b])
                    row_unit = int(alignment.unit_of_piece[int(anchor_pieces[0])]) if len(anchor_pieces) else None
                    self._kept.append((b, members, present, present / words, row_unit))
                    continue
                # each query's own baseline over the words it sees, their mean; the last unit's row
                seen_members, seen_words = members.cumsum(axis=0)[start:], alignment.unit_is_word.cumsum()[start:, None]
                with np.errstate(invalid="ignore", divide="ignore"):
                    shares = np.where(seen_words > 0, seen_members / seen_words, np.nan)
                baseline = np.nanmean(shares, axis=0) if (seen_words > 0).any() else np.full(len(self.classes), np.nan)
                self._kept.append((b, members, present, baseline, alignment.num_units - 1))
        values = []  # per kept sequence: [head + uniform heads, class, row] at this layer, the uniform heads last
        for b, members, _, _, row_unit in self._kept:
            word_maps = maps.word_attention(batch, b)  # [head, u, u]
            n = int(batch.host_lengths[b])  # the uniform head's word-level map (1 / |S_i| over the keys each row saw) last
            uniform = to_word_level(maps.uniform(batch)[b, :, :n, :n], batch.alignments[b]).to(word_maps.dtype)
            word_maps = torch.cat([word_maps, uniform])
            indicator = torch.as_tensor(members, dtype=word_maps.dtype, device=word_maps.device)
            to_class = word_maps @ indicator  # [head, u, class]: each query's attention to the class
            every = to_class[:, start:].mean(dim=-2)
            row = to_class[:, row_unit] if row_unit is not None else torch.full_like(every, torch.nan)
            values.append(torch.stack([every, row], dim=-1))
        if values:
            self._pending.append(torch.stack(values))

    def finish_batch(self, batch: Batch) -> None:
        if not self._kept:
            return
        # [sequence, layer, head + uniform heads, class, row], one copy: the uniform head's after the heads' (one, or one per
        # head under a view that reads each head's own vectors, LayerMaps.uniform)
        values = stack_layers(self._pending, batch, dim=1).double().cpu().numpy()
        self._pending = []
        for value, (_, _, present, _, _) in zip(values, self._kept):
            value[:, :, present == 0] = np.nan  # a sequence without the class says nothing of it
        values, uniform = values[:, :, : batch.num_heads], values[:, :, batch.num_heads :]
        if self._attention is None:
            self._attention = RunningMoments(values.shape[1:])
            self._uniform = RunningMoments(uniform.shape[1:])
            self._excess = RunningMoments(values.shape[1:])
        self._attention.push(values)
        self._uniform.push(uniform)
        self._excess.push(values - uniform)
        # an encoder's baseline: the class's share of the words; a decoder's: the mean over its rows of the share each row sees
        self._baseline.push(np.stack([np.where(present > 0, baseline, np.nan) for _, _, present, baseline, _ in self._kept]))
        self._kept = []

    def merge(self, other: "ClassAttention") -> "ClassAttention":
        check_same_kind(self, other)
        self._attention = merge_moments(self._attention, other._attention)
        self._uniform = merge_moments(self._uniform, other._uniform)
        self._excess = merge_moments(self._excess, other._excess)
        self._baseline.merge(other._baseline)
        return self

    def result(self) -> pd.DataFrame:
        """``layer, head, class, row, value, ci_low, ci_high, n, baseline, ratio, uniform, excess, excess_ci_low,
        excess_ci_high`` (``row``: :func:`class_rows`, ``all`` or ``cls_row``, a decoder's ``last_row``): ``uniform`` the
        uniform head's value on the same rows of the same sequences, ``excess`` the mean of the head's value minus it, with
        its 95% interval."""
        columns = ["layer", "head", "class", "row", "value", "ci_low", "ci_high", "n", "baseline", "ratio", "uniform", "excess",
                   "excess_ci_low", "excess_ci_high"]
        if self._attention is None:
            return pd.DataFrame(columns=columns)
        layers, heads = self._attention.count.shape[:2]
        names = [token_class.name for token_class in self.classes]
        index = pd.MultiIndex.from_product([range(layers), range(heads), names, class_rows(self.kind)], names=["layer", "head", "class", "row"])
        table = interval_frame(self._attention, index)
        baseline = dict(zip(names, self._baseline.means()))
        table["baseline"] = table["class"].map(baseline).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            table["ratio"] = table["value"] / table["baseline"]
        table["uniform"] = np.broadcast_to(self._uniform.means(), self._attention.count.shape).ravel()
        excess = interval_frame(self._excess, index)
        table["excess"], table["excess_ci_low"], table["excess_ci_high"] = excess.value, excess.ci_low, excess.ci_high
        return table[columns]

    def occurrences(self) -> dict[str, int]:
        """Sequences in which each class occurred."""
        return {token_class.name: int(count) for token_class, count in zip(self.classes, self._baseline.count)}
