"""Issue 39: a decoder's report reads as a decoder's. One ``analyze`` run of the tiny GPT-2 under two views, and the text,
tables and figures its report shows: the kind's anchor words, blocks numbered alike in every figure, GPT-2's piece marks on
the thumbnails, whole layers and titles that fit on the views figure, no empty frame, each corpus-wide line once."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import pytest
from conftest import TEXTS

import bertology
from bertology.core.model.kinds import DECODER, ENCODER
from bertology.core.storage.runfolder import RunFolder
from bertology.families import get_family
from bertology.families.patterns.report import THUMBNAILS_PER_CLASS, WORD_START, pattern_thumbnails, shown_tokens
from bertology.families.profile.analyzer import profile_metric_names
from bertology.families.profile.report import metric_heatmaps, special_by_layer
from bertology.families.sinks.report import activations_by_layer, sink_map, sinks_section, weight_and_share_by_layer
from bertology.render.figures import HIDDEN_STATE_LABEL, METRIC_TITLES, plt
from bertology.studies.analyze.weightings import views_figure


@pytest.fixture(scope="module")
def run(tiny_gpt2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("decoder-report") / "run"
    result = bertology.analyze(str(tiny_gpt2_dir), TEXTS, weighting="attention,norm", out=out, progress=False, view=False)
    return result, out, html.unescape((out / "report.html").read_text())


def test_the_report_names_the_decoders_anchor_not_cls_or_sep(run):
    _, _, report = run
    assert "[CLS]'s rolled-out attention" not in report and "the [CLS] vector" not in report
    assert "The profile of the last position's rolled-out attention says which inputs the vector that predicts the next token" in report
    assert "heads that put their weight on [CLS] or [SEP]" not in report
    assert f"heads that put their weight on {DECODER.anchor_words} often mix in little" in report


def test_the_massive_activations_figure_numbers_blocks_as_every_other_figure(run):
    result, _, report = run
    activations = result.results["sinks"].tables["massive_activations"]
    assert sorted(activations.layer.unique()) == [0, 1, 2]  # the table: 0 the embeddings, then the two blocks' outputs
    figure = activations_by_layer(activations)
    axis = figure.axes[0]
    assert [label.get_text() for label in axis.get_xticklabels()] == ["emb.", "0", "1"]
    assert axis.get_xlabel() == HIDDEN_STATE_LABEL and "embeddings" in axis.get_xlabel()
    assert "layer 0: the embeddings" not in axis.get_title()
    plt.close(figure)
    assert "massive_activations.csv counts the embeddings as layer 0, so its layer l is block l - 1's output" in report


def test_thumbnails_mark_gpt2_pieces_as_byte_level_bpe_does(run):
    result, _, report = run
    examples = result.results["patterns"].extras["pattern_examples"]
    items = [item for kept in examples.values() for item in kept]
    assert items
    for item in items:
        shown = shown_tokens(item.tokens, item.text, DECODER)
        assert not any(token.startswith("##") for token in shown)
        # GPT-2's pieces: "Ġ" where a space goes before, the rest bare; together they spell the text
        assert "".join(shown).replace(WORD_START, " ") == item.text
        assert any(token.startswith(WORD_START) for token in shown)
    figure = pattern_thumbnails(examples, DECODER)
    drawn = [axis for axis in figure.axes if axis.images]
    items = [item for kept in examples.values() for item in kept[:THUMBNAILS_PER_CLASS]]  # the maps drawn
    assert len(drawn) == len(items)
    for axis, item in zip(drawn, items):
        assert [text.get_text() for text in axis.texts if text.get_gid() == "xtick"] == shown_tokens(item.tokens, item.text, DECODER)
    plt.close(figure)
    assert "pieces that begin a word after a space marked \u0120" in report and "marked ##" not in report
    # an encoder's thumbnails keep BERT's marks
    assert shown_tokens(["[CLS]", "un", "##believ", "[SEP]"], "unbeliev", ENCODER) == ["[CLS]", "un", "##believ", "[SEP]"]
    assert shown_tokens(["[CLS]", "the", "c", "##at", "."], "the cat.", DECODER) == ["BOS", "the", f"{WORD_START}c", "at", "."]


def test_the_views_figure_has_whole_layers_and_titles_that_fit(run):
    _, out, report = run
    table = pd.read_csv(out / "views_by_layer.csv")
    zero = [family for family, rows in table.groupby("family") if (rows.value.fillna(0) == 0).all()]
    shown = table[~table.family.isin(zero)]
    figure = views_figure(shown, ["attention", "norm"])
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    panels = [axis for axis in figure.axes if axis.get_title()]
    assert [axis.get_title() for axis in panels] == list(dict.fromkeys(shown.family))
    boxes = [axis.title.get_window_extent(renderer) for axis in panels]
    for left, right in zip(boxes, boxes[1:]):
        assert left.x1 < right.x0, "two panel titles overlap"
    for axis in panels:
        ticks = axis.get_xticks()
        assert np.array_equal(ticks, np.round(ticks)) and set(ticks) <= set(shown.layer)
        assert all("." not in label.get_text() for label in axis.get_xticklabels())
    assert "solid: attention weights" in figure._suptitle.get_text()
    plt.close(figure)
    # a family whose every value is 0 (roles, on this tiny model) is said in a line, not drawn as an empty panel
    assert zero and not set(zero) & set(shown.family)
    for family in zero:
        assert f"{family}: nothing to show: every value is 0 under every view" in report


def test_rates_that_are_all_zero_are_said_not_drawn(run, tmp_path):
    result, _, _ = run
    tables = result.results["sinks"].tables
    zero = tables["sink_rates"].assign(rate=0.0)
    figure = weight_and_share_by_layer(tables["sinks"], zero)
    assert len(figure.axes) == 1 and figure.axes[0].get_ylabel() == "to the first token (mean over heads)"
    plt.close(figure)
    section = sinks_section(RunFolder(tmp_path / "folder"), tables["sinks"], zero, tables["secondary_sinks"], tables["massive_activations"], 0.3, 1)
    assert any("nothing to show: every value is 0" in note for note in section.notes)
    assert all("Left: the share of sink heads" not in figure.caption for figure in section.figures)
    some = tables["sink_rates"].assign(rate=[0.25, 0.0, 0.125])
    figure = weight_and_share_by_layer(tables["sinks"], some)
    assert len(figure.axes) == 2
    plt.close(figure)


def test_a_corpus_wide_line_is_printed_once_whatever_the_views(run):
    result, _, report = run
    lines = get_family("profile").summary(result.results["profile"])
    assert sum(line.startswith("no head can be 'broad'") for line in lines) == 1
    assert [line.split("heads past")[0] for line in lines if "heads past Clark's thresholds" in line] == ["[attention weights] ", "[norm shares] "]
    assert report.count("No head can be labelled 'broad'") == 1


def test_a_random_models_figures_draw_its_near_uniform_heads_alike_beside_the_uniform_head(run):
    """Issue 49, on the run's own tables: the random GPT-2's heads all attend about as the uniform head does. Its entropy and
    distance maps run from 0 to the uniform head's (or the largest head's) value, so its heads share one colour and no bar
    writes an offset; the attention to the first token is drawn beside the uniform head's line (layers.csv's), and the sink
    map's title fits its figure."""
    result, _, report = run
    heads = result.results["profile"].tables["heads"].query("weighting == 'attention'")
    layers = result.results["profile"].tables["layers"].query("weighting == 'attention'")
    figure = metric_heatmaps(heads, profile_metric_names(DECODER))
    figure.canvas.draw()
    panels = {axis.get_title(): axis for axis in figure.axes if axis.images}
    for metric in ("entropy", "distance"):
        rows, image = heads[heads.metric == metric], panels[METRIC_TITLES[metric]].images[0]
        assert image.get_clim() == (0.0, max(rows.value.max(), rows.uniform.max()))
        assert np.ptp(image.norm(rows.value.to_numpy())) < 0.05  # about one colour: they differ by less than 5% of the scale
    assert all(axis.yaxis.get_offset_text().get_text() == "" for axis in figure.axes)
    plt.close(figure)
    figure = special_by_layer(heads, ("first", "punct"))
    uniform = {line.get_label(): line for line in figure.axes[0].get_lines()}["uniform head"]
    np.testing.assert_allclose(uniform.get_ydata(), layers[layers.metric == "first"].sort_values("layer").uniform)
    plt.close(figure)
    figure = sink_map(result.results["sinks"].tables["sinks"], 0.3)
    figure.canvas.draw()
    title = figure.axes[0].title.get_window_extent()
    assert figure.bbox.x0 <= title.x0 and title.x1 <= figure.bbox.x1 and title.y1 <= figure.bbox.y1
    plt.close(figure)
    assert "the dotted line the uniform head's on the same sequences" in report and "dotted: the uniform head's" in report
