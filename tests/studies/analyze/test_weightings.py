"""Both views of attention in one run (Kobayashi et al. 2020, METHODS.md section 7): one forward pass, a weighting
column in every table of a family that reads the maps, each view equal to a run of that view alone, and a report
section that sets them side by side."""

import pandas as pd
import pytest
from conftest import TEXTS

import bertology
from bertology.core.engine import capture
from bertology.families import FamilyResult
from bertology.studies.analyze.weightings import combine_views, disagreements

READ_THE_MAPS = ["profile", "roles", "patterns", "rollout"]


def _count_forward_passes(monkeypatch):
    calls = []
    original = capture.model_forward

    def counted(model, tensors, *args):
        calls.append(tensors["input_ids"].shape[0])
        return original(model, tensors, *args)

    monkeypatch.setattr(capture, "model_forward", counted)
    return calls


def test_both_views_share_one_pass_and_each_equals_its_own_run(tiny_bert, tmp_path, monkeypatch):
    calls = _count_forward_passes(monkeypatch)
    analyses = [*READ_THE_MAPS, "mixing"]
    both = bertology.analyze(tiny_bert, TEXTS, analyses=analyses, weighting="attention,norm", out=tmp_path / "both", progress=False, view=False)
    both_calls = len(calls)
    calls.clear()
    alone = {weighting: bertology.analyze(tiny_bert, TEXTS, analyses=analyses, weighting=weighting, progress=False, view=False)
             for weighting in ("attention", "norm")}
    assert both_calls == len(calls) // 2  # one forward pass per batch, whatever the number of views

    for name in ("heads", "layers", "roles", "role_shares", "patterns", "patterns_by_layer", "rollout"):
        table = both.table(name)
        assert list(table.columns)[0] == "weighting" and list(dict.fromkeys(table.weighting)) == ["attention", "norm"]
        for weighting, run in alone.items():
            rows = table[table.weighting == weighting].drop(columns="weighting").reset_index(drop=True)
            expected = run.table(name)
            expected = expected.drop(columns="weighting") if "weighting" in expected else expected
            pd.testing.assert_frame_equal(rows, expected.reset_index(drop=True), check_dtype=False)
    assert "weighting" not in alone["attention"].table("heads")  # the plain weights keep the tables they always had
    assert list(dict.fromkeys(alone["norm"].table("heads").weighting)) == ["norm"]
    assert "weighting" not in both.table("mixing")  # the mixing ratios do not read the maps: once, the same under both views
    pd.testing.assert_frame_equal(both.table("mixing"), alone["attention"].table("mixing"))

    # Norm shares are not the weights: on a random model they move attention around.
    heads = both.table("heads").pivot_table(index=["layer", "head", "metric"], columns="weighting", values="value")
    assert (heads.attention - heads.norm).abs().max() > 0.01

    folder = tmp_path / "both"
    for name in ("views_by_layer.csv", "views_by_layer.png", "heatmaps.png", "rollout_by_layer.png", "mixing_by_layer.png"):
        assert (folder / name).is_file(), name
    assert not list(folder.glob("norm_*")), "the families' sections show the first view; the views section shows both"
    report = (folder / "report.html").read_text()
    assert "Attention weights beside norm shares" in report and "The views disagree most on" in report
    assert "General attention profile — attention weights" in report
    views = pd.read_csv(folder / "views_by_layer.csv")
    assert set(views.weighting) == {"attention", "norm"} and set(views.family) == set(READ_THE_MAPS)
    layers = both.table("layers")[both.table("layers").metric == "cls"]
    for weighting in ("attention", "norm"):
        expected = layers[layers.weighting == weighting].set_index("layer").value
        got = views[(views.weighting == weighting) & (views.quantity == "attention to [CLS]")].set_index("layer").value
        pd.testing.assert_series_equal(got, expected, check_names=False)


def test_an_unknown_weighting_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(bertology.BertologyError, match="weighting"):
        bertology.analyze("no/such/model", ["a sentence"], weighting="norms", progress=False)


def test_combine_views_by_hand():
    first = FamilyResult(tables={"t": pd.DataFrame({"layer": [0, 1], "value": [1.0, 2.0]})}, documents={"d": {"x": 1}}, extras={"e": "A"})
    second = FamilyResult(tables={"t": pd.DataFrame({"layer": [0, 1], "value": [3.0, 4.0]})}, documents={"d": {"x": 2}}, extras={"e": "B"})
    combined = combine_views({"attention": first, "norm": second})
    assert combined.tables["t"].to_dict("list") == {"weighting": ["attention", "attention", "norm", "norm"], "layer": [0, 1, 0, 1],
                                                     "value": [1.0, 2.0, 3.0, 4.0]}
    assert combined.documents == {"d": {"weighting": "attention", "x": 1}, "d_norm": {"weighting": "norm", "x": 2}}
    assert combined.extras == {"e": "A", "e_norm": "B"}


def test_disagreements_rank_by_the_absolute_difference():
    table = pd.DataFrame({
        "weighting": ["attention"] * 3 + ["norm"] * 3,
        "family": ["profile"] * 6,
        "quantity": ["a", "a", "b"] * 2,
        "layer": [0, 1, 0] * 2,
        "value": [0.5, 0.2, 0.9, 0.1, 0.25, 0.95],
    })
    ranked = disagreements(table)
    assert list(zip(ranked.quantity, ranked.layer)) == [("a", 0), ("a", 1), ("b", 0)]
    assert ranked.difference.tolist() == pytest.approx([-0.4, 0.05, 0.05])


def test_a_layout_without_known_blocks_leaves_mixing_out_and_refuses_norms(tiny_bert, monkeypatch):
    from bertology.core.model.layouts import LAYOUTS

    monkeypatch.delitem(LAYOUTS, "bert")  # as if bertology did not know BERT's blocks
    result = bertology.analyze(tiny_bert, TEXTS, progress=False, view=False, analyses=None)
    assert "mixing" not in result.results and "rollout" in result.results
    assert any("mixing left out" in warning for warning in result.warnings)
    with pytest.raises(bertology.BertologyError, match="know the attention blocks"):
        bertology.analyze(tiny_bert, TEXTS, progress=False, view=False, weighting="norm")
    with pytest.raises(bertology.BertologyError, match="know the attention blocks"):
        bertology.analyze(tiny_bert, TEXTS, progress=False, view=False, analyses=["mixing"])
