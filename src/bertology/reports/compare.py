"""The comparison part of a run folder: figures and the report section."""

from __future__ import annotations

import pandas as pd

from bertology.reports import figures
from bertology.reports.html import Figure, Section
from bertology.core.runfolder import RunFolder


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
    section.figures.append(Figure(folder.write_figure("similarity_heatmap", figures.similarity_heatmap(similarity, name_a, name_b)), "Cosine similarity per head."))
    section.figures.append(Figure(folder.write_figure("similarity_by_layer", figures.similarity_by_layer(layers)), "Mean similarity per layer."))
    section.tables.append(("Similarity per layer", layers))
    wide = deltas.groupby(["layer", "metric"]).delta.mean().unstack("metric").reset_index()
    section.tables.append(("Mean change (B - A) of each profile metric, per layer", wide))
    if roles is not None:
        counts = roles.groupby(["role", "change"]).size().unstack("change", fill_value=0).reset_index() if len(roles) else roles
        section.tables.append(("Roles gained and lost (heads)", counts))
    return section


def layer_view_section(folder: RunFolder, probes: pd.DataFrame, layers: pd.DataFrame, name_a: str, name_b: str) -> Section:
    """Both models' layer probes side by side, with each layer's attention similarity."""
    from bertology.families.layers.report import probes_by_layer

    section = Section(
        title="What changed, layer by layer",
        intro=(f"Linear probes of every layer's word vectors (UPOS tags and dependency relations, with control tasks) for {name_a} (A) "
               f"and {name_b} (B) on the same sentences, beside the mean cosine similarity of the two models' attention in the block "
               "that makes each layer (layer_probes.csv, layer_comparison.csv). The Primer: fine-tuning changes the last layers most."),
    )
    section.figures.append(Figure(folder.write_figure("layer_probes_compared", probes_by_layer(probes, by="model")),
                                  "Probe accuracy, control accuracy and selectivity by layer (0 = embeddings), A and B."))
    section.tables.append(("Probe accuracy of A and B and attention similarity per layer", layers))
    return section
