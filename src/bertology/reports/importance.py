"""The report section of ``ablate``, ``importance`` and ``prune``: which heads matter for the task."""

from __future__ import annotations

import pandas as pd

from bertology.reports import figures
from bertology.reports.html import Figure, Section
from bertology.core.runfolder import RunFolder


NORMALISED = {"layer": "divided by its layer's l2 norm", "global": "min-max scaled over all heads",
              "layer+global": "divided by its layer's l2 norm, then min-max scaled over all heads", "none": "not normalised"}


def heads_within(pruning: pd.DataFrame, metric: str, unpruned: float, tolerance: float = 0.01) -> int:
    """The most heads pruned on the curve before the metric first drops by more than ``tolerance``."""
    rows = pruning[pruning.metric == metric].sort_values("heads_pruned")
    kept = 0
    for row in rows.itertuples():
        if row.value < unpruned - tolerance:
            break
        kept = int(row.heads_pruned)
    return kept


def importance_section(folder: RunFolder, study) -> Section:
    metric = next(iter(study.baseline))
    unpruned = study.baseline[metric]
    measured = ""
    if study.importance is not None:
        split, normalised = study.settings["importance_split"], NORMALISED[study.settings["normalise"]]
        measured = f"Measured on {study.importance_examples} {split} examples; importance_normalised is {normalised}. "
    section = Section(
        title="Which heads matter",
        intro=(
            f"{study.task}, {study.examples} dev examples; {metric} with no intervention: {unpruned:.4f}. "
            "Leave-one-out (ablation.csv): the metric with one head, or one whole layer (head -1), disabled, its change with a "
            "paired bootstrap 95% interval over examples and a two-sided p, FDR-corrected across heads and layers (p_adj). "
            "Importance (importance.csv, Michel et al. 2019): E|dL/d xi_h| for a gate xi_h on each head's output, the absolute gradient "
            f"per example averaged over examples. {measured}"
            "Pruning (pruning.csv): mask the least important heads by normalised importance step by step, recomputing the importance each time."
        ),
    )
    if study.ablation is not None:
        section.figures.append(Figure(folder.write_figure("ablation_heatmap", figures.ablation_heatmap(study.ablation, metric)),
                                      "Change of the metric when each head or layer is disabled (points); * p_adj < 0.05."))
        rows = study.ablation[study.ablation.metric == metric]
        significant = rows[(rows.p_adj < 0.05) & (rows["head"] >= 0)].sort_values("delta")
        section.tables.append(("Heads whose removal changes the metric significantly (p_adj < 0.05)", significant))
        section.tables.append(("Whole layers disabled", rows[rows["head"] < 0]))
        if rows.p.isna().all():
            section.notes.append("No p-value: the dev set has fewer examples than --min-sample, too few for a test; no head or layer "
                                 "is called significant, and the changes describe these examples only.")
    if study.importance is not None:
        section.figures.append(Figure(folder.write_figure("importance_heatmap", figures.importance_heatmap(study.importance)),
                                      f"Head importance ({NORMALISED[study.settings['normalise']]})."))
    if study.pruning is not None:
        section.figures.append(Figure(folder.write_figure("pruning_curve", figures.pruning_curve(study.pruning, metric, unpruned)),
                                      "The metric against the share of heads pruned."))
        section.notes.append(f"{heads_within(study.pruning, metric, unpruned)} heads can be pruned before {metric} first drops by more than 1 point.")
    if study.pruned is not None:
        pruned = study.pruned
        section.notes.append(
            f"Pruned physically to {pruned['heads_kept']} heads ({pruned['parameters_pruned']:,} of {pruned['parameters_full']:,} parameters), "
            f"saved to {pruned['model']}: {metric} {pruned['metric_pruned'][metric]:.4f} (full: {pruned['metric_full'][metric]:.4f}); "
            f"{pruned['speedup']:.2f}x as fast on these examples ({pruned['seconds_full']:.2f} s -> {pruned['seconds_pruned']:.2f} s, best of {pruned['repeats']})."
        )
    return section
