"""The report section of ``bertology patch``: each method's effect per head, and attribution against exact patching.

A layer x head grid per method, with the heads that matter ringed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import head_grid, plt
from bertology.render.html import Figure, Section

METHOD_TITLES = {"activation": "activation patching (exact)", "attribution": "attribution patching (first-order)",
                 "attribution*": "AtP* with GradDrop (a magnitude)"}


def effect_grids(patching: pd.DataFrame):
    """Exact and attribution patching's normalised effect per layer and head (at all positions), the heads that matter
    ringed, and attribution's change against exact patching's, one point per head."""
    every = patching[patching.position == "all"]
    figure, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    limit = max(float(np.nanmax(np.abs(every.effect.to_numpy()))) if every.effect.notna().any() else 0.0, 1e-6)
    for axis, method in zip(axes, ("activation", "attribution")):
        rows = every[every.method == method]
        grid = rows.pivot(index="layer", columns="head", values="effect")
        head_grid(axis, grid, f"effect, {METHOD_TITLES[method]}", cmap="RdBu", vmin=-limit, vmax=limit)
        ringed = rows[rows.matters]
        axis.scatter(ringed["head"], ringed.layer, s=160, facecolors="none", edgecolors="black", linewidths=1.5)
    exact, estimate = (every[every.method == method].logit_diff_change.to_numpy() for method in ("activation", "attribution"))
    axes[2].scatter(exact, estimate, s=12)
    ends = [min(exact.min(), estimate.min()), max(exact.max(), estimate.max())]
    axes[2].plot(ends, ends, color="grey", linewidth=1, linestyle="--")
    axes[2].tick_params(axis="x", labelrotation=30)
    axes[2].set_xlabel("exact change of LD")
    axes[2].set_ylabel("attribution's estimate")
    axes[2].set_title("attribution against exact patching, one point per head", fontsize=9)
    return figure


def position_grid(patching: pd.DataFrame):
    """Exact patching's normalised effect of each head (a row, layer-head) at each position alone (a column), the cells
    that matter ringed."""
    rows = patching[(patching.method == "activation") & (patching.position != "all")].assign(
        where=lambda t: t.layer.astype(str) + "-" + t["head"].astype(str), spot=lambda t: t.position.astype(int))
    grid = rows.pivot_table(index="where", columns="spot", values="effect", sort=False)
    figure, axis = plt.subplots(figsize=(max(5.0, 0.35 * grid.shape[1] + 2), max(3.0, 0.18 * grid.shape[0] + 1)))
    limit = max(float(np.nanmax(np.abs(grid.to_numpy()))) if grid.notna().any().any() else 0.0, 1e-6)
    image = axis.imshow(grid.to_numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    axis.set_yticks(range(grid.shape[0]), grid.index, fontsize=6)
    axis.set_xlabel("position of the patch")
    axis.set_ylabel("layer-head")
    ringed = rows[rows.matters]
    axis.scatter(ringed.spot, [grid.index.get_loc(w) for w in ringed["where"]], s=40, facecolors="none", edgecolors="black")
    figure.colorbar(image, ax=axis, label="effect (exact)")
    return figure


def agreement_matrix(rankings: pd.DataFrame):
    """Spearman's rho of every two methods' rankings of the heads (by ``|change|``), as a symmetric grid."""
    methods = list(dict.fromkeys([*rankings.method_a, *rankings.method_b]))
    grid = pd.DataFrame(np.eye(len(methods)), index=methods, columns=methods)
    for row in rankings.itertuples():
        grid.loc[row.method_a, row.method_b] = grid.loc[row.method_b, row.method_a] = row.spearman
    figure, axis = plt.subplots(figsize=(5.2, 4.2))
    image = axis.imshow(grid.to_numpy(dtype=float), cmap="RdBu", vmin=-1, vmax=1)
    axis.set_xticks(range(len(methods)), methods, rotation=35, ha="right", fontsize=8)
    axis.set_yticks(range(len(methods)), methods, fontsize=8)
    for i in range(len(methods)):
        for j in range(len(methods)):
            value = grid.iat[i, j]
            axis.text(j, i, "n/a" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=7)
    axis.set_title("rank agreement of the methods over heads (Spearman)", fontsize=9)
    figure.colorbar(image, ax=axis)
    figure.tight_layout()
    return figure


def patching_section(folder: RunFolder, study) -> Section:
    settings, agreement = study.settings, study.agreement
    direction = ("from the clean run into the corrupted one (denoising)" if settings["direction"] == "denoise"
                 else "from the corrupted run into the clean one (noising)")
    section = Section(
        title="Which heads matter, causally",
        intro=(f"{settings['n']} pairs; each head's output z_h at every position patched {direction}. LD = logit[answer] - logit[wrong]; "
               f"mean LD {study.ld_clean:.4f} on the clean prompts, {study.ld_corrupt:.4f} on the corrupted. patching.csv: the mean change "
               "of LD (logit_diff_change) and the effect, that change over the mean gap, with a bootstrap 95% interval over pairs "
               f"({settings['bootstrap']} replicates), a two-sided bootstrap p and p_adj ({settings['correction']} over heads); a head "
               "matters where its interval excludes 0 and p_adj < 0.05. Per-pair values: patching_pairs.parquet."),
    )
    section.figures.append(Figure(folder.write_figure("patching_effects", effect_grids(study.patching)),
                                  "Normalised effect per layer and head (ringed: the heads that matter); attribution against exact patching."))
    if settings.get("positions") == "each":
        section.figures.append(Figure(folder.write_figure("patching_positions", position_grid(study.patching)),
                                      "Exact patching at each position alone: the normalised effect per head and position (ringed: matters, "
                                      "corrected over every head and position)."))
    for method, agreed in agreement.items():
        title = METHOD_TITLES[method]
        section.notes.append(f"{title[0].upper()}{title[1:]} against exact patching: Spearman {agreed['spearman']:.3f}, "
                             f"top-{agreed['top_k']} recall {agreed['top_k_recall']:.2f}.")
    if len(study.rankings) > 1:
        methods = list(dict.fromkeys([*study.rankings.method_a, *study.rankings.method_b]))
        section.figures.append(Figure(folder.write_figure("rank_agreement", agreement_matrix(study.rankings)),
                                      f"How {', '.join(methods)} rank the heads (|change of LD|): where zero ablation and patching "
                                      "disagree, zeroing may be taking the model off its distribution (rank_agreement.csv: Spearman and "
                                      "top-k overlap)."))
    mattering = study.mattering()
    section.tables.append(("Heads that matter (activation patching)", mattering))
    if study.patching.p.isna().all():
        section.notes.append(f"No p-value: fewer pairs than --min-sample ({settings['min_sample']}), or a gap of 0 between the clean and "
                             "corrupted prompts; no head is called anything.")
    return section
