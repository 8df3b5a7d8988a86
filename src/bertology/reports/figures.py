"""Figures of the general profile. Layers and heads are numbered from 0, as in every table."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

METRIC_TITLES = {
    "cls": "attention to [CLS]",
    "sep": "attention to [SEP]",
    "punct": "attention to punctuation",
    "self": "attention to self",
    "prev": "attention to previous token",
    "next": "attention to next token",
    "entropy": "entropy (nats)",
    "cls_entropy": "entropy of the [CLS] row (nats)",
    "distance": "mean attention distance (tokens)",
    "syntax": "best syntactic head (mean over relations)",
}


def special_by_layer(heads: pd.DataFrame, metrics=("cls", "sep", "punct")):
    """Clark et al.'s figure 2: each head's attention to special tokens (dots) and the layer mean (line)."""
    figure, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), sharey=True)
    rng = np.random.default_rng(0)
    for axis, metric in zip(np.atleast_1d(axes), metrics):
        rows = heads[heads.metric == metric]
        jitter = rng.uniform(-0.15, 0.15, len(rows))
        axis.scatter(rows.layer + jitter, rows.value, s=12, alpha=0.55, color="tab:blue", label="one head")
        mean = rows.groupby("layer").value.mean()
        axis.plot(mean.index, mean.values, color="tab:red", marker="o", label="layer mean")
        axis.set_title(METRIC_TITLES[metric])
        axis.set_xlabel("layer (0-based)")
        axis.set_xticks(sorted(rows.layer.unique()))
        axis.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("average attention")
    np.atleast_1d(axes)[0].legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    return figure


def metric_heatmap(heads: pd.DataFrame, metric: str, axis=None):
    """Layer x head heatmap of one metric's mean over sequences."""
    grid = heads[heads.metric == metric].pivot(index="layer", columns="head", values="value")
    own = axis is None
    if own:
        figure, axis = plt.subplots(figsize=(0.45 * grid.shape[1] + 2.5, 0.45 * grid.shape[0] + 1.5))
    image = axis.imshow(grid.values, aspect="auto", cmap="viridis")
    axis.set_xticks(range(grid.shape[1]), grid.columns)
    axis.set_yticks(range(grid.shape[0]), grid.index)
    axis.set_xlabel("head (0-based)")
    axis.set_ylabel("layer (0-based)")
    axis.set_title(METRIC_TITLES.get(metric, metric))
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    if own:
        figure.tight_layout()
        return figure
    return axis.figure


def metric_heatmaps(heads: pd.DataFrame, metrics) -> plt.Figure:
    """All metrics' layer x head heatmaps in one grid (for the report)."""
    columns = 3
    rows = int(np.ceil(len(metrics) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.4 * rows))
    for axis, metric in zip(axes.ravel(), metrics):
        metric_heatmap(heads, metric, axis=axis)
    for axis in axes.ravel()[len(metrics):]:
        axis.set_visible(False)
    figure.tight_layout()
    return figure


def head_map(embedding: pd.DataFrame):
    """2-D MDS map of the heads by Jensen-Shannon distance, coloured by layer (Clark et al. figure 6)."""
    figure, axis = plt.subplots(figsize=(6.5, 5.5))
    points = axis.scatter(embedding.x, embedding.y, c=embedding.layer, cmap="viridis", s=40, edgecolor="white", linewidth=0.5)
    for row in embedding.itertuples():
        axis.annotate(f"{row.layer}-{row.head}", (row.x, row.y), fontsize=6, alpha=0.7, xytext=(2, 2), textcoords="offset points")
    bar = plt.colorbar(points, ax=axis)
    bar.set_label("layer (0-based)")
    axis.set_title("heads by Jensen-Shannon distance (MDS); labels layer-head")
    axis.set_xticks([])
    axis.set_yticks([])
    figure.tight_layout()
    return figure


def best_heads_vs_baseline(best: pd.DataFrame, top: int = 15):
    """Bars: the best head's accuracy per relation (with its bootstrap interval) against the best offset baseline."""
    rows = best[best.relation != "all"].head(top)
    rows = pd.concat([best[best.relation == "all"], rows])
    figure, axis = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.2))
    x = np.arange(len(rows))
    error = np.vstack([rows.accuracy - rows.ci_low, rows.ci_high - rows.accuracy])
    axis.bar(x - 0.2, rows.accuracy, 0.4, yerr=error, capsize=2, color="tab:blue", label="best head (95% bootstrap interval)")
    axis.bar(x + 0.2, rows.baseline_accuracy, 0.4, color="tab:gray", label="best fixed offset")
    labels = [f"{r.relation}\n{r.layer}-{r.head}{'*' if r.significant else ''}" for r in rows.itertuples()]
    axis.set_xticks(x, labels, fontsize=8)
    axis.set_ylabel("accuracy")
    axis.set_ylim(0, 1)
    axis.set_title("best head per relation (layer-head, 0-based; * beats the baseline after correction)")
    axis.legend(fontsize=8, loc="upper right")
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
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
    figure.tight_layout()
    return figure


ROLE_COLOURS = {"local": "tab:green", "delimiter": "tab:red", "cls": "tab:orange", "sep": "tab:purple", "block": "tab:blue", "syntactic": "tab:brown"}
PATTERN_COLOURS = {"vertical": "tab:red", "diagonal": "tab:green", "vertical+diagonal": "tab:olive", "block": "tab:blue", "heterogeneous": "tab:gray"}


def role_shares_by_layer(shares: pd.DataFrame, tau: float):
    """Share of heads per layer that hold each role (grouped bars)."""
    roles = list(dict.fromkeys(shares.role))
    layers = sorted(shares.layer.unique())
    figure, axis = plt.subplots(figsize=(max(6.0, 1.1 * len(layers) + 2), 3.8))
    width = 0.8 / max(1, len(roles))
    for k, role in enumerate(roles):
        rows = shares[shares.role == role].set_index("layer").reindex(layers)
        axis.bar(np.arange(len(layers)) + (k - (len(roles) - 1) / 2) * width, rows.share, width, label=role, color=ROLE_COLOURS.get(role))
    axis.set_xticks(range(len(layers)), layers)
    axis.set_xlabel("layer (0-based)")
    axis.set_ylabel("share of heads with the role")
    axis.set_ylim(0, 1)
    axis.set_title(f"heads holding each role (one-sided t-test, tau = {tau:g}, corrected)")
    axis.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def role_colocation_heatmap(matrix: pd.DataFrame):
    """How many heads hold two roles at once."""
    figure, axis = plt.subplots(figsize=(4.8, 4.0))
    image = axis.imshow(matrix.values, cmap="Blues")
    axis.set_xticks(range(len(matrix)), matrix.columns, rotation=45, ha="right")
    axis.set_yticks(range(len(matrix)), matrix.index)
    for (i, j), value in np.ndenumerate(matrix.values):
        axis.text(j, i, int(value), ha="center", va="center", fontsize=8, color="black" if value < matrix.values.max() / 2 else "white")
    axis.set_title("heads holding both roles")
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    figure.tight_layout()
    return figure


def role_grid(roles: pd.DataFrame, order):
    """Layer x head grid: each cell lists the roles its head holds, coloured by the strongest (largest t)."""
    held = roles[roles.role.isin(order) & roles.has_role]
    num_layers, num_heads = roles.layer.max() + 1, roles["head"].max() + 1
    figure, axis = plt.subplots(figsize=(0.75 * num_heads + 1.5, 0.6 * num_layers + 1.2))
    axis.set_xlim(-0.5, num_heads - 0.5)
    axis.set_ylim(num_layers - 0.5, -0.5)
    for (layer, head), rows in held.groupby(["layer", "head"]):
        strongest = rows.sort_values("t", ascending=False).role.iloc[0]
        axis.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, color=ROLE_COLOURS.get(strongest, "tab:gray"), alpha=0.35))
        label = "\n".join(role[:3] for role in rows.sort_values("t", ascending=False).role)
        axis.text(head, layer, label, ha="center", va="center", fontsize=6)
    axis.set_xticks(range(num_heads))
    axis.set_yticks(range(num_layers))
    axis.set_xlabel("head (0-based)")
    axis.set_ylabel("layer (0-based)")
    axis.set_title("roles held by each head (colour: strongest)")
    axis.grid(False)
    figure.tight_layout()
    return figure


def pattern_shares_by_layer(by_layer: pd.DataFrame):
    """Stacked bars: the share of maps of each pattern class per layer, and overall."""
    wide = by_layer.pivot(index="layer", columns="pattern", values="share")
    wide = wide[[p for p in PATTERN_COLOURS if p in wide.columns]]
    labels = ["all" if layer == -1 else str(layer) for layer in wide.index]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.8 * len(wide) + 3), 3.8))
    bottom = np.zeros(len(wide))
    for pattern in wide.columns:
        axis.bar(labels, wide[pattern], bottom=bottom, color=PATTERN_COLOURS[pattern], label=pattern)
        bottom += wide[pattern].values
    axis.set_xlabel("layer (0-based)")
    axis.set_ylabel("share of maps")
    axis.set_title("attention pattern classes per layer (Kovaleva et al.)")
    axis.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    figure.tight_layout()
    return figure


def pattern_grid(patterns: pd.DataFrame):
    """Layer x head grid coloured by each head's majority pattern."""
    majority = patterns.drop_duplicates(["layer", "head"]).pivot(index="layer", columns="head", values="majority")
    names = list(PATTERN_COLOURS)
    codes = majority.map(names.index).values
    from matplotlib.colors import ListedColormap

    figure, axis = plt.subplots(figsize=(0.5 * majority.shape[1] + 3.5, 0.45 * majority.shape[0] + 1.5))
    axis.imshow(codes, cmap=ListedColormap([PATTERN_COLOURS[n] for n in names]), vmin=-0.5, vmax=len(names) - 0.5, aspect="auto")
    axis.set_xticks(range(majority.shape[1]), majority.columns)
    axis.set_yticks(range(majority.shape[0]), majority.index)
    axis.set_xlabel("head (0-based)")
    axis.set_ylabel("layer (0-based)")
    axis.set_title("majority pattern of each head")
    handles = [plt.Rectangle((0, 0), 1, 1, color=PATTERN_COLOURS[n]) for n in names]
    axis.legend(handles, names, fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    figure.tight_layout()
    return figure


def pattern_thumbnails(examples: dict):
    """A row of example maps for each pattern class, drawn from the corpus."""
    columns = max(1, max(len(items) for items in examples.values()))
    figure, axes = plt.subplots(len(examples), columns, figsize=(1.9 * columns + 1.2, 1.9 * len(examples)), squeeze=False)
    for row, (pattern, items) in enumerate(examples.items()):
        for column in range(columns):
            axis = axes[row, column]
            axis.set_xticks([])
            axis.set_yticks([])
            if column < len(items):
                item = items[column]
                axis.imshow(item.attention.astype(float), cmap="Greys", vmin=0, vmax=max(float(item.attention.max()), 1e-6))
                axis.set_title(f"layer {item.layer}, head {item.head}", fontsize=7)
            else:
                axis.axis("off")
            if column == 0:
                axis.set_ylabel(pattern, fontsize=9)
                if not items:
                    axis.axis("on")
                    axis.set_frame_on(False)
                    axis.text(0.5, 0.5, "no map of this class", ha="center", va="center", fontsize=8, transform=axis.transAxes)
    figure.suptitle("example maps per pattern (rows: queries, columns: keys)", fontsize=9)
    figure.tight_layout()
    return figure


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
    figure.tight_layout()
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
    figure.tight_layout()
    return figure


def ablation_heatmap(ablation: pd.DataFrame, metric: str):
    """Layer x head change of the task metric when each head (and, last column, the whole layer) is disabled.

    Blue: removing it helps; red: it hurts. A star marks an FDR-corrected p < 0.05.
    """
    rows = ablation[ablation.metric == metric].copy()
    rows["column"] = rows["head"].where(rows["head"] >= 0, rows["head"].max() + 1)
    delta = rows.pivot(index="layer", columns="column", values="delta")
    significant = rows.pivot(index="layer", columns="column", values="p_adj") < 0.05
    limit = max(float(np.nanmax(np.abs(delta.values))), 1e-6)
    figure, axis = plt.subplots(figsize=(0.55 * delta.shape[1] + 2.8, 0.5 * delta.shape[0] + 1.8))
    image = axis.imshow(100 * delta.values, aspect="auto", cmap="RdBu", vmin=-100 * limit, vmax=100 * limit)
    for (i, j), value in np.ndenumerate(delta.values):
        star = "*" if significant.values[i, j] else ""
        colour = "white" if abs(value) > 0.6 * limit else "black"
        axis.text(j, i, f"{100 * value:+.1f}{star}", ha="center", va="center", fontsize=6, color=colour)
    axis.axvline(delta.shape[1] - 1.5, color="black", linewidth=1)
    axis.set_xticks(range(delta.shape[1]), [*map(str, delta.columns[:-1]), "layer"])
    axis.set_yticks(range(delta.shape[0]), delta.index)
    axis.set_xlabel("head disabled (0-based); last column: the whole layer")
    axis.set_ylabel("layer (0-based)")
    intervention = rows.intervention.iloc[0]
    axis.set_title(f"change of {metric} (points) with the head {'masked' if intervention == 'mask' else 'made uniform'}; * p_adj < 0.05", fontsize=9)
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04, label="points")
    figure.tight_layout()
    return figure


def importance_heatmap(importance: pd.DataFrame):
    """Michel et al.'s head importance, normalised per layer."""
    grid = importance.pivot(index="layer", columns="head", values="importance_normalised")
    figure, axis = plt.subplots(figsize=(0.5 * grid.shape[1] + 2.8, 0.45 * grid.shape[0] + 1.6))
    image = axis.imshow(grid.values, aspect="auto", cmap="viridis", vmin=0)
    axis.set_xticks(range(grid.shape[1]), grid.columns)
    axis.set_yticks(range(grid.shape[0]), grid.index)
    axis.set_xlabel("head (0-based)")
    axis.set_ylabel("layer (0-based)")
    axis.set_title("head importance E|dL/d xi| (normalised per layer)", fontsize=9)
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    figure.tight_layout()
    return figure


def pruning_curve(pruning: pd.DataFrame, metric: str, unpruned: float):
    """Michel et al.'s figure: the task metric against the share of heads pruned, the unpruned model as a line."""
    rows = pruning[pruning.metric == metric]
    figure, axis = plt.subplots(figsize=(5.8, 3.6))
    axis.plot(100 * rows.share_pruned, rows.value, marker="o", label="pruned by importance")
    axis.axhline(unpruned, color="black", linestyle="--", linewidth=1, label="unpruned")
    axis.axhline(unpruned - 0.01, color="grey", linestyle=":", linewidth=1, label="1 point below")
    axis.set_xlabel("heads pruned (%)")
    axis.set_ylabel(metric)
    axis.set_title("iterative pruning (Michel et al. 2019)", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def pretraining_curve(losses: pd.DataFrame, checkpoints: pd.DataFrame, unigram: float, window: int = 20):
    """Masked-LM loss against step (log axis): training (moving mean), validation at each checkpoint, and the unigram baseline."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    smooth = losses.set_index("step")[["mlm_loss", "nsp_loss"]].rolling(window, min_periods=1, center=True).mean()
    left.plot(smooth.index, smooth.mlm_loss, color="tab:blue", label=f"training (centred mean of {window} steps)")
    left.plot(checkpoints.step.clip(lower=1), checkpoints.val_mlm_loss, "o-", color="tab:red", label="validation, at each checkpoint (step 0 drawn at 1)")
    left.axhline(unigram, color="black", linestyle="--", label=f"unigram cross-entropy {unigram:.2f}")
    left.set_ylabel("masked-LM loss (nats)")
    left.set_title("masked-language-model loss")
    _log_step_axis(left)
    right.plot(smooth.index, smooth.nsp_loss, color="tab:blue", label="training loss")
    right.axhline(np.log(2), color="black", linestyle="--", label="chance (ln 2)")
    right.set_xscale("log")
    right.set_xlabel("training step (log; step 0 drawn at 1)")
    right.set_ylabel("next-sentence loss (nats)")
    accuracy = right.twinx()
    accuracy.plot(checkpoints.step.clip(lower=1), checkpoints.val_nsp_accuracy, "o-", color="tab:red", label="validation accuracy")
    accuracy.set_ylim(0, 1)
    accuracy.set_ylabel("validation accuracy")
    right.set_title("next-sentence prediction")
    right.grid(alpha=0.3)
    lines = right.get_legend_handles_labels()[0] + accuracy.get_legend_handles_labels()[0]
    right.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower left")
    figure.tight_layout()
    return figure


def layer_by_step_heatmaps(layers: pd.DataFrame, metrics=("cls", "sep", "punct")):
    """One heatmap per metric: layer (rows) x checkpoint step (columns, in order), the layer mean."""
    figure, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 3.6), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        grid = layers[layers.metric == metric].pivot(index="layer", columns="step", values="value")
        image = axis.imshow(grid.values, aspect="auto", cmap="viridis", origin="lower")
        axis.set_xticks(range(grid.shape[1]), [str(s) for s in grid.columns], rotation=60, fontsize=7)
        axis.set_yticks(range(grid.shape[0]), grid.index)
        axis.set_xlabel("checkpoint (training step)")
        axis.set_ylabel("layer (0-based)")
        axis.set_title(METRIC_TITLES[metric])
        plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    figure.tight_layout()
    return figure


def _log_step_axis(axis) -> None:
    """A training-step x axis on a log scale (step 0 is drawn at 1), with grid and legend."""
    axis.set_xscale("log")
    axis.set_xlabel("training step (log; step 0 drawn at 1)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)


def emergence_curves(strength: pd.DataFrame, emergence: pd.DataFrame):
    """Left: each pattern's strength against step. Right: the patterns that rise, as a share of their rise, with the half-way crossings."""
    figure, (raw, scaled) = plt.subplots(1, 2, figsize=(12, 4.0))
    for k, (metric, rows) in enumerate(strength.groupby("metric", sort=False)):
        color, label = f"C{k}", METRIC_TITLES.get(metric, metric)
        x = rows.step.clip(lower=1)
        raw.plot(x, rows.value, "o-", color=color, label=label)
        first, final = rows.value.iloc[0], rows.value.iloc[-1]
        crossing = emergence[emergence.metric == metric].half_step.iloc[0]
        if final > first:
            scaled.plot(x, (rows.value - first) / (final - first), "o-", color=color, label=f"{label} ({first:.3f} -> {final:.3f})")
            scaled.axvline(max(crossing, 1), color=color, linestyle=":", alpha=0.8)
    scaled.axhline(0.5, color="black", linestyle="--", linewidth=0.8, label="half of the rise")
    raw.set_ylabel("strength (max over layers of the layer mean)")
    raw.set_title("each pattern's strength")
    scaled.set_ylabel("share of the rise from the first checkpoint")
    scaled.set_title("patterns that rise; dotted: where each crosses half")
    _log_step_axis(raw)
    _log_step_axis(scaled)
    figure.tight_layout()
    return figure


def syntax_by_step(series: pd.DataFrame, best: pd.DataFrame, relations: list[str]):
    """Best syntactic-head accuracy against step: the mean over relations with its bootstrap band, and the given relations' best heads."""
    figure, axis = plt.subplots(figsize=(7.5, 4.0))
    x = series.step.clip(lower=1)
    axis.fill_between(x, series.ci_low, series.ci_high, color="black", alpha=0.15)
    axis.plot(x, series.value, "o-", color="black", linewidth=2, label="mean over relations (95% bootstrap band)")
    for metric in relations:
        rows = best[best.metric == metric].sort_values("step")
        axis.plot(rows.step.clip(lower=1), rows.value, ".-", alpha=0.7, label=metric.removeprefix("syntax:"))
    axis.set_ylim(0, 1)
    axis.set_ylabel("accuracy of the best head")
    axis.set_title("best syntactic head per relation over training")
    _log_step_axis(axis)
    figure.tight_layout()
    return figure


def peak_layers_by_metric(layer_means: dict, peaks: dict):
    """The final model's layer means of attention to [CLS], [SEP] and punctuation, peaks marked with their bootstrap interval."""
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    for k, (metric, values) in enumerate(layer_means.items()):
        color = f"C{k}"
        axis.plot(range(len(values)), values, "o-", color=color, label=METRIC_TITLES[metric])
        peak = peaks[metric]
        axis.errorbar([peak["layer"]], [peak["value"]], xerr=[[peak["layer"] - peak["ci_low"]], [peak["ci_high"] - peak["layer"]]],
                      fmt="*", markersize=14, color=color, capsize=4)
    axis.set_xlabel("layer (0-based)")
    axis.set_ylabel("mean attention (layer mean over heads)")
    axis.set_title("where each pattern peaks (star: peak, bar: 95% bootstrap interval)")
    axis.set_xticks(range(len(next(iter(layer_means.values())))))
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure
