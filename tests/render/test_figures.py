"""The head grids' labels and layout at 72 and at 1,024 heads: numbers outside the map, axis labels past them, colour bars apart."""

import numpy as np
import pandas as pd
import pytest

from bertology.core.model.kinds import DECODER, ENCODER
from bertology.families.profile.analyzer import profile_metric_names
from bertology.families.profile.report import metric_heatmaps
from bertology.render.figures import head_grid, head_grid_size, head_ticks, panel_colorbar, panel_grid, plt


def labels(axis, gid: str) -> list:
    return [text for text in axis.texts if text.get_gid() == gid]


@pytest.mark.parametrize(("layers", "heads", "named_heads"), [(6, 12, [str(h) for h in range(12)]), (32, 32, [str(h) for h in range(0, 32, 4)])])
def test_head_ticks_name_the_heads_outside_the_map_with_the_axis_labels_past_them(layers, heads, named_heads):
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.imshow(np.zeros((layers, heads)), aspect="auto")
    head_ticks(axis, range(layers), range(heads))
    figure.canvas.draw()
    frame = axis.get_window_extent()
    x, y = labels(axis, "xtick"), labels(axis, "ytick")
    assert [text.get_text() for text in x] == named_heads  # every head up to 16, else every 4th of 32
    assert [text.get_position()[0] for text in x] == [int(name) for name in named_heads]
    assert len(y) == (layers if layers <= 16 else 8) and axis.get_xticks().size == 0 and axis.get_yticks().size == 0
    x_boxes, y_boxes = [text.get_window_extent() for text in x], [text.get_window_extent() for text in y]
    assert all(box.y1 <= frame.y0 for box in x_boxes) and all(box.x1 <= frame.x0 for box in y_boxes)
    assert all(left.x1 <= right.x0 for left, right in zip(x_boxes, x_boxes[1:]))  # the numbers never overlap
    assert axis.xaxis.label.get_window_extent().y1 <= min(box.y0 for box in x_boxes)  # "head (0-based)" under the numbers
    assert axis.yaxis.label.get_window_extent().x1 <= min(box.x0 for box in y_boxes)  # "layer (0-based)" left of them
    plt.close(figure)


def overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("kind", [ENCODER, DECODER])
@pytest.mark.parametrize(("layers", "heads"), [(6, 12), (32, 32)])
def test_the_profiles_heat_maps_keep_their_size_and_their_colour_bars_apart(kind, layers, heads):
    metrics = profile_metric_names(kind)
    grid = pd.MultiIndex.from_product([range(layers), range(heads), metrics], names=["layer", "head", "metric"]).to_frame(index=False)
    table = grid.assign(value=np.random.default_rng(0).random(len(grid)), uniform=0.5)
    figure = metric_heatmaps(table, metrics)
    assert figure.get_figwidth() <= 22 and figure.get_figheight() <= 16  # 1,024 heads: no bigger than about 200
    figure.canvas.draw()
    boxes = [part.get_window_extent() for axis in figure.axes if axis.get_visible() for part in (axis, *axis.child_axes)]  # bars: insets
    assert len(boxes) == len(metrics) + sum(metric not in ("cls", "sep", "first", "punct", "self", "prev", "next") for metric in metrics) + 1
    assert not any(overlap(a, b) for k, a in enumerate(boxes) for b in boxes[k + 1:])  # no panel or colour bar over another
    panels = [axis for axis in figure.axes if axis.images]
    assert sum(bool(labels(axis, "xtick")) for axis in panels) == 3  # the heads numbered under each column's lowest panel
    assert sum(bool(labels(axis, "ytick")) for axis in panels) == -(-len(metrics) // 3)  # the layers left of each row
    plt.close(figure)


def whole_ticks(bar) -> list[float]:
    """The numbers a colour bar writes at its ticks, after checking that each one is its tick's value, written whole."""
    labels = [label.get_text().replace("\u2212", "-") for label in bar.ax.get_yticklabels()]
    assert bar.ax.yaxis.get_offset_text().get_text() == ""  # no "1e-5+2.426" over the title
    assert len(set(labels)) == len(labels) >= 2
    np.testing.assert_allclose([float(label) for label in labels], bar.get_ticks(), rtol=0, atol=1e-12)
    return [float(label) for label in labels]


def test_colour_bars_write_each_tick_whole_with_no_offset_text():
    """Issue 49: a bar over values 2.42600 ... 2.42601 got matplotlib's offset text ('1e-5+2.426') printed over the map's
    title. head_grid's and panel_colorbar's bars write every tick's number whole, even there."""
    grid = pd.DataFrame(2.426 + 1e-5 * np.linspace(0, 1, 8).reshape(2, 4))
    figure, axis = plt.subplots(figsize=head_grid_size(grid))
    head_grid(axis, grid, "values 1e-5 apart")  # the values' own range: the case matplotlib writes with an offset
    bar = axis.images[0].colorbar
    default = figure.colorbar(axis.images[0], ax=axis)  # matplotlib's own bar of the same image, for comparison
    figure.canvas.draw()
    assert default.ax.yaxis.get_offset_text().get_text() != ""  # the data are the case that prints one
    assert all(2.426 <= tick <= 2.42601 for tick in whole_ticks(bar))
    plt.close(figure)
    figure, axes = panel_grid(1, 1, (2.0, 1.5))
    bar = panel_colorbar(figure, axes[0, 0].imshow(grid.values), axes[0, 0])
    figure.canvas.draw()
    assert all(2.426 <= tick <= 2.42601 for tick in whole_ticks(bar))
    plt.close(figure)
