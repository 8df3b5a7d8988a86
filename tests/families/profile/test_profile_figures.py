"""Issue 49: the profile's figures as a reader sees them on a model whose heads all attend about uniformly (a random one): no
noise stretched over a colour scale, no offset text over a title, every title and label inside the figure, and the uniform
head's line beside the attention to the special tokens."""

import numpy as np
import pandas as pd
import pytest

from bertology.core.model.kinds import DECODER, ENCODER
from bertology.families.profile.analyzer import profile_metric_names
from bertology.families.profile.report import SHARE_METRICS, metric_heatmaps, special_by_layer
from bertology.render.figures import METRIC_TITLES, plt

#: The uniform head's value of each metric on these made-up sequences, and how far the heads stray from it.
UNIFORM = {"entropy": 2.4262, "cls_entropy": 2.4262, "distance": 14.2319}


def near_uniform_heads(kind, layers: int = 2, heads: int = 4) -> pd.DataFrame:
    """heads.csv of a model whose heads all attend about uniformly: entropies 2.42600 ... 2.42601 nats (1e-5 apart, under the
    uniform head's 2.4262), distances 14.2288 ... 14.2335 tokens (about the uniform head's), shares about 1/15."""
    metrics = profile_metric_names(kind)
    table = pd.MultiIndex.from_product([range(layers), range(heads), metrics], names=["layer", "head", "metric"]).to_frame(index=False)
    step = (table.layer * heads + table["head"]) / max(layers * heads - 1, 1)  # 0 ... 1 over the heads
    low = table.metric.map({"entropy": 2.42600, "cls_entropy": 2.42600, "distance": 14.2288}).fillna(0.0682)
    width = table.metric.map({"entropy": 1e-5, "cls_entropy": 1e-5, "distance": 0.0047}).fillna(4e-4)
    table["value"] = low + width * step
    table["uniform"] = table.metric.map(UNIFORM).fillna(0.0685)
    return table


def drawn_panels(figure) -> dict:
    return {axis.get_title(): axis for axis in figure.axes if axis.images}


@pytest.mark.parametrize("kind", [ENCODER, DECODER])
def test_entropy_and_distance_of_heads_1e5_apart_are_drawn_alike_on_a_scale_from_0(kind):
    heads = near_uniform_heads(kind)
    figure = metric_heatmaps(heads, profile_metric_names(kind))
    figure.canvas.draw()
    panels = drawn_panels(figure)
    for metric in set(UNIFORM) & set(profile_metric_names(kind)):
        image = panels[METRIC_TITLES[metric]].images[0]
        values = heads[heads.metric == metric].value.to_numpy()
        low, high = image.get_clim()
        assert low == 0.0 and high == pytest.approx(max(values.max(), UNIFORM[metric]))  # 0 to the uniform head, or the largest head
        assert high - low >= UNIFORM[metric]  # the floor: the uniform head's value, not the heads' 1e-5
        shades = image.norm(values)
        assert shades.max() - shades.min() < 1e-3  # heads that barely differ get one colour, not the whole scale
        assert shades.min() > 0.99  # near the top: each one attends about as evenly as the uniform head
    for axis in figure.axes:  # panels and colour bars: no offset text anywhere, every tick written whole
        assert axis.xaxis.get_offset_text().get_text() == "" and axis.yaxis.get_offset_text().get_text() == ""
    bars = {image.colorbar for axis in figure.axes for image in axis.images if image.colorbar is not None}
    for bar in bars:
        labels = [label.get_text().replace("\u2212", "-") for label in bar.ax.get_yticklabels()]
        assert 2 <= len(labels) <= 8 and len(set(labels)) == len(labels)
        np.testing.assert_allclose([float(label) for label in labels], bar.get_ticks(), atol=1e-12)
    plt.close(figure)


@pytest.mark.parametrize("kind", [ENCODER, DECODER])
@pytest.mark.parametrize(("layers", "heads"), [(1, 1), (2, 4), (6, 12)])
def test_every_title_and_label_of_the_heat_maps_lies_inside_the_figure_and_apart(kind, layers, heads):
    """A tiny model's panels are small: each title, axis label and colour-bar label must still fit in the figure, and no
    title may lie over another or over a panel's axis label."""
    figure = metric_heatmaps(near_uniform_heads(kind, layers, heads), profile_metric_names(kind))
    figure.canvas.draw()
    whole = figure.bbox
    visible = [axis for axis in figure.axes if axis.get_visible()]
    titles = [axis.title.get_window_extent() for axis in visible if axis.get_title()]
    labels = [text.get_window_extent() for axis in visible for text in (axis.xaxis.label, axis.yaxis.label) if text.get_text()]
    assert len(titles) == len(profile_metric_names(kind)) and len(labels) >= 3
    for box in titles + labels:
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, box
    assert not any(a.overlaps(b) for k, a in enumerate(titles) for b in titles[k + 1:] + labels)
    plt.close(figure)


@pytest.mark.parametrize("kind", [ENCODER, DECODER])
def test_the_special_tokens_figure_draws_the_uniform_heads_line_from_0(kind):
    heads = near_uniform_heads(kind, layers=3)
    heads.loc[heads.metric.isin(SHARE_METRICS), "uniform"] = heads.layer.map({0: 0.05, 1: 0.0685, 2: 0.09})  # one value per layer
    metrics = (*kind.anchors, "punct")
    figure = special_by_layer(heads, metrics)
    figure.canvas.draw()
    for axis, metric in zip(figure.axes, metrics):
        lines = {line.get_label(): line for line in axis.get_lines()}
        expected = [heads[(heads.metric == metric) & (heads.layer == layer)].uniform.mean() for layer in range(3)]
        np.testing.assert_allclose(lines["uniform head"].get_ydata(), expected)
        np.testing.assert_array_equal(lines["uniform head"].get_xdata(), [0, 1, 2])
        bottom, top = axis.get_ylim()
        assert bottom == 0.0 and top >= max(heads[heads.metric == metric].value.max(), max(expected))  # every dot and line shown
        assert axis.yaxis.get_offset_text().get_text() == ""
    assert [text.get_text() for text in figure.axes[0].get_legend().get_texts()] == ["one head", "layer mean", "uniform head"]
    plt.close(figure)
