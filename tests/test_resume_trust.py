"""Nothing lost, nothing forged (issue 25): another command's unfinished work and inputs inside ``--out`` are never deleted,
a resume never mixes two models, and a damaged or forged resume state is refused in one line, never believed."""

import json
import shutil

import numpy as np
import pytest
from conftest import TEXTS
from core.test_backends import _interrupt_after

import bertology
from bertology.core.errors import BertologyError
from bertology.core.storage import states
from bertology.core.storage.runfolder import RunFolder, check_out, claims_out

OPTIONS = dict(batch_size=2, progress=False, view=False, analyses=["profile", "roles"], checkpoint_every=2)
SENTENCES = [f"{text} number {k}." for k in range(3) for text in TEXTS]


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def interrupted(tiny_bert_dir, tmp_path_factory):
    """A run folder holding an unfinished analysis (``resume/``) of the tiny BERT on 24 sentences."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    with pytest.MonkeyPatch.context() as patch:
        _interrupt_after(patch, 5)
        with pytest.raises(KeyboardInterrupt):
            bertology.analyze(tiny_bert_dir, SENTENCES, out=out, **OPTIONS)
    assert (out / "resume" / "state.json").is_file()
    return out


def _copy(interrupted, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(interrupted, target)
    (target / ".bertology-lock").unlink(missing_ok=True)
    return target


# ---- case 2: another command's unfinished work is refused, not deleted ----

@pytest.mark.parametrize("work, other", [("resume", "checkpoint"), ("checkpoint", "resume"), ("training", "parts"), ("parts", "training")])
def test_a_folder_holding_another_commands_unfinished_work_is_refused(tmp_path, work, other):
    out = tmp_path / "out"
    with RunFolder(out) as folder:
        folder.write_text("report.html", "an earlier run")
    (out / other).mkdir()
    (out / other / "state.pt").write_bytes(b"hours of training")
    before = snapshot(out)

    @claims_out(work=work)
    def command(out):
        RunFolder(out).commit()

    with pytest.raises(BertologyError, match=rf"holds .*\({other}/\), which this run would delete") as error:
        command(out)
    assert "\n" not in str(error.value)
    assert snapshot(out) == before
    shutil.rmtree(out / other)
    (out / work).mkdir()  # its own work: the same command resumes it
    check_out(out, work=work)


def test_an_analysis_into_a_folder_holding_a_finetuning_checkpoint_is_refused(tiny_bert_dir, tmp_path):
    out = tmp_path / "ft"
    with RunFolder(out) as folder:
        folder.write_text("manifest.json", "{}")
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "state.pt").write_bytes(b"an unfinished fine-tuning")
    before = snapshot(out)
    with pytest.raises(BertologyError, match="unfinished fine-tuning"):
        bertology.analyze(tiny_bert_dir, TEXTS, out=out, analyses=["profile"], progress=False, view=False)
    assert snapshot(out) == before


def test_a_finetuning_into_a_folder_holding_an_unfinished_analysis_is_refused(interrupted, tmp_path, cat_task, tiny_bert_dir):
    from bertology.core.learning.tasks import load_task
    from bertology.studies.finetune.finetuning import finetune

    out = _copy(interrupted, tmp_path)
    before = snapshot(out)
    with pytest.raises(BertologyError, match="unfinished analysis"):
        finetune(load_task(cat_task), out, model=tiny_bert_dir, progress=False)
    assert snapshot(out) == before


# ---- case 3: a path inside an option's value is an input too ----

def test_a_word_list_inside_out_is_an_input_and_is_not_deleted(tiny_bert_dir, tmp_path):
    out = tmp_path / "W"
    with RunFolder(out) as folder:
        folder.write_text("report.html", "an earlier run")
    words = out / "myneg.txt"
    words.write_text("not\nnever\n")
    with pytest.raises(BertologyError, match="holds the input"):
        bertology.analyze(tiny_bert_dir, TEXTS, out=out, analyses=["classes"], classes=[f"neg=words:{words}"], progress=False, view=False)
    assert words.read_text() == "not\nnever\n"
    with pytest.raises(BertologyError, match="holds the input"):  # any KEY=..., KEY:... value
        check_out(out, [f"x=y:z={words}"])


# ---- case 4: a resume never mixes two models ----

def test_a_resume_with_other_weights_under_the_same_config_is_refused(interrupted, tiny_bert_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    out = _copy(interrupted, tmp_path)
    # the interrupted run read tiny_bert_dir: the same weights in another folder resume it
    weights = load_file(model / "model.safetensors")
    name = next(key for key in weights if key.endswith("query.weight"))
    weights[name] = weights[name] + 0.01
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(out)
    with pytest.raises(BertologyError, match=r"another model, corpus or settings \(weights included\)"):
        bertology.analyze(model, SENTENCES, out=out, **OPTIONS)
    assert snapshot(out) == before


def test_the_weights_digest_is_cached_by_path_size_and_time(tiny_bert_dir, tmp_path, monkeypatch):
    import hashlib

    from bertology.core.storage import digests

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    expected = hashlib.sha256(f"model.safetensors\0{hashlib.sha256((tiny_bert_dir / 'model.safetensors').read_bytes()).hexdigest()}\n"
                              .encode()).hexdigest()
    assert digests.folder_weights_digest(tiny_bert_dir) == expected
    cache = json.loads(digests.cache_path().read_text())
    assert list(cache) == [str((tiny_bert_dir / "model.safetensors").resolve())]
    hashed = []
    monkeypatch.setattr(digests.hashlib, "file_digest", lambda *a: hashed.append(a) or pytest.fail("hashed again"))
    assert digests.folder_weights_digest(tiny_bert_dir) == expected and not hashed
    digests.cache_path().write_text("[[[[not json")  # a damaged cache is recomputed, never believed
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert digests.folder_weights_digest(tiny_bert_dir) == expected


# ---- cases 5 and 6: a damaged or forged state is refused in one line ----

def _damage(out, change):
    """Apply ``change(document, arrays)`` to the saved state (both may be modified in place or replaced)."""
    folder = out / "resume"
    document = json.loads((folder / "state.json").read_text())
    with np.load(folder / "arrays.npz") as stored:
        arrays = {key: stored[key] for key in stored.files}
    result = change(document, arrays)
    if result is not None:
        document, arrays = result
    (folder / "state.json").write_text(document if isinstance(document, str) else json.dumps(document))
    with open(folder / "arrays.npz", "wb") as handle:
        np.savez(handle, **arrays)


def _first_float_array(document, arrays):
    return next(key for key, value in arrays.items() if value.dtype.kind == "f" and value.size)


def _nan_means(document, arrays):
    arrays[_first_float_array(document, arrays)][...] = np.nan


def _progress(**changes):
    def change(document, arrays):
        document["progress"].update(changes)
    return change


def _missing_progress_key(document, arrays):
    del document["progress"]["batches_done"]


def _no_module(document, arrays):
    text = json.dumps(document).replace("bertology.families.profile.analyzer:GeneralProfile", "bertology.no_such_module:GeneralProfile", 1)
    return text, arrays


def _not_an_object(document, arrays):
    return json.dumps([1, 2, 3]), arrays


def _deep(document, arrays):
    return "[" * 200_000 + "]" * 200_000, arrays


def _wrong_shape(document, arrays):
    key = _first_float_array(document, arrays)
    arrays[key] = np.zeros(arrays[key].shape + (2,))


def _missing_array(document, arrays):
    del arrays[_first_float_array(document, arrays)]


DAMAGES = {
    "nan means": (_nan_means, "NaN or infinite"),
    "batches_done 1e9 (a float)": (_progress(batches_done=1e9), "'batches_done' must be int, not 1000000000.0"),
    "batches_done past the window": (_progress(batches_done=10**9), "batches_done = 1000000000 is out of range"),
    "negative position": (_progress(window_start=-4), "window_start = -4 is out of range"),
    "missing key": (_missing_progress_key, "missing key 'batches_done'"),
    "module that does not exist": (_no_module, "does not exist"),
    "state.json not an object": (_not_an_object, "expected a JSON object"),
    "200,000 deep": (_deep, "nested deeper"),
    "an array of another shape": (_wrong_shape, "must share one"),
    "an array the npz lacks": (_missing_array, "does not hold"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_resume_state_is_refused_in_one_line(interrupted, tiny_bert_dir, tmp_path, damage):
    change, message = DAMAGES[damage]
    out = _copy(interrupted, tmp_path)
    _damage(out, change)
    before = snapshot(out)
    with pytest.raises(BertologyError, match=message) as error:
        bertology.analyze(tiny_bert_dir, SENTENCES, out=out, **OPTIONS)
    assert "\n" not in str(error.value) and "resume" in str(error.value)
    assert snapshot(out) == before


def test_an_arrays_file_that_is_no_zip_is_refused_in_one_line(interrupted, tiny_bert_dir, tmp_path):
    out = _copy(interrupted, tmp_path)
    (out / "resume" / "arrays.npz").write_bytes(b"not a zip at all")
    with pytest.raises(BertologyError, match=r"arrays.npz: not a state bertology can resume from \(not a NumPy .npz archive"):
        bertology.analyze(tiny_bert_dir, SENTENCES, out=out, **OPTIONS)


def test_an_undamaged_resume_still_finishes(interrupted, tiny_bert_dir, tmp_path, capsys):
    out = _copy(interrupted, tmp_path)
    result = bertology.analyze(tiny_bert_dir, SENTENCES, out=out, **OPTIONS)
    assert "resuming: 8 of 24 examples" in capsys.readouterr().err
    assert result.stats.sequences == 24 and not (out / "resume").exists()


def test_a_finished_track_folders_parts_are_a_cache_not_unfinished_work(tmp_path):
    out = tmp_path / "track"
    with RunFolder(out) as folder:
        folder.write_json("manifest.json", {"status": "complete"})
    (out / "parts").mkdir()
    (out / "parts" / "x.npz").write_bytes(b"a cached part")
    check_out(out)  # a finished run, parts and all, may be replaced like any other
    (out / "manifest.json").write_text(json.dumps({"status": "partial"}))
    with pytest.raises(BertologyError, match=r"\(parts/\), which this run would delete"):
        check_out(out)


def test_the_finetune_command_resumes_its_own_checkpoint_in_the_out_it_is_given(cat_task, tiny_bert_dir, tmp_path):
    """The command line checked --out without naming its own work, and refused the run that would resume it."""
    import subprocess
    import sys

    out = tmp_path / "ft"
    command = [sys.executable, "-m", "bertology.cli", "finetune", str(cat_task), "--model", str(tiny_bert_dir), "--out", str(out),
               "--max-length", "16", "--batch-size", "4", "--epochs", "0.5", "--checkpoint-every", "1", "--device", "cpu", "-q"]
    first = subprocess.run(command, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "state.pt").write_bytes(b"a damaged checkpoint")
    again = subprocess.run(command, capture_output=True, text=True)
    assert "holds an unfinished fine-tuning" not in again.stderr
    [error] = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert again.returncode == 2 and "checkpoint/state.pt: cannot read it as a training state" in error, again.stderr


def test_a_window_of_many_small_batches_resumes_past_sort_window_batches(interrupted, tmp_path):
    """The engine splits a window's batches where they would hold too many attention weights: a window may then have more
    than sort_window batches, and a resume after batch 40 of one must not be refused."""
    from bertology.core.backends import Resume
    from bertology.core.engine import RunStats

    resume = Resume(tmp_path, "unused")
    stats = RunStats(sequences=40, batches=40)
    progress = {"backend": "local", "window_start": 0, "batches_done": 40, "truncated_before": 0, "skipped_before": 0, "sources_before": 0,
                "degenerate_before": 0}
    assert resume.checked_local_progress(progress, stats, total=100, window_size=64) == progress
    with pytest.raises(BertologyError, match="batches_done = 65 is out of range"):
        resume.checked_local_progress({**progress, "batches_done": 65}, stats, total=100, window_size=64)


@pytest.mark.parametrize("seconds", [10**400, float("nan"), "1.5", True])
def test_a_saved_number_past_the_float_range_or_of_another_kind_is_refused(seconds):
    """Found by the fuzz: a saved time of 10**400 reached numpy's isfinite, which raised a TypeError."""
    from bertology.core.engine import RunStats

    saved = RunStats(seconds=seconds)
    with pytest.raises(BertologyError, match="should be a finite number"):
        states.check_like(saved, RunStats(), "the saved stats")
