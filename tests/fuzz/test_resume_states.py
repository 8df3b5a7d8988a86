"""Fuzzing with Hypothesis: an analysis's resume state (``OUT/resume/``: ``state.json`` and ``arrays.npz``).

Whatever is changed in a valid state, :meth:`Resume.load` (with its checks of the saved position) either gives analyzers
of the same form as a fresh run's, or refuses the state with a one-line :class:`BertologyError`; no other exception
escapes, and nothing outside the state's folder changes.
"""

import io
import json
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bertology.core.backends import Resume
from bertology.core.engine import Engine
from bertology.core.errors import BertologyError
from bertology.core.model.kinds import ENCODER
from bertology.families import registered
from fuzz.documents import changed, paths

FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FINGERPRINT = "fuzz"
FAMILIES = ("profile", "roles", "patterns")


def fresh_analyzers():
    built = []
    for name in FAMILIES:
        family = registered()[name]
        settings_ = {option.name: option.default for option in family.options} | {"bootstrap": 50, "seed": 0, "punct": "upos",
                                                                                   "correction": "fdr_bh", "parser": None}
        family.prepare(settings_)
        built += list(family.analyzers(settings_, ENCODER).values())
    return built


@pytest.fixture(scope="module")
def saved_state(tiny_bert, tmp_path_factory):
    """``(folder, document, arrays)``: a real resume state of three families after a pass over the test sentences."""
    analyzers = fresh_analyzers()
    stats = Engine(tiny_bert, batch_size=3, progress=False).run(tiny_examples(), analyzers)
    out = tmp_path_factory.mktemp("state")
    position = {"backend": "local", "window_start": 0, "batches_done": stats.batches, "truncated_before": 0, "skipped_before": 0,
                "sources_before": 0}
    Resume(out, FINGERPRINT).save(position, stats, analyzers)
    document = json.loads((out / "resume" / "state.json").read_text())
    with np.load(out / "resume" / "arrays.npz") as stored:
        arrays = {key: stored[key] for key in stored.files}
    return out, document, arrays


def load_state(folder: Path, total: int = 10) -> None:
    """Load the state as a resumed local run does; a refusal must be one line."""
    resume = Resume(folder, FINGERPRINT)
    try:
        loaded = resume.load(fresh_analyzers())
        if loaded is not None:
            progress, stats = loaded
            resume.checked_local_progress(progress, stats, total, window_size=3 * 32)
    except BertologyError as error:
        assert "\n" not in str(error), str(error)


def write_state(folder: Path, document_text: str | bytes, arrays: dict | bytes) -> None:
    state = folder / "resume"
    state.mkdir(parents=True)
    (state / "state.json").write_bytes(document_text if isinstance(document_text, bytes) else document_text.encode("utf-8", "surrogatepass"))
    if isinstance(arrays, bytes):
        (state / "arrays.npz").write_bytes(arrays)
    else:
        with open(state / "arrays.npz", "wb") as handle:
            np.savez(handle, **arrays)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12) | st.sampled_from(["__array__", "__tensor__", "__object__", "a0", "bertology.core.statistics.stats:RunningMoments", "os:system"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["__array__", "__tensor__", "__tuple__", "__set__", "__dict__",
                                                                                 "__object__", "state", "x"]) | st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


@settings(FUZZ, max_examples=400)
@given(data=st.data())
def test_a_state_with_any_value_replaced_loads_or_is_refused_in_one_line(saved_state, data):
    folder, document, arrays = saved_state
    all_paths = list(paths(document))
    path = data.draw(st.sampled_from(all_paths))
    new = data.draw(JSON_VALUES)
    with tempfile.TemporaryDirectory() as place:
        write_state(Path(place), json.dumps(changed(document, path, new)), arrays)
        load_state(Path(place))


ARRAY_DTYPES = st.sampled_from([np.float64, np.float32, np.int64, np.int32, np.bool_, np.uint8, np.complex128])


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_a_state_with_any_array_replaced_loads_or_is_refused_in_one_line(saved_state, data):
    folder, document, arrays = saved_state
    key = data.draw(st.sampled_from(sorted(arrays)))
    original = arrays[key]
    shape = data.draw(st.sampled_from([original.shape, original.shape + (2,), original.shape[1:], (0,), ()]
                                      + ([tuple(max(1, n - 1) for n in original.shape)] if original.ndim else [])))
    dtype = data.draw(st.sampled_from([original.dtype.type]) | ARRAY_DTYPES)
    new = data.draw(hnp.arrays(dtype, shape, elements=None if dtype not in (np.float64, np.float32) else
                               st.floats(allow_nan=True, allow_infinity=True, width=32)))
    with tempfile.TemporaryDirectory() as place:
        write_state(Path(place), json.dumps(document), {**arrays, key: new})
        load_state(Path(place))


@settings(FUZZ, max_examples=200)
@given(document_bytes=st.binary(max_size=300), array_bytes=st.binary(max_size=300), zipped=st.booleans())
def test_a_state_of_any_bytes_is_refused_in_one_line(saved_state, document_bytes, array_bytes, zipped):
    folder, document, arrays = saved_state
    if zipped:  # a zip that holds bytes of no array
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("a0.npy", array_bytes)
        array_bytes = buffer.getvalue()
    with tempfile.TemporaryDirectory() as place:
        write_state(Path(place), document_bytes, array_bytes)
        load_state(Path(place))


def test_the_valid_state_loads(saved_state, tmp_path):
    folder, document, arrays = saved_state
    shutil.copytree(folder / "resume", tmp_path / "resume")
    progress, stats = Resume(tmp_path, FINGERPRINT).load(fresh_analyzers())
    assert progress["backend"] == "local" and stats.sequences == len(tiny_examples())
