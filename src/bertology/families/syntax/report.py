"""The syntactic heads' figures and report section (Clark et al. 2019, section 4)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import plt
from bertology.render.html import Figure, Section

MAX_TIES_SHOWN = 6  # the report lists this many tied heads per relation; syntax_best.csv lists them all


def _shorten_ties(ties: str) -> str:
    heads = ties.split("; ")
    return ties if len(heads) <= MAX_TIES_SHOWN else "; ".join(heads[:MAX_TIES_SHOWN]) + f"; ... ({len(heads) - MAX_TIES_SHOWN} more)"


def best_heads_vs_baseline(best: pd.DataFrame, top: int = 15):
    """Bars: the best head's accuracy per relation (with its bootstrap interval) against the best offset baseline and the
    uniform head, on the same pairs."""
    rows = best[best.relation != "all"].head(top)
    rows = pd.concat([best[best.relation == "all"], rows])
    figure, axis = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.2))
    x = np.arange(len(rows))
    error = np.vstack([rows.accuracy - rows.ci_low, rows.ci_high - rows.accuracy])
    axis.bar(x - 0.27, rows.accuracy, 0.27, yerr=error, capsize=2, color="tab:blue", label="best head (95% bootstrap interval)")
    axis.bar(x, rows.baseline_accuracy, 0.27, color="tab:gray", label="best fixed offset (same pairs)")
    if "uniform" in rows:
        axis.bar(x + 0.27, rows.uniform, 0.27, color="tab:olive", label="uniform head (same pairs)")
    labels = [f"{r.relation}\n{r.layer}-{r.head}{'*' if r.significant else ''}" for r in rows.itertuples()]
    axis.set_xticks(x, labels, fontsize=8)
    axis.set_ylabel("accuracy")
    axis.set_ylim(0, 1)
    axis.set_title("best head per relation (layer-head, 0-based; * beats the baseline and the uniform head after correction)")
    axis.legend(fontsize=8, loc="upper right")
    axis.grid(axis="y", alpha=0.3)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def relation_heatmap(syntax: pd.DataFrame, relation: str):
    """Layer x head accuracy for one relation, one panel per direction."""
    rows = syntax[syntax.relation == relation]
    directions = list(dict.fromkeys(rows.direction))
    figure, axes = plt.subplots(1, len(directions), figsize=(5.4 * len(directions), 3.6))
    vmax = rows.accuracy.max()
    for axis, direction in zip(np.atleast_1d(axes), directions):
        grid = rows[rows.direction == direction].pivot(index="layer", columns="head", values="accuracy")
        image = axis.imshow(grid.values, aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        axis.set_xticks(range(grid.shape[1]), grid.columns)
        axis.set_yticks(range(grid.shape[0]), grid.index)
        axis.set_xlabel("head (0-based)")
        axis.set_ylabel("layer (0-based)")
        axis.set_title(f"{relation}: {direction} (n={int(rows.n.iloc[0])})")
        plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure



def syntax_section(folder: RunFolder, syntax: pd.DataFrame, best: pd.DataFrame, probe: dict | None, relation: str, min_dependents: int) -> Section:
    """Write the syntax figures into ``folder`` and return the report section that shows them."""
    section = Section(
        title="Syntactic heads",
        intro=(
            "Clark et al. (2019), section 4: for each relation, the head whose attention argmax most often lands on the gold "
            "parent (dep->head: the dependent attends to its head; head->dep: the head attends to its dependent), against "
            "the best fixed-offset baseline and the uniform head (each row spread evenly over the keys it sees), all scored on the same "
            "(dependent, head) pairs, those the row sees; a row's maximum tied among t words scores 1/t. A head is significant only when "
            "it beats both. Intervals and one-sided paired p-values come from a bootstrap over sentences; "
            "p_adj is corrected across relations (syntax_best.csv; every head in syntax.csv). Heads tied at the best accuracy "
            "are all listed (n_ties, ties); the row's head, interval and p-value are the first of them. 'all' pools every "
            "relation; the root word is no dependent (its gold head is no word), so it counts nowhere."
        ),
    )
    shown = best[~best.few]
    bars = folder.write_figure("syntax_best", best_heads_vs_baseline(shown))
    section.figures.append(Figure(bars, "Best head per relation against the best fixed-offset baseline (relations with enough dependents)."))
    if relation in set(syntax.relation):
        heatmap = folder.write_figure(f"syntax_heatmap_{relation}", relation_heatmap(syntax, relation))
        section.figures.append(Figure(heatmap, f"Accuracy of every head for '{relation}', in both directions."))
    listed = best.assign(ties=best.ties.map(_shorten_ties))
    section.tables.append((f"Best head per relation (at least {min_dependents} dependents)", listed[~listed.few]))
    if listed.few.any():
        section.folded.append((f"Relations with fewer than {min_dependents} dependents: not tested", listed[listed.few]))
    tied = shown[shown.n_ties > 1]
    if len(tied):
        section.notes.append("Several heads share the best accuracy for " + ", ".join(f"{r.relation} ({r.n_ties})" for r in tied.itertuples())
                             + ": see the ties column.")
    if (best.few).any():
        section.notes.append(f"{int(best.few.sum())} relations have fewer than {min_dependents} dependents (--min-dependents): a best head "
                             "found on so few words is no finding, so they get no interval, p-value or significance, and are folded away.")
    if probe is not None:
        uas = pd.DataFrame({"method": list(probe["uas"]), "UAS": list(probe["uas"].values())})
        section.tables.append((f"Attention parsing probe ({probe['evaluation']})", uas))
        section.tables.append(("Does each probe variant beat the best of the offset baselines and its uniform probe?", probe_verdict_table(probe)))
        section.notes.append(
            "attn: a learned linear combination of every head's word-level attention in both directions; attn+emb: the "
            "head weights also depend on the two words' input embeddings from the model (Clark et al. used GloVe). "
            "uniform_attn and uniform_attn+emb: the same probes, same folds and seed, on each layer's uniform head instead of its "
            "heads (the null model; uniform_attn+emb is in effect a probe of the embeddings and of position). A variant beats "
            "the baselines only when its UAS exceeds the best of right-branching, left-branching, the best offset and its own "
            "uniform probe, by a one-sided paired bootstrap over the held-out sentences, corrected over the variants."
        )
    return section


def probe_verdict_table(probe: dict) -> pd.DataFrame:
    """One row per probe variant: its UAS, the best reference (offset baseline or uniform probe of the variant) and its UAS,
    the margin with its 95% bootstrap interval, p, p_adj and whether it beats them (``probe.json``'s ``verdict``)."""
    return pd.DataFrame([{"variant": variant, **verdict} for variant, verdict in probe["verdict"].items()])
