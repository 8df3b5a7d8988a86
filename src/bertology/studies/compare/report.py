"""The comparison part of a run folder: figures and the report section."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import plt
from bertology.render.html import Figure, Section


def comparison_section(folder: RunFolder, similarity: pd.DataFrame, layers: pd.DataFrame, deltas: pd.DataFrame,
                       roles: pd.DataFrame | None, name_a: str, name_b: str) -> Section:
    section = Section(
        title="What changed between the models",
        intro=(
            f"Kovaleva et al. (2019): per head, the cosine similarity between the flattened attention maps of {name_a} (A) "
            f"and {name_b} (B) on the same input, averaged over inputs with a 95% interval (similarity.csv); the change of "
            "every general-profile metric (profile_delta.csv) and the roles gained and lost (roles_delta.csv)."
        ),
    )
    section.figures.append(Figure(folder.write_figure("similarity_heatmap", similarity_heatmap(similarity, name_a, name_b)), "Cosine similarity per head."))
    section.figures.append(Figure(folder.write_figure("similarity_by_layer", similarity_by_layer(layers)), "Mean similarity per layer."))
    section.tables.append(("Similarity per layer", layers))
    wide = deltas.groupby(["layer", "metric"]).delta.mean().unstack("metric").reset_index()
    section.tables.append(("Mean change (B - A) of each profile metric, per layer", wide))
    if roles is not None:
        counts = roles.groupby(["role", "change"]).size().unstack("change", fill_value=0).reset_index() if len(roles) else roles
        section.tables.append(("Roles gained and lost (heads)", counts))
    return section


def layer_view_section(folder: RunFolder, probes: pd.DataFrame, layers: pd.DataFrame, name_a: str, name_b: str) -> Section:
    """Both models' layer probes side by side, with each layer's attention similarity."""
    from bertology.families.layers.report import HIDDEN_STATES_NUMBERED, probes_by_layer

    section = Section(
        title="What changed, layer by layer",
        intro=(f"Linear probes of every layer's word vectors (UPOS tags and dependency relations, with control tasks) for {name_a} (A) "
               f"and {name_b} (B) on the same sentences, beside the mean cosine similarity of the two models' attention in the block "
               "that makes each layer (layer_probes.csv, layer_comparison.csv). The Primer: fine-tuning changes the last layers most. "
               + HIDDEN_STATES_NUMBERED),
    )
    section.figures.append(Figure(folder.write_figure("layer_probes_compared", probes_by_layer(probes, by="model")),
                                  "Probe accuracy, control accuracy and selectivity after the embeddings (emb.) and after each block "
                                  "(0-based, as in the other figures), A and B."))
    section.tables.append(("Probe accuracy of A and B and attention similarity per layer", layers))
    return section


def similarity_heatmap(similarity: pd.DataFrame, name_a: str, name_b: str):
    """Layer x head cosine similarity between two models' maps (Kovaleva et al. figure 5)."""
    grid = similarity.pivot(index="layer", columns="head", values="cosine")
    figure, axis = plt.subplots(figsize=(0.5 * grid.shape[1] + 2.8, 0.45 * grid.shape[0] + 1.6))
    image = axis.imshow(grid.values, aspect="auto", cmap="RdYlGn", vmin=min(0.0, float(np.nanmin(grid.values))), vmax=1.0)
    for (i, j), value in np.ndenumerate(grid.values):
        axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6)
    axis.set_xticks(range(grid.shape[1]), grid.columns)
    axis.set_yticks(range(grid.shape[0]), grid.index)
    axis.set_xlabel("head (0-based)")
    axis.set_ylabel("layer (0-based)")
    axis.set_title(f"cosine similarity of attention maps\n{name_a} vs {name_b}", fontsize=9)
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def similarity_by_layer(layers: pd.DataFrame):
    """Mean similarity per layer with its 95% interval."""
    figure, axis = plt.subplots(figsize=(5.5, 3.4))
    axis.errorbar(layers.layer, layers.cosine, yerr=[layers.cosine - layers.ci_low, layers.ci_high - layers.cosine], marker="o", capsize=3)
    axis.set_xticks(layers.layer)
    axis.set_xlabel("layer (0-based)")
    axis.set_ylabel("mean cosine similarity")
    axis.set_title("how much each layer's attention changed (1 = unchanged)")
    axis.grid(alpha=0.3)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure
