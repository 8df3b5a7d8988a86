"""The figure and report section of ``bertology restore`` (the Primer, section 6.3).

restore.csv counts the embeddings as layer 0 and block l - 1 as layer l; the figure numbers blocks from 0 as every
figure does and marks the embeddings ``emb.`` (:func:`~bertology.render.figures.hidden_state_axis`).
"""

from __future__ import annotations

import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import hidden_state_axis, plt
from bertology.render.html import Figure, Section

KIND_TITLES = {"layer": "restored alone", "first_k": "restored with the embeddings and every block before it"}
#: The figure's x label: what each tick restores.
RESTORED_LABEL = "restored: emb. the embeddings, else that block (0-based, as in every figure)"


def restore_curves(table: pd.DataFrame, metric: str, fine_tuned: float):
    """The task metric with each layer restored alone and with the first layers restored, against the fine-tuned model's."""
    figure, axis = plt.subplots(figsize=(6.4, 3.8))
    rows = table[table.metric == metric]
    for kind, group in rows.groupby("kind", sort=False):
        axis.errorbar(group.layer, group.value, yerr=[group.delta - group.ci_low, group.ci_high - group.delta], marker="o", capsize=3,
                      label=KIND_TITLES[kind])
    axis.axhline(fine_tuned, color="grey", linestyle="--", label="fine-tuned")
    hidden_state_axis(axis, rows.layer)  # restore.csv's layer 0 is the embeddings, its layer l block l - 1
    axis.set_xlabel(RESTORED_LABEL)
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
               "matter little, the last ones much. The figures mark the embeddings emb. and number the blocks from 0, as every figure "
               "does; restore.csv counts the embeddings as layer 0, so its layer l is block l - 1."),
    )
    for metric, value in fine_tuned.items():
        section.figures.append(Figure(folder.write_figure(f"restore_{metric}", restore_curves(table, metric, value)),
                                      f"Dev {metric} with layers restored; error bars: the 95% interval of the change."))
    section.tables.append(("Every restoration", table))
    if table.p.isna().all():
        section.notes.append("No p-value: the dev set has fewer examples than --min-sample, too few for a test; the changes describe "
                             "these examples only.")
    return section
