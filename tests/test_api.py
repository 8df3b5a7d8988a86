"""The Python API, and one end-to-end run on the bundled default model."""

import numpy as np

import bertology
from bertology.analyzers import PROFILE_METRICS

SENTENCES = [
    "The old lighthouse keeper climbed the stairs every evening.",
    "Where did you put the keys?",
    "She said, quietly, that the train had already left.",
    "Birds sing.",
]


def test_end_to_end_on_the_bundled_minilm(minilm, tmp_path):
    result = bertology.analyze(minilm, SENTENCES + [bertology.Example("A man plays guitar.", "Someone makes music.")], out=tmp_path, progress=False, head_distance_sample=1.0)
    heads = result.heads
    assert len(heads) == 6 * 12 * len(PROFILE_METRICS)
    assert (heads.n == 5).all()
    wide = heads.pivot_table(index=["layer", "head"], columns="metric", values="value")
    # Attention to a set never exceeds 1, and [CLS] + [SEP] + the rest is all of it.
    assert ((wide[["cls", "sep", "punct", "self", "prev", "next"]] >= 0) & (wide[["cls", "sep", "punct", "self", "prev", "next"]] <= 1)).all().all()
    assert (wide.entropy > 0).all()
    assert (heads.ci_low <= heads.value + 1e-12).all() and (heads.value <= heads.ci_high + 1e-12).all()
    assert result.head_map.shape == (72, 4)
    assert (tmp_path / "report.html").is_file() and (tmp_path / "manifest.json").is_file()
    assert "all-MiniLM-L6-v2" in result._repr_html_()


def test_results_are_deterministic(tiny_bert):
    first = bertology.analyze(tiny_bert, SENTENCES, progress=False, head_distance_sample=1.0)
    second = bertology.analyze(tiny_bert, SENTENCES, progress=False, head_distance_sample=1.0, batch_size=1)
    np.testing.assert_allclose(first.heads.value, second.heads.value, rtol=1e-5)
    np.testing.assert_allclose(first.head_map[["x", "y"]], second.head_map[["x", "y"]], rtol=1e-4, atol=1e-6)


def test_no_sampled_sequence_is_a_warning_not_a_failure(tiny_bert):
    result = bertology.analyze(tiny_bert, ["the cat sat."], progress=False, head_distance_sample=1e-9)
    assert result.head_map is None and "no sequence was sampled" in result.warnings[0]
