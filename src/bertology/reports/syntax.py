"""The syntax part of a run folder: its figures and its report section."""

from __future__ import annotations

import pandas as pd

from bertology.reports import figures
from bertology.reports.html import Figure, Section
from bertology.runfolder import RunFolder

MAX_TIES_SHOWN = 6  # the report lists this many tied heads per relation; syntax_best.csv lists them all


def _shorten_ties(ties: str) -> str:
    heads = ties.split("; ")
    return ties if len(heads) <= MAX_TIES_SHOWN else "; ".join(heads[:MAX_TIES_SHOWN]) + f"; ... ({len(heads) - MAX_TIES_SHOWN} more)"


def syntax_section(folder: RunFolder, syntax: pd.DataFrame, best: pd.DataFrame, probe: dict | None, relation: str, min_dependents: int) -> Section:
    """Write the syntax figures into ``folder`` and return the report section that shows them."""
    section = Section(
        title="Syntactic heads",
        intro=(
            "Clark et al. (2019), section 4: for each relation, the head whose attention argmax most often lands on the gold "
            "parent (dep->head: the dependent attends to its head; head->dep: the head attends to its dependent), against "
            "the best fixed-offset baseline. Intervals and one-sided paired p-values come from a bootstrap over sentences; "
            "p_adj is corrected across relations (syntax_best.csv; every head in syntax.csv). Heads tied at the best accuracy "
            "are all listed (n_ties, ties); the row's head, interval and p-value are the first of them. 'all' pools every "
            "relation; the root word is no dependent (its gold head is no word), so it counts nowhere."
        ),
    )
    shown = best[~best.few]
    bars = folder.write_figure("syntax_best", figures.best_heads_vs_baseline(shown))
    section.figures.append(Figure(bars, "Best head per relation against the best fixed-offset baseline (relations with enough dependents)."))
    if relation in set(syntax.relation):
        heatmap = folder.write_figure(f"syntax_heatmap_{relation}", figures.relation_heatmap(syntax, relation))
        section.figures.append(Figure(heatmap, f"Accuracy of every head for '{relation}', in both directions."))
    section.tables.append(("Best head per relation", best.assign(ties=best.ties.map(_shorten_ties))))
    tied = shown[shown.n_ties > 1]
    if len(tied):
        section.notes.append("Several heads share the best accuracy for " + ", ".join(f"{r.relation} ({r.n_ties})" for r in tied.itertuples())
                             + ": see the ties column.")
    if (best.few).any():
        section.notes.append(f"Relations with fewer than {min_dependents} dependents are flagged 'few': their best head is unreliable.")
    if probe is not None:
        uas = pd.DataFrame({"method": list(probe["uas"]), "UAS": list(probe["uas"].values())})
        section.tables.append((f"Attention parsing probe ({probe['evaluation']})", uas))
        section.notes.append(
            "attn: a learned linear combination of every head's word-level attention in both directions; attn+emb: the "
            "head weights also depend on the two words' input embeddings from the model (Clark et al. used GloVe)."
        )
    return section
