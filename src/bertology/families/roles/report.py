"""The head roles' figures and report section (Pande et al. 2021)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.reports.figures import plt

from bertology.core.runfolder import RunFolder
from bertology.families.roles.analyzer import SUMMARY_ROLES, role_colocation, role_shares
from bertology.reports.html import Figure, Section


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
    figure.tight_layout()
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
    figure.tight_layout()
    return figure


def role_grid(roles: pd.DataFrame, order):
    """Layer x head grid: each cell lists the roles its head holds, coloured by the strongest (largest t)."""
    held = roles[roles.role.isin(order) & roles.has_role]
    num_layers, num_heads = roles.layer.max() + 1, roles["head"].max() + 1
    figure, axis = plt.subplots(figsize=(0.75 * num_heads + 1.5, 0.6 * num_layers + 1.2))
    axis.set_xlim(-0.5, num_heads - 0.5)
    axis.set_ylim(num_layers - 0.5, -0.5)
    for (layer, head), rows in held.groupby(["layer", "head"]):
        strongest = rows.sort_values("t", ascending=False).role.iloc[0]
        axis.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, color=ROLE_COLOURS.get(strongest, "tab:gray"), alpha=0.35))
        label = "\n".join(role[:3] for role in rows.sort_values("t", ascending=False).role)
        axis.text(head, layer, label, ha="center", va="center", fontsize=6)
    axis.set_xticks(range(num_heads))
    axis.set_yticks(range(num_layers))
    axis.set_xlabel("head (0-based)")
    axis.set_ylabel("layer (0-based)")
    axis.set_title("roles held by each head (colour: strongest)")
    axis.grid(False)
    figure.tight_layout()
    return figure



def roles_section(folder: RunFolder, roles: pd.DataFrame, shares_by_tau: pd.DataFrame, tau: float, correction: str, min_sample: int) -> Section:
    """Write the role figures and tables into ``folder`` and return the report section."""
    section = Section(
        title="Head roles",
        intro=(
            "Pande et al. (2021), 'The heads hypothesis': each head's sieve score for a role is its attention per sieve token "
            "relative to uniform attention (1 = uniform). A head holds a role when a one-sided t-test over sequences rejects "
            f"mean <= tau (tau = {tau:g}) after {correction} correction within each role over its heads (roles.csv). "
            "A head may hold several roles."
        ),
    )
    by_layer = role_shares(roles, by_layer=True)
    folder.write_table("role_shares_by_layer", by_layer)
    colocation = role_colocation(roles)
    folder.write_table("role_colocation", colocation.reset_index(names="role"))
    section.figures.append(Figure(folder.write_figure("roles_by_layer", role_shares_by_layer(by_layer, tau)), "Share of heads holding each role, per layer."))
    section.figures.append(Figure(folder.write_figure("roles_grid", role_grid(roles, SUMMARY_ROLES)), "Roles of every head (first three letters; colour: the role with the largest t)."))
    section.figures.append(Figure(folder.write_figure("roles_colocation", role_colocation_heatmap(colocation)), "How many heads hold two roles at once."))
    section.tables.append(("Share of heads holding each role, by tau", shares_by_tau.pivot(index="role", columns="tau", values="share").reset_index()))
    untested = roles[roles.p.isna() & (roles.n > 0)]
    if len(untested):
        counts = untested.groupby("role", sort=False).n.max()
        section.notes.append(f"Not tested, on fewer than --min-sample {min_sample} sequences (no p-value, and no role claimed): "
                             + ", ".join(f"{role} (at most {int(n)})" for role, n in counts.items()) + ".")
        section.folded.append(("Head and role cells not tested (too few sequences)", untested))
    return section
