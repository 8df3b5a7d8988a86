"""The README's "Your own analysis" example runs as it stands, and its family behaves like bertology's own."""

import json

import numpy as np
import pandas as pd
import pytest
from conftest import readme_example, run_offline

SECTION = "Your own analysis"


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


def test_a_registered_family_runs_in_the_same_pass_and_matches_a_computation_by_hand(tiny_bert, monkeypatch):
    """The example family on the tiny model, against numpy on the attention maps the engine hands out."""
    import bertology
    from bertology import families as registry  # the module
    from bertology.core.engine import Engine

    namespace: dict = {}
    code = readme_example(SECTION)
    exec(code[: code.index("bertology.register_family(")], namespace)
    monkeypatch.setattr(registry, "_registry", dict(registry.registered()))  # registered for this test only
    bertology.register_family(namespace["FirstPiece"]())
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
        bertology.register_family(namespace["FirstPiece"]())
