"""Plotting helpers shared by families and studies (each draws its own figures in its room). Layers and heads are numbered from 0, as in every table."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

METRIC_TITLES = {
    "cls": "attention to [CLS]",
    "sep": "attention to [SEP]",
    "first": "attention to the first token",
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


def all_zero(values) -> bool:
    """True if every value that is there (not NaN) is 0, or none is: a plot of them would be an empty frame, and a report
    says so in words instead."""
    values = pd.to_numeric(pd.Series(values), errors="coerce").dropna()
    return bool((values == 0).all())


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


#: The x label of a figure by hidden state (:func:`hidden_state_axis`): blocks numbered as in every other figure.
HIDDEN_STATE_LABEL = "output of block (0-based, as in every figure); emb.: the embeddings"


def hidden_state_axis(axis, states) -> None:
    """On ``axis``, whose x values are hidden-state indices (0 the embeddings, ``l`` the output of block ``l - 1``, as
    transformers returns them): ticks named as every other figure numbers layers, the embeddings ``emb.``, block ``l - 1``
    at index ``l``, and an x label that says so (:data:`HIDDEN_STATE_LABEL`)."""
    states = sorted(int(state) for state in pd.unique(pd.Series(states)))
    axis.set_xticks(states, ["emb." if state == 0 else str(state - 1) for state in states])
    axis.set_xlabel(HIDDEN_STATE_LABEL)


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


def log_step_axis(axis) -> None:
    """A training-step x axis on a log scale (step 0 is drawn at 1), with grid and legend."""
    axis.set_xscale("log")
    axis.set_xlabel("training step (log; step 0 drawn at 1)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)


