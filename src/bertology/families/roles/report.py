"""The head roles' figures and report section (Pande et al. 2021)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.colors import TwoSlopeNorm

from bertology.core.storage.runfolder import RunFolder
from bertology.families.roles.analyzer import SUMMARY_ROLES, role_colocation, role_shares
from bertology.render.figures import LABELLED_UP_TO, PANEL_INCHES, all_zero, head_map_inches, head_ticks, panel_colorbar, panel_grid, plt
from bertology.render.html import Figure, Section, without_rows

ROLE_COLOURS = {"local": "tab:green", "delimiter": "tab:red", "cls": "tab:orange", "sep": "tab:purple", "block": "tab:blue", "syntactic": "tab:brown"}


def role_shares_by_layer(shares: pd.DataFrame, tau: float):
    """Share of heads per layer that hold each role (grouped bars)."""
    roles = list(dict.fromkeys(shares.role))
    layers = sorted(shares.layer.unique())
    figure, axis = plt.subplots(figsize=(max(6.0, 1.1 * len(layers) + 2), 3.8))
    width = 0.8 / max(1, len(roles))
    for k, role in enumerate(roles):
        rows = shares[shares.role == role].set_index("layer").reindex(layers)
        axis.bar(np.arange(len(layers)) + (k - (len(roles) - 1) / 2) * width, rows.share, width, label=role, color=ROLE_COLOURS.get(role))
    axis.set_xticks(range(len(layers)), layers)
    axis.set_xlabel("layer (0-based)")
    axis.set_ylabel("share of heads with the role")
    axis.set_ylim(0, 1)
    axis.set_title(f"heads holding each role (one-sided t-test, tau = {tau:g}, corrected)")
    axis.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    axis.grid(axis="y", alpha=0.3)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def role_colocation_heatmap(matrix: pd.DataFrame):
    """How many heads hold two roles at once."""
    figure, axis = plt.subplots(figsize=(4.8, 4.0))
    image = axis.imshow(matrix.values, cmap="Blues")
    axis.set_xticks(range(len(matrix)), matrix.columns, rotation=45, ha="right")
    axis.set_yticks(range(len(matrix)), matrix.index)
    for (i, j), value in np.ndenumerate(matrix.values):
        axis.text(j, i, int(value), ha="center", va="center", fontsize=8, color="black" if value < matrix.values.max() / 2 else "white")
    axis.set_title("heads holding both roles")
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def role_strength(roles: pd.DataFrame, order) -> dict[str, tuple[pd.DataFrame, pd.DataFrame]]:
    """Per role of ``order`` with a score: the layer x head grids of the mean sieve score and of whether the head holds it."""
    grids = {}
    for role in order:
        rows = roles[roles.role == role]
        if rows["mean"].notna().any():
            grids[role] = (rows.pivot(index="layer", columns="head", values="mean"), rows.pivot(index="layer", columns="head", values="has_role").astype(bool))
    return grids


def role_grid(roles: pd.DataFrame, order, tau: float):
    """One layer x head map per role: the mean sieve score (white at tau, red above, blue below, on the role's own
    scale), a dot on every head that holds the role, and the strongest head named in the title; the heads numbered
    under the lowest panel of each column, the layers left of the first."""
    grids = role_strength(roles, order)
    columns = min(2, len(grids))
    rows = -(-len(grids) // columns)
    num_layers, num_heads = next(iter(grids.values()))[0].shape
    panel = head_map_inches(num_layers, num_heads, cell=(0.42, 0.36), most=PANEL_INCHES)
    figure, axes = panel_grid(rows, columns, panel, top=0.75, right=1.1)  # right: room for the last column's colour bars
    for k, (axis, (role, (score, held))) in enumerate(zip(axes.ravel(), grids.items())):
        top = float(np.nanmax(score.values))
        low = min(0.0, float(np.nanmin(score.values)), tau - 1.0)  # the scale must run below tau (scores are >= 0; tau may be too)
        norm = TwoSlopeNorm(vcenter=tau, vmin=low, vmax=max(top, tau + 0.05 * abs(tau) + 1e-6))
        image = axis.imshow(score.values, aspect="auto", cmap="RdBu_r", norm=norm)
        layer, head = np.nonzero(held.values)
        axis.scatter(head, layer, s=14 * min(1.0, LABELLED_UP_TO / max(num_layers, num_heads)), color="black", edgecolor="white", linewidth=0.6)
        best = np.unravel_index(np.nanargmax(score.values), score.shape)
        axis.set_title(f"{role}: {int(held.values.sum())} of {held.size} heads hold it; strongest {score.index[best[0]]}-{score.columns[best[1]]} "
                       f"({top:.2f})", fontsize=9)
        head_ticks(axis, score.index, score.columns, fontsize=7, x=k + columns >= len(grids), y=k % columns == 0)  # the outer panels
        panel_colorbar(figure, image, axis, label=f"mean sieve score (tau = {tau:g})")
    for axis in axes.ravel()[len(grids):]:
        axis.set_visible(False)
    figure.suptitle("each role's mean sieve score per head (1 = uniform attention); dot: the head holds the role")
    return figure


def roles_section(folder: RunFolder, roles: pd.DataFrame, shares_by_tau: pd.DataFrame, tau: float, correction: str, min_sample: int) -> Section:
    """Write the role figures and tables into ``folder`` and return the report section."""
    section = Section(
        title="Head roles",
        intro=(
            "Pande et al. (2021), 'The heads hypothesis': each head's sieve score for a role is its attention per sieve token "
            "relative to uniform attention (1 = uniform). A head holds a role when a one-sided t-test over sequences rejects "
            f"mean <= tau (tau = {tau:g}) and a paired one rejects that it does no better than the uniform head on the same "
            f"sequences (each row uniform over the keys it saw; its mean score is the uniform column: 1 for every role but block, "
            f"about ln n there), the larger p after {correction} correction within each role over its heads (roles.csv). "
            "A head may hold several roles."
        ),
    )
    by_layer = role_shares(roles, by_layer=True)
    folder.write_table("role_shares_by_layer", by_layer)
    if roles.empty:
        folder.write_table("role_colocation", pd.DataFrame(columns=["role"]))
        return without_rows(section, "roles.csv")
    colocation = role_colocation(roles)
    folder.write_table("role_colocation", colocation.reset_index(names="role"))
    held = not all_zero(by_layer.share)  # else the shares' bars and the colocation counts would be empty frames
    if held:
        section.figures.append(Figure(folder.write_figure("roles_by_layer", role_shares_by_layer(by_layer, tau)),
                                      "Share of heads holding each role, per layer."))
    else:
        section.notes.append("Share of heads holding each role per layer, and heads holding two roles at once: nothing to show: every value "
                             "is 0 (no tested head holds any role; role_shares_by_layer.csv, role_colocation.csv).")
    section.figures.append(Figure(folder.write_figure("roles_grid", role_grid(roles, SUMMARY_ROLES, tau)),
                                  f"Each role's mean sieve score per head, on the role's own scale: white at tau = {tau:g}, red above, blue below; "
                                  "a dot marks the heads that hold the role (corrected t-test)."))
    if held:
        section.figures.append(Figure(folder.write_figure("roles_colocation", role_colocation_heatmap(colocation)), "How many heads hold two roles at once."))
    section.tables.append(("Share of heads holding each role, by tau", shares_by_tau.pivot(index="role", columns="tau", values="share").reset_index()))
    untested = roles[roles.p.isna() & (roles.n > 0)]
    if len(untested):
        counts = untested.groupby("role", sort=False).n.max()
        section.notes.append(f"Not tested, on fewer than --min-sample {min_sample} sequences (no p-value, and no role claimed): "
                             + ", ".join(f"{role} (at most {int(n)})" for role, n in counts.items()) + ".")
        section.folded.append(("Head and role cells not tested (too few sequences)", untested))
    return section
