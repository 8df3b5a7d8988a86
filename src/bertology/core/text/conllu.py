"""CoNLL-U sentences with their gold trees (Universal Dependencies), read line by line and checked to be trees."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from conllu.exceptions import ParseException
from conllu.parser import DEFAULT_FIELDS, parse_line

from bertology.core.errors import CorpusError
from bertology.core.text.examples import Example, numbered_lines


def read_conllu(path: Path) -> Iterator[Example]:
    """CoNLL-U with gold trees: words, heads and relations.

    Multiword-token lines (``3-4``) give the surface text but no tree node; empty nodes (``5.1``)
    are skipped. ``SpaceAfter=No`` is respected when rebuilding the sentence text, so the
    tokenizer sees the sentence as written. Each sentence must be one tree, as UD requires
    (exactly one root, no cycle: :func:`_check_tree`).
    """
    block: list[tuple[int, str]] = []
    for number, line in numbered_lines(path):
        if line.strip():
            block.append((number, line))
            continue
        if block:
            yield _conllu_sentence(path, block)
            block = []
    if block:
        yield _conllu_sentence(path, block)


def _conllu_token(path: Path, number: int, line: str) -> dict:
    """One CoNLL-U line's token (conllu's fields), refused in one line naming ``path:number`` where it is malformed."""
    columns = line.split("\t")
    if len(columns) != 10:
        raise CorpusError(path, number, f"expected 10 tab-separated CoNLL-U columns, found {len(columns)}")
    try:
        token = parse_line(line, DEFAULT_FIELDS)
    except ParseException as exc:
        raise CorpusError(path, number, f"malformed CoNLL-U line: {exc}") from exc
    if not token["form"]:
        raise CorpusError(path, number, "empty FORM column (CoNLL-U writes _ for a missing value)")
    return token


class _SentenceBuilder:
    """A CoNLL-U sentence's words and text as its lines come: each word's span in the text, where a multiword token's
    surface form stands once for its words (``_split_surface``)."""

    def __init__(self, path: Path):
        self.path, self.text = path, ""
        self.words: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self.heads: list[int] = []
        self.relations: list[str] = []
        self.upos: list[str] = []
        self.word_lines: list[int] = []
        # An open multiword token: (first id, last id, surface form, space after, line), and its words so far.
        self.multiword: tuple[int, int, str, bool, int] | None = None
        self.multiword_words: list[str] = []

    def append_surface(self, form: str, space_after: bool) -> int:
        begin = len(self.text)
        self.text += form + (" " if space_after else "")
        return begin

    def open_multiword(self, token: dict, space_after: bool, number: int) -> None:
        if self.multiword is not None:
            self.close_multiword()
        first, _, last = token["id"]
        self.multiword = (first, last, token["form"], space_after, number)

    def close_multiword(self) -> None:
        first, last, form, space_after, line_number = self.multiword
        if len(self.multiword_words) != last - first + 1:
            raise CorpusError(self.path, line_number, f"multiword token {first}-{last} is not followed by its {last - first + 1} words")
        self.spans.extend(_split_surface(form, self.multiword_words, self.append_surface(form, space_after)))
        self.multiword_words.clear()
        self.multiword = None

    def add_word(self, token: dict, space_after: bool, number: int) -> None:
        if token["id"] != len(self.words) + 1:
            raise CorpusError(self.path, number, f"word id {token['id']} out of order (expected {len(self.words) + 1})")
        if not isinstance(token["head"], int):
            raise CorpusError(self.path, number, f"HEAD must be a word id, found {token['head']!r}")
        self.words.append(token["form"])
        self.heads.append(token["head"])
        self.relations.append(token["deprel"] or "_")
        self.upos.append(token["upos"] or "_")
        self.word_lines.append(number)
        if self.multiword is None:
            begin = self.append_surface(token["form"], space_after)
            self.spans.append((begin, begin + len(token["form"])))
            return
        self.multiword_words.append(token["form"])
        if token["id"] == self.multiword[1]:
            self.close_multiword()


def _conllu_sentence(path: Path, block: list[tuple[int, str]]) -> Example:
    """One sentence of a CoNLL-U file (its lines, numbered) as an :class:`Example` with its basic tree, checked to be one tree."""
    sentence = _SentenceBuilder(path)
    for number, line in block:
        if line.startswith("#"):
            continue
        token = _conllu_token(path, number, line)
        space_after = not (token["misc"] and token["misc"].get("SpaceAfter") == "No")
        if isinstance(token["id"], tuple):
            if token["id"][1] != ".":  # an empty node (enhanced dependencies) is no word of the basic tree
                sentence.open_multiword(token, space_after, number)
            continue
        sentence.add_word(token, space_after, number)
    if sentence.multiword is not None:
        sentence.close_multiword()
    if not sentence.words:
        raise CorpusError(path, block[0][0], "sentence has no words")
    _check_tree(path, sentence.heads, sentence.word_lines)
    return Example(text=sentence.text.rstrip(), source=f"{path.name}:{block[0][0]}", words=tuple(sentence.words), word_spans=tuple(sentence.spans),
                   heads=tuple(sentence.heads), relations=tuple(sentence.relations), upos=tuple(sentence.upos))


def _check_tree(path: Path, heads: list[int], lines: list[int]) -> None:
    """Refuse heads (1-based, 0 = root) that are not one tree, naming the line of the offending word.

    As in UD, a sentence has exactly one root (a second root is an error) and every word reaches it.
    """
    count = len(heads)
    root = None
    for word, (head, line) in enumerate(zip(heads, lines), start=1):
        if not 0 <= head <= count:
            raise CorpusError(path, line, f"word {word} has head {head}, but the sentence has {count} words (heads are 0 to {count})")
        if head == word:
            raise CorpusError(path, line, f"word {word} is its own head")
        if head == 0 and root is not None:
            raise CorpusError(path, line, f"word {word} is a second root (word {root} has head 0 too); UD allows one root per sentence")
        if head == 0:
            root = word
    rooted = {0}
    for start in range(1, count + 1):
        walk: list[int] = []  # from start up its heads, until a word known to reach the root or a repeat
        node = start
        while node not in rooted and node not in walk:
            walk.append(node)
            node = heads[node - 1]
        if node in rooted:
            rooted.update(walk)
            continue
        cycle = walk[walk.index(node):]
        first = cycle.index(min(cycle))
        cycle = cycle[first:] + cycle[:first + 1]
        words = " -> ".join(map(str, cycle))
        message = f"words {words} form a cycle that never reaches the root" if root else f"no word has head 0 (no root): words {words} form a cycle"
        raise CorpusError(path, lines[cycle[0] - 1], message)


def _split_surface(form: str, words: list[str], begin: int) -> list[tuple[int, int]]:
    """Spans of a multiword token's words: exact where their forms concatenate to the surface
    form (``don't`` = ``do`` + ``n't``), else the surface cut in proportion to the words' lengths."""
    if "".join(words).lower() == form.lower():
        lengths = [len(word) for word in words]
    else:
        total = sum(len(word) for word in words)
        lengths = [max(1, round(len(form) * len(word) / total)) for word in words]
    cuts = [0]
    for length in lengths:
        cuts.append(min(len(form), cuts[-1] + length))
    cuts[-1] = len(form)
    return [(begin + a, begin + b) for a, b in zip(cuts, cuts[1:])]
