"""Plotting helpers shared by families and studies, each of which draws its own figures in its room.

Layers and heads are numbered from 0, as in every table.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

# Titles sit at the top of their axes (no figure here has tick labels above a plot): placing each by the tick labels it
# might overlap measured every label of the axes, a seventh of a report's drawing time.
plt.rcParams["axes.titley"] = 1.0

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


def plain_ticks() -> ScalarFormatter:
    """A tick formatter (one per axis) that writes each tick's number whole: never an offset nor a shared power of ten
    (matplotlib's ``1e-5+2.426``), which it prints over a title when the ticks differ only in their last digits."""
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    return formatter


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


#: Up to this many layers (or heads) an axis of a head grid names each one; past it, every :func:`tick_step`-th, so the
#: labels of a 32 x 32 grid (heads 0, 4, 8, ...) never overlap. No head grid writes text in its cells.
LABELLED_UP_TO = 16
#: The most inches a head grid's map takes (width, height): past it the cells shrink, so a figure of 1,024 heads keeps
#: the size of one of about 200.
GRID_INCHES = (8.0, 6.0)
#: The same for one panel of a figure of several maps side by side.
PANEL_INCHES = (5.0, 3.5)


def tick_step(count: int) -> int:
    """Every how many layers (or heads) an axis of ``count`` names one: 1 up to :data:`LABELLED_UP_TO`, else at most
    ``LABELLED_UP_TO / 2`` labels."""
    return 1 if count <= LABELLED_UP_TO else -(-count // (LABELLED_UP_TO // 2))


#: Points between an axis and its :func:`text_ticks` labels (matplotlib's tick length, 3.5, plus its pad, 3.5).
TEXT_TICK_PAD = 7.0
#: A digit's width in em (DejaVu Sans, matplotlib's font): how far a :func:`head_ticks` y label sits from its numbers.
DIGIT_EM = 0.64


def text_ticks(axis, which: str, positions, labels, fontsize: float | None = None, rotation: float = 0.0,
               pad: float = TEXT_TICK_PAD) -> None:
    """Label ``positions`` (data units) of one side of ``axis`` with plain text, and take its ticks off.

    ``which``: "x" under the axes, "y" left of them. Not matplotlib's ticks: each is five artists (two marks, a grid
    line, two labels), and building and drawing the thousand of a report's head grids and thumbnails was most of its
    time. Each label's gid is ``"xtick"`` or ``"ytick"``.
    """
    from matplotlib.transforms import ScaledTranslation

    size = fontsize if fontsize is not None else plt.rcParams["xtick.labelsize" if which == "x" else "ytick.labelsize"]
    if which == "x":
        axis.set_xticks([])
        place = axis.get_xaxis_transform() + ScaledTranslation(0, -pad / 72, axis.figure.dpi_scale_trans)
        for position, label in zip(positions, labels):
            axis.text(position, 0, label, transform=place, rotation=rotation, ha="center", va="top", fontsize=size, gid="xtick")
    else:
        axis.set_yticks([])
        place = axis.get_yaxis_transform() + ScaledTranslation(-pad / 72, 0, axis.figure.dpi_scale_trans)
        for position, label in zip(positions, labels):
            axis.text(0, position, label, transform=place, rotation=rotation, ha="right", va="center", fontsize=size, gid="ytick")


def head_ticks(axis, layers, heads, fontsize: float | None = None, *, x: bool = True, y: bool = True) -> None:
    """Name the ``heads`` (x) and ``layers`` (y) of a layer x head map on ``axis``, every :func:`tick_step`-th of each
    (:func:`text_ticks`), the axis labels set off past them. ``x`` or ``y`` false: that side unnamed (a panel of a grid
    whose panel below, or left, names it)."""
    from matplotlib.font_manager import FontProperties

    size = FontProperties(size=fontsize if fontsize is not None else plt.rcParams["xtick.labelsize"]).get_size_in_points()
    named = {}
    for which, names, shown in (("x", [str(head) for head in heads], x), ("y", [str(layer) for layer in layers], y)):
        positions = range(0, len(names), tick_step(len(names))) if shown else range(0)
        named[which] = [names[position] for position in positions]
        text_ticks(axis, which, positions, named[which], fontsize=size)
    # The axis labels go past the numbers: one line of them under the map, the widest of them left of it (in points).
    if x:
        axis.set_xlabel("head (0-based)", fontsize=fontsize, labelpad=TEXT_TICK_PAD + 1.2 * size)
    if y:
        axis.set_ylabel("layer (0-based)", fontsize=fontsize, labelpad=TEXT_TICK_PAD + DIGIT_EM * size * max(map(len, named["y"]), default=0) + 2)


def head_map_inches(layers: int, heads: int, cell: tuple[float, float] = (0.5, 0.45),
                    most: tuple[float, float] = GRID_INCHES) -> tuple[float, float]:
    """The inches of a layer x head map: ``cell`` inches a head, up to ``most`` (a panel among several: less than a
    figure's :data:`GRID_INCHES`)."""
    return min(cell[0] * heads, most[0]), min(cell[1] * layers, most[1])


def head_grid(axis, grid: pd.DataFrame, title: str, **imshow) -> None:
    """On ``axis``: a layer x head heat map of ``grid`` (index: layer, columns: head, both 0-based) with a colour bar."""
    image = axis.imshow(grid.values, aspect="auto", **{"cmap": "viridis", **imshow})
    head_ticks(axis, grid.index, grid.columns)
    axis.set_title(title, fontsize=9)
    plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04, format=plain_ticks())


def head_grid_size(grid: pd.DataFrame) -> tuple[float, float]:
    """A figure size that gives each head's cell room, the map at most :data:`GRID_INCHES`."""
    width, height = head_map_inches(*grid.shape)
    return width + 2.8, height + 1.6


def panel_grid(rows: int, columns: int, panel: tuple[float, float], *, top: float = 0.45, right: float = 0.25, across: float = 1.45,
               **subplots):
    """A figure of ``rows x columns`` panels of ``panel`` inches each, margins and gaps fixed in inches.

    Room for tick labels, axis labels, a title and a colour bar beside each panel (:func:`panel_colorbar`; ``across``,
    the gap between panels: less where panels share their y axis and have no colour bar), ``top`` inches above the
    panels and ``right`` beside them. Laid out once by hand: a layout engine measures every label of every panel first,
    most of a grid's drawing time. ``subplots``: more of ``plt.subplots``'s arguments (``sharey``). Returns the figure
    and its axes, ``[rows, columns]``.
    """
    left, bottom, down = 0.7, 0.6, 0.85
    width = left + right + columns * panel[0] + (columns - 1) * across
    height = bottom + top + rows * panel[1] + (rows - 1) * down
    figure, axes = plt.subplots(rows, columns, figsize=(width, height), squeeze=False,
                                gridspec_kw={"left": left / width, "right": 1 - right / width, "bottom": bottom / height,
                                             "top": 1 - top / height, "wspace": across / panel[0], "hspace": down / panel[1]}, **subplots)
    figure.fixed_layout = True  # RunFolder.write_figure keeps these margins
    return figure, axes


def panel_colorbar(figure, image, axis, label: str | None = None):
    """A colour bar for ``image`` just right of ``axis`` (in the gap :func:`panel_grid` leaves), the panel kept whole."""
    return figure.colorbar(image, cax=axis.inset_axes((1.03, 0.0, 0.04, 1.0)), label=label, format=plain_ticks())


def log_step_axis(axis) -> None:
    """A training-step x axis on a log scale (step 0 is drawn at 1), with grid and legend."""
    axis.set_xscale("log")
    axis.set_xlabel("training step (log; step 0 drawn at 1)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)


