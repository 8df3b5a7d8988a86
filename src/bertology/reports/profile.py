"""The general-profile part of a run folder: its figures and its report section."""

from __future__ import annotations

import pandas as pd

from bertology.analyzers.profile import CLARK_THRESHOLDS, PROFILE_METRICS
from bertology.reports import figures
from bertology.reports.html import Figure, Section
from bertology.runfolder import RunFolder

_PUNCT_SETS = {"upos": "every token that is only punctuation (Unicode category P*; --punct upos)",
               "clark": "the tokens '.' and ',' only, as in Clark et al.'s code (--punct clark)"}


def profile_section(
    folder: RunFolder,
    heads: pd.DataFrame,
    layers: pd.DataFrame,
    labels: pd.DataFrame,
    head_map: pd.DataFrame | None,
    punct: str = "upos",
) -> Section:
    """Write the profile figures into ``folder`` and return the report section that shows them (``punct``: the punctuation set)."""
    section = Section(
        title="General attention profile",
        intro=(
            "Clark et al. (2019), 'What Does BERT Look At?': for every head, the average attention to [CLS], [SEP], "
            "punctuation, itself and its neighbours, the entropy of its attention and its mean attention distance, "
            f"averaged over sequences with 95% intervals (heads.csv). Punctuation: {_PUNCT_SETS[punct]}."
        ),
    )
    special = folder.write_figure("special_tokens_by_layer", figures.special_by_layer(heads))
    section.figures.append(Figure(special, "Attention to [CLS], [SEP] and punctuation by layer: dots are heads, the line is the layer mean."))
    for metric in PROFILE_METRICS:
        folder.write_figure(f"heatmap_{metric}", figures.metric_heatmap(heads, metric))
    grid = folder.write_figure("heatmaps", figures.metric_heatmaps(heads, PROFILE_METRICS))
    section.figures.append(Figure(grid, "Each metric's mean per head, layer x head (heatmap_<metric>.png has each on its own)."))
    if head_map is not None:
        mds = folder.write_figure("head_map", figures.head_map(head_map))
        section.figures.append(Figure(mds, "Heads placed by their Jensen-Shannon distance (MDS): heads that attend alike sit together."))
    wide = layers.pivot(index="layer", columns="metric", values="value")[list(PROFILE_METRICS)].reset_index()
    section.tables.append(("Per-layer means (a sequence's layer value is the mean of its heads)", wide))
    thresholds = ", ".join(f"{metric} > {value}" for metric, value in CLARK_THRESHOLDS.items())
    if len(labels):
        section.tables.append((f"Heads that pass Clark's thresholds ({thresholds})", labels))
    else:
        section.notes.append(f"No head passes Clark's thresholds ({thresholds}).")
    return section
