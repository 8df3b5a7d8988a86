"""Issue 49: the sink figures as a reader sees them: the sink map's title inside its figure whatever the heads, and the
uniform head's lines beside the first token's weight and norm share."""

import numpy as np
import pandas as pd
import pytest

from bertology.families.sinks.report import sink_map, weight_and_share_by_layer
from bertology.render.figures import plt


def sinks_table(layers: int, heads: int, seed: int = 0) -> pd.DataFrame:
    """sinks.csv's attention and norm-share rows: random means, a uniform head's value per layer (as the analyzer gives it:
    one for every head of a layer), a few heads far above it (p_excess tiny: sink heads past eps = 0.3)."""
    rng = np.random.default_rng(seed)
    table = pd.MultiIndex.from_product([range(layers), range(heads), ["attention", "norm_share"]],
                                       names=["layer", "head", "quantity"]).to_frame(index=False)
    table["value"] = rng.uniform(0.0, 1.0, len(table))
    table["uniform"] = 0.05 + 0.02 * table.layer + 0.01 * (table.quantity == "norm_share")
    table["n"] = 40
    table["p_excess"] = np.where(table.value > 0.5, 1e-9, 0.5)
    return table


@pytest.mark.parametrize(("layers", "heads"), [(1, 1), (2, 4), (6, 12), (32, 32)])
def test_the_sink_maps_title_lies_inside_its_figure(layers, heads):
    figure = sink_map(sinks_table(layers, heads), eps=0.3)
    figure.canvas.draw()
    axis = figure.axes[0]
    title, whole = axis.title.get_window_extent(), figure.bbox
    assert "mean attention to the first token" in axis.get_title() and "rings: sink heads (> 0.3 and > uniform)" in axis.get_title()
    assert whole.x0 <= title.x0 and title.x1 <= whole.x1 and whole.y0 <= title.y0 and title.y1 <= whole.y1  # not cut at either end
    assert title.y0 >= axis.get_window_extent().y1  # above the map
    plt.close(figure)


def test_the_first_tokens_weight_and_norm_share_are_drawn_beside_the_uniform_heads():
    sinks = sinks_table(3, 4)
    rates = pd.DataFrame({"layer": ["0", "1", "2", "all"], "eps": 0.3, "sink_heads": [1, 0, 2, 3], "heads": 4, "rate": [0.25, 0.0, 0.5, 0.25]})
    figure = weight_and_share_by_layer(sinks, rates)
    right = figure.axes[-1]
    lines = {line.get_label(): line for line in right.get_lines()}
    for quantity, label in (("attention", "attention weight"), ("norm_share", "norm share")):
        rows = sinks[sinks.quantity == quantity]
        np.testing.assert_allclose(lines[label].get_ydata(), [rows[rows.layer == layer].value.mean() for layer in range(3)])
        uniform = lines[f"{label}: uniform head"]
        np.testing.assert_allclose(uniform.get_ydata(), [0.05, 0.07, 0.09] if quantity == "attention" else [0.06, 0.08, 0.1])
        assert uniform.get_linestyle() == ":" and uniform.get_color() == lines[label].get_color()  # dotted, in its line's colour
    assert {text.get_text() for text in right.get_legend().get_texts()} == set(lines)
    plt.close(figure)
