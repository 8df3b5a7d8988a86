"""Corpus readers: plain text, sentence pairs, GLUE TSVs, CoNLL-U, frame-annotated JSON lines, and the bundled sample corpus.

Every reader is a generator of :class:`Example` and reports bad input as a
:class:`~bertology.core.errors.CorpusError` that names the file and line. Files are read line by line,
so a corpus of any size streams in constant memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from bertology.core.errors import CorpusError, StateError
from bertology.core.storage.safeload import parse_json
from bertology.core.text.conllu import read_conllu
from bertology.core.text.examples import Example, FrameAnnotation, numbered_lines

FORMATS = ("auto", "text", "pairs", "glue", "conllu", "frames", "labels")


def read_text(path: Path) -> Iterator[Example]:
    """Plain text: one sequence per line; blank lines are skipped."""
    for number, line in numbered_lines(path):
        if line.strip():
            yield Example(text=line.strip(), source=f"{path.name}:{number}")


def read_pairs(path: Path) -> Iterator[Example]:
    """Sentence pairs: ``text_a<TAB>text_b`` per line (an optional third column is a label)."""
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        columns = line.split("\t")
        if len(columns) < 2:
            raise CorpusError(path, number, f"expected 2 tab-separated columns (sentence A, sentence B), found {len(columns)}")
        text_a, text_b = columns[0].strip(), columns[1].strip()
        if not text_a or not text_b:
            raise CorpusError(path, number, "empty sentence in a pair")
        label = columns[2].strip() if len(columns) > 2 else None
        yield Example(text=text_a, text_pair=text_b, label=label, source=f"{path.name}:{number}")


@dataclass(frozen=True)
class TableLayout:
    """Which columns of a TSV hold the text, the optional second text and the label."""

    text: str | int
    text_pair: str | int | None = None
    label: str | int | None = None
    header: bool = True


# GLUE layouts, by header (see ../shared/data/README.md). CoLA has no header.
GLUE_LAYOUTS = {
    ("sentence", "label"): TableLayout("sentence", label="label"),  # SST-2
    ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"): TableLayout("#1 String", "#2 String", "Quality"),  # MRPC
    ("index", "sentence1", "sentence2", "label"): TableLayout("sentence1", "sentence2", "label"),  # RTE, WNLI
    ("index", "question", "sentence", "label"): TableLayout("question", "sentence", "label"),  # QNLI
    ("id", "qid1", "qid2", "question1", "question2", "is_duplicate"): TableLayout("question1", "question2", "is_duplicate"),
}
COLA_LAYOUT = TableLayout(text=3, label=1, header=False)
KNOWN_GLUE = "SST-2, MRPC, RTE, QNLI, QQP, or CoLA without header"
# Column names that hold text in some GLUE header: a first line naming one is a header, not data.
GLUE_TEXT_COLUMNS = frozenset(c for layout in GLUE_LAYOUTS.values() for c in (layout.text, layout.text_pair) if c is not None)


def read_table(path: Path, layout: TableLayout) -> Iterator[Example]:
    """A TSV without quoting (as GLUE ships it), columns chosen by name (with a header) or by index."""
    lines = numbered_lines(path)
    names: list[str] | None = None
    if layout.header:
        first = next(lines, None)
        if first is None:
            return
        names = [name.strip() for name in first[1].split("\t")]
    wanted = [c for c in (layout.text, layout.text_pair, layout.label) if c is not None]
    index: dict[str | int, int] = {}
    for column in wanted:
        if isinstance(column, int):
            index[column] = column
        elif names is None or column not in names:
            raise CorpusError(path, 1, f"missing column {column!r} in the header (found: {', '.join(names or [])})")
        else:
            index[column] = names.index(column)
    needed = max(index.values()) + 1
    for number, line in lines:
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) < needed:
            raise CorpusError(path, number, f"expected at least {needed} tab-separated columns, found {len(cells)}")

        def cell(column):
            return None if column is None else cells[index[column]].strip()

        text = cell(layout.text)
        if not text:
            raise CorpusError(path, number, "empty text")
        yield Example(text=text, text_pair=cell(layout.text_pair), label=cell(layout.label), source=f"{path.name}:{number}")


def first_cells(path: Path) -> tuple[str, ...]:
    """The tab-separated cells of a file's first line."""
    first = next(numbered_lines(path), None)
    if first is None:
        raise CorpusError(path, None, "the file is empty")
    return tuple(c.strip() for c in first[1].split("\t"))


def _glue_layout(cells: tuple[str, ...]) -> TableLayout | None:
    """The GLUE layout a first line belongs to (a known header, or CoLA's header-less four columns)."""
    if cells in GLUE_LAYOUTS:
        return GLUE_LAYOUTS[cells]
    return COLA_LAYOUT if len(cells) == 4 and cells[1] in {"0", "1"} else None


def _is_glue_style_header(cells: tuple[str, ...]) -> bool:
    return len(cells) >= 2 and not GLUE_TEXT_COLUMNS.isdisjoint(cells)


def glue_layout(path: Path) -> TableLayout:
    """Recognise a GLUE TSV by its header (or CoLA's header-less four columns)."""
    layout = _glue_layout(first_cells(path))
    if layout is None:
        raise CorpusError(path, 1, f"not a GLUE TSV header this reader knows ({KNOWN_GLUE})")
    return layout


def check_header(path: Path, format: str) -> None:
    """Refuse a GLUE-style header in a file read as ``text`` or ``pairs`` (it would be read as data)."""
    cells = first_cells(path)
    if cells in GLUE_LAYOUTS:
        raise CorpusError(path, 1, f"a GLUE header ({', '.join(cells)}), not {format}: use --format glue (or auto)")
    if _is_glue_style_header(cells):
        raise CorpusError(path, 1, f"a GLUE-style header this reader does not know ({', '.join(cells)}); known: {KNOWN_GLUE}")


FRAME_KEYS = ("text", "frame", "target", "elements")


def json_records(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for every non-blank line of a JSON-lines file; a line that is no JSON object (or nests too
    deep, or holds NaN: :func:`~bertology.core.storage.safeload.parse_json`) names itself."""
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        try:
            record = parse_json(line, path)
        except StateError as exc:
            raise CorpusError(path, number, exc.message) from None
        if not isinstance(record, dict):
            raise CorpusError(path, number, "expected a JSON object")
        yield number, record


def prepare_jsonl_append(path: Path) -> None:
    """Make ``path`` safe to append JSON lines to: every line it has (the last one too) must be a JSON object, else a
    :class:`CorpusError` names it; a last line without its line end gets one (fsynced), so the next record starts a line."""
    if not path.exists():
        return
    for _ in json_records(path):
        pass
    try:
        with path.open("rb") as handle:
            handle.seek(max(handle.seek(0, os.SEEK_END) - 1, 0))
            last = handle.read(1)
        if last not in (b"", b"\n", b"\r"):
            with path.open("ab") as handle:
                handle.write(b"\n")
                handle.flush()
                os.fsync(handle.fileno())
    except OSError as exc:
        raise CorpusError(path, None, f"cannot append to the file ({exc.strerror})") from exc


def _frame_span(path: Path, number: int, text: str, what: str, value) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise CorpusError(path, number, f"{what} must be [start, end], two character offsets, not {json.dumps(value)}")
    start, end = value
    if not 0 <= start < end <= len(text):
        raise CorpusError(path, number, f"{what} [{start}, {end}] lies outside the text's {len(text)} characters (or is empty)")
    return start, end


def read_frames(path: Path) -> Iterator[Example]:
    """Frame-annotated sentences, one JSON object a line (Kovaleva et al. 2019, section 4.3):
    ``{"text": ..., "frame": ..., "target": [start, end], "elements": {"Agent": [start, end], ...}}``, with
    character offsets into ``text`` (end exclusive). An element may not overlap the target. Blank lines are skipped."""
    for number, record in json_records(path):
        missing = [key for key in FRAME_KEYS if key not in record]
        if missing:
            raise CorpusError(path, number, f"missing key(s) {', '.join(missing)}: each line needs {', '.join(FRAME_KEYS)}")
        text, frame, elements = record["text"], record["frame"], record["elements"]
        if not isinstance(text, str) or not text.strip():
            raise CorpusError(path, number, "text must be a non-empty string")
        if not isinstance(frame, str) or not frame:
            raise CorpusError(path, number, "frame must be a non-empty string")
        target = _frame_span(path, number, text, "target", record["target"])
        if not isinstance(elements, dict) or not elements:
            raise CorpusError(path, number, "elements must be an object of at least one core element: {\"Name\": [start, end]}")
        spans = []
        for name, value in elements.items():
            start, end = _frame_span(path, number, text, f"element {name!r}", value)
            if start < target[1] and target[0] < end:
                raise CorpusError(path, number, f"element {name!r} [{start}, {end}] overlaps the target [{target[0]}, {target[1]}]")
            spans.append((name, (start, end)))
        yield Example(text=text, source=f"{path.name}:{number}", frames=(FrameAnnotation(frame, target, tuple(spans)),))


#: The classes a map can be labelled with (Kovaleva et al. 2019), as :mod:`bertology.families.patterns` names them.
PATTERN_LABELS = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")


def read_labels(path: Path) -> Iterator[Example]:
    """Hand labels of attention maps, one JSON object a line: ``{"text": ..., "text_pair": optional, "layer": L, "head": H,
    "label": one of PATTERN_LABELS}`` (layers and heads from 0). Blank lines are skipped."""
    for number, record in json_records(path):
        yield label_example(path, number, record)


def label_example(path: Path, number: int, record: dict) -> Example:
    """One line of a labels file as an :class:`Example` with its ``pattern_label``; a bad line is a one-line error naming it."""
    missing = [key for key in ("text", "layer", "head", "label") if key not in record]
    if missing:
        raise CorpusError(path, number, f"missing key(s) {', '.join(missing)}: each line needs text, layer, head and label")
    text, pair = record["text"], record.get("text_pair")
    if not isinstance(text, str) or not text.strip() or not (pair is None or isinstance(pair, str) and pair.strip()):
        raise CorpusError(path, number, "text (and text_pair, where given) must be non-empty strings")
    for key in ("layer", "head"):
        if not isinstance(record[key], int) or isinstance(record[key], bool) or record[key] < 0:
            raise CorpusError(path, number, f"{key} must be a whole number from 0, not {json.dumps(record[key])}")
    if record["label"] not in PATTERN_LABELS:
        raise CorpusError(path, number, f"label {json.dumps(record['label'])} is not one of {', '.join(PATTERN_LABELS)}")
    return Example(text=text, text_pair=pair, source=f"{path.name}:{number}", pattern_label=(record["layer"], record["head"], record["label"]))


def _jsonl_format(path: Path) -> str:
    """``frames`` or ``labels``, by the keys of the first JSON line (frames name a frame; labels a layer and a label)."""
    for number, record in json_records(path):
        if "frame" in record:
            return "frames"
        if "label" in record and "layer" in record:
            return "labels"
        raise CorpusError(path, number, "a .jsonl corpus holds frames (text, frame, target, elements) or map labels (text, layer, head, label)")
    return "frames"


def sample_files() -> tuple[Path, Path]:
    """The bundled sample corpus: single sentences and sentence pairs, written for bertology."""
    data = resources.files("bertology") / "data"
    return Path(str(data / "sample_sentences.txt")), Path(str(data / "sample_pairs.tsv"))


def detect_format(path: Path) -> str:
    """Guess a corpus format from the file's extension and first line."""
    if path.suffix.lower() in {".conllu", ".conll"}:
        return "conllu"
    if path.suffix.lower() == ".jsonl":
        return _jsonl_format(path)
    cells = first_cells(path)
    if _glue_layout(cells) is not None:
        return "glue"
    check_header(path, "pairs")  # a GLUE-style header this reader does not know must not become a pair
    return "pairs" if len(cells) >= 2 else "text"


@dataclass
class Corpus:
    """A re-iterable corpus: a file in one of :data:`FORMATS`, or the bundled sample (``path=None``)."""

    path: Path | None = None
    format: str = "auto"
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise CorpusError(self.path or "sample", None, f"unknown format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.path is not None:
            self.path = Path(self.path)
            if self.path.is_dir():
                raise CorpusError(self.path, None, "is a folder, not a corpus file")
            if not self.path.is_file():
                raise CorpusError(self.path, None, "no such file")
            if self.format == "auto":
                self.format = detect_format(self.path)
            elif self.format in ("text", "pairs"):
                check_header(self.path, self.format)
        elif self.format == "auto":
            self.format = "sample"

    @property
    def name(self) -> str:
        return "sample" if self.path is None else self.path.name

    def _examples(self) -> Iterator[Example]:
        if self.path is None:
            sentences, pairs = sample_files()
            yield from read_text(sentences)
            yield from read_pairs(pairs)
        elif self.format == "text":
            yield from read_text(self.path)
        elif self.format == "pairs":
            yield from read_pairs(self.path)
        elif self.format == "glue":
            yield from read_table(self.path, glue_layout(self.path))
        elif self.format == "frames":
            yield from read_frames(self.path)
        elif self.format == "labels":
            yield from read_labels(self.path)
        else:
            yield from read_conllu(self.path)

    def __iter__(self) -> Iterator[Example]:
        for count, example in enumerate(self._examples()):
            if self.limit is not None and count >= self.limit:
                return
            yield example

    def validate(self) -> int:
        """Read the whole corpus once (before any model runs) and return its number of examples.

        Raises :class:`CorpusError` at the first bad line, or if there is no example at all.
        """
        count = sum(1 for _ in self)
        if count == 0:
            raise CorpusError(self.path or "sample", None, "no examples in the corpus (empty file or only blank lines)")
        return count

    def sha256(self) -> str:
        """Hash of the corpus file(s), for the run manifest."""
        digest = hashlib.sha256()
        for path in sample_files() if self.path is None else (self.path,):
            with path.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
        return digest.hexdigest()


def open_corpus(corpus, format: str = "auto", limit: int | None = None) -> tuple["Corpus | list[Example]", dict]:
    """Resolve what a user passed as a corpus, and describe it for the manifest.

    ``None`` is the bundled sample; a path is a :class:`Corpus` (``format`` auto-detected); a
    :class:`Corpus` is used as it is; any other iterable of strings or :class:`Example` is kept
    in memory (first ``limit`` items).
    """
    if isinstance(corpus, Corpus):
        return corpus, {"name": corpus.name, "path": str(corpus.path) if corpus.path else None, "format": corpus.format, "sha256": corpus.sha256()}
    if corpus is None or isinstance(corpus, (str, Path)):
        return open_corpus(Corpus(None if corpus is None else Path(corpus), format=format, limit=limit))
    examples = [item if isinstance(item, Example) else Example(str(item)) for item in corpus]
    examples = examples[:limit] if limit is not None else examples
    return examples, {"name": "in-memory", "path": None, "format": "examples", "sha256": None}


def has_trees(examples: Corpus | list[Example]) -> bool:
    """Whether a corpus comes with dependency trees (CoNLL-U, or examples that carry them)."""
    if isinstance(examples, Corpus):
        return examples.format == "conllu"
    return any(example.has_tree for example in examples)


def has_frames(examples: Corpus | list[Example]) -> bool:
    if isinstance(examples, Corpus):
        return examples.format == "frames"
    return any(example.frames for example in examples)

