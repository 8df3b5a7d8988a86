"""The token-class heat maps and report section (Kovaleva et al. 2019). Layers and heads are numbered from 0."""

from __future__ import annotations

import math

import pandas as pd

from bertology.core.model.kinds import Kind
from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import head_grid, plt
from bertology.render.html import Figure, Section

#: How far a head's excess over the uniform head must clear 0 (its interval's lower end) to name it: beyond the rounding
#: of a head that is uniform (the null model's float32 maps against the exact uniform rows).
EXCESS_TOLERANCE = 1e-6


def top_heads(table: pd.DataFrame, k: int) -> pd.DataFrame:
    """Each class's ``k`` heads with the most attention to it from every query beyond the uniform head's on the same rows
    (``excess``), among the rows whose excess has an interval above 0 (a class seen in fewer than ``--min-sample``
    sequences has none, and no head is named for it; a head that does no more than a uniform one is named for nothing)."""
    rows = table[(table.row == "all") & table.value.notna() & table.ci_low.notna() & (table.excess_ci_low > EXCESS_TOLERANCE)]
    rows = rows.sort_values("excess", ascending=False, kind="stable")
    columns = ["class", "layer", "head", "value", "ci_low", "ci_high", "uniform", "excess", "excess_ci_low", "baseline", "ratio", "n"]
    order = {name: position for position, name in enumerate(dict.fromkeys(table["class"]))}  # the classes in the order given
    top = rows.groupby("class", sort=False).head(k)
    return top.sort_values("class", key=lambda names: names.map(order), kind="stable")[columns].reset_index(drop=True)


def class_heatmaps(table: pd.DataFrame, names: list[str]):
    """One layer x head map per class: the attention to it from every query, as a multiple of its share of words."""
    rows = table[table.row == "all"]
    columns = min(len(names), 3)
    layers, heads = rows.layer.nunique(), rows["head"].nunique()
    width, height = 0.32 * heads + 2.6, 0.32 * layers + 1.5
    figure, axes = plt.subplots(math.ceil(len(names) / columns), columns, figsize=(width * columns, height * math.ceil(len(names) / columns)),
                                squeeze=False)
    for axis, name in zip(axes.flat, names):
        grid = rows[rows["class"] == name].pivot(index="layer", columns="head", values="ratio")
        head_grid(axis, grid, f"{name}: attention / share of words", cmap="magma", vmin=0)
    for axis in list(axes.flat)[len(names):]:
        axis.axis("off")
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def classes_section(folder: RunFolder, table: pd.DataFrame, classes, kind: Kind) -> Section:
    """Write the class heat maps into ``folder`` and return the report section (``kind``: the run's kind of model)."""
    section = Section(
        title="Attention to token classes",
        intro=("Kovaleva et al. (2019): per head, the mean over queries of the word-level attention to the words of each class, "
               "with a 95% interval over the sequences that contain the class, beside its uniform baseline, the class's share "
               "of the words; the ratio says how many times more than its share a head gives the class. uniform is what a head that spreads "
               "each row evenly over the keys it sees gives the class on the same rows; the heads named are those whose excess over it "
               "has a 95% interval above 0. The [CLS] row's own "
               "attention is in classes.csv (row = cls_row). Classes: " + "; ".join(c.spec for c in classes) + "."),
    )
    if not kind.sees_later_keys:  # a decoder (docs/methods.md#decoders)
        section.intro += (" On a decoder each query sees only the words before it: the queries are every word but the first, each "
                          "against the class's share of the words it sees, and the last word's row (row = last_row) takes [CLS]'s place.")
    names = [c.name for c in classes if table[(table["class"] == c.name) & table.value.notna()].shape[0]]
    if names:
        section.figures.append(Figure(folder.write_figure("classes_heatmaps", class_heatmaps(table, names)),
                                      "Attention to each class from every query divided by the class's share of words, per head (layers and heads 0-based)."))
    section.tables.append(("The three heads with the most attention to each class", top_heads(table, 3)))
    return section
