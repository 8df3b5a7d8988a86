"""Files of the user's inside an earlier run folder are kept (issue 49, case 1): a rerun into it is refused in one line
before any computing, and a rerun into a folder of nothing but the earlier run's own files still replaces it whole. Every
study's own case is the study check ``foreign_files_kept`` (tests/test_checks.py); here the command line of the issue,
word for word, and the rerun that must still work."""

import hashlib
import json
from pathlib import Path

import pytest
from conftest import TEXTS, write_books
from test_cli import bertology

from bertology.core.storage.inventory import MARKER

#: The families ``analyze`` is told to leave out, so that it runs the head profile alone (seconds).
ONLY_PROFILE = ("sinks", "headtypes", "roles", "patterns", "syntax", "classes", "frames", "layers", "rollout", "mixing")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def snapshot(folder: Path) -> dict:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def plant(out: Path) -> None:
    (out / "NOTES.md").write_text("# what I saw\n")
    (out / "x.txt").write_text("keep\n")
    (out / "my_figures").mkdir()
    (out / "my_figures" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n mine")


def in_process(name: str, given: dict):
    """``bertology NAME`` with the options ``given`` (by name), run in this process as the command line runs it."""
    from typer.testing import CliRunner

    from bertology.cli import build_app
    from bertology.studies import registered_studies
    from bertology.testing.studies import command_line

    return CliRunner().invoke(build_app(), command_line(registered_studies()[name], {**given, "quiet": True, "device": "cpu"}))


def test_analyze_again_into_a_folder_with_the_users_files_is_one_line_and_keeps_them(tiny_bert_dir, corpus, tmp_path):
    out = tmp_path / "R"
    given = {"model": str(tiny_bert_dir), "corpus": corpus, "out": out, **{f"run_{name}": False for name in ONLY_PROFILE}}
    assert in_process("analyze", given).exit_code == 0
    plant(out)
    before = snapshot(out)
    again = bertology("analyze", "--model", tiny_bert_dir, "--corpus", corpus, "--out", out, "-q", "--device", "cpu",
                      *(f"--no-{name}" for name in ONLY_PROFILE))
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr == (f"error: {out}: holds NOTES.md, which the earlier run did not write (2 more besides); a new run replaces the folder "
                            "whole and would delete them: move them out of the folder or choose another --out\n")
    assert snapshot(out) == before and "heads.csv" in before and "my_figures/a.png" in before
    assert [path.name for path in tmp_path.iterdir()] == ["R"]  # refused before it computed: nothing staged beside it


def test_an_edited_table_of_the_run_is_the_users_too(tiny_bert_dir, corpus, tmp_path):
    given = {"model": str(tiny_bert_dir), "corpus": corpus, "out": tmp_path / "R"}
    assert in_process("profile", given).exit_code == 0
    heads = tmp_path / "R" / "heads.csv"
    heads.write_text(heads.read_text().replace("layer,head", "Layer,head", 1))  # the same size, other bytes
    refused = in_process("profile", given)
    assert str(refused.exception).startswith(f"{tmp_path / 'R'}: holds heads.csv, changed since the earlier run wrote it; a new run replaces")
    assert heads.read_text().startswith("Layer,head")


def _own_files(out: Path, work: str | None) -> set[str]:
    return {str(path.relative_to(out)) for path in out.rglob("*") if path.is_file()
            and path.name not in (MARKER, ".bertology-lock") and path.relative_to(out).parts[0] != work}


@pytest.mark.parametrize("study", ["analyze", "track", "pretrain"])
def test_a_rerun_into_a_clean_earlier_run_folder_replaces_it(tiny_bert_dir, corpus, tmp_path, study):
    out = tmp_path / "R"
    given = {
        "analyze": {"model": str(tiny_bert_dir), "corpus": corpus, **{f"run_{name}": False for name in ONLY_PROFILE}},
        "track": {"checkpoint": [str(tiny_bert_dir), str(tiny_bert_dir)], "steps": "0,10", "corpus": corpus, "bootstrap": 200},
        "pretrain": {"corpus": [write_books(tmp_path / "books")], "vocab_size": 120, "layers": 2, "heads": 2, "hidden": 32, "max_length": 32,
                     "batch_size": 8, "steps": 4, "checkpoints": 2},
    }[study]
    work = {"track": "parts"}.get(study)
    first = in_process(study, {**given, "out": out})
    assert first.exit_code == 0, first.output
    listed = json.loads((out / MARKER).read_text())["files"]
    assert set(listed) == _own_files(out, work)  # the run lists every file it wrote, with its bytes' sha256
    assert all(entry["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest() for name, entry in listed.items())
    (out / "manifest.json").touch()  # the same bytes at a new time (a copied folder): still the run's own
    earlier = (out / "manifest.json").stat().st_ino
    again = in_process(study, {**given, "out": out})
    assert again.exit_code == 0, again.output
    assert (out / "manifest.json").stat().st_ino != earlier  # written anew and swapped in whole
    assert set(json.loads((out / MARKER).read_text())["files"]) == _own_files(out, work)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("R")] == ["R"]
