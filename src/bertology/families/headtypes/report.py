"""The head types' figure and report section (Elhage et al. 2021; Olsson et al. 2022). Layers and heads from 0."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import LABELLED_UP_TO, PANEL_INCHES, head_map_inches, head_ticks, panel_colorbar, panel_grid
from bertology.render.html import Figure, Section, without_rows


def head_type_grid(table: pd.DataFrame):
    """One layer x head map per role with a score: the mean attention mass on the role's targets (0 to 1), a dot on every head
    that holds the role, and how many do in the title."""
    roles = [role for role, rows in table.groupby("role", sort=False) if rows.value.notna().any()]
    columns = min(3, len(roles))
    rows_of_panels = -(-len(roles) // columns)
    num_layers, num_heads = int(table.layer.max()) + 1, int(table["head"].max()) + 1
    figure, axes = panel_grid(rows_of_panels, columns, head_map_inches(num_layers, num_heads, cell=(0.42, 0.36), most=PANEL_INCHES), top=0.75, right=1.1)
    for axis, role in zip(axes.ravel(), roles):
        rows = table[table.role == role]
        score = rows.pivot(index="layer", columns="head", values="value")
        held = rows.pivot(index="layer", columns="head", values="holds").reindex_like(score).fillna(False).astype(bool)
        image = axis.imshow(score.values, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
        layer, head = np.nonzero(held.values)
        axis.scatter(head, layer, s=14 * min(1.0, LABELLED_UP_TO / max(num_layers, num_heads)), color="white", edgecolor="black", linewidth=0.6)
        axis.set_title(f"{role}: {int(held.values.sum())} of {held.size} heads hold it", fontsize=9)
        head_ticks(axis, score.index, score.columns, fontsize=7)
        panel_colorbar(figure, image, axis, label="mass on the targets")
    for axis in axes.ravel()[len(roles):]:
        axis.set_visible(False)
    figure.suptitle("each role's mean attention mass on its targets per head; dot: the head holds the role")
    return figure


def headtypes_section(folder: RunFolder, table: pd.DataFrame, correction: str, min_sample: int,
                      copying: pd.DataFrame | None = None) -> Section:
    """Write the head-type figure into ``folder`` and return the report section (with the heads' copying scores where the
    model has an unembedding)."""
    section = Section(
        title="Head types: previous-token, duplicate-token, induction",
        intro=(
            "Elhage et al. (2021) and Olsson et al. (2022): for each head and sequence, the mean over the rows that have a target of "
            "the attention on the role's targets: the previous token (previous-token), the earlier occurrences of the query's "
            "token (duplicate-token; on an encoder every other occurrence) and the tokens that followed them (induction). Beside "
            "it, the uniform head's on the same sequences (each row uniform over the keys it saw); a head holds a role when a "
            f"paired one-sided t-test over sequences says it puts more there than the uniform head, {correction}-corrected within "
            "the role over its heads (head_types.csv, head_type_heads.csv). On the synthetic probe (--synthetic-repeats: random "
            "tokens repeated twice) the induction score is Olsson et al.'s prefix-matching score."
        ),
    )
    if table.empty or not (table.n > 0).any():
        return without_rows(section, "head_types.csv")
    section.figures.append(Figure(folder.write_figure("head_types_grid", head_type_grid(table)),
                                  "Each role's mean attention mass on its targets per head (0 to 1); a dot marks the heads that hold it."))
    counts = table.assign(tested=table.p_excess.notna()).groupby("role", sort=False).agg(
        heads_holding=("holds", "sum"), tested=("tested", "sum"), strongest=("value", "max"), uniform=("uniform", "mean"))
    section.tables.append(("Heads holding each role (of those tested), the largest mean mass and the uniform head's mean", counts.reset_index()))
    held = table[table.holds.astype(bool)].sort_values("value", ascending=False)
    if len(held):
        section.tables.append(("The heads that hold a role (strongest 20)", held.head(20)[["role", "layer", "head", "value", "uniform", "p_adj", "n"]]))
    if copying is not None and len(copying):
        top = copying.sort_values("copying_score", ascending=False).head(10)
        section.tables.append(("Copying scores from the weights (Elhage et al. 2021): copying_score is sum Re(lambda) / sum |lambda| "
                               "over the eigenvalues of each head's OV circuit W_U W_O W_V W_E (-1 to 1; positive: it raises the logits "
                               "of the tokens it attends to), positive_eigenvalue_share the share of them with a positive real part; "
                               "the 10 highest copying scores (copying_scores.csv)", top))
    untested = table[table.p_excess.isna() & (table.n > 0)]
    if len(untested):
        section.notes.append(f"Not tested, on fewer than --min-sample {min_sample} sequences (no p-value, no claim): "
                             + ", ".join(f"{role} (at most {int(n)})" for role, n in untested.groupby("role", sort=False).n.max().items()) + ".")
        section.folded.append(("Head and role cells not tested (too few sequences)", untested))
    return section
