"""The figure and report section of ``bertology restore`` (the Primer, section 6.3). Layer 0 is the embeddings."""

from __future__ import annotations

import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import plt
from bertology.render.html import Figure, Section

KIND_TITLES = {"layer": "this layer alone restored", "first_k": "layers 0..L all restored"}


def restore_curves(table: pd.DataFrame, metric: str, fine_tuned: float):
    """The task metric with each layer restored alone and with the first layers restored, against the fine-tuned model's."""
    figure, axis = plt.subplots(figsize=(6.4, 3.8))
    rows = table[table.metric == metric]
    for kind, group in rows.groupby("kind", sort=False):
        axis.errorbar(group.layer, group.value, yerr=[group.delta - group.ci_low, group.ci_high - group.delta], marker="o", capsize=3,
                      label=KIND_TITLES[kind])
    axis.axhline(fine_tuned, color="grey", linestyle="--", label="fine-tuned")
    axis.set_xticks(sorted(rows.layer.unique()))
    axis.set_xlabel("layer L (0 = embeddings)")
    axis.set_ylabel(f"dev {metric}")
    axis.set_title("restoring pre-trained weights after fine-tuning")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def restore_section(folder: RunFolder, table: pd.DataFrame, fine_tuned: dict[str, float]) -> Section:
    """Write one figure per metric into ``folder`` and return the report section."""
    section = Section(
        title="Layers restored to their pre-trained weights",
        intro=("The Primer (section 6.3): put a layer of the fine-tuned model back to its pre-trained weights and evaluate the task. "
               "Each layer alone, and the first layers together, against the fine-tuned model, with 95% paired-bootstrap intervals of "
               "the change over dev examples and p-values corrected within each kind (restore.csv). Early layers are expected to "
               "matter little, the last ones much."),
    )
    for metric, value in fine_tuned.items():
        section.figures.append(Figure(folder.write_figure(f"restore_{metric}", restore_curves(table, metric, value)),
                                      f"Dev {metric} with layers restored; error bars: the 95% interval of the change."))
    section.tables.append(("Every restoration", table))
    if table.p.isna().all():
        section.notes.append("No p-value: the dev set has fewer examples than --min-sample, too few for a test; the changes describe "
                             "these examples only.")
    return section
