"""Fuzzing with Hypothesis: the corpus readers, the appends to a labels file, and the labelling server's requests.

Whatever the bytes, a reader yields its examples or refuses the file with a one-line :class:`CorpusError` naming it; an
append after :func:`prepare_jsonl_append` keeps every earlier record; the server answers every request with 200 or a
4xx and keeps serving.
"""

import json
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from studies.label.test_labelling import VALID_LABEL, hand_maps, post_label

from bertology.core.errors import CorpusError
from bertology.core.text.corpora import GLUE_LAYOUTS, PATTERN_LABELS, Corpus, json_records, prepare_jsonl_append, read_labels
from bertology.studies.label.labelling import MAX_LABEL_BYTES, LabelServer

# No example database (it would be written into the checkout); a fixture's folder is reused by every example.
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# (format, file suffix): every reader, and the detection of ``auto`` by suffix and first line.
READS = [("text", ".txt"), ("pairs", ".tsv"), ("glue", ".tsv"), ("conllu", ".conllu"), ("frames", ".jsonl"), ("labels", ".jsonl"),
         ("auto", ".txt"), ("auto", ".conllu"), ("auto", ".jsonl")]


def read_fully(path, format: str) -> None:
    """Read every example of ``path`` as ``format``; a refusal must be one line that names the file."""
    try:
        Corpus(path, format=format).validate()
    except CorpusError as error:
        assert "\n" not in str(error) and "\r" not in str(error) and str(error).startswith(str(path)), str(error)
        event(f"{format}: refused")
    else:
        event(f"{format}: read")


def mostly(draw, valid, wrong):
    """A draw from ``valid`` three times in four, else from ``wrong``."""
    return draw(valid if draw(st.integers(0, 3)) else wrong)


# ---- files: line ends, BOMs and stray bytes around lines of any format ----

STRAY_BYTES = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xef\xbb\xbf", b"\x00", b"\r", b"\n", b"\t"]) | st.binary(min_size=1, max_size=3)


@st.composite
def file_of(draw, lines: st.SearchStrategy) -> bytes:
    """``lines`` ended by CR LF, CR or LF at random (the last one maybe not at all), maybe after a BOM, now and then with a
    stray byte or two."""
    text = "".join(line + draw(st.sampled_from(["\n", "\r\n", "\r"])) for line in draw(lines))
    if draw(st.booleans()):
        text = text.removesuffix("\n").removesuffix("\r")
    data = (("\ufeff" if draw(st.booleans()) else "") + text).encode()
    for _ in range(mostly(draw, st.just(0), st.integers(1, 2))):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(STRAY_BYTES) + data[at:]
    return data


SENTENCES = st.sampled_from(["the cat sat .", "a dog", "don't", "Yes !", "0", "1"])
WORDS = st.sampled_from(["the", "cat", ".", "don't", "", " ", "_"]) | st.text(max_size=8)


@st.composite
def cells(draw, width: int) -> str:
    """``width`` tab-separated cells of text, now and then another number of cells of anything."""
    return "\t".join(mostly(draw, st.lists(SENTENCES, min_size=width, max_size=width), st.lists(WORDS, max_size=width + 2)))


@st.composite
def glue_lines(draw) -> list[str]:
    """Rows under one of the GLUE headers, or CoLA's rows without one (the label in the second of four columns)."""
    header = draw(st.sampled_from([*GLUE_LAYOUTS, None]))
    rows = draw(st.lists(cells(len(header) if header else 4), max_size=5))
    if header is None:
        rows = [row.replace("\t", f"\t{draw(st.sampled_from('01'))}\t", 1) for row in rows]
    return (["\t".join(header)] if header else []) + rows


# ---- JSON lines: records near the valid ones, with wrong keys and types, huge numbers, NaN, deep nesting ----

# Tokens written into a JSON line as they are (``json.dumps`` cannot write them): numbers too long or too large, the
# constants JSON does not have, a lone surrogate, nesting just under and far over the limit.
RAW_TOKENS = ["9" * 5000, "1e400", "-1e400", "NaN", "Infinity", "-Infinity", '"\\ud800"', "[" * 60 + "]" * 60, "[" * 5000 + "]" * 5000,
              '{"a":' * 70 + "1" + "}" * 70]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | WORDS | st.sampled_from(PATTERN_LABELS)
    | st.integers(0, len(RAW_TOKENS) - 1).map(lambda k: f"@raw:{k}@"),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(WORDS, children, max_size=3),
    max_leaves=8,
)


def with_raw_tokens(text: str) -> str:
    """JSON ``text`` with each ``"@raw:K@"`` string replaced by the token ``RAW_TOKENS[K]`` itself."""
    return re.sub(r'"@raw:(\d+)@"', lambda match: RAW_TOKENS[int(match[1])], text)


@st.composite
def broken(draw, record: dict) -> str:
    """``record`` as one JSON line, its keys dropped, changed or added at random, maybe cut short."""
    for key in draw(st.lists(st.sampled_from(sorted(record)), max_size=2)):
        record.pop(key, None)
    record.update(draw(st.dictionaries(st.sampled_from(sorted(record) or ["text"]) | WORDS, JSON_VALUES, max_size=2)))
    line = with_raw_tokens(json.dumps(record))
    return line[: draw(st.integers(0, len(line)))] if draw(st.integers(0, 9)) == 0 else line


@st.composite
def label_line(draw) -> str:
    record = {"text": draw(SENTENCES), "layer": draw(st.integers(0, 12)), "head": draw(st.integers(0, 12)),
              "label": draw(st.sampled_from(PATTERN_LABELS))}
    if draw(st.booleans()):
        record["text_pair"] = draw(SENTENCES)
    return mostly(draw, st.just(json.dumps(record)), broken(record))


@st.composite
def frame_line(draw) -> str:
    text = draw(st.text(min_size=2, max_size=20).filter(str.strip))
    start = draw(st.integers(1, len(text) - 1))
    end = draw(st.integers(start + 1, len(text)))
    record = {"text": text, "frame": draw(SENTENCES), "target": [start, end], "elements": {draw(WORDS): [0, start]}}
    return mostly(draw, st.just(json.dumps(record)), broken(record))


# ---- CoNLL-U: sentences of ten columns, with multiword tokens, empty nodes, and fields or counts gone wrong ----

FORMS = st.sampled_from(["do", "n't", "don't", "", "_", " ", "a b"]) | WORDS
FIELDS = st.sampled_from(["_", "", "x", "A=B", "A=B|C=D", "a=b=c", "|", "=", "SpaceAfter=No", "1:nsubj", "0:root|2:obj", "x:y", "-1",
                          "1-2", "1.1", "0"]) | FORMS


@st.composite
def conllu_sentence(draw) -> list[str]:
    """The lines of one sentence: a tree of words (each headed by an earlier one), now and then a multiword token or an
    empty node (its words may not follow), a field gone wrong, or a column too few or too many."""
    count = draw(st.integers(1, 5))
    lines = ["# sent_id = 1"] if draw(st.booleans()) else []
    for word in range(1, count + 1):
        if draw(st.integers(0, 7)) == 0:
            token = draw(st.sampled_from([f"{word}-{min(word + 1, count)}", f"{word}-{word + 2}", f"{word}.1"]))
            lines.append("\t".join([token, draw(FORMS)] + ["_"] * 8))
        columns = [str(word), draw(SENTENCES), "_", "NOUN", "_", "_", str(draw(st.integers(1, word - 1)) if word > 1 else 0), "dep", "_",
                   draw(st.sampled_from(["_", "SpaceAfter=No"]))]
        if draw(st.integers(0, 7)) == 0:
            columns[draw(st.integers(0, 9))] = draw(FIELDS)
        width = draw(st.sampled_from([10] * 14 + [9, 11]))  # ten columns, or one too few or too many
        lines.append("\t".join((columns + ["_"])[:width]))
    return lines


@st.composite
def conllu_lines(draw) -> list[str]:
    """Sentences, each followed by a blank line."""
    return [line for sentence in draw(st.lists(conllu_sentence(), max_size=3)) for line in [*sentence, ""]]


STRUCTURED = {
    "text": st.lists(SENTENCES | WORDS, max_size=6),
    "pairs": st.lists(cells(2) | cells(3), max_size=6),
    "glue": glue_lines(),
    "conllu": conllu_lines(),
    "frames": st.lists(frame_line() | st.sampled_from(["", " "]), max_size=5),
    "labels": st.lists(label_line() | st.sampled_from(["", " "]), max_size=5),
}


@pytest.mark.parametrize("format, suffix", READS)
@given(data=st.binary(max_size=600))
@settings(FUZZ, max_examples=100)
def test_any_bytes_are_read_or_refused_in_one_line(tmp_path, format, suffix, data):
    path = tmp_path / f"corpus{suffix}"
    path.write_bytes(data)
    read_fully(path, format)


@pytest.mark.parametrize("format", list(STRUCTURED))
@given(data=st.data())
@settings(FUZZ, max_examples=200)
def test_near_valid_files_are_read_or_refused_in_one_line(tmp_path, format, data):
    path = tmp_path / f"corpus{dict(READS)[format]}"
    path.write_bytes(data.draw(file_of(STRUCTURED[format])))
    read_fully(path, format)
    if path.suffix == ".jsonl":
        read_fully(path, "auto")


# ---- appends to a labels file ----

@given(content=file_of(st.lists(label_line(), max_size=5)), position=st.integers(0, 2), label=st.sampled_from(PATTERN_LABELS))
@settings(FUZZ, max_examples=100)
def test_a_label_appended_after_any_file_keeps_every_earlier_record(tmp_path, content, position, label):
    """Where the file reads, the server starts and its label follows every earlier record; else nothing is written."""
    path = tmp_path / "labels.jsonl"
    path.write_bytes(content)
    try:
        before = [(e.text, e.text_pair, e.pattern_label) for e in read_labels(path)]
    except CorpusError:
        event("refused")
        with pytest.raises(CorpusError):
            LabelServer(hand_maps(), path)
        assert path.read_bytes() == content
        return
    event(f"{len(before)} earlier labels")
    server = LabelServer(hand_maps(), path)
    server.server.server_close()
    server.add(position, label)
    item = server.maps[position]
    assert [(e.text, e.text_pair, e.pattern_label) for e in read_labels(path)] == before + [(item.text, None, (item.layer, item.head, label))]


@given(content=st.binary(max_size=300) | file_of(st.lists(label_line() | frame_line() | st.sampled_from(["", "[]"]), max_size=4)))
@settings(FUZZ, max_examples=150)
def test_prepare_jsonl_append_refuses_or_only_ends_the_last_line(tmp_path, content):
    path = tmp_path / "records.jsonl"
    path.write_bytes(content)
    try:
        before = list(json_records(path))
    except CorpusError:
        event("refused")
        with pytest.raises(CorpusError):
            prepare_jsonl_append(path)
        assert path.read_bytes() == content
        return
    prepare_jsonl_append(path)
    after = path.read_bytes()
    event("line end added" if after != content else "unchanged")
    assert after in (content, content + b"\n") and (after == b"" or after.endswith((b"\n", b"\r")))
    assert list(json_records(path)) == before


# ---- the labelling server's requests ----

@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    server = LabelServer(hand_maps(), tmp_path_factory.mktemp("fuzzed-server") / "labels.jsonl").start()
    yield server
    server.stop()
    list(read_labels(server.path))  # whatever it was sent, the file it wrote reads back


def assert_answered_and_still_serving(server, status: int) -> None:
    assert status == 200 or 400 <= status < 500, status
    status, body = post_label(server, VALID_LABEL)
    assert status == 200 and set(json.loads(body)) == {"labelled"}


# Objects near a label ({"position": 0, "label": "block"}: a position or class wrong, a key missing or added), and any JSON.
NEAR_LABELS = st.builds(
    lambda label, extra: {**extra, **label},
    st.fixed_dictionaries({}, optional={"position": st.integers(-1, 3) | JSON_VALUES, "label": st.sampled_from(PATTERN_LABELS) | JSON_VALUES}),
    st.dictionaries(WORDS, JSON_VALUES, max_size=2),
)
LABEL_BODIES = (NEAR_LABELS | JSON_VALUES).map(lambda value: with_raw_tokens(json.dumps(value)).encode())


@given(body=st.binary(max_size=400) | LABEL_BODIES)
@settings(FUZZ, max_examples=200)
def test_any_label_body_is_answered_and_the_server_keeps_serving(fuzzed_server, body):
    status = post_label(fuzzed_server, body)[0]
    event(f"answered {status}")
    assert_answered_and_still_serving(fuzzed_server, status)


def unreadable_length(value: str) -> bool:
    """Whether the server answers Content-Length ``value`` without reading a body (one it would wait for is left out)."""
    return not (value.isascii() and value.isdigit()) or not 0 < int(value) <= MAX_LABEL_BYTES


@given(length=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=14).map(str.strip).filter(unreadable_length)
       | st.integers(MAX_LABEL_BYTES + 1, 10**30).map(str) | st.integers(-(10**30), 0).map(str))
@settings(FUZZ, max_examples=100)
def test_any_content_length_is_answered_and_the_server_keeps_serving(fuzzed_server, length):
    """Sent with no body ("": no Content-Length at all)."""
    status = post_label(fuzzed_server, b"", length or None)[0]
    event(f"answered {status}")
    assert_answered_and_still_serving(fuzzed_server, status)
