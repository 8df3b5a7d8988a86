import json
import os
import stat
import subprocess
import sys

import pandas as pd
import pytest

from bertology.core.errors import BertologyError
from bertology.core.runfolder import LOCK, RunFolder, atomic_write, check_out, claim


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
    earlier = tmp_path / "earlier"  # a run folder of a bertology without the marker
    earlier.mkdir()
    (earlier / "manifest.json").write_text(json.dumps({"status": "complete", "versions": {"bertology": "0.1.0"}}))
    check_out(earlier)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_place_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(BertologyError, match="cannot write"):
        check_out(locked / "run")


def test_a_folder_held_by_a_live_run_is_refused_and_a_stale_lock_taken_over(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out) as folder:
        folder.write_text("a.txt", "complete\n")
    (out / LOCK).write_text(f"{os.getppid()}\n")  # a live process holds it
    with pytest.raises(BertologyError, match=rf"another run \(pid {os.getppid()}\) is writing") as error:
        check_out(out)
    assert "\n" not in str(error.value)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (out / LOCK).write_text(f"{dead}\n")  # left behind by a killed run
    with claim(out):
        assert (out / LOCK).read_text().split() == [str(os.getpid())]
        with claim(out):  # the same run may claim it again (save inside analyze)
            pass
        assert (out / LOCK).is_file()
    assert not (out / LOCK).exists() and (out / "a.txt").read_text() == "complete\n"


def test_a_claimed_new_folder_that_stays_empty_is_removed(tmp_path):
    with pytest.raises(BertologyError, match="bad corpus"), claim(tmp_path / "run"):
        assert (tmp_path / "run").is_dir()
        raise BertologyError("bad corpus")
    assert list(tmp_path.iterdir()) == []
