"""Figures shared by the workflows (comparison, importance, training dynamics); each analysis family draws its own in its room. Layers and heads are numbered from 0, as in every table."""

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


#: Marker and line style of each line of :func:`layer_lines`, in turn: lines that coincide stay apart to the eye.
LINE_STYLES = (("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", (0, (5, 1, 1, 1))), ("P", (0, (1, 2))))


def layer_lines(axis, table: pd.DataFrame, by: str, labels: dict[str, str]) -> None:
    """On ``axis``: one line per value of column ``by``, its ``value`` by ``layer`` with the 95% interval
    (``ci_low``, ``ci_high``) as error bars; layers numbered from 0. Each line has its own marker and line style, and
    each marker is smaller than the one before, drawn over it: a line that lies on another still shows."""
    for k, (key, rows) in enumerate(table.groupby(by, sort=False)):
        marker, style = LINE_STYLES[k % len(LINE_STYLES)]
        axis.errorbar(rows.layer, rows.value, yerr=[rows.value - rows.ci_low, rows.ci_high - rows.value], marker=marker, linestyle=style,
                      markersize=max(3.0, 9.0 - 2.0 * k), capsize=3, label=labels[key])
    axis.set_xticks(sorted(table.layer.unique()))
    axis.set_xlabel("layer (0-based)")
    axis.grid(alpha=0.3)


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


def head_grid(axis, grid: pd.DataFrame, title: str, **imshow) -> None:
    """On ``axis``: a layer x head heat map of ``grid`` (index: layer, columns: head, both 0-based) with a colour bar."""
    image = axis.imshow(grid.values, aspect="auto", **{"cmap": "viridis", **imshow})
    axis.set_xticks(range(grid.shape[1]), grid.columns)
    axis.set_yticks(range(grid.shape[0]), grid.index)
    axis.set_xlabel("head (0-based)")
    axis.set_ylabel("layer (0-based)")
    axis.set_title(title, fontsize=9)
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)


def head_grid_size(grid: pd.DataFrame) -> tuple[float, float]:
    """A figure size that gives each head's cell room."""
    return 0.5 * grid.shape[1] + 2.8, 0.45 * grid.shape[0] + 1.6


def importance_heatmap(importance: pd.DataFrame):
    """Michel et al.'s head importance, normalised per layer."""
    grid = importance.pivot(index="layer", columns="head", values="importance_normalised")
    figure, axis = plt.subplots(figsize=head_grid_size(grid))
    head_grid(axis, grid, "head importance E|dL/d xi| (normalised per layer)", vmin=0)
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
