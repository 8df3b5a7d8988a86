"""The attention-rollout figure and report section (Abnar & Zuidema 2020). Layers are numbered from 0."""

from __future__ import annotations

import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import layer_lines, plt
from bertology.render.html import Figure, Section, without_rows

TARGET_TITLES = {"cls": "input [CLS]", "sep": "input [SEP]", "punct": "input punctuation", "self": "its own input token"}
ROW_TITLES = {"cls_row": "the [CLS] position", "all": "every position (mean)"}
#: A decoder's (docs/methods.md#decoders): the first token in [CLS]'s place, the last token's row (the one that predicts).
DECODER_TARGET_TITLES = {"first": "input first token", "punct": "input punctuation", "self": "its own input token"}
DECODER_ROW_TITLES = {"last_row": "the last position", "all": "every position but the first (mean)"}
#: At the [CLS] position, its own input token is [CLS]: the two lines are one by definition, and the legend says so.
CLS_ROW_TITLES = {**TARGET_TITLES, "self": "its own input token (= input [CLS] here)"}


def rollout_by_layer(table: pd.DataFrame):
    """Rolled-out attention to each target after each layer: the [CLS] row and every row, with 95% intervals; each line
    with its own marker and line style (:func:`~bertology.render.figures.layer_lines`), so lines that coincide both show."""
    causal = bool((table.row == "last_row").any())
    row_titles, target_titles = (DECODER_ROW_TITLES, DECODER_TARGET_TITLES) if causal else (ROW_TITLES, TARGET_TITLES)
    figure, axes = plt.subplots(1, 2, figsize=(10.0, 3.6), sharey=True)
    for axis, row in zip(axes, row_titles):
        layer_lines(axis, table[table.row == row], "target", CLS_ROW_TITLES if row == "cls_row" else target_titles)
        axis.set_title(f"rolled out from {row_titles[row]}")
    axes[0].set_ylabel("rolled-out attention")
    axes[0].legend(fontsize=8)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def rollout_section(folder: RunFolder, table: pd.DataFrame) -> Section:
    """Write the rollout figure into ``folder`` and return its report section."""
    section = Section(
        title="Attention rollout",
        intro=("Abnar & Zuidema (2020): R_l = (0.5 A_l + 0.5 I) R_(l-1), rows renormalised, A_l the head mean of layer l, so R_l[i, j] "
               "is how much input token j reaches position i after layer l (the residual counted as half). The profile of "
               "[CLS]'s rolled-out attention says which inputs the [CLS] vector is built from, layer by layer (rollout.csv)."),
    )
    if table.empty:
        return without_rows(section, "rollout.csv")
    if (table.row == "last_row").any():  # a decoder's
        section.intro += (" On a decoder the first token's row sees only itself: the rows are the last position's (the one that predicts "
                          "the next token) and every position but the first, and the first token takes [CLS]'s place.")
        section.figures.append(Figure(folder.write_figure("rollout_by_layer", rollout_by_layer(table)),
                                      "Rolled-out attention to the first token, punctuation and the token itself by layer (0-based), with 95% intervals."))
        last_row = table[table.row == "last_row"].pivot(index="layer", columns="target", values="value")[list(DECODER_TARGET_TITLES)].reset_index()
        section.tables.append(("The last position's rolled-out attention per layer", last_row))
        return section
    section.figures.append(Figure(folder.write_figure("rollout_by_layer", rollout_by_layer(table)),
                                  "Rolled-out attention to [CLS], [SEP], punctuation and the token itself by layer (0-based), with 95% intervals."))
    cls_row = table[table.row == "cls_row"].pivot(index="layer", columns="target", values="value")[list(TARGET_TITLES)].reset_index()
    section.tables.append(("The [CLS] position's rolled-out attention per layer", cls_row))
    return section
