"""Wordpiece-to-word alignment through the tokenizer's offset mapping, and word-level attention.

docs/methods.md#notation-and-word-level-attention (Clark et al. 2019): attention TO a split word is the SUM over its pieces
(columns); attention FROM a split word is the MEAN over its pieces (rows). Special tokens
([CLS], [SEP], <s>, </s>) stay as their own units. Alignment is by character offsets, never by
string matching.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import numpy as np
import torch

# Default words for text that comes without annotation: runs of word characters (keeping inner
# apostrophes, "don't", "dog's") and single punctuation characters.
_WORD_PATTERN = re.compile(r"\w+(?:['\u2019]\w+)*|[^\w\s]")


def default_word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the words of un-annotated text (see ``_WORD_PATTERN``)."""
    return [match.span() for match in _WORD_PATTERN.finditer(text)]


@dataclass(frozen=True)
class WordAlignment:
    """How the pieces of one sequence group into units: words, plus each special token on its own.

    ``assignment[u, p]`` is the share of piece ``p`` that belongs to unit ``u``: 1 for a piece
    inside one word, the character overlap share for a piece that straddles words (BERT's "don" in
    UD's "do" + "n't"); every column sums to 1. ``unit_of_piece[p]`` is the unit with the largest
    share. ``word_unit[w]`` is the unit of word ``w`` (words of sentence A, then of sentence B), or
    -1 if no piece overlaps it (cut by truncation). ``unit_is_word[u]`` is False for special-token
    (and unaligned) units.
    """

    assignment: np.ndarray
    word_unit: np.ndarray
    unit_is_word: np.ndarray

    @property
    def num_units(self) -> int:
        return len(self.unit_is_word)

    @property
    def unit_of_piece(self) -> np.ndarray:
        return self.assignment.argmax(axis=0)


def _overlaps(begin: int, end: int, spans: list[tuple[int, int]], starts: list[int]) -> list[tuple[int, int]]:
    """(word, characters in common) for the words a piece [begin, end) overlaps; an empty piece
    (a lone "Ġ") counts as one character of the word that holds its position."""
    if end <= begin:
        end = begin + 1
    found = []
    k = max(bisect.bisect_right(starts, begin) - 1, 0)
    while k < len(spans) and spans[k][0] < end:
        common = min(end, spans[k][1]) - max(begin, spans[k][0])
        if common > 0:
            found.append((k, common))
        k += 1
    return found


def align(
    offsets: list[tuple[int, int]],
    sequence_ids: list[int | None],
    word_spans: list[list[tuple[int, int]]],
) -> WordAlignment:
    """Align the pieces of one encoded sequence to words by character offsets.

    ``offsets`` and ``sequence_ids`` are the tokenizer's ``offset_mapping`` and ``sequence_ids()``
    (``None`` marks special tokens); ``word_spans[s]`` are the character spans of the words of
    segment ``s`` (one list for a single sentence, two for a pair). Units are numbered in order of
    first appearance; a word reached only through a shared piece gets its unit after the others.
    """
    starts = [[begin for begin, _ in spans] for spans in word_spans]
    first_word = np.cumsum([0] + [len(spans) for spans in word_spans])
    word_unit = np.full(first_word[-1], -1, dtype=np.int64)
    unit_is_word: list[bool] = []
    shares: list[list[tuple[int, float]]] = []  # per piece: (global word or -1 - unit, weight)
    for (begin, end), segment in zip(offsets, sequence_ids):
        found = [] if segment is None else _overlaps(begin, end, word_spans[segment], starts[segment])
        if not found:  # a special token, or a piece outside every word: a unit of its own
            shares.append([(-1 - len(unit_is_word), 1.0)])
            unit_is_word.append(False)
            continue
        total = sum(common for _, common in found)
        main = first_word[segment] + max(found, key=lambda item: item[1])[0]
        if word_unit[main] < 0:
            word_unit[main] = len(unit_is_word)
            unit_is_word.append(True)
        shares.append([(first_word[segment] + k, common / total) for k, common in found])
    for piece_shares in shares:  # words that only share a piece with a neighbour
        for word, _ in piece_shares:
            if word >= 0 and word_unit[word] < 0:
                word_unit[word] = len(unit_is_word)
                unit_is_word.append(True)
    assignment = np.zeros((len(unit_is_word), len(offsets)))
    for piece, piece_shares in enumerate(shares):
        for word, weight in piece_shares:
            assignment[word_unit[word] if word >= 0 else -1 - word, piece] += weight
    return WordAlignment(assignment, word_unit, np.array(unit_is_word, dtype=bool))


def to_word_level(attention: np.ndarray | torch.Tensor, alignment: WordAlignment) -> np.ndarray | torch.Tensor:
    """Merge a piece-level attention map ``[..., n, n]`` into a unit-level one ``[..., u, u]``.

    ``W = (P / P 1) A P^T`` with ``P = alignment.assignment``: rows are averaged over a unit's
    pieces, columns summed, so rows still sum to 1 (docs/methods.md#notation-and-word-level-attention). A piece shared by two
    words counts towards each by its share.
    """
    assignment = alignment.assignment
    row_mean = assignment / assignment.sum(axis=1, keepdims=True)
    if isinstance(attention, torch.Tensor):
        sums = torch.as_tensor(assignment, dtype=attention.dtype, device=attention.device)
        means = torch.as_tensor(row_mean, dtype=attention.dtype, device=attention.device)
        return means @ attention @ sums.T
    return row_mean @ attention @ assignment.T
