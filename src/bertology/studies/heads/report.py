"""The report section of ``ablate``, ``importance`` and ``prune``: which heads matter for the task.

The task is a classifier's, or a decoder's next-token prediction on a corpus.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import head_grid, head_grid_size, plt
from bertology.render.html import Figure, Section
from bertology.studies.heads import ablated

NORMALISED = {"layer": "divided by its layer's l2 norm", "global": "min-max scaled over all heads",
              "layer+global": "divided by its layer's l2 norm, then min-max scaled over all heads", "none": "not normalised"}


#: How far the headline metric may get worse before a pruned model counts as worse: 1 point of a task metric (higher is
#: better), 0.01 nats of a language model's ``lm_loss`` (lower is better; a perplexity ``exp(0.01)``, about 1%, higher).
TOLERANCE = 0.01


def worse_by(metric: str) -> str:
    """How the report words the headline ``metric`` (a task metric, or ``lm_loss``) getting worse by more than :data:`TOLERANCE`."""
    return "rises by more than 0.01 nats (perplexity by 1%)" if metric == "lm_loss" else "drops by more than 1 point"


def heads_within(pruning: pd.DataFrame, metric: str, unpruned: float) -> int:
    """The most heads pruned on the curve before the headline ``metric`` (a task metric, or ``lm_loss``) first gets worse
    by more than :data:`TOLERANCE` (:func:`worse_by`)."""
    rows = pruning[pruning.metric == metric].sort_values("heads_pruned")
    better = -1.0 if metric == "lm_loss" else 1.0  # the sign of an improvement
    kept = 0
    for row in rows.itertuples():
        if better * (row.value - unpruned) < -TOLERANCE:
            break
        kept = int(row.heads_pruned)
    return kept


def importance_section(folder: RunFolder, study) -> Section:
    metric = next(iter(study.baseline))
    unpruned = study.baseline[metric]
    measured = ""
    if study.importance is not None:
        where = f"{study.settings['importance_split']} examples" if study.corpus is None else "texts of the corpus (no splits: the curve reads it too)"
        measured = f"Measured on {study.importance_examples} {where}; importance_normalised is {NORMALISED[study.settings['normalise']]}. "
    loss = study.loss if study.corpus is None else f"{study.loss}, each text's mean over its real pieces, none on padding"
    section = Section(
        title="Which heads matter",
        intro=f"{study.task}, {study.examples} {study.unit}; {metric} with no intervention: {unpruned:.4f}.",
    )
    # Only the files this run wrote: ``ablate`` writes ablation.csv, ``importance`` and ``prune`` importance.csv and pruning.csv.
    if study.ablation is not None:
        section.intro += (f" Leave-one-out (ablation.csv): the metric with one head, or one whole layer (head -1), ablated by "
                          f"{ablated(study.settings)}, its change with a paired bootstrap 95% interval over {study.unit} and a two-sided p, "
                          "corrected across heads and layers (p_adj); it matters where the interval excludes 0 and p_adj < 0.05.")
    if study.importance is not None:
        section.intro += (" Importance (importance.csv, Michel et al. 2019): E|dL/d xi_h| for a gate xi_h on each head's output, the "
                          f"absolute gradient per example of the loss L ({loss}) averaged over examples. {measured}".rstrip())
    if study.pruning is not None:
        section.intro += (" Pruning (pruning.csv): mask the least important heads by normalised importance step by step, recomputing "
                          "the importance each time; each step's row names the heads it removed (removed: layer-head, 0-based).")
    if study.ablation is not None:
        section.figures.append(Figure(folder.write_figure("ablation_heatmap", ablation_heatmap(study.ablation, metric)),
                                      f"Change of {metric} when each head or layer is ablated; * it matters."))
        rows = study.ablation[study.ablation.metric == metric]
        significant = rows[rows.matters & (rows["head"] >= 0)].sort_values("delta")
        section.tables.append(("Heads whose ablation matters (interval excludes 0, p_adj < 0.05)", significant))
        section.tables.append(("Whole layers disabled", rows[rows["head"] < 0]))
        if rows.p.isna().all():
            section.notes.append("No p-value: the dev set has fewer examples than --min-sample, too few for a test; no head or layer "
                                 "is called significant, and the changes describe these examples only.")
    if study.importance is not None:
        section.figures.append(Figure(folder.write_figure("importance_heatmap", importance_heatmap(study.importance)),
                                      f"Head importance ({NORMALISED[study.settings['normalise']]})."))
    if study.pruning is not None:
        section.figures.append(Figure(folder.write_figure("pruning_curve", pruning_curve(study.pruning, metric, unpruned)),
                                      "The metric against the share of heads pruned."))
        section.notes.append(f"{heads_within(study.pruning, metric, unpruned)} heads can be pruned before {metric} first {worse_by(metric)}.")
    if study.pruned is not None:
        pruned = study.pruned
        section.notes.append(
            f"Pruned physically to {pruned['heads_kept']} heads ({pruned['parameters_pruned']:,} of {pruned['parameters_full']:,} parameters), "
            f"saved to {pruned['model']}: {metric} {pruned['metric_pruned'][metric]:.4f} (full: {pruned['metric_full'][metric]:.4f}); "
            f"{pruned['speedup']:.2f}x as fast on these examples ({pruned['seconds_full']:.2f} s -> {pruned['seconds_pruned']:.2f} s, "
            f"best of {pruned['repeats']})."
        )
    return section


def ablation_heatmap(ablation: pd.DataFrame, metric: str):
    """Layer x head change of the task metric (points) or of a decoder's ``lm_loss`` (nats) when each head (and, last column,
    the whole layer) is ablated.

    Blue: ablating it raises the metric; red: it lowers it. A star marks a change that matters (interval excludes 0, p_adj < 0.05).
    """
    rows = ablation[ablation.metric == metric].copy()
    rows["column"] = rows["head"].where(rows["head"] >= 0, rows["head"].max() + 1)
    delta = rows.pivot(index="layer", columns="column", values="delta")
    significant = rows.pivot(index="layer", columns="column", values="matters").astype(bool)
    scale, unit = (1, "nats") if metric == "lm_loss" else (100, "points")
    limit = max(float(np.nanmax(np.abs(delta.values))), 1e-6)
    figure, axis = plt.subplots(figsize=(0.55 * delta.shape[1] + 2.8, 0.5 * delta.shape[0] + 1.8))
    image = axis.imshow(scale * delta.values, aspect="auto", cmap="RdBu", vmin=-scale * limit, vmax=scale * limit)
    for (i, j), value in np.ndenumerate(delta.values):
        star = "*" if significant.values[i, j] else ""
        colour = "white" if abs(value) > 0.6 * limit else "black"
        axis.text(j, i, f"{scale * value:+.{1 if scale == 100 else 3}f}{star}", ha="center", va="center", fontsize=6, color=colour)
    axis.axvline(delta.shape[1] - 1.5, color="black", linewidth=1)
    axis.set_xticks(range(delta.shape[1]), [*map(str, delta.columns[:-1]), "layer"])
    axis.set_yticks(range(delta.shape[0]), delta.index)
    axis.set_xlabel("head ablated (0-based); last column: the whole layer")
    axis.set_ylabel("layer (0-based)")
    axis.set_title(f"change of {metric} ({unit}), {rows.intervention.iloc[0]} ablation; * matters", fontsize=9)
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04, label=unit)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def importance_heatmap(importance: pd.DataFrame):
    """Michel et al.'s head importance, normalised per layer."""
    grid = importance.pivot(index="layer", columns="head", values="importance_normalised")
    figure, axis = plt.subplots(figsize=head_grid_size(grid))
    head_grid(axis, grid, "head importance E|dL/d xi| (normalised per layer)", vmin=0)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def pruning_curve(pruning: pd.DataFrame, metric: str, unpruned: float):
    """Michel et al.'s figure: the task metric (or a language model's loss) against the share of heads pruned, the unpruned
    model as a line and the tolerance (:data:`TOLERANCE`) as another."""
    rows = pruning[pruning.metric == metric]
    figure, axis = plt.subplots(figsize=(5.8, 3.6))
    axis.plot(100 * rows.share_pruned, rows.value, marker="o", label="pruned by importance")
    axis.axhline(unpruned, color="black", linestyle="--", linewidth=1, label="unpruned")
    loss = metric == "lm_loss"
    axis.axhline(unpruned + TOLERANCE if loss else unpruned - TOLERANCE, color="grey", linestyle=":", linewidth=1,
                 label="0.01 nats above" if loss else "1 point below")
    axis.set_xlabel("heads pruned (%)")
    axis.set_ylabel(metric)
    axis.set_title("iterative pruning (Michel et al. 2019)", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure
