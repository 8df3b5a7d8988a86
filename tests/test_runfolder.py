import json

import pandas as pd
import pytest

from bertology.runfolder import RunFolder, atomic_write


def test_tables_are_written_as_csv_and_parquet(tmp_path):
    folder = RunFolder(tmp_path / "run")
    table = pd.DataFrame({"layer": [0, 1], "value": [0.5, 0.25]})
    csv, parquet = folder.write_table("heads", table)
    pd.testing.assert_frame_equal(pd.read_csv(csv), table)
    pd.testing.assert_frame_equal(pd.read_parquet(parquet), table)
    folder.write_json("manifest.json", {"status": "complete"})
    assert json.loads((tmp_path / "run" / "manifest.json").read_text()) == {"status": "complete"}


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
