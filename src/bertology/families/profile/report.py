"""The general profile's figures and report section (Clark et al. 2019). Layers and heads are numbered from 0."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.transforms import Bbox

from bertology.core.model.kinds import Kind
from bertology.core.storage.runfolder import RunFolder
from bertology.families.profile.analyzer import EXACT, clark_threshold_values, profile_metric_names
from bertology.render.figures import METRIC_TITLES, PANEL_INCHES, head_map_inches, head_ticks, panel_colorbar, panel_grid, plain_ticks, plt
from bertology.render.html import Figure, Section, without_rows

_PUNCT_SETS = {"upos": "every token that is only punctuation (Unicode category P*; --punct upos)",
               "clark": "the tokens '.' and ',' only, as in Clark et al.'s code (--punct clark)"}


def special_by_layer(heads: pd.DataFrame, metrics=("cls", "sep", "punct")):
    """Clark et al.'s figure 2: each head's attention to special tokens (dots) and the layer mean (line), beside the uniform
    head's on the same sequences (dotted, heads.csv's ``uniform``): a head on it attends no more than chance. From 0, a share."""
    figure, axes = panel_grid(1, len(metrics), (3.7, 2.4), across=0.3, sharey=True)
    axes = axes[0]
    rng = np.random.default_rng(0)
    for axis, metric in zip(axes, metrics):
        rows = heads[heads.metric == metric]
        jitter = rng.uniform(-0.15, 0.15, len(rows))
        axis.scatter(rows.layer + jitter, rows.value, s=12, alpha=0.55, color="tab:blue", label="one head")
        mean = rows.groupby("layer")[["value", "uniform"]].mean()
        axis.plot(mean.index, mean.value, color="tab:red", marker="o", label="layer mean")
        axis.plot(mean.index, mean.uniform, color="black", linestyle=":", label="uniform head")
        axis.yaxis.set_major_formatter(plain_ticks())
        axis.set_title(METRIC_TITLES[metric])
        axis.set_xlabel("layer (0-based)")
        axis.set_xticks(sorted(rows.layer.unique()))
        axis.grid(alpha=0.3)
    shown = heads[heads.metric.isin(metrics)]
    axes[0].set_ylim(0.0, 1.1 * np.nanmax(np.r_[shown.value.to_numpy(float), shown.uniform.to_numpy(float)]))  # shared by the panels
    axes[0].set_ylabel("average attention")
    axes[0].legend(loc="best", fontsize=8)
    return figure


#: Metrics that are shares of a row's attention (0 to 1): their heat maps share one colour scale, so they compare.
SHARE_METRICS = ("cls", "sep", "first", "punct", "self", "prev", "next")
#: The least inches a panel of :func:`metric_heatmaps` takes (width, height): a model of a few heads and layers still has
#: room for each title (the widest spills into the gaps beside it) and for "layer (0-based)" beside its panel.
LEAST_PANEL_INCHES = (1.7, 1.4)
#: The unit of each other metric, for its own colour bar.
METRIC_UNITS = {"entropy": "nats", "cls_entropy": "nats", "distance": "tokens"}


def own_scale(rows: pd.DataFrame) -> tuple[float, float]:
    """The colour scale of one entropy's or distance's map (``rows``: its rows of heads.csv): from 0 (all weight on one key;
    on the query itself) to the larger of its largest head and the uniform head's value (the most entropy these sequences
    allow; the distance of a head that looks nowhere in particular). Not the heads' own least to largest: heads that differ
    by 1e-5 nats (a random model's, all near uniform) would stretch that noise over every colour, and read as contrast."""
    return 0.0, float(np.nanmax(np.r_[rows.value.to_numpy(float), rows.uniform.to_numpy(float)]))


def metric_heatmap(heads: pd.DataFrame, metric: str, axis, named: tuple[bool, bool] = (True, True), **imshow):
    """Layer x head heatmap of one metric's mean over sequences, drawn on ``axis``; returns the image. ``named``: whether
    its heads (x) and layers (y) are numbered (:func:`~bertology.render.figures.head_ticks`)."""
    grid = heads[heads.metric == metric].pivot(index="layer", columns="head", values="value")
    image = axis.imshow(grid.values, aspect="auto", cmap="viridis", **imshow)
    head_ticks(axis, grid.index, grid.columns, x=named[0], y=named[1])
    axis.set_title(METRIC_TITLES.get(metric, metric))
    return image


def metric_heatmaps(heads: pd.DataFrame, metrics) -> plt.Figure:
    """All metrics' layer x head heatmaps in one grid (for the report). The shares of attention (:data:`SHARE_METRICS`)
    share one colour scale from 0 to 1 and one colour bar, right of the grid beside the rows they end; every other metric has its
    own bar, labelled with its unit, from 0 to at least the uniform head's value (:func:`own_scale`). The panels keep one size
    whatever the heads (:func:`head_map_inches`), and at least :data:`LEAST_PANEL_INCHES`; the heads are numbered under the
    lowest panel of each column, the layers left of the first column (the panels line up)."""
    columns = 3
    rows = int(np.ceil(len(metrics) / columns))
    panel = tuple(np.maximum(head_map_inches(heads.layer.nunique(), heads["head"].nunique(), cell=(0.35, 0.42), most=PANEL_INCHES),
                             LEAST_PANEL_INCHES))
    figure, axes = panel_grid(rows, columns, panel, right=1.1)
    # The shares' bar stands beside the rows whose last panel is a share: a row that ends in another metric has that
    # metric's own bar there (a decoder's second row).
    shares = [(k, axis) for k, (axis, metric) in enumerate(zip(axes.ravel(), metrics)) if metric in SHARE_METRICS]
    shared = [axis for k, axis in shares if k % columns == columns - 1] or [axis for _, axis in shares]
    for k, (axis, metric) in enumerate(zip(axes.ravel(), metrics)):
        named = (k + columns >= len(metrics), k % columns == 0)  # no panel below it; the first column
        if metric in SHARE_METRICS:
            share_image = metric_heatmap(heads, metric, axis, named, vmin=0.0, vmax=1.0)
        else:
            low, high = own_scale(heads[heads.metric == metric])
            panel_colorbar(figure, metric_heatmap(heads, metric, axis, named, vmin=low, vmax=high), axis, label=METRIC_UNITS.get(metric))
    if shared:
        span = Bbox.union([axis.get_position() for axis in shared])
        bar = figure.add_axes((span.x1 + 0.25 / figure.get_figwidth(), span.y0, 0.15 / figure.get_figwidth(), span.height))
        figure.colorbar(share_image, cax=bar, label="share of attention")
    for axis in axes.ravel()[len(metrics):]:
        axis.set_visible(False)
    return figure


#: The heads farthest from the centre of the head map that :func:`head_map_figure` tries to label: past a few hundred,
#: hardly one more fits, and each try measures a label (1,024 heads took a second).
LABELS_TRIED = 200


def head_map_figure(embedding: pd.DataFrame):
    """2-D MDS map of the heads by Jensen-Shannon distance, one colour per layer with a legend (Clark et al. figure 6).

    Each head is labelled ``layer-head`` where the label overlaps no label already drawn, the heads farthest from the
    centre first (the outliers are the heads worth naming; the :data:`LABELS_TRIED` farthest); the others stay unlabelled
    dots."""
    # margins in inches: the title above, the legend of layers right of the map (no ticks): laid out once, by hand
    figure, axis = plt.subplots(figsize=(9.0, 7.5), gridspec_kw={"left": 0.2 / 9.0, "right": 1 - 1.5 / 9.0, "bottom": 0.2 / 7.5,
                                                                 "top": 1 - 0.45 / 7.5})
    figure.fixed_layout = True  # RunFolder.write_figure keeps these margins
    layers = sorted(embedding.layer.unique())
    colours = plt.get_cmap("viridis", len(layers))
    for k, layer in enumerate(layers):
        rows = embedding[embedding.layer == layer]
        axis.scatter(rows.x, rows.y, color=colours(k), s=45, edgecolor="black", linewidth=0.4, label=f"layer {layer}")
    axis.set_xticks([])
    axis.set_yticks([])
    axis.legend(title="layer (0-based)", fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    axis.set_title("heads by Jensen-Shannon distance (MDS); labels layer-head, where they fit")
    renderer = figure.canvas.get_renderer()
    centre = embedding[["x", "y"]].mean()
    kept = []
    farthest = embedding.assign(far=np.hypot(embedding.x - centre.x, embedding.y - centre.y)).sort_values("far", ascending=False)
    for row in farthest.head(LABELS_TRIED).itertuples():
        label = axis.annotate(f"{row.layer}-{row.head}", (row.x, row.y), fontsize=8, xytext=(3, 3), textcoords="offset points")
        box = label.get_window_extent(renderer)
        if any(box.overlaps(other) for other in kept):
            label.remove()
        else:
            kept.append(box)
    return figure


def head_distance_approximation_note(head_distance: pd.DataFrame) -> str:
    """One line naming the head distance's approximation and the rows each kind of pair ran over (Clark et al.'s distance
    is the mean over every row of the sampled sequences of JS(A_i, B_i); past the budget, over sampled rows)."""
    a, b = head_distance[["layer_a", "head_a"]].to_numpy(), head_distance[["layer_b", "head_b"]].to_numpy()
    first = (a[:, 0] < b[:, 0]) | ((a[:, 0] == b[:, 0]) & (a[:, 1] < b[:, 1]))  # each pair once: not (b, a), not a head and itself
    approximated = head_distance[first & (head_distance.method != EXACT)].drop_duplicates(["layer_a", "head_a", "layer_b", "head_b"])  # views
    same = approximated.layer_a == approximated.layer_b
    rows = "; ".join(f"{what} pairs on {int(part.rows.iloc[0]):,} rows" for what, part in (("within-layer", approximated[same]),
                                                                                          ("cross-layer", approximated[~same])) if len(part))
    return (f"The head distance is an approximation ({approximated.method.iloc[0]}) for {len(approximated):,} pairs of heads: sequences "
            f"past --head-distance-budget (head pairs x rows x keys) compare their heads on a sample of their rows ({rows}; "
            "head_distance.csv's rows and method columns).")


def profile_section(
    folder: RunFolder,
    heads: pd.DataFrame,
    layers: pd.DataFrame,
    labels: pd.DataFrame,
    clark: pd.DataFrame,
    head_map: pd.DataFrame | None,
    kind: Kind,
    punct: str = "upos",
    head_distance: pd.DataFrame | None = None,
) -> Section:
    """Write the profile figures into ``folder`` and return the report section that shows them (``kind``: the run's kind of
    model, whose metrics the tables hold, :func:`~bertology.families.profile.analyzer.profile_metric_names`; ``punct``: the
    punctuation set; ``head_distance``: the head distance's table, whose ``method`` the head map's note names).
    A decoder's table has ``first`` in place of ``cls`` (docs/methods.md#decoders)."""
    metrics, thresholds, targets = profile_metric_names(kind), clark_threshold_values(kind), kind.anchor_words
    section = Section(
        title="General attention profile",
        intro=(
            f"Clark et al. (2019), 'What Does BERT Look At?': for every head, the average attention to {targets}, "
            "punctuation, itself and its neighbours, the entropy of its attention and its mean attention distance, "
            f"averaged over sequences with 95% intervals (heads.csv). Punctuation: {_PUNCT_SETS[punct]}."
            + (" A decoder: query i sees keys j <= i only, so row 0 is left out of every mean over queries, the entropy is smoothed "
               "over the keys each row sees, and [SEP] and the next token have no meaning (docs/methods.md#decoders)." if not kind.sees_later_keys else "")
        ),
    )
    if heads.empty:
        return without_rows(section, "heads.csv")
    special = folder.write_figure("special_tokens_by_layer", special_by_layer(heads, (*kind.anchors, "punct")))
    section.figures.append(Figure(special, f"Attention to {targets} and punctuation by layer: dots are heads, the line is the layer mean, "
                                           "the dotted line the uniform head's on the same sequences."))
    grid = folder.write_figure("heatmaps", metric_heatmaps(heads, metrics))
    section.figures.append(Figure(grid, "Each metric's mean per head, layer x head (every value is in heads.csv). The shares of attention "
                                        "share one scale, 0 to 1; entropy and distance run "
                                        "from 0 to the larger of their largest head and the uniform head's value (for the entropy, the most "
                                        "its sequences allow)."))
    if head_map is not None:
        mds = folder.write_figure("head_map", head_map_figure(head_map))
        section.figures.append(Figure(mds, "Heads placed by their Jensen-Shannon distance (MDS): heads that attend alike sit together."))
    if head_distance is not None and "method" in head_distance and (head_distance.method != EXACT).any():
        section.notes.append(head_distance_approximation_note(head_distance))
    wide = layers.pivot(index="layer", columns="metric", values="value")[list(metrics)].reset_index()
    section.tables.append(("Per-layer means (a sequence's layer value is the mean of its heads)", wide))
    thresholds = ", ".join(f"{metric} > {value}" for metric, value in thresholds.items())
    if len(labels):
        section.tables.append((f"Heads that pass Clark's thresholds ({thresholds})", labels))
    else:
        section.notes.append(f"No head passes Clark's thresholds ({thresholds}).")
    section.tables.append(("Clark's thresholds and the largest value this corpus allows (clark_thresholds.csv)", clark))
    for row in clark[~clark.reachable].itertuples():
        section.notes.append(f"No head can be labelled '{row.label}' on this corpus: its threshold, {row.metric} > {row.threshold:g} nats, is "
                             f"above the largest mean entropy its sequences allow, {row.corpus_max:.2f} nats (uniform attention: the mean "
                             f"of ln n). Clark et al. set it on sequences of up to 128 tokens; compare heads by entropy instead.")
    return section
