"""Wordpiece-to-word alignment through the tokenizer's offset mapping, and word-level attention.

METHODS.md section 2 (Clark et al. 2019): attention TO a split word is the SUM over its pieces
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

    ``unit_of_piece[p]`` is the unit of piece ``p``; units are numbered in order of first appearance.
    ``word_unit[w]`` is the unit of word ``w`` (words of sentence A, then of sentence B), or -1 if
    no piece falls in it. ``unit_is_word[u]`` is False for special-token (and unaligned) units.
    """

    unit_of_piece: np.ndarray
    word_unit: np.ndarray
    unit_is_word: np.ndarray

    @property
    def num_units(self) -> int:
        return len(self.unit_is_word)

    def assignment(self) -> np.ndarray:
        """One-hot matrix ``P[u, p] = 1`` if piece ``p`` belongs to unit ``u``."""
        matrix = np.zeros((self.num_units, len(self.unit_of_piece)))
        matrix[self.unit_of_piece, np.arange(len(self.unit_of_piece))] = 1.0
        return matrix


def align(
    offsets: list[tuple[int, int]],
    sequence_ids: list[int | None],
    word_spans: list[list[tuple[int, int]]],
) -> WordAlignment:
    """Align the pieces of one encoded sequence to words.

    ``offsets`` and ``sequence_ids`` are the tokenizer's ``offset_mapping`` and ``sequence_ids()``
    (``None`` marks special tokens); ``word_spans[s]`` are the character spans of the words of
    segment ``s`` (one list for a single sentence, two for a pair). A piece belongs to the word
    that holds its last character, so byte-level BPE pieces whose offsets include the leading
    space ("Ġword") align too; an empty piece goes with the character after it.
    """
    starts = [[begin for begin, _ in spans] for spans in word_spans]
    first_word = np.cumsum([0] + [len(spans) for spans in word_spans])
    word_unit = np.full(first_word[-1], -1, dtype=np.int64)
    unit_of_piece = np.empty(len(offsets), dtype=np.int64)
    unit_is_word: list[bool] = []
    for piece, ((begin, end), segment) in enumerate(zip(offsets, sequence_ids)):
        word = -1
        if segment is not None:
            # The piece's last character; an empty piece (a lone "Ġ") goes with the character after it.
            char = end - 1 if end > begin else begin
            spans = word_spans[segment]
            k = bisect.bisect_right(starts[segment], char) - 1
            if k >= 0 and spans[k][0] <= char < spans[k][1]:
                word = first_word[segment] + k
        if word < 0:  # a special token, or a piece outside every word: a unit of its own
            unit_of_piece[piece] = len(unit_is_word)
            unit_is_word.append(False)
            continue
        if word_unit[word] < 0:
            word_unit[word] = len(unit_is_word)
            unit_is_word.append(True)
        unit_of_piece[piece] = word_unit[word]
    return WordAlignment(unit_of_piece, word_unit, np.array(unit_is_word, dtype=bool))


def to_word_level(attention: np.ndarray | torch.Tensor, alignment: WordAlignment) -> np.ndarray | torch.Tensor:
    """Merge a piece-level attention map ``[..., n, n]`` into a unit-level one ``[..., u, u]``.

    ``W = (P / |pieces|) A P^T``: rows are averaged over a unit's pieces, columns summed, so rows
    still sum to 1 (METHODS.md section 2).
    """
    assignment = alignment.assignment()
    row_mean = assignment / assignment.sum(axis=1, keepdims=True)
    if isinstance(attention, torch.Tensor):
        sums = torch.as_tensor(assignment, dtype=attention.dtype, device=attention.device)
        means = torch.as_tensor(row_mean, dtype=attention.dtype, device=attention.device)
        return means @ attention @ sums.T
    return row_mean @ attention @ assignment.T
