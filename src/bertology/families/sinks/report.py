"""The attention-sink figures and report section (Xiao et al. 2024; Gu et al. 2025; Sun et al. 2024).

Layers and heads are numbered from 0.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import all_zero, head_grid, head_grid_size, hidden_state_axis, layer_lines, plt
from bertology.render.html import Figure, Section, without_rows


def sink_map(sinks: pd.DataFrame, eps: float, min_sample: int = 1, correction: str = "fdr_bh"):
    """Layer x head map of the mean attention to the first token, each sink head (mean > eps and significantly above the
    uniform head's, :func:`~bertology.families.sinks.analyzer.sink_mask`) marked with a white ring."""
    from bertology.families.sinks.analyzer import sink_mask

    attention = sinks[sinks.quantity == "attention"]
    attention = attention.assign(sink=sink_mask(attention, eps, min_sample, correction))
    grid = attention.pivot(index="layer", columns="head", values="value")
    rings = attention.pivot(index="layer", columns="head", values="sink").reindex_like(grid).fillna(False).astype(bool)
    figure, axis = plt.subplots(figsize=head_grid_size(grid))
    # two lines: on one, the title of a map of a few heads is wider than its figure, and cut at both ends
    head_grid(axis, grid, f"mean attention to the first token\nrings: sink heads (> {eps:g} and > uniform)", vmin=0.0, vmax=1.0)
    layers, heads = np.nonzero(rings.values)
    axis.scatter(heads, layers, s=60, facecolors="none", edgecolors="white", linewidths=1.4)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def weight_and_share_by_layer(sinks: pd.DataFrame, rates: pd.DataFrame):
    """Left: Sink_eps per layer. Right: the head mean of the first token's attention weight and of its norm share per layer,
    each beside the uniform head's on the same sequences (dotted, sinks.csv's ``uniform``): a sink takes much weight and gives
    little (Kobayashi et al. 2020's norms). With no rate to draw (:func:`rates_to_show`), the right panel alone."""
    per_layer = rates[rates.layer != "all"]
    if rates_to_show(rates):
        figure, (left, right) = plt.subplots(1, 2, figsize=(10.0, 3.6))
        left.bar(per_layer.layer.astype(int), per_layer.rate, color="tab:blue")
        left.set_ylim(0, 1)
        left.set_xticks(per_layer.layer.astype(int))
        left.set_xlabel("layer (0-based)")
        left.set_ylabel(f"Sink_{per_layer.eps.iloc[0]:g}: share of sink heads")
        left.grid(alpha=0.3, axis="y")
    else:
        figure, right = plt.subplots(figsize=(5.4, 3.6))
    means = sinks[sinks.quantity.isin(("attention", "norm_share"))].groupby(["quantity", "layer"], as_index=False)[["value", "uniform"]].mean()
    for quantity, label, marker, colour in (("attention", "attention weight", "o", "tab:blue"), ("norm_share", "norm share", "s", "tab:orange")):
        rows = means[means.quantity == quantity]
        right.plot(rows.layer, rows.value, marker=marker, color=colour, label=label)
        right.plot(rows.layer, rows.uniform, linestyle=":", color=colour, label=f"{label}: uniform head")
    right.set_xticks(sorted(means.layer.unique()))
    right.set_xlabel("layer (0-based)")
    right.set_ylabel("to the first token (mean over heads)")
    right.set_ylim(0, 1)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    figure.set_layout_engine("tight")
    return figure


def rates_to_show(rates: pd.DataFrame) -> bool:
    """Whether a bar of Sink_eps per layer would show anything: not when every rate is 0 or undecided (an empty frame)."""
    return not all_zero(rates[rates.layer != "all"].rate)


def rates_note(rates: pd.DataFrame, eps: float) -> str:
    """The section's line in place of an empty plot of the rates."""
    values = pd.to_numeric(rates[rates.layer != "all"].rate, errors="coerce")
    if values.isna().all():
        return f"Sink_{eps:g} per layer: nothing to show: no layer's rate is decided (too few sequences per head; sink_rates.csv)."
    return f"Sink_{eps:g} per layer: nothing to show: every value is 0 (no sink head in any layer; sink_rates.csv)."


def activations_by_layer(activations: pd.DataFrame):
    """The largest hidden-state magnitude at position 0 and elsewhere per layer output, with 95% intervals (log scale)."""
    figure, axis = plt.subplots(figsize=(6.0, 3.6))
    layer_lines(axis, activations[activations.quantity != "ratio"], "quantity", {"first_max": "position 0", "rest_max": "every other position"})
    hidden_state_axis(axis, activations.layer)  # massive_activations.csv's layer 0 is the embeddings, its layer l block l - 1's output
    axis.set_yscale("log")
    axis.set_ylabel("largest |hidden state| (log)")
    axis.set_title("massive activations (Sun et al. 2024)", fontsize=9)
    axis.legend(fontsize=8)
    figure.set_layout_engine("tight")
    return figure


def sinks_section(folder: RunFolder, sinks: pd.DataFrame, rates: pd.DataFrame, secondary: pd.DataFrame, activations: pd.DataFrame,
                  eps: float, min_sample: int, correction: str = "fdr_bh") -> Section:
    """Write the sink figures into ``folder`` and return the report section."""
    section = Section(
        title="Attention sinks",
        intro=(f"Xiao et al. (2024) and Gu et al. (2025): in a decoder, many heads put most of their weight on the first token. For "
               "each head, alpha_0 is the mean over queries i > 0 of a[i, 0], averaged over sequences with a 95% interval (sinks.csv); "
               "beside it, the uniform head's value on the same sequences (each row uniform over the keys it saw: about 0.16 on "
               f"typical lines, above 0.3 on five pieces or fewer); a head whose mean exceeds eps = {eps:g} and whose paired excess "
               "over the uniform head is significant (corrected over the heads) is a sink head, and Sink_eps is the share of such "
               "heads (sink_rates.csv). Beside "
               "the weight: the first token's norm-based share (Kobayashi et al. 2020; a sink takes much weight and gives little), its key "
               "and value norms against the other tokens', and the largest hidden-state magnitude at position 0 against elsewhere "
               "(massive activations, Sun et al. 2024; massive_activations.csv). Pieces at later positions whose mean received attention "
               "exceeds eps and the uniform head's are secondary sinks (secondary_sinks.csv)."),
    )
    if sinks.empty:
        return without_rows(section, "sinks.csv")
    section.figures.append(Figure(folder.write_figure("sink_map", sink_map(sinks, eps, min_sample, correction)),
                                  "Each head's mean attention to the first token, layer x head; white rings mark sink heads."))
    if rates_to_show(rates):
        caption = ("Left: the share of sink heads per layer. Right: the first token's attention weight and its norm share, head means, "
                   "dotted: the uniform head's.")
    else:
        section.notes.append(rates_note(rates, eps))
        caption = "The first token's attention weight and its norm share per layer, head means; dotted: the uniform head's."
    section.figures.append(Figure(folder.write_figure("sinks_by_layer", weight_and_share_by_layer(sinks, rates)), caption))
    if not activations.empty:
        section.figures.append(Figure(folder.write_figure("massive_activations", activations_by_layer(activations)),
                                      "The largest hidden-state magnitude at position 0 and elsewhere after the embeddings (emb.) and after each block "
                                      "(0-based, as in the other figures; massive_activations.csv counts the embeddings as layer 0, so its "
                                      "layer l is block l - 1's output), with 95% intervals."))
    section.tables.append((f"Sink_{eps:g} per layer and overall (heads on fewer than {min_sample} sequences leave a rate undecided)", rates))
    wide = sinks.groupby(["quantity", "layer"]).value.mean().unstack("quantity").reset_index()
    section.tables.append(("Per-layer head means: attention to the first token, its norm share, its key and value norm ratios", wide))
    if len(secondary):
        section.tables.append(("Secondary sinks: pieces after the first whose mean received attention exceeds eps (strongest 20)", secondary.head(20)))
    else:
        section.notes.append(f"No piece after the first takes more than {eps:g} of a head's attention on average (seen at least {min_sample} times).")
    return section
