"""The README's "Your own analysis" example runs as it stands, and its family behaves like bertology's own."""

import json
import sys
import types

import numpy as np
import pandas as pd
import pytest
from conftest import TEXTS, readme_example, run_offline, tiny_examples

from bertology.testing import parametrize_with_checks

SECTION = "Your own analysis"


def readme_module() -> str:
    """The README's example up to the line that registers its family: what a user's module ``first_piece.py`` holds."""
    code = readme_example(SECTION)
    return code[: code.index("\n", code.index("bertology.register_family("))]


def readme_classes() -> dict:
    """The README's analyzer and family classes, defined (not registered) from its text in a module ``first_piece`` of their
    own, as a user's module holds them (pickling finds a class by its module)."""
    module = types.ModuleType("first_piece")
    code = readme_module()
    exec(code[: code.index("bertology.register_family(")], module.__dict__)
    sys.modules.setdefault(module.__name__, module)
    return vars(sys.modules[module.__name__])


README_CLASSES = readme_classes()


@pytest.fixture
def first_piece_registered(monkeypatch):
    """The README's family registered for one test, after bertology's commands are made (so that it gets none, which would
    outlive the test)."""
    import bertology
    from bertology import families as registry  # the module
    from bertology.studies import registered_studies

    registered_studies()
    monkeypatch.setattr(registry, "_registry", dict(registry.registered()))
    return bertology.register_family(README_CLASSES["FirstPiece"]())


def test_the_readme_example_runs_and_its_table_and_section_land_in_the_run_folder(tmp_path):
    result = run_offline(readme_example(SECTION), tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "runs" / "first-piece"
    table = pd.read_csv(out / "first_piece.csv")
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(table.columns) == ["layer", "head", "value", "ci_low", "ci_high", "n"] and len(table) == 6 * 12
    assert (table.n == manifest["stats"]["sequences"]).all() and manifest["settings"]["analyses"] == ["profile", "first_piece"]
    assert ((table.value > 0) & (table.value < 1)).all()
    assert (out / "heads.csv").is_file() and "Attention to the first piece of the word" in (out / "report.html").read_text()


def test_a_registered_family_runs_in_the_same_pass_and_matches_a_computation_by_hand(tiny_bert, first_piece_registered):
    """The example family on the tiny model, against numpy on the attention maps the engine hands out."""
    import bertology
    from bertology.core.engine import Engine

    texts = ["unbelievably, tokenization splits words!", "the cat walked slowly.", "we saw it."]
    result = bertology.analyze(tiny_bert, texts, analyses=["first_piece"], progress=False, view=False)

    captured = []
    Engine(tiny_bert, progress=False).run([bertology.Example(t) for t in texts],
                                         [type("Capture", (), {"update": lambda self, batch: captured.append(batch)})()])
    values = []
    for batch in captured:
        for b, alignment in enumerate(batch.alignments):
            words = alignment.assignment.argmax(0)
            attention = batch.attentions[:, b].double().numpy()
            cells = [attention[:, :, i, list(words).index(words[i])] for i in range(len(words)) if alignment.unit_is_word[words[i]]]
            values.append(np.mean(cells, axis=0))
    expected = np.mean(values, axis=0)
    np.testing.assert_allclose(result.table("first_piece").value.to_numpy().reshape(expected.shape), expected, rtol=1e-12)
    with pytest.raises(bertology.BertologyError, match="registered already"):
        bertology.register_family(README_CLASSES["FirstPiece"]())


@parametrize_with_checks(families=[README_CLASSES["FirstPiece"]()])
def test_the_readme_family_passes_the_family_checks(family, check, first_piece_registered, tiny_bert):
    check(family, model=tiny_bert, corpus=TEXTS)  # registered after bertology made its commands: its command's check is skipped


@parametrize_with_checks(analyzers=[README_CLASSES["FirstPieceAttention"]])
def test_the_readme_analyzer_passes_the_analyzer_contract(analyzer, check, tiny_bert):
    check(analyzer, tiny_bert, tiny_examples())


def test_the_readmes_test_file_for_the_family_runs_each_check_as_its_own_test(tmp_path):
    """The README's test file, beside its module, run by pytest as a user runs it (the bundled model and corpus)."""
    (tmp_path / "first_piece.py").write_text(readme_module())
    (tmp_path / "test_first_piece.py").write_text(readme_example(SECTION, 1))
    result = run_offline("import sys, pytest; sys.exit(pytest.main(['-v', '-rs', '-p', 'no:cacheprovider', 'test_first_piece.py']))", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    for name in ("tables_declared", "section_renders_full", "section_renders_empty", "options_round_trip"):  # registered first, it has a command
        assert f"test_first_piece[first_piece-{name}] PASSED" in result.stdout
    assert " 4 passed in " in result.stdout
