import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bertology.core.errors import BertologyError
from bertology.core.storage import runfolder
from bertology.core.storage.runfolder import LOCK, RunFolder, atomic_write, check_out, claim, claims_out


def snapshot(folder):
    """Every file under ``folder`` (hidden ones too), by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tables_are_written_as_csv_and_parquet(tmp_path):
    with RunFolder(tmp_path / "run") as folder:
        table = pd.DataFrame({"layer": [0, 1], "value": [0.5, 0.25]})
        csv, parquet = folder.write_table("heads", table)
        pd.testing.assert_frame_equal(pd.read_csv(csv), table)
        pd.testing.assert_frame_equal(pd.read_parquet(parquet), table)
        folder.write_json("manifest.json", {"status": "complete"})
    assert json.loads((tmp_path / "run" / "manifest.json").read_text()) == {"status": "complete"}
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "run" / "heads.parquet"), table)


def test_a_crash_while_writing_leaves_neither_the_file_nor_a_partial_one(tmp_path):
    target = tmp_path / "heads.csv"

    def crash(path):
        path.write_text("layer,head\n0,")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, crash)
    assert list(tmp_path.iterdir()) == []


def test_a_crash_keeps_the_previous_complete_file(tmp_path):
    target = tmp_path / "heads.csv"
    atomic_write(target, lambda p: p.write_text("complete\n"))
    with pytest.raises(RuntimeError):
        atomic_write(target, lambda p: (p.write_text("half"), (_ for _ in ()).throw(RuntimeError("killed"))))
    assert target.read_text() == "complete\n"


def test_output_files_follow_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        with RunFolder(tmp_path / "run") as folder:
            folder.write_table("heads", pd.DataFrame({"layer": [0]}))
            folder.write_text("report.html", "<p>report</p>")
        atomic_write(tmp_path / "view.html", lambda p: p.write_text("page"))
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [*(tmp_path / "run").iterdir(), tmp_path / "view.html", tmp_path / "run"]}
    assert modes == {"heads.csv": 0o644, "heads.parquet": 0o644, "report.html": 0o644, ".bertology-run": 0o644, "view.html": 0o644, "run": 0o755}


def test_csv_cells_a_spreadsheet_would_run_are_quoted_numbers_and_parquet_are_not(tmp_path):
    table = pd.DataFrame({
        "relation": ["=HYPERLINK(\"http://x\")", "+1", "-cmd", "@SUM(A1)", "nsubj", "a=b"],
        "token": pd.Series(["=", "\tx", "@x", "ok", "-", "b-"], dtype="string"),
        "delta": [-0.5, 1.0, -2.0, 0.0, -1e-9, 3.0],
        "layer": [-1, 0, 1, 2, 3, 4],
    })
    with RunFolder(tmp_path / "run") as folder:
        folder.write_table("syntax", table)
    csv = pd.read_csv(tmp_path / "run" / "syntax.csv", keep_default_na=False)
    assert csv.relation.tolist() == ["'=HYPERLINK(\"http://x\")", "'+1", "'-cmd", "'@SUM(A1)", "nsubj", "a=b"]
    assert csv.token.tolist() == ["'=", "'\tx", "'@x", "ok", "'-", "b-"]
    assert csv.delta.tolist() == table.delta.tolist() and csv.layer.tolist() == table.layer.tolist()  # negative numbers stay numbers
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "run" / "syntax.parquet"), table)  # Parquet keeps the exact values


def test_a_new_run_replaces_the_previous_one_whole(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out) as folder:
        folder.write_table("roles", pd.DataFrame({"layer": [0]}))
        folder.write_json("manifest.json", {"run": 1})
    with RunFolder(out) as folder:
        assert folder.path.parent == tmp_path and folder.path.name.startswith("run.tmp-")
        folder.write_json("manifest.json", {"run": 2})
        assert json.loads((out / "manifest.json").read_text()) == {"run": 1}  # the previous run stays whole until the end
    assert sorted(p.name for p in out.iterdir()) == [".bertology-run", "manifest.json"]  # no stale roles table
    assert json.loads((out / "manifest.json").read_text()) == {"run": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_failure_while_saving_leaves_the_previous_run_byte_identical(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with RunFolder(out) as folder:
        folder.write_table("heads", pd.DataFrame({"layer": [0, 1]}))
        folder.write_json("manifest.json", {"status": "complete"})
    before = snapshot(out)

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", disk_full)
    with pytest.raises(OSError, match="No space left"), claim(out):
        folder = RunFolder(out)
        folder.write_text("report.html", "new")
        folder.write_table("heads", pd.DataFrame({"layer": [5]}))
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging folder, no lock left


def test_out_that_cannot_be_a_run_folder_is_refused_in_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"\xff\xd8")
    refused = [(notes, "is a file"), (notes / "run", "cannot write"), (photos, "not a bertology run folder")]
    for out, message in refused:
        with pytest.raises(BertologyError, match=message) as error:
            check_out(out)
        assert "\n" not in str(error.value) and str(out) in str(error.value)
        with pytest.raises(BertologyError, match=message), claim(out):
            pytest.fail("claimed a folder that must be refused")
    assert notes.read_text() == "mine\n" and [p.name for p in photos.iterdir()] == ["cat.jpg"]
    check_out(tmp_path / "new" / "run")  # a new folder is fine, and checking it creates nothing
    assert not (tmp_path / "new").exists()
    earlier = tmp_path / "earlier"  # a run folder of a bertology without the marker, which listed nothing: a run folder, kept
    earlier.mkdir()
    (earlier / "manifest.json").write_text(json.dumps({"status": "complete", "versions": {"bertology": "0.1.0"}}))
    with pytest.raises(BertologyError, match=r"a run folder of an earlier bertology, which did not list the files it wrote.*\(the first: manifest.json\)"):
        check_out(earlier)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_place_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(BertologyError, match="cannot write"):
        check_out(locked / "run")


HOLD = """
import sys, time
from bertology.core.storage.runfolder import claim
with claim(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_live_run_holds_its_folder_until_it_dies_even_killed(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out) as folder:
        folder.write_text("a.txt", "complete\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(BertologyError, match=rf"another run \(pid {holder.pid}\) is writing") as error:
            check_out(out)
        assert "\n" not in str(error.value)
        with pytest.raises(BertologyError, match=rf"another run \(pid {holder.pid}\) is writing"), claim(out):
            pytest.fail("claimed a folder a live run holds")
    finally:
        holder.kill()  # SIGKILL: no clean-up runs
        holder.wait()
    assert (out / LOCK).read_text().split() == [str(holder.pid)]  # its lock file stays, but the kernel let the lock go
    with claim(out):
        assert (out / LOCK).read_text().split() == [str(os.getpid())]
        with claim(out):  # the same run may claim it again (save inside analyze)
            pass
        assert (out / LOCK).is_file()
    assert not (out / LOCK).exists() and (out / "a.txt").read_text() == "complete\n"


RACER = """
import fcntl, os, sys, time
handle = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_lock_taken_but_not_yet_written_is_not_mistaken_for_a_stale_one(tmp_path):
    # a racing run that has created and locked the lock file, but not yet written its pid
    out = tmp_path / "run"
    with RunFolder(out) as folder:
        folder.write_text("a.txt", "complete\n")
    racer = subprocess.Popen([sys.executable, "-c", RACER, str(out / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert racer.stdout.readline().strip() == "held"
        assert (out / LOCK).read_text() == ""
        with pytest.raises(BertologyError, match="another run is writing this folder"), claim(out):
            pytest.fail("took over the lock of a live run")
        assert (out / LOCK).exists()  # not unlinked under the racing run
    finally:
        racer.kill()
        racer.wait()


def test_a_lock_file_naming_a_live_process_that_holds_no_lock_is_taken_over(tmp_path):
    # the run that wrote it died and its pid was given to another process (here: pytest's parent)
    out = tmp_path / "run"
    with RunFolder(out) as folder:
        folder.write_text("a.txt", "complete\n")
    (out / LOCK).write_text(f"{os.getppid()}\n")
    check_out(out)
    with claim(out):
        assert (out / LOCK).read_text().split() == [str(os.getpid())]
    assert not (out / LOCK).exists()


CHECK = """
import sys
from bertology.core.errors import BertologyError
from bertology.core.storage.runfolder import check_out
try:
    check_out(sys.argv[1])
except BertologyError as error:
    print(error)
"""


def test_the_new_run_stays_locked_from_its_swap_to_the_end_of_the_claim(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out) as folder:
        folder.write_text("a.txt", "old\n")
    with claim(out):
        folder = RunFolder(out)
        folder.write_text("a.txt", "new\n")
        folder.commit()
        assert (out / "a.txt").read_text() == "new\n"
        seen = subprocess.run([sys.executable, "-c", CHECK, str(out)], capture_output=True, text=True).stdout
        assert f"another run (pid {os.getpid()}) is writing" in seen
    assert not (out / LOCK).exists()


def make_run(folder: Path, **files) -> Path:
    with RunFolder(folder) as run:
        for name, text in files.items():
            run.write_text(name, text)
    return folder


def test_a_run_folder_that_holds_other_run_folders_is_refused(tmp_path):
    runs = make_run(tmp_path / "runs", **{"report.html": "first run"})  # --out runs, once
    make_run(runs / "analyze-model-sample-1", **{"manifest.json": "{}"})  # then a default out inside it
    before = snapshot(runs)
    with pytest.raises(BertologyError, match=r"holds another run folder \(analyze-model-sample-1\), which replacing it would delete") as error:
        check_out(runs)
    assert "\n" not in str(error.value) and str(runs) in str(error.value)
    with pytest.raises(BertologyError, match="holds another run folder"):
        RunFolder(runs).commit()
    assert snapshot(runs) == before
    # an earlier bertology's run folder (a manifest naming bertology, no marker), further down
    shutil.rmtree(runs / "analyze-model-sample-1")
    earlier = runs / "old" / "syntax-run"
    earlier.mkdir(parents=True)
    (earlier / "manifest.json").write_text(json.dumps({"status": "complete", "versions": {"bertology": "0.1.0"}}))
    with pytest.raises(BertologyError, match=r"holds another run folder \(old/syntax-run\)"):
        check_out(runs)
    # the work a run keeps inside its own out to resume is no run folder: the command that resumes it may write there
    shutil.rmtree(runs / "old")
    work = {"checkpoint": ["checkpoint/state.pt"], "training": ["training/state/state.pt", "training/checkpoints/step-000000/config.json"],
            "parts": ["parts/x-1a2b.npz"]}
    for folder, names in work.items():
        for name in names:
            (runs / name).parent.mkdir(parents=True, exist_ok=True)
            (runs / name).write_bytes(b"work")
        if folder == "training":
            (runs / "training" / "checkpoints" / "step-000000" / "manifest.json").write_text(json.dumps({"versions": {"torch": "2"}}))
        check_out(runs, work=folder)
        shutil.rmtree(runs / folder)


def test_an_out_that_is_or_holds_an_input_is_refused(tmp_path):
    model = make_run(tmp_path / "runs" / "ft", **{"model.safetensors": "weights", "corpus.txt": "a cat sat.\n"})  # a file of the run: no foreign one
    corpus = tmp_path / "runs" / "ft" / "corpus.txt"
    with pytest.raises(BertologyError, match="is the input") as error:
        check_out(model, inputs=[str(model)])
    assert str(error.value) == f"{model}: is the input {model}, which replacing the run folder would delete; give another folder"
    with pytest.raises(BertologyError, match=r"holds the input .*corpus.txt"):
        check_out(model, inputs=(None, "nobody/model", [tmp_path / "elsewhere.txt", corpus]))
    check_out(model, inputs=["nobody/model", tmp_path / "missing", 3, None, ["the cat sat.", "a dog ran."]])  # no existing path
    check_out(model, inputs=[["~CGoehring wrote this.", "~nobody-here/x"]])  # a sentence like a home folder of no known user (EWT has one)
    check_out(tmp_path / "new", inputs=[model, corpus])  # inputs elsewhere are fine

    @claims_out
    def work(model=None, corpus=None, *, out=None, analyses=None, command=None, **options):
        return "ran"

    for call in (lambda: work(str(model), out=model), lambda: work(None, [corpus], out=str(model)),
                 lambda: work(out=model, probe_test=str(corpus)), lambda: work(tmp_path / "runs" / "ft" / ".." / "ft", out=model)):
        with pytest.raises(BertologyError, match="the input"):
            call()
    assert (model / "model.safetensors").read_text() == "weights" and corpus.read_text() == "a cat sat.\n"
    assert work("nobody/model", out=model, command=["bertology", "analyze", "--out", str(model)]) == "ran"  # the command line is no input


def test_a_rerun_into_a_folder_named_like_an_option_is_no_input(tmp_path, monkeypatch):
    @claims_out(words=("analyses", "parser", "device"))
    def work(model=None, *, out=None, analyses=None, parser=None, device="auto", command=None):
        return "ran"

    @claims_out
    def undeclared(model=None, *, out=None, analyses=None, command=None):
        return "ran"

    monkeypatch.chdir(tmp_path)
    for name in ("roles", "spacy", "cpu"):
        make_run(tmp_path / name, **{"report.html": "earlier"})
    assert work(out="roles", analyses=["roles"]) == "ran"
    assert work(out="spacy", parser="spacy") == "ran"
    assert work(out="cpu", device="cpu") == "ran"
    # an argument not declared a word is read as a path: the same rerun is then refused, the folder kept
    with pytest.raises(BertologyError, match="roles: is the input roles"):
        undeclared(out="roles", analyses=["roles"])
    assert (tmp_path / "roles" / "report.html").read_text() == "earlier"


def test_track_refuses_an_out_that_holds_its_checkpoints_before_reading_them(tmp_path):
    from bertology.studies.track.dynamics import track

    pretrained = make_run(tmp_path / "pt", **{"pretraining.json": "{}"})
    step = pretrained / "checkpoints" / "step-000000"
    step.mkdir(parents=True)
    (step / "config.json").write_text("not read")
    before = snapshot(pretrained)
    with pytest.raises(BertologyError, match=r"holds the input .*step-000000"):
        track([str(step)], None, out=pretrained, progress=False)
    assert snapshot(pretrained) == before


@pytest.mark.parametrize("command", [["finetune", "{task}"], ["ablate", "{task}"], ["importance", "{task}"], ["prune", "{task}"]])
def test_the_task_commands_refuse_an_out_that_is_the_model_or_holds_the_task(command, tmp_path):
    from typer.testing import CliRunner

    from bertology.cli import app

    model = make_run(tmp_path / "runs" / "ft", **{"model.safetensors": "weights"})
    elsewhere, inside = tmp_path / "glue" / "SST-2", model / "SST-2"
    for task in (elsewhere, inside):
        task.mkdir(parents=True)
        for split in ("train", "dev"):
            (task / f"{split}.tsv").write_text("sentence\tlabel\na cat.\t1\na dog.\t0\n")
    before = snapshot(model)
    for task, model_arg, message in ((elsewhere, model, f"{model}: is the input {model}"), (inside, "nobody/none", f"{model}: holds the input {inside}")):
        args = [arg.format(task=task) for arg in command] + ["--model", str(model_arg), "--out", str(model)]
        result = CliRunner().invoke(app, args)
        assert isinstance(result.exception, BertologyError), result.output
        assert str(result.exception).startswith(message)
    assert snapshot(model) == before


def test_an_out_that_is_or_holds_the_current_folder_is_refused(tmp_path, monkeypatch):
    out = make_run(tmp_path / "run", **{"a.txt": "complete\n"})
    (out / "notes").mkdir()
    monkeypatch.chdir(out)
    for given in (".", out, Path("..") / "run"):
        with pytest.raises(BertologyError, match="is the current folder, and a run replaces its out folder whole") as error:
            check_out(given)
        assert "\n" not in str(error.value)
    with pytest.raises(BertologyError, match="is the current folder"):
        RunFolder(".")
    monkeypatch.chdir(out / "notes")
    for given in (out, ".."):
        with pytest.raises(BertologyError, match="holds the current folder"):
            check_out(given)
    assert (out / "a.txt").read_text() == "complete\n" and Path.cwd() == out / "notes"
    check_out(out / "notes" / "run")  # a new folder below the current one is fine


def test_a_previous_run_that_cannot_be_deleted_is_left_with_a_warning(tmp_path, monkeypatch):
    out = make_run(tmp_path / "run", **{"a.txt": "old\n"})
    delete = shutil.rmtree

    def stuck(path, *args, **kwargs):
        if ".old-" in Path(path).name:
            raise PermissionError(13, "Permission denied", str(path))
        return delete(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stuck)
    with pytest.warns(UserWarning, match="the new run is in place, but the previous one could not be deleted") as record:
        make_run(out, **{"a.txt": "new\n"})
    [old] = tmp_path.glob("run.old-*")
    assert record[0].category is runfolder.RunFolderWarning and str(old) in str(record[0].message)
    assert (out / "a.txt").read_text() == "new\n" and (old / "a.txt").read_text() == "old\n"
    assert not (out / LOCK).exists()


def test_a_claimed_new_folder_that_stays_empty_is_removed(tmp_path):
    with pytest.raises(BertologyError, match="bad corpus"), claim(tmp_path / "run"):
        assert (tmp_path / "run").is_dir()
        raise BertologyError("bad corpus")
    assert list(tmp_path.iterdir()) == []


def test_track_resumes_from_the_parts_it_keeps_inside_its_own_out(tiny_bert_dir, tmp_path, monkeypatch):
    from bertology.studies.track import dynamics

    series = [shutil.copytree(tiny_bert_dir, tmp_path / "series" / f"step-{step}") for step in (0, 10)]
    settings = dict(out=tmp_path / "track", bootstrap=100, device="cpu", progress=False)
    corpus = ["the cat sat on the mat.", "where is the dog?", "we saw it."]
    first = dynamics.track([str(c) for c in series], corpus, **settings)
    assert len(list((tmp_path / "track" / "parts").glob("*.npz"))) == 2
    monkeypatch.setattr(dynamics, "_analyze_checkpoint", lambda *args, **kwargs: pytest.fail("a saved part was computed again"))
    again = dynamics.track([str(c) for c in series], corpus, **settings)  # out holds parts/: no run folder, so not refused
    pd.testing.assert_frame_equal(again.table, first.table)


def test_a_run_that_fails_before_writing_leaves_no_folder_it_created(tmp_path, monkeypatch):
    """The README's API example on a missing corpus left an empty runs/ behind (issue 26)."""
    import bertology
    from bertology.core.errors import CorpusError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    with pytest.raises(CorpusError, match="no such file"):
        bertology.analyze(corpus="missing.txt", out="runs/a/sample", progress=False)
    with pytest.raises(CorpusError, match="no such file"):
        bertology.analyze(corpus="missing.txt", out="kept/sample", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())
