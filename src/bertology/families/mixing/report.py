"""The context-mixing figure and report section (Kobayashi et al. 2021). Layers are numbered from 0."""

from __future__ import annotations

import pandas as pd

from bertology.core.model.kinds import Kind
from bertology.core.storage.runfolder import RunFolder
from bertology.families.mixing import RATIO_KINDS
from bertology.render.figures import layer_lines, plt
from bertology.render.html import Figure, Section, without_rows

RATIO_TITLES = {"attn": "attention alone (Attn-N)", "attn_res": "with the residual (AttnRes-N)",
                "attn_res_ln": "with the residual and the layer norm (AttnResLn-N)", "alti": "ALTI: 1 - c[i, i] (Ferrando et al. 2022)",
                "value_zeroing": "value zeroing: 1 - c[i, i] (Mohebbi et al. 2023)", "alti_rollout": "ALTI rolled out: 1 - R[i, i]",
                "value_zeroing_rollout": "value zeroing rolled out: 1 - R[i, i]"}

#: Why ALTI's share from the other tokens is small where value zeroing's is large (docs/methods.md#norms-and-mixing): said
#: wherever the section shows both.
ALTI_AND_VALUE_ZEROING = (
    "Why ALTI's share from the other tokens is small and value zeroing's large: both are right, they measure different things. "
    "ALTI (Ferrando et al. 2022) splits the block's output y_i, residual included, into each input token's part T_i(x_j) and scores "
    "c[i, j] = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), rows normalised; the residual puts token i's own vector x_i in T_i(x_i), "
    "and it is most of y_i, so 1 - c[i, i] is small. Value zeroing (Mohebbi et al. 2023) reruns the layer with token j's value "
    "vectors zeroed and scores the cosine distance between token i's output with and without them, each row normalised to sum 1; "
    "the residual x_i stays in both outputs whichever token's values are zeroed, so it is credited to no token, not even i, and "
    "1 - c[i, i] reads how the attention mixes the tokens' values (token i's own value one among them) without the residual's weight.")


def mixing_by_layer(table: pd.DataFrame):
    """Each context-mixing ratio by layer, with its 95% interval over sequences."""
    figure, axis = plt.subplots(figsize=(6.0, 3.6))
    layer_lines(axis, table, "ratio", RATIO_TITLES)
    axis.set_ylabel("context-mixing ratio")
    axis.set_ylim(0, 1)
    axis.set_title("share of each token's update that comes from other tokens")
    axis.legend(fontsize=8)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def mixing_section(folder: RunFolder, table: pd.DataFrame, kind: Kind) -> Section:
    """Write the mixing figure into ``folder`` and return its report section (``kind``: the run's kind of model; a pre-norm
    decoder's run has the contribution measures alone, :data:`~bertology.families.mixing.RATIO_KINDS`)."""
    section = Section(
        title="Context mixing with the residual and the layer norm",
        intro=("Kobayashi et al. (2021): the ratio ||M|| / (||M|| + ||P||) of what a token's new vector mixes in from the other tokens (M) "
               "against what it keeps of itself (P), counting the attention alone, then the residual, then the layer norm, "
               "averaged over tokens and sequences with 95% intervals (mixing.csv). The paper finds BERT mixes far less "
               "than the weights suggest once the residual and the layer norm are counted." if kind.name in RATIO_KINDS else
               "On this decoder (pre-norm) the share 1 - c[i, i] of each token's representation after the attention block that comes "
               "from the other tokens, by ALTI (Ferrando et al. 2022; the block x + attention, docs/methods.md#decoders) and by value "
               "zeroing (Mohebbi et al. 2023; the whole layer rerun), per layer and rolled out across layers, averaged over tokens and "
               "sequences with 95% intervals (mixing.csv). Kobayashi's ratios take a post-norm block and are left out."),
    )
    if table.empty:
        return without_rows(section, "mixing.csv")
    if {"alti", "value_zeroing"} <= set(table.ratio):
        section.intro += " " + ALTI_AND_VALUE_ZEROING
    section.figures.append(Figure(folder.write_figure("mixing_by_layer", mixing_by_layer(table)),
                                  "Context-mixing ratios by layer (0-based), mean over sequences with 95% intervals."))
    wide = table.pivot(index="layer", columns="ratio", values="value")[[ratio for ratio in RATIO_TITLES if (table.ratio == ratio).any()]].reset_index()
    section.tables.append(("Mean context-mixing ratio per layer", wide))
    return section
