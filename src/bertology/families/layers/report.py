"""The layer-probe figure and report section.

layer_probes.csv counts hidden states (layer 0 the embeddings, layer l the output of block l - 1); the figure numbers
blocks from 0 as every figure does and marks the embeddings ``emb.``
(:func:`~bertology.render.figures.hidden_state_axis`).
"""

from __future__ import annotations

import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import hidden_state_axis, plt
from bertology.render.html import Figure, Section, without_rows

TASK_TITLES = {"upos": "UPOS tag", "deprel": "dependency relation"}
#: How the probes' layers are numbered, said wherever their table is shown: the tables count hidden states, the figures blocks.
HIDDEN_STATES_NUMBERED = ("The figures mark the embeddings emb. and number the blocks from 0, as every figure does; the tables count "
                          "the embeddings as layer 0, as layer_probes.csv does, so a table's layer l is block l - 1's output (and so are "
                          "best_layer, most_selective_layer and the expected layer where shown).")


def probes_by_layer(table: pd.DataFrame, by: str | None = None):
    """Per task: probe accuracy with its 95% interval, control accuracy, majority baseline and selectivity by layer;
    with ``by`` (a column such as ``model``), one line of each per value of it."""
    tasks = list(dict.fromkeys(table.task))
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        rows = table[table.task == task]
        for key, group in rows.groupby(by, sort=False) if by else [(None, rows)]:
            label = f"{key}: " if key is not None else ""
            line = axis.errorbar(group.layer, group.accuracy, yerr=[group.accuracy - group.ci_low, group.ci_high - group.accuracy], marker="o",
                                 capsize=3, label=f"{label}accuracy")
            colour = line[0].get_color()
            axis.plot(group.layer, group.control_accuracy, linestyle="--", color=colour, label=f"{label}control task")
            axis.plot(group.layer, group.selectivity, linestyle=":", marker="s", color=colour, label=f"{label}selectivity")
        axis.axhline(rows.majority.iloc[0], color="grey", linewidth=1, label="majority label")
        hidden_state_axis(axis, rows.layer)  # layer_probes.csv's layer 0 is the embeddings, its layer l block l - 1's output
        axis.set_ylim(min(0.0, rows.selectivity.min() - 0.05), 1)  # a negative selectivity stays in view
        axis.set_title(f"probing the {TASK_TITLES[task]}")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][-1].legend(fontsize=7)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def with_intervals(summary: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """``summary`` with ``best_accuracy_ci`` beside ``best_accuracy``: the 95% bootstrap interval of each task's best
    layer (its ``ci_low`` and ``ci_high`` in ``table``), as ``[low, high]``."""
    best = table.set_index(["task", "layer"]).loc[list(zip(summary.task, summary.best_layer))]
    shown = summary.copy()
    shown.insert(shown.columns.get_loc("best_accuracy") + 1, "best_accuracy_ci", [f"[{low:.3f}, {high:.3f}]" for low, high in zip(best.ci_low, best.ci_high)])
    return shown


def layers_section(folder: RunFolder, table: pd.DataFrame, summary: pd.DataFrame) -> Section:
    """Write the probe figure into ``folder`` and return the report section."""
    section = Section(
        title="Where in the layers: linear probes of the word vectors",
        intro=("A logistic regression per layer reads each word's tag or relation from its vector, trained on 80% of "
               "the sentences and tested on the rest, with a 95% bootstrap interval over test sentences. The control task "
               "(Hewitt & Liang 2019) gives every word type a fixed random label; selectivity = accuracy - control accuracy. "
               "The expected layer (expected_layer_running_max) weights each layer by how much it raises the best accuracy of the "
               "layers below, a one-probe-per-layer variant of Tenney et al.'s (2019) expected layer (docs/methods.md). "
               "The Primer reports syntax most prominent in the middle layers (layer_probes.csv). " + HIDDEN_STATES_NUMBERED),
    )
    if table.empty:
        return without_rows(section, "layer_probes.csv")
    section.figures.append(Figure(folder.write_figure("layer_probes", probes_by_layer(table)),
                                  "Probe accuracy (95% intervals), control-task accuracy and selectivity after the embeddings (emb.) and after "
                                  "each block (0-based, as in the other figures)."))
    section.tables.append(("Best layer, most selective layer and expected layer per task", with_intervals(summary, table)))
    section.tables.append(("Probe accuracy per layer with its 95% bootstrap interval", table[["task", "layer", "accuracy", "ci_low", "ci_high",
                                                                                             "control_accuracy", "selectivity", "majority"]]))
    return section
