"""Fuzzing with Hypothesis: the files bertology keeps and reads back: a pattern classifier (``classifier.json``), a
checkpoint's step (``pretraining_step.json``, ``trainer_state.json``), a part of ``track`` (``parts/*.npz`` and its two
tables) and a training state (``state.pt`` of ``finetune`` and ``pretrain``).

Whatever is changed in a valid file, or whatever its bytes, the reader gives what it reads, and that can be used (a
classifier's probabilities are finite, a part's means give a verdict, a resumed training state takes a step), or it
refuses the file with a one-line :class:`BertologyError` that names it. No other exception escapes, and reading changes
no file.
"""

import io
import json
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TEXTS, gold_example
from core.storage.test_runfolder import snapshot
from families.patterns.test_trained_patterns import classifier_document
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from bertology.core.errors import BertologyError
from bertology.core.learning.training import load_training_state, random_states, resume_training, save_training_state
from bertology.families.patterns.analyzer import PATTERNS
from bertology.families.patterns.trained import TrainedClassifier
from bertology.studies.track.checkpoints import MAX_STEP, checkpoint_step
from bertology.studies.track.dynamics import track
from bertology.studies.track.hypothesis import hypothesis_verdict
from bertology.studies.track.parts import load_part
from fuzz.documents import DELETE, changed, paths

# No example database (it would be written into the checkout); the test's folder is reused by every example.
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextmanager
def reading(folder: Path, files: dict[str, bytes], *watched: Path):
    """Write ``files`` into ``folder`` (emptied first) for a reader; afterwards the files, the rest of ``folder.parent``
    and the ``watched`` folders must be as they were, and a refusal one line that names a file of ``folder``."""
    shutil.rmtree(folder, ignore_errors=True)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    before = {path: snapshot(path) for path in (folder.parent, *watched)}
    try:
        yield
    except BertologyError as error:
        assert "\n" not in str(error) and str(error).startswith(str(folder)), str(error)
        event("refused")
    else:
        event("read")
    assert {path: snapshot(path) for path in before} == before


@st.composite
def one_changed_byte(draw, data: bytes) -> bytes:
    """``data`` cut short, with a byte replaced, or with bytes inserted."""
    at = draw(st.integers(0, max(len(data) - 1, 0)))
    how = draw(st.sampled_from(["cut", "replace", "insert"]))
    if how == "cut":
        return data[:at]
    if how == "replace":
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]


# ---- JSON: any document, and tokens json.dumps cannot write (the constants JSON lacks, numbers too long or too large,
# nesting just under and far over the limit) ----

RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 5000, "[" * 60 + "]" * 60, "[" * 100_000 + "]" * 100_000,
              '{"a":' * 70 + "1" + "}" * 70]
KEYS = ["format", "version", "grid", "classes", "mean", "scale", "coef", "intercept", "step", "global_step", "checkpoint"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8) | st.sampled_from(PATTERNS)
    | st.sampled_from([1e308, -1e308, 5e-324, 0.0, -1, 2**63, 2**64]) | st.sampled_from(range(len(RAW_TOKENS))).map(lambda k: f"@raw:{k}@"),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)


def json_text(value) -> str:
    """``value`` as JSON (NaN and infinities as json.dumps writes them), each ``"@raw:K@"`` replaced by raw token K."""
    return re.sub(r'"@raw:(\d+)@"', lambda match: RAW_TOKENS[int(match[1])], json.dumps(value))


# ---- the pattern classifier ----

ARRAYS = (st.lists(st.floats(), max_size=80) | st.lists(st.lists(st.floats(-10, 10), min_size=68, max_size=68), max_size=6)
          | st.lists(st.floats(-1e308, 1e308), min_size=68, max_size=68))


def check_classifier(path: Path) -> None:
    """Load ``path``; a classifier that loads must give finite probabilities that sum to 1 on any map."""
    classifier = TrainedClassifier.load(path)
    n = 6
    maps = torch.softmax(torch.randn(1, 2, n, n, dtype=torch.float64), dim=-1)
    special = torch.zeros(1, n, dtype=torch.bool)
    special[0, [0, n - 1]] = True
    probabilities = classifier.probabilities(maps, torch.ones(1, n, dtype=torch.bool), special, torch.zeros(1, n, dtype=torch.long))
    assert np.isfinite(probabilities).all() and np.allclose(probabilities.sum(-1), 1.0)


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_a_classifier_with_any_value_changed_loads_or_is_refused_in_one_line(tmp_path, data):
    document = classifier_document(data.draw(st.sampled_from([("vertical", "diagonal", "block"), ("vertical", "block")])))
    path = data.draw(st.sampled_from(list(paths(document))))
    new = data.draw(JSON_VALUES | ARRAYS | st.just(DELETE) if path else JSON_VALUES)
    with reading(tmp_path / "example", {"classifier.json": json_text(changed(document, path, new)).encode()}):
        check_classifier(tmp_path / "example" / "classifier.json")


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_a_classifier_of_any_bytes_is_refused_in_one_line(tmp_path, data):
    text = json.dumps(classifier_document()).encode()
    content = data.draw(st.binary(max_size=200) | one_changed_byte(text))
    with reading(tmp_path / "example", {"classifier.json": content}):
        check_classifier(tmp_path / "example" / "classifier.json")


# ---- a checkpoint's step ----

@settings(FUZZ, max_examples=300)
@given(marker=st.sampled_from([("pretraining_step.json", "step"), ("trainer_state.json", "global_step")]),
       content=st.one_of(JSON_VALUES.map(json_text), st.dictionaries(st.sampled_from(KEYS), JSON_VALUES, max_size=3).map(json_text),
                         st.builds(lambda value: {"step": value, "global_step": value}, st.integers(-3, 2**64) | JSON_VALUES).map(json_text)).map(str.encode)
       | st.binary(max_size=60))
def test_a_step_file_of_anything_gives_a_whole_step_or_is_refused_in_one_line(tmp_path, marker, content):
    folder = tmp_path / "example"
    with reading(folder, {f"checkpoint-5/{marker[0]}": content}):
        step = checkpoint_step(str(folder / "checkpoint-5"))
        assert type(step) is int and 0 <= step <= MAX_STEP


# ---- a part of track ----

@pytest.fixture(scope="module")
def saved_part(tiny_bert_dir, tmp_path_factory):
    """``(parts folder, name, key, files)``: the part of one checkpoint, with trees (so its syntax is saved too)."""
    out = tmp_path_factory.mktemp("track") / "out"
    track([str(tiny_bert_dir)], [gold_example(k, text) for k, text in enumerate(TEXTS)], out=out, bootstrap=20, min_dependents=2, device="cpu",
          progress=False)
    parts = out / "parts"
    [marker] = parts.glob("*.npz")
    with np.load(marker) as arrays:
        key = str(arrays["key"])
    return parts, marker.stem, key, {path.name: path.read_bytes() for path in parts.iterdir()}


def check_part(parts: Path, name: str, key: str) -> None:
    """Load a part; one that loads must be of 21 replicates (bootstrap 20) and give a verdict."""
    result = load_part(parts, name, key, 21, finished=False)
    if result is None:
        event("recomputed")
        return
    assert result.means.shape[0] == 21 and np.isfinite(result.means[0]).all()
    assert result.syntax is None or result.syntax.shape == (21,)
    hypothesis_verdict([result.step], [result.checkpoint], result.means[None], result.kind, None if result.syntax is None else result.syntax[None],
                       excess=result.excess[None])


def npz_bytes(arrays: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


ARRAY_DTYPES = st.sampled_from([np.float64, np.float32, np.int64, np.bool_, np.uint8, np.complex128, np.dtype("U5")])


@st.composite
def changed_array(draw, original: np.ndarray) -> np.ndarray:
    """An array near ``original``: its shape or one more or fewer axis, any dtype, NaN, infinities and values beyond [0, 1]."""
    shape = draw(st.sampled_from([original.shape, original.shape + (2,), original.shape[1:], (0,), ()]
                                 + ([tuple(max(1, n - 1) for n in original.shape)] if original.ndim else [])))
    dtype = draw(ARRAY_DTYPES | st.just(original.dtype))
    if np.dtype(dtype).kind == "f" and draw(st.booleans()):  # the original's values with a few changed
        base = np.resize(original.astype(dtype) if original.dtype.kind == "f" else np.zeros(1, dtype), shape)
        for _ in range(draw(st.integers(1, 3))):
            if base.size:
                base.flat[draw(st.integers(0, base.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, -0.5, 1.5, 0.0, 1.0]))
        return base
    return draw(hnp.arrays(dtype, shape, elements=st.floats(width=32) if np.dtype(dtype).kind == "f" else None))


@st.composite
def changed_part_file(draw, files: dict[str, bytes], name: str):
    """The part's files with one of them changed: an array or the meta of the ``.npz``, a table's columns or values, or
    any file's bytes; or a file missing."""
    files = dict(files)
    target = draw(st.sampled_from(sorted(files)))
    how = draw(st.sampled_from(["content", "bytes", "missing"]))
    if how == "missing":
        del files[target]
    elif how == "bytes":
        files[target] = draw(st.binary(max_size=100) | one_changed_byte(files[target]))
    elif target.endswith(".npz"):
        arrays = dict(np.load(io.BytesIO(files[target])))
        member = draw(st.sampled_from(sorted(arrays)))
        if member == "meta":
            meta = json.loads(str(arrays["meta"]))
            path = draw(st.sampled_from(list(paths(meta))))
            arrays["meta"] = np.array(json_text(changed(meta, path, draw(JSON_VALUES | st.just(DELETE) if path else JSON_VALUES))))
        elif draw(st.integers(0, 9)) == 0:
            del arrays[member]
        else:
            arrays[member] = draw(changed_array(arrays[member]))
        files[target] = npz_bytes(arrays)
    else:
        table = pd.read_parquet(io.BytesIO(files[target]))
        column = draw(st.sampled_from(list(table.columns)))
        change = draw(st.sampled_from(["drop", "rename", "strings", "floats", "nothing", "first rows", "other step", "other checkpoint"]))
        if change == "drop":
            table = table.drop(columns=column)
        elif change == "rename":
            table = table.rename(columns={column: "other"})
        elif change == "strings":
            table[column] = "x"
        elif change == "floats":
            table[column] = draw(st.floats())
        elif change == "nothing":
            table[column] = None
        elif change == "first rows":
            table = table.head(draw(st.integers(0, 3)))
        else:
            table = table.assign(**({"step": draw(st.integers(-3, 3))} if change == "other step" else {"checkpoint": "elsewhere"}))
        buffer = io.BytesIO()
        table.to_parquet(buffer, index=False)
        files[target] = buffer.getvalue()
    return files


@settings(FUZZ, max_examples=250)
@given(data=st.data())
def test_a_part_with_any_file_changed_loads_or_is_refused_in_one_line(saved_part, tmp_path, data):
    parts, name, key, files = saved_part
    with reading(tmp_path / "example", data.draw(changed_part_file(files, name)), parts):
        check_part(tmp_path / "example", name, key)


# ---- a training state ----

def tiny_training() -> tuple:
    """A tiny classifier with fine-tuning's AdamW (decay and no-decay groups) and linear schedule."""
    torch.manual_seed(0)
    network = BertForSequenceClassification(BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=16, max_position_embeddings=16))
    no_decay = [name.endswith(("bias", "LayerNorm.weight")) for name, _ in network.named_parameters()]
    parameters = [parameter for _, parameter in network.named_parameters()]
    optimizer = torch.optim.AdamW([{"params": [p for p, skip in zip(parameters, no_decay) if not skip], "weight_decay": 0.01},
                                   {"params": [p for p, skip in zip(parameters, no_decay) if skip], "weight_decay": 0.0}], lr=1e-3)
    return network, optimizer, get_linear_schedule_with_warmup(optimizer, 1, 10)


def train_step(network, optimizer, scheduler) -> float:
    loss = network(input_ids=torch.tensor([[2, 5, 7, 3], [2, 9, 3, 0]]), labels=torch.tensor([0, 1])).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


@pytest.fixture(scope="module")
def training_state(tmp_path_factory):
    """The ``state.pt`` bytes of the tiny classifier after two steps, as :func:`finetune` saves it."""
    network, optimizer, scheduler = tiny_training()
    losses = [train_step(network, optimizer, scheduler) for _ in range(2)]
    folder = tmp_path_factory.mktemp("state") / "checkpoint"
    save_training_state(folder, {"model": network.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                 "step": 2, "losses": losses, "settings": {"model": "tiny", "seed": 0}, "random": random_states()})
    return (folder / "state.pt").read_bytes()


def state_paths(value, prefix=()):
    """Paths to values inside a training state (of a long list or tuple, only its first two and its last item)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from state_paths(item, prefix + (key,))
    elif isinstance(value, (list, tuple)):
        for index in sorted({0, 1, len(value) - 1} & set(range(len(value)))):
            yield from state_paths(value[index], prefix + (index,))


def state_changed(value, path, new):
    """``value`` with the item at ``path`` replaced by ``new`` (or deleted: :data:`DELETE`); tuples become new tuples."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        copy = dict(value)
        if new is DELETE and not rest:
            del copy[head]
        else:
            copy[head] = state_changed(value[head], rest, new)
        return copy
    items = list(value)
    if new is DELETE and not rest:
        del items[head]
    else:
        items[head] = state_changed(value[head], rest, new)
    return type(value)(items)


TENSOR_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64])


@st.composite
def state_value(draw, original):
    """A value for a training state: a tensor near ``original`` (its shape or another, another dtype, NaN and infinities),
    a plain value, a list, a dict."""
    if isinstance(original, torch.Tensor) and draw(st.booleans()):
        shape = draw(st.sampled_from([tuple(original.shape), tuple(original.shape)[1:], (*original.shape, 1), (2,), (0,), ()]))
        dtype = draw(TENSOR_DTYPES | st.just(original.dtype))
        tensor = (original.clone() if shape == tuple(original.shape) else torch.ones(shape)).to(dtype)
        if tensor.is_floating_point() and tensor.numel() and draw(st.booleans()):
            tensor.view(-1)[draw(st.integers(0, tensor.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -1.0, 1e30]))
        return tensor
    plain = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
    return draw(st.just(DELETE) | st.recursive(plain, lambda children: st.lists(children, max_size=3)
                                               | st.dictionaries(st.text(max_size=4) | st.integers(0, 3), children, max_size=3), max_leaves=5))


def check_training_state(path: Path) -> None:
    """Load a state as a resumed run does; one that loads must resume the tiny classifier, which then takes a step."""
    state = load_training_state(path)
    network, optimizer, scheduler = tiny_training()
    resume_training(path, state, network, optimizer, scheduler)
    train_step(network, optimizer, scheduler)


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_a_training_state_with_any_value_changed_resumes_or_is_refused_in_one_line(training_state, tmp_path, data):
    state = torch.load(io.BytesIO(training_state), weights_only=True)
    for _ in range(data.draw(st.integers(1, 2))):
        path = data.draw(st.sampled_from(list(state_paths(state))))
        target = state
        for step in path:
            target = target[step]
        state = state_changed(state, path, data.draw(state_value(target)))
        if not isinstance(state, dict):
            break
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with reading(tmp_path / "example", {"state.pt": buffer.getvalue()}):
        check_training_state(tmp_path / "example" / "state.pt")


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_a_training_state_of_any_bytes_is_refused_in_one_line(training_state, tmp_path, data):
    content = data.draw(st.binary(max_size=200) | one_changed_byte(training_state))
    if data.draw(st.booleans()):  # bytes inside the zip that torch.save writes, the member names kept
        with zipfile.ZipFile(io.BytesIO(training_state)) as archive:
            members = {info.filename: archive.read(info) for info in archive.infolist()}
        member = data.draw(st.sampled_from(sorted(members)))
        members[member] = data.draw(one_changed_byte(members[member]))
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for filename, member_bytes in members.items():
                archive.writestr(filename, member_bytes)
        content = buffer.getvalue()
    with reading(tmp_path / "example", {"state.pt": content}):
        check_training_state(tmp_path / "example" / "state.pt")


def test_the_valid_files_read(saved_part, training_state, tmp_path):
    """The fuzzed files, unchanged, read (so a refusal above is the change's doing)."""
    parts, name, key, files = saved_part
    assert load_part(parts, name, key, 21, finished=False).syntax is not None
    (tmp_path / "state.pt").write_bytes(training_state)
    check_training_state(tmp_path / "state.pt")
    (tmp_path / "classifier.json").write_text(json.dumps(classifier_document()))
    check_classifier(tmp_path / "classifier.json")
