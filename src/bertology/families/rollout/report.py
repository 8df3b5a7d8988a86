"""The attention-rollout figure and report section (Abnar & Zuidema 2020). Layers are numbered from 0."""

from __future__ import annotations

import pandas as pd

from bertology.core.model.kinds import Kind
from bertology.core.storage.runfolder import RunFolder
from bertology.families.rollout.analyzer import rollout_rows, rollout_targets
from bertology.render.figures import layer_lines, panel_grid
from bertology.render.html import Figure, Section, without_rows

#: Every target's title, of every kind of model (a decoder's first token in [CLS]'s place, docs/methods.md#decoders).
TARGET_TITLES = {"cls": "input [CLS]", "sep": "input [SEP]", "first": "input first token", "punct": "input punctuation", "self": "its own input token"}
#: Each one-position row's title: [CLS]'s, or a decoder's last token's (the one that predicts).
ROW_TITLES = {"cls_row": "the [CLS] position", "last_row": "the last position"}
#: How a sentence names each anchor.
ANCHOR_NAMES = {"cls": "[CLS]", "sep": "[SEP]", "first": "the first token"}


def target_titles(kind: Kind, row: str = "all") -> dict[str, str]:
    """The titles of a ``kind`` of model's targets (:func:`~bertology.families.rollout.analyzer.rollout_targets`) in ``row``:
    at an anchor's own position its input token is that anchor, and its title says so (the two lines are one by definition)."""
    titles = {target: TARGET_TITLES[target] for target in rollout_targets(kind)}
    anchor = row.removesuffix("_row")
    if anchor in kind.anchors:
        titles["self"] = f"its own input token (= {TARGET_TITLES[anchor]} here)"
    return titles


def row_titles(kind: Kind) -> dict[str, str]:
    """The titles of a ``kind`` of model's rows (:func:`~bertology.families.rollout.analyzer.rollout_rows`), the one
    position's row first: every query's mean leaves out the rows that are no query (a decoder's first)."""
    every, one = rollout_rows(kind)
    return {one: ROW_TITLES[one], every: "every position but the first (mean)" if kind.first_query else "every position (mean)"}


def rollout_by_layer(table: pd.DataFrame, kind: Kind):
    """Rolled-out attention to each target after each layer: the one position's row ([CLS]'s, a decoder's last) and every
    row, with 95% intervals; each line with its own marker and line style (:func:`~bertology.render.figures.layer_lines`),
    so lines that coincide both show."""
    titles = row_titles(kind)
    figure, axes = panel_grid(1, 2, (4.3, 2.6), across=0.3, sharey=True)
    axes = axes[0]
    for axis, row in zip(axes, titles):
        layer_lines(axis, table[table.row == row], "target", target_titles(kind, row))
        axis.set_title(f"rolled out from {titles[row]}")
    axes[0].set_ylabel("rolled-out attention")
    axes[0].legend(fontsize=8)
    return figure


def rollout_section(folder: RunFolder, table: pd.DataFrame, kind: Kind) -> Section:
    """Write the rollout figure into ``folder`` and return its report section (``kind``: the run's kind of model)."""
    section = Section(
        title="Attention rollout",
        intro=("Abnar & Zuidema (2020): R_l = (0.5 A_l + 0.5 I) R_(l-1), rows renormalised, A_l the head mean of layer l, so R_l[i, j] "
               "is how much input token j reaches position i after layer l (the residual counted as half). "
               + ("The profile of [CLS]'s rolled-out attention says which inputs the [CLS] vector is built from, layer by layer (rollout.csv)."
                  if kind.sees_later_keys else
                  "The profile of the last position's rolled-out attention says which inputs the vector that predicts the next token is "
                  "built from, layer by layer (rollout.csv).")),
    )
    if table.empty:
        return without_rows(section, "rollout.csv")
    if not kind.sees_later_keys:
        section.intro += (" On a decoder the first token's row sees only itself: the rows are the last position's and every position "
                          f"but the first, and the anchor is {kind.anchor_words}.")
    anchors = ", ".join(ANCHOR_NAMES[anchor] for anchor in kind.anchors)
    section.figures.append(Figure(folder.write_figure("rollout_by_layer", rollout_by_layer(table, kind)),
                                  f"Rolled-out attention to {anchors}, punctuation and the token itself by layer (0-based), with 95% intervals."))
    one = rollout_rows(kind)[1]
    wide = table[table.row == one].pivot(index="layer", columns="target", values="value")[list(rollout_targets(kind))].reset_index()
    section.tables.append((f"{ROW_TITLES[one][0].upper()}{ROW_TITLES[one][1:]}'s rolled-out attention per layer", wide))
    return section
