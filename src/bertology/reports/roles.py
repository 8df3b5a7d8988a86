"""The roles-and-patterns part of a run folder: figures and report sections."""

from __future__ import annotations

import pandas as pd

from bertology.analyzers.roles import SUMMARY_ROLES, role_colocation, role_shares
from bertology.reports import figures
from bertology.reports.html import Figure, Section
from bertology.runfolder import RunFolder


def roles_section(folder: RunFolder, roles: pd.DataFrame, shares_by_tau: pd.DataFrame, tau: float, correction: str) -> Section:
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
    section.figures.append(Figure(folder.write_figure("roles_by_layer", figures.role_shares_by_layer(by_layer, tau)), "Share of heads holding each role, per layer."))
    section.figures.append(Figure(folder.write_figure("roles_grid", figures.role_grid(roles, SUMMARY_ROLES)), "Roles of every head (first three letters; colour: the role with the largest t)."))
    section.figures.append(Figure(folder.write_figure("roles_colocation", figures.role_colocation_heatmap(colocation)), "How many heads hold two roles at once."))
    section.tables.append(("Share of heads holding each role, by tau", shares_by_tau.pivot(index="role", columns="tau", values="share").reset_index()))
    return section


def patterns_section(folder: RunFolder, patterns: pd.DataFrame, by_layer: pd.DataFrame, examples: dict, thresholds: dict | None) -> Section:
    """Write the pattern figures into ``folder`` and return the report section."""
    section = Section(
        title="Attention patterns",
        intro=(
            "Kovaleva et al. (2019), 'Revealing the Dark Secrets of BERT': every head's map on every sequence is classified as "
            "vertical, diagonal, vertical+diagonal, block (pairs) or heterogeneous (patterns.csv: shares per head and the "
            "head's majority class)."
        ),
    )
    section.figures.append(Figure(folder.write_figure("patterns_by_layer", figures.pattern_shares_by_layer(by_layer)), "Pattern shares per layer, and over all layers."))
    section.figures.append(Figure(folder.write_figure("patterns_grid", figures.pattern_grid(patterns)), "Each head's majority pattern."))
    section.figures.append(Figure(folder.write_figure("patterns_examples", figures.pattern_thumbnails(examples)), "Example maps of each class, drawn from the corpus."))
    wide = by_layer.assign(layer=by_layer.layer.map(lambda layer: "all" if layer == -1 else layer)).pivot(index="layer", columns="pattern", values="share")
    section.tables.append(("Pattern shares per layer", wide.reset_index()))
    if thresholds is not None:
        section.notes.append(
            "Rules (shares of a map's attention mass; vertical = special-token columns + the heaviest other column, diagonal = "
            "the +-1 diagonals, block = inside the query's own sentence): vertical+diagonal if both >= {mixed_min} and their sum "
            ">= {mixed_total}; else vertical if >= {vertical}; else diagonal if >= {diagonal}; else block if >= {block} (pairs); "
            "else heterogeneous.".format(**thresholds)
        )
    return section
