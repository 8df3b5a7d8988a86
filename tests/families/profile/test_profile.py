import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.spatial.distance import jensenshannon

from bertology.core.model.kinds import ENCODER
from bertology.families.profile import analyzer as profile_analyzer
from bertology.families.profile.analyzer import clark_labels, clark_threshold_values, pairwise_js, profile_metric_names, profile_metrics

PROFILE_METRICS = profile_metric_names(ENCODER)


def by_hand(a: np.ndarray, cls: list[int], sep: list[int], punct: list[int]) -> dict:
    """Clark et al.'s metrics of one n x n map, written as plain loops (METHODS.md section 1)."""
    n = a.shape[0]
    smoothed = 0.9999 * a + 0.0001 / n
    row_entropy = [-sum(smoothed[i, j] * math.log(smoothed[i, j]) for j in range(n)) for i in range(n)]
    return {
        "cls": sum(a[i, j] for i in range(n) for j in cls) / n,
        "sep": sum(a[i, j] for i in range(n) for j in sep) / n,
        "punct": sum(a[i, j] for i in range(n) for j in punct) / n,
        "self": sum(a[i, i] for i in range(n)) / n,
        "prev": sum(a[i, i - 1] for i in range(1, n)) / n,
        "next": sum(a[i, i + 1] for i in range(n - 1)) / n,
        "entropy": sum(row_entropy) / n,
        "cls_entropy": row_entropy[cls[0]],
        "distance": sum(a[i, j] * abs(i - j) for i in range(n) for j in range(n)) / n,
    }


def padded_batch(maps, flags):
    """Stack maps of different n into one zero-padded batch of one head, with masks."""
    width = max(m.shape[0] for m in maps)
    attention = torch.zeros(len(maps), 1, width, width, dtype=torch.float64)
    masks = {name: torch.zeros(len(maps), width, dtype=torch.bool) for name in ("mask", "cls", "sep", "punct")}
    for b, (m, (cls, sep, punct)) in enumerate(zip(maps, flags)):
        n = m.shape[0]
        attention[b, 0, :n, :n] = torch.tensor(m)
        masks["mask"][b, :n] = True
        masks["cls"][b, cls] = True
        masks["sep"][b, sep] = True
        masks["punct"][b, punct] = True
    return attention, masks


@pytest.mark.parametrize("cells_at_once", [1 << 19, 30, 1], ids=["every-row", "two-rows", "one-row"])
def test_metrics_match_hand_computation_on_sequences_of_different_length(monkeypatch, cells_at_once):
    monkeypatch.setattr(profile_analyzer, "CELLS_AT_ONCE", cells_at_once)  # the entropy's rows smoothed at a time
    rng = np.random.default_rng(0)
    short = rng.dirichlet(np.ones(4), size=4)  # [CLS] w , [SEP]
    long = rng.dirichlet(np.full(7, 0.3), size=7)  # [CLS] w w [SEP] w . [SEP]
    flags = [([0], [3], [2]), ([0], [3, 6], [5])]
    attention, m = padded_batch([short, long], flags)
    values = profile_metrics(attention, m["mask"], {"cls": m["cls"], "sep": m["sep"]}, m["punct"], ENCODER).numpy()
    for b, (matrix, (cls, sep, punct)) in enumerate(zip([short, long], flags)):
        expected = by_hand(matrix, cls, sep, punct)
        for k, metric in enumerate(PROFILE_METRICS):
            assert values[b, 0, k] == pytest.approx(expected[metric], rel=1e-10), metric


def test_uniform_attention_has_entropy_ln_n_and_self_one_over_n():
    n = 6
    attention, m = padded_batch([np.full((n, n), 1 / n)], [([0], [5], [])])
    values = dict(zip(PROFILE_METRICS, profile_metrics(attention, m["mask"], {"cls": m["cls"], "sep": m["sep"]}, m["punct"], ENCODER)[0, 0].tolist()))
    assert values["entropy"] == pytest.approx(math.log(n))
    assert values["cls_entropy"] == pytest.approx(math.log(n))
    assert values["self"] == pytest.approx(1 / n)
    assert values["cls"] == pytest.approx(1 / n)
    assert values["punct"] == 0


def test_previous_token_head():
    n = 5
    a = np.zeros((n, n))
    a[0, 0] = 1
    for i in range(1, n):
        a[i, i - 1] = 1
    attention, m = padded_batch([a], [([0], [4], [])])
    values = dict(zip(PROFILE_METRICS, profile_metrics(attention, m["mask"], {"cls": m["cls"], "sep": m["sep"]}, m["punct"], ENCODER)[0, 0].tolist()))
    assert values["prev"] == pytest.approx((n - 1) / n)
    assert values["next"] == 0
    assert values["self"] == pytest.approx(1 / n)
    assert values["distance"] == pytest.approx((n - 1) / n)


@pytest.mark.parametrize("cells_at_once", [1 << 19, 40, 20, 1])  # every row at once, 2 and 1 rows of the 4 heads' 5 keys, 1 row
def test_pairwise_js_equals_scipy_squared_distance_summed_over_rows(monkeypatch, cells_at_once):
    monkeypatch.setattr(profile_analyzer, "CELLS_AT_ONCE", cells_at_once)
    rng = np.random.default_rng(3)
    heads = rng.dirichlet(np.ones(5), size=(4, 5))  # 4 heads, 5 rows of 5 keys
    heads[2, :, 4] = 0  # zeros are allowed (padding, hard attention)
    heads[2] /= heads[2].sum(axis=1, keepdims=True)
    matrix = pairwise_js(torch.tensor(heads)).numpy()
    for x in range(4):
        for y in range(4):
            expected = sum(jensenshannon(heads[x, i], heads[y, i]) ** 2 for i in range(5))
            assert matrix[x, y] == pytest.approx(expected, abs=1e-12)


def test_clark_labels_apply_the_thresholds():
    heads = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "metric": ["entropy", "entropy", "sep", "prev"],
            "value": [4.0, 3.0, 0.7, 0.5],
            "ci_low": 0.0,
            "ci_high": 1.0,
            "n": 10,
        }
    )
    labels = clark_labels(heads, clark_threshold_values(ENCODER))
    assert labels[["layer", "head", "label"]].values.tolist() == [[0, 0, "broad"], [1, 0, "sep"]]
    assert clark_labels(heads, {"prev": 0.4}).label.tolist() == ["prev"]


def test_clark_labels_need_an_excess_over_the_uniform_head_but_broad():
    heads = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "metric": ["entropy", "sep", "sep", "prev"],
                          "value": [4.0, 0.7, 0.7, 0.6], "uniform": [4.1, 0.7, 0.2, 0.55], "excess": [-0.1, 0.0, 0.5, 0.05],
                          "excess_ci_low": [-0.2, -1e-9, 0.4, -0.01]})
    labels = clark_labels(heads, clark_threshold_values(ENCODER))
    # broad stays (high entropy is the uniform head's own mark); 0-1 and 1-1 do no more than a uniform head
    assert labels[["layer", "head", "label"]].values.tolist() == [[0, 0, "broad"], [1, 0, "sep"]]
    assert labels.uniform.tolist() == [4.1, 0.2]


@pytest.mark.parametrize("piece, upos, clark", [
    (".", True, True), (",", True, True), ("\u0120.", True, True), ("##,", True, True), (";", True, False), ("!", True, False),
    ("...", True, False), ("\u2581,", True, True), ("a.", False, False), ("", False, False),
    # Unicode punctuation beyond ASCII (UPOS PUNCT): dashes, quotes, guillemets, inverted marks, CJK and Devanagari stops
    ("\u2014", True, False), ("\u201c", True, False), ("\u00ab", True, False), ("\u00bf", True, False), ("\u3002", True, False),
    ("\u0964", True, False), ("##\u2026", True, False),
    # ASCII symbols are not punctuation (category S): $ + < = > ^ ` | ~
    ("$", False, False), ("+", False, False), ("=", False, False), ("|", False, False), ("~", False, False),
])
def test_punctuation_sets(piece, upos, clark):
    from bertology.core.model.models import is_punctuation

    assert (is_punctuation(piece, "upos"), is_punctuation(piece, "clark")) == (upos, clark)


PUNCT_TEXT = "we saw it; the dog ran! the cat, the dog."
# every query sends 0.25 to [CLS], 0.1 to ";", 0.2 to "!", 0.3 to "," and 0.15 to "."
PUNCT_WEIGHTS = {"[CLS]": 0.25, ";": 0.1, "!": 0.2, ",": 0.3, ".": 0.15}


@pytest.mark.parametrize("punct, expected", [("upos", 0.75), ("clark", 0.45)])
def test_punct_set_upos_or_clark_on_a_hand_made_map(tiny_bert, punct, expected):
    import dataclasses

    from bertology.core.engine import Engine, RunStats
    from bertology.core.text.corpora import Example
    from bertology.families.profile.analyzer import GeneralProfile

    engine = Engine(tiny_bert, progress=False, punct=punct)
    (items,) = list(engine.batches(engine.encode(enumerate([Example(PUNCT_TEXT)]), RunStats())))
    batch = engine.run_batch(items)
    tokens = tiny_bert.tokenizer.convert_ids_to_tokens(items[0].input_ids)
    assert tokens[1:-1] == ["we", "saw", "it", ";", "the", "dog", "ran", "!", "the", "cat", ",", "the", "dog", "."]
    members = {";", "!", ",", "."} if punct == "upos" else {",", "."}
    assert batch.punct_mask[0].tolist() == [token in members for token in tokens]
    row = np.array([PUNCT_WEIGHTS.get(token, 0.0) for token in tokens])
    attention = torch.tensor(np.tile(row, (len(tokens), 1)), dtype=torch.float64)
    assert attention.sum(-1).allclose(torch.ones(len(tokens), dtype=torch.float64))
    profile = GeneralProfile(ENCODER)
    profile.update(dataclasses.replace(batch, attentions=attention.expand(2, 1, 4, -1, -1).clone()))
    values = profile.result().query("metric == 'punct'").value
    by_numpy = np.mean([sum(attention[i, j].item() for j in range(len(tokens)) if tokens[j] in members) for i in range(len(tokens))])
    assert by_numpy == pytest.approx(expected, abs=1e-12)
    assert values.tolist() == pytest.approx([by_numpy] * 8, abs=1e-12)


def test_punct_reaches_the_engine_from_the_api_and_the_command_line(tiny_bert, tiny_bert_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from bertology.api import analyze
    from bertology.cli import app
    from bertology.core.errors import BertologyError

    tokens = tiny_bert.tokenizer.convert_ids_to_tokens(tiny_bert.tokenizer(PUNCT_TEXT)["input_ids"])
    attentions = torch.stack(tiny_bert.model(**tiny_bert.tokenizer(PUNCT_TEXT, return_tensors="pt"), output_attentions=True).attentions)[:, 0]
    for punct, members in (("upos", {";", "!", ",", "."}), ("clark", {",", "."})):
        result = analyze(tiny_bert, [PUNCT_TEXT], analyses=["profile"], punct=punct, view=False, progress=False)
        assert result.settings["punct"] == punct
        columns = [j for j, token in enumerate(tokens) if token in members]
        expected = attentions[..., columns].sum(-1).mean(-1).detach().numpy().ravel()  # [layer, head]
        np.testing.assert_allclose(result.table("heads").query("metric == 'punct'").value, expected, rtol=1e-5)
    with pytest.raises(BertologyError, match="unknown punctuation set 'ptb': use upos or clark"):
        analyze(tiny_bert, [PUNCT_TEXT], analyses=["profile"], punct="ptb", view=False, progress=False)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PUNCT_TEXT + "\n")
    out = tmp_path / "run"
    outcome = CliRunner().invoke(app, ["analyze", "-m", str(tiny_bert_dir), "-c", str(corpus), "-o", str(out), "--punct", "clark",
                                       "--no-roles", "--no-patterns", "-q"])
    assert outcome.exit_code == 0, outcome.output
    assert json.loads((out / "manifest.json").read_text())["settings"]["punct"] == "clark"
    assert "(--punct clark)" in (out / "report.html").read_text()


def test_head_distance_sample_does_not_depend_on_the_file_name(tiny_bert):
    from conftest import TEXTS

    from bertology.core.engine import Engine
    from bertology.core.text.corpora import Example
    from bertology.families.profile.analyzer import HeadDistance

    def matrix(name):
        analyzer = HeadDistance(sample=0.5, seed=1)
        Engine(tiny_bert, progress=False).run([Example(text, source=f"{name}:{line}") for line, text in enumerate(TEXTS, 1)], [analyzer])
        return analyzer._rows, analyzer.matrix()

    (rows, first), (rows_again, second) = matrix("corpus.txt"), matrix("other/folder/renamed.txt")
    assert 0 < rows == rows_again < sum(len(tiny_bert.tokenizer(t)["input_ids"]) for t in TEXTS)
    np.testing.assert_array_equal(first, second)


def test_clark_thresholds_say_what_the_corpus_allows(tiny_bert, tmp_path):
    """The mean entropy of a head is at most the mean over sequences of ln n (uniform attention): on short sentences
    Clark's "broad" (3.8 nats) cannot be reached, and the table, the report and the summary say so (issue 26)."""
    import bertology
    from bertology.families import get_family

    texts = ["the cat sat on the mat.", "where is the dog?", "we saw it.", "they walked slowly to the house; the dog was running."]
    result = bertology.analyze(tiny_bert, texts, analyses=["profile"], out=tmp_path / "run", progress=False, view=False)
    lengths = [len(tiny_bert.tokenizer(text)["input_ids"]) for text in texts]
    clark = result.results["profile"].tables["clark_thresholds"].set_index("label")
    assert clark.loc["broad", "corpus_max"] == pytest.approx(np.mean(np.log(lengths)), rel=1e-12)
    assert not clark.loc["broad", "reachable"] and clark.drop("broad").reachable.all()
    heads = result.results["profile"].tables["heads"]
    assert heads[heads.metric == "entropy"].value.max() <= clark.loc["broad", "corpus_max"] + 1e-9
    import html

    assert "No head can be labelled 'broad' on this corpus" in html.unescape((tmp_path / "run" / "report.html").read_text())
    assert any(line.startswith("no head can be 'broad'") for line in get_family("profile").summary(result.results["profile"]))
    assert (tmp_path / "run" / "clark_thresholds.csv").is_file()


def test_heatmaps_share_one_scale_for_the_shares_and_keep_their_own_for_entropy_and_distance():
    """Issue 26: [SEP] (max 0.18) must not look as hot as [CLS] (0.8): the six shares of attention are drawn on one
    0-1 scale with one colour bar; entropy and distance keep their own bars, labelled with their units, from 0 to the larger
    of their largest head and the uniform head's value (issue 49)."""
    from bertology.families.profile.report import METRIC_UNITS, SHARE_METRICS, metric_heatmaps
    from bertology.render.figures import METRIC_TITLES

    rng = np.random.default_rng(0)
    rows = [(layer, head, metric, rng.uniform(0, 0.8 if metric == "cls" else 0.18 if metric in SHARE_METRICS else 4.0))
            for layer in range(3) for head in range(4) for metric in PROFILE_METRICS]
    heads = pd.DataFrame(rows, columns=["layer", "head", "metric", "value"])
    heads["uniform"] = heads.metric.map({"entropy": 4.5, "cls_entropy": 1.0}).fillna(2.0)  # above, below and amid the heads' values
    figure = metric_heatmaps(heads, PROFILE_METRICS)
    drawn = {axis.get_title(): axis for axis in figure.axes if axis.images}
    for metric in PROFILE_METRICS:
        image = drawn[METRIC_TITLES[metric]].images[0]
        grid = heads[heads.metric == metric].pivot(index="layer", columns="head", values="value").to_numpy()
        np.testing.assert_array_equal(image.get_array(), grid)
        expected = (0.0, 1.0) if metric in SHARE_METRICS else (0.0, max(grid.max(), heads[heads.metric == metric].uniform.max()))
        assert image.get_clim() == pytest.approx(expected), metric
    bars = [bar.ax.get_ylabel() for bar in {image.colorbar for axis in figure.axes for image in axis.images if image.colorbar is not None}]
    assert sorted(bars) == sorted(["share of attention", *(METRIC_UNITS[m] for m in PROFILE_METRICS if m not in SHARE_METRICS)])


def test_the_head_map_labels_only_where_labels_do_not_collide_with_a_legend_entry_per_layer():
    from bertology.families.profile.report import head_map_figure

    rng = np.random.default_rng(1)
    embedding = pd.DataFrame([(layer, head, *rng.normal(scale=0.05 if head else 1.0, size=2)) for layer in range(4) for head in range(8)],
                             columns=["layer", "head", "x", "y"])  # a dense cluster, and one outlier per layer
    figure = head_map_figure(embedding)
    axis = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in axis.texts]
    assert 4 <= len(boxes) < len(embedding)  # the crowd is thinned out
    assert not any(a.overlaps(b) for k, a in enumerate(boxes) for b in boxes[k + 1:])
    assert {f"{layer}-0" for layer in range(4)} <= {text.get_text() for text in axis.texts}  # the outliers are named
    assert min(text.get_fontsize() for text in axis.texts) >= 8
    assert [text.get_text() for text in axis.get_legend().get_texts()] == [f"layer {layer}" for layer in range(4)]
    colours = [tuple(collection.get_facecolor()[0]) for collection in axis.collections]
    assert len(set(colours)) == 4


def test_the_head_map_recovers_distances_that_a_plane_holds_and_keeps_its_map_whatever_the_seed():
    """The MDS map (classical scaling, then SMACOF) of heads whose distances are those of points in a plane gives the same
    distances back (Euclidean, up to rotation and reflection), and the map does not depend on the seed."""
    from scipy.spatial.distance import pdist, squareform

    from bertology.families.profile.analyzer import HeadDistance

    points = np.random.default_rng(5).normal(size=(2 * 6, 2))  # 2 layers x 6 heads
    embeddings = []
    for seed in (0, 7):
        distance = HeadDistance(seed=seed)
        distance._shape, distance._rows, distance._within_rows, distance._cross_rows = (2, 6), 10, 10, 10
        distance._total = squareform(pdist(points)) * 10  # sums over 10 rows
        embedding = distance.embedding()
        assert list(embedding[["layer", "head"]].itertuples(index=False, name=None)) == [(layer, head) for layer in range(2) for head in range(6)]
        np.testing.assert_allclose(pdist(embedding[["x", "y"]].to_numpy()), pdist(points), atol=1e-3)
        embeddings.append(embedding)
    pd.testing.assert_frame_equal(*embeddings)
