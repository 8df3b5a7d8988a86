"""The figure and report section of ``bertology gradients`` (Clark et al. 2019, Figure 3).

On a decoder, the first token takes [CLS]'s place and there is no [SEP]. Layers are numbered from 0.
"""

from __future__ import annotations

import pandas as pd

from bertology.core.model.kinds import DECODER, Kind
from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import layer_lines, plt
from bertology.render.html import Figure, Section

#: How each target of :func:`~bertology.studies.gradients.gradients.gradient_targets` reads in the figure and table.
TARGET_TITLES = {"sep": "[SEP]", "cls": "[CLS]", "first": "the first token", "punct": "punctuation", "all": "every token"}


def gradients_by_layer(table: pd.DataFrame):
    """Left: mean attention to each token set by layer; right: the mean |dL/da| of those weights (log scale where any is positive)."""
    figure, axes = plt.subplots(1, 2, figsize=(10.0, 3.6))
    weights = table[table.target != "all"].rename(columns={"attention": "value", "attention_ci_low": "ci_low", "attention_ci_high": "ci_high"})
    layer_lines(axes[0], weights, "target", TARGET_TITLES)
    axes[0].set_ylabel("mean attention")
    axes[0].set_title("attention to the token set")
    gradients = table.rename(columns={"gradient": "value", "gradient_ci_low": "ci_low", "gradient_ci_high": "ci_high"})
    layer_lines(axes[1], gradients, "target", TARGET_TITLES)
    if (table.gradient > 0).any():  # a log scale needs a positive value (a decoder's sequences of two pieces give none)
        axes[1].set_yscale("log")
    axes[1].set_ylabel("mean |dL/da| per weight")
    axes[1].set_title("gradient of the loss w.r.t. those weights")
    axes[1].legend(fontsize=8)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def gradients_section(folder: RunFolder, table: pd.DataFrame, loss: str, kind: Kind) -> Section:
    """Write the figure into ``folder`` and return the report section; ``kind``: the model's, as the run recorded it (a
    decoder's first token stands in [CLS]'s place and it has no [SEP], docs/methods.md#decoders)."""
    if kind is DECODER:
        title, intro = "Attention to the first token and its gradient", (
            "Clark et al. (2019, section 3.2) on a decoder: per layer, the mean attention to the first token (in [CLS]'s place; a decoder "
            f"has no [SEP]) and punctuation beside the mean magnitude of the gradient of the loss ({loss}) with respect to each of those "
            "attention weights, over the keys each query sees (j <= i) and the queries after the first, with 95% intervals over sequences "
            "(gradients.csv). Where attention to the first token is high but its gradient is small next to every token's, that attention "
            "changes little: a no-op, as of an attention sink.")
    else:
        title, intro = "Attention to [SEP] and its gradient", (
            f"Clark et al. (2019, section 3.2): per layer, the mean attention to [SEP], [CLS] and punctuation beside the mean "
            f"magnitude of the gradient of the loss ({loss}) with respect to each of those attention weights, with 95% intervals "
            "over sequences (gradients.csv). Where attention to [SEP] is high but its gradient is small next to every "
            "token's, attending to [SEP] changes little: a no-op.")
    section = Section(title=title, intro=intro)
    section.figures.append(Figure(folder.write_figure("gradients_by_layer", gradients_by_layer(table)),
                                  "Mean attention (left) and mean |dL/da| per weight (right, log scale where any is positive) by layer (0-based), "
                                  "with 95% intervals."))
    wide = table.pivot(index="layer", columns="target", values=["attention", "gradient"])
    wide.columns = [f"{quantity} {TARGET_TITLES[target]}" for quantity, target in wide.columns]
    section.tables.append(("Attention and gradient per layer", wide.reset_index()))
    return section
