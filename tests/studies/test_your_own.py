"""The README's "Your own study" example runs as it stands: a study added by registering it alone (no other file of bertology
touched) gets its command, writes its folder through the one finish, and passes every check bertology's own studies pass."""

import json

import pandas as pd
import pytest
from conftest import TEXTS, readme_example, run_offline

from bertology.testing import parametrize_with_checks

SECTION = "Your own study"


def readme_study():
    """The README's study, defined (not registered) from its text."""
    namespace = {}
    exec(readme_example(SECTION).split("\nregister_study(")[0], namespace)
    return namespace["PieceCounts"]()


PIECES = readme_study()


def test_the_readme_study_runs_as_a_command_and_counts_the_pieces_the_tokenizer_makes(tmp_path):
    result = run_offline(readme_example(SECTION), tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "runs" / "pieces"
    table = pd.read_csv(out / "pieces.csv")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["corpus"]["name"] == "sample" and "versions" in manifest
    assert "20 examples" in result.stdout and "Word pieces per example" in (out / "report.html").read_text()

    from bertology.core.model.models import load_model
    from bertology.core.text.corpora import open_corpus

    examples, _ = open_corpus(None, "auto", 20)
    tokenizer = load_model(None, device="cpu").tokenizer
    expected = [len(tokenizer(e.text, e.text_pair)["input_ids"]) for e in examples]
    assert table.pieces.tolist() == expected and table.example.tolist() == list(range(20))


@pytest.fixture
def pieces_study():
    """The README's study registered in this process (and taken out again)."""
    from bertology import studies

    study = studies.register_study(PIECES)
    yield study
    del studies._registry[study.name]


@parametrize_with_checks(studies=[PIECES])
def test_the_readme_study_passes_the_study_checks(study, check, pieces_study, tmp_path):
    # its --help is skipped (the study is registered in this process only) and checked through build_app below
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    check(study, out=tmp_path / "runs" / "pieces", corpus=corpus, limit=12)


def test_a_registered_study_gets_its_command_with_the_shared_options(pieces_study):
    from typer.testing import CliRunner

    from bertology.cli import build_app

    outcome = CliRunner().invoke(build_app(), ["pieces", "--help"])
    assert outcome.exit_code == 0
    for flag in ("--model", "--corpus", "--format", "--limit", "--out"):
        assert flag in outcome.output
    assert "Hub name or local folder" in outcome.output  # the shared group's help, declared once


def test_the_readmes_test_file_for_the_study_runs_each_check_as_its_own_test(tmp_path):
    """The README's test file, beside its module, run by pytest as a user runs it: every check passes, its --help's too (the
    module registers the study, so a fresh interpreter that imports it has the command, and it imports nothing heavy)."""
    from bertology.testing import STUDY_CHECKS

    code = readme_example(SECTION)
    (tmp_path / "pieces.py").write_text(code[: code.index("\n", code.index("\nregister_study(") + 1)])
    (tmp_path / "corpus.txt").write_text("\n".join(TEXTS) + "\n")
    (tmp_path / "test_pieces.py").write_text(readme_example(SECTION, 1))
    result = run_offline("import sys, pytest; sys.exit(pytest.main(['-v', '-rs', '-p', 'no:cacheprovider', 'test_pieces.py']))", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    for name in STUDY_CHECKS:
        assert f"test_pieces[pieces-{name}] PASSED" in result.stdout
    assert f" {len(STUDY_CHECKS)} passed in " in result.stdout
    assert {path.name for path in tmp_path.iterdir()} - {"__pycache__"} == {"corpus.txt", "pieces.py", "test_pieces.py"}  # runs went to temporary folders
