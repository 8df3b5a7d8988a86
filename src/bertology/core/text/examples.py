"""What every corpus reader yields: an :class:`Example` (a sequence or sentence pair, with its tree, frames or labels where
the corpus has them), and the numbered lines of a UTF-8 file that every reader reads."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from bertology.core.errors import CorpusError


@dataclass(frozen=True)
class FrameAnnotation:
    """One annotated frame of a sentence (FrameNet style): the ``frame``'s name, the character span
    ``target`` = (start, end) of the word(s) that evoke it, and its core ``elements`` as (name, (start, end))."""

    frame: str
    target: tuple[int, int]
    elements: tuple[tuple[str, tuple[int, int]], ...]


@dataclass(frozen=True)
class Example:
    """One input sequence (or sentence pair), with its dependency tree where the corpus has one.

    ``words``/``word_spans`` give the syntactic words and their character spans in ``text``;
    ``heads`` are 1-based CoNLL-U heads (0 = root), ``relations`` the dependency relations and
    ``upos`` the universal part-of-speech tags. ``frames``: the sentence's annotated frames (the ``frames`` format);
    ``pattern_label``: ``(layer, head, pattern)``, a hand label of one head's map of this input (the ``labels`` format).
    ``second_copy``: in Olsson et al.'s probe (:func:`~bertology.core.text.synthetic.synthetic_repeats`), the position among the sequence's non-special
    pieces where its second copy begins; the induction score then reads that copy's rows alone (the prefix-matching score).
    ``period``: in a probe whose segment repeats at a random period (:func:`~bertology.core.text.synthetic.induction_probe`),
    that sequence's period: a head that copies by position scores at one period alone.
    """

    text: str
    text_pair: str | None = None
    label: str | None = None
    source: str = ""
    words: tuple[str, ...] | None = None
    word_spans: tuple[tuple[int, int], ...] | None = None
    heads: tuple[int, ...] | None = None
    relations: tuple[str, ...] | None = None
    upos: tuple[str, ...] | None = None
    frames: tuple[FrameAnnotation, ...] | None = None
    pattern_label: tuple[int, int, str] | None = None
    second_copy: int | None = None
    period: int | None = None

    @property
    def has_tree(self) -> bool:
        return self.heads is not None

    @property
    def line(self) -> int | None:
        """The example's line in its file (``source`` is ``NAME:LINE``); None when ``source`` names no line."""
        line = self.source.rpartition(":")[2]
        return int(line) if line.isdigit() else None


def _line_bytes(handle: BinaryIO, size: int = 1 << 16) -> Iterator[bytes]:
    """The lines of a binary file without their ends, split at CR LF, CR and LF alike; read ``size`` bytes at a time."""
    partial: list[bytes] = []  # the pieces of a line that no read has ended yet
    after_cr = False
    while chunk := handle.read(size):
        if after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CR LF that fell between two reads
        after_cr = chunk.endswith(b"\r")
        for piece in chunk.splitlines(keepends=True):
            partial.append(piece)
            if piece.endswith((b"\r", b"\n")):
                yield b"".join(partial).rstrip(b"\r\n")
                partial = []
    if partial:
        yield b"".join(partial)


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Numbered lines of a UTF-8 file (BOM and line ends stripped; CR LF, CR and LF all end a line); invalid UTF-8 names its line."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise CorpusError(path, None, f"cannot open file ({exc.strerror})") from exc
    with handle:
        for number, raw in enumerate(_line_bytes(handle), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(path, number, f"invalid UTF-8 at byte {exc.start} of the line") from exc
            yield number, line.removeprefix("\ufeff") if number == 1 else line
