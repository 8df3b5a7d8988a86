"""The frame-semantic heads' figure and report section (Kovaleva et al. 2019). Layers and heads are numbered from 0."""

from __future__ import annotations

import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import head_grid, head_grid_size, plt
from bertology.render.html import Figure, Section


def frame_heatmaps(table: pd.DataFrame):
    """Per head: the frame score, and the score minus its random-pair baseline."""
    score = table.pivot(index="layer", columns="head", values="score")
    difference = table.pivot(index="layer", columns="head", values="difference")
    width, height = head_grid_size(score)
    figure, axes = plt.subplots(1, 2, figsize=(2 * width, height))
    head_grid(axes[0], score, "max attention between target and core element", vmin=0, vmax=1)
    bound = max(float(abs(difference.values).max()), 1e-9) if difference.notna().any().any() else 1.0
    head_grid(axes[1], difference, "score minus position-matched random pairs", cmap="RdBu_r", vmin=-bound, vmax=bound)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def frames_section(folder: RunFolder, table: pd.DataFrame, top: int, min_sample: int) -> Section:
    """Write the frame figure into ``folder`` and return the report section."""
    section = Section(
        title="Frame-semantic heads",
        intro=("Kovaleva et al. (2019): for every annotated pair of a frame's target and one of its core elements, a head's score is "
               "its largest attention weight between a token of the element and a token of the target, in either direction, "
               "averaged over pairs (95% intervals over pairs). The baseline moves both spans by the same random number of words "
               "within the sentence; each head's excess over it, averaged per sentence, is tested one-sided over the sentences "
               "and corrected over the heads (frames.csv)."),
    )
    if table.empty:
        section.notes.append("No annotated pair kept its pieces.")
        return section
    section.figures.append(Figure(folder.write_figure("frames_heatmaps", frame_heatmaps(table)),
                                  "Frame score per head, and its excess over random pairs (layers and heads 0-based)."))
    columns = ["layer", "head", "score", "ci_low", "ci_high", "baseline", "difference", "p_adj", "significant", "n"]
    section.tables.append((f"The {top} heads with the highest frame score", table.sort_values("score", ascending=False, kind="stable").head(top)[columns]))
    section.tables.append((f"The {top} heads furthest above random pairs", table.sort_values("difference", ascending=False, kind="stable").head(top)[columns]))
    if table.p.isna().all():
        section.notes.append(f"No head is tested: the random baseline matched pairs in {int(table.n.max())} sentences, fewer than --min-sample "
                             f"{min_sample}. The scores describe this corpus; they are no finding about the heads.")
    return section
