"""The attention patterns' figures and report section (Kovaleva et al. 2019)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.model.kinds import Kind
from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import head_grid_size, head_ticks, plt, text_ticks
from bertology.render.html import Figure, Section

PATTERN_COLOURS = {"vertical": "tab:red", "diagonal": "tab:green", "vertical+diagonal": "tab:olive", "block": "tab:blue", "heterogeneous": "tab:gray"}


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
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def pattern_grid(patterns: pd.DataFrame):
    """Layer x head grid coloured by each head's majority pattern."""
    majority = patterns.drop_duplicates(["layer", "head"]).pivot(index="layer", columns="head", values="majority")
    names = list(PATTERN_COLOURS)
    codes = majority.map(names.index).values
    from matplotlib.colors import ListedColormap

    width, height = head_grid_size(majority)
    figure, axis = plt.subplots(figsize=(width + 0.7, height - 0.1))
    axis.imshow(codes, cmap=ListedColormap([PATTERN_COLOURS[n] for n in names]), vmin=-0.5, vmax=len(names) - 0.5, aspect="auto")
    head_ticks(axis, majority.index, majority.columns)
    axis.set_title("majority pattern of each head")
    handles = [plt.Rectangle((0, 0), 1, 1, color=PATTERN_COLOURS[n]) for n in names]
    axis.legend(handles, names, fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


#: The mark of a piece that begins a word after a space on a decoder's thumbnails: byte-level BPE's (GPT-2's) "Ġ".
WORD_START = "\u0120"


def shown_tokens(tokens: list[str], text: str, kind: Kind | None = None) -> list[str]:
    """A thumbnail's token labels in the marks of the ``kind``'s tokenizers: an encoder's as the analyzer names them (BERT's
    ``##`` before a piece that goes on a word, [CLS] and [SEP]); a decoder's as byte-level BPE writes them, ``Ġ`` before a
    piece that follows a space in ``text`` (it begins a word), every other piece bare, no ``##``, and an added first token
    ``BOS``."""
    if kind is None or kind.sees_later_keys:
        return list(tokens)
    shown, cursor = [], 0
    for token in tokens:
        if token in ("[CLS]", "[SEP]", ""):
            shown.append("BOS" if token == "[CLS]" else token)
            continue
        piece = token.removeprefix("##")
        at = text.find(piece, cursor) if piece else -1
        if at < 0:
            shown.append(piece)
            continue
        shown.append(WORD_START + piece if at > 0 and text[at - 1].isspace() else piece)
        cursor = at + len(piece)
    return shown


#: Example maps drawn per pattern class: each map's tokens are most of the report's text to draw.
THUMBNAILS_PER_CLASS = 2


def pattern_thumbnails(examples: dict, kind: Kind | None = None):
    """A row of example maps for each pattern class with examples (one head each, the first
    :data:`THUMBNAILS_PER_CLASS`), the tokens on both axes in the marks of the ``kind``'s tokenizers
    (:func:`shown_tokens`); the classes without any are named in the title."""
    shown = {pattern: items[:THUMBNAILS_PER_CLASS] for pattern, items in examples.items() if items}
    columns = max([len(items) for items in shown.values()], default=1)
    rows = max(1, len(shown))
    figure, axes = plt.subplots(rows, columns, figsize=(3.3 * columns + 0.6, 3.5 * rows), squeeze=False)
    # Fixed margins for the token labels (at most about 0.8 inch at 7 points), not a layout engine: measuring 1,000 labels
    # took longer than drawing them.
    figure.subplots_adjust(left=0.8 / (3.3 * columns + 0.6), right=0.99, bottom=0.8 / (3.5 * rows), top=1 - 0.95 / (3.5 * rows),
                           wspace=0.32, hspace=0.5)
    for axis in axes.ravel():
        axis.axis("off")
    for row, (pattern, items) in enumerate(shown.items()):
        for axis, item in zip(axes[row], items):
            axis.axis("on")
            axis.imshow(item.attention.astype(float), cmap="Greys", vmin=0, vmax=max(float(item.attention.max()), 1e-6))
            tokens = shown_tokens(item.tokens, item.text, kind)
            size = min(7.0, 170 / len(tokens))  # points: the labels of a 32-piece map just fit
            text_ticks(axis, "x", range(len(tokens)), tokens, fontsize=size, rotation=90, pad=1)
            text_ticks(axis, "y", range(len(tokens)), tokens, fontsize=size, pad=1)
            axis.set_title(f"{pattern}: layer {item.layer}, head {item.head}", fontsize=8)
    missing = [pattern for pattern, items in examples.items() if not items]
    figure.suptitle("example maps per pattern, one head each (rows: queries, columns: keys)"
                    + (f"\nno map of class {', '.join(missing)}" if missing else ""), fontsize=10)
    figure.fixed_layout = True  # RunFolder.write_figure then keeps these margins
    return figure


def patterns_section(folder: RunFolder, patterns: pd.DataFrame, by_layer: pd.DataFrame, examples: dict, thresholds: dict | None,
                     kind: Kind | None = None) -> Section:
    """Write the pattern figures into ``folder`` and return the report section (``kind``: the run's kind of model, whose
    tokenizers' marks the thumbnails use)."""
    section = Section(
        title="Attention patterns",
        intro=(
            "Kovaleva et al. (2019), 'Revealing the Dark Secrets of BERT': every head's map on every sequence is classified as "
            "vertical, diagonal, vertical+diagonal, block (pairs) or heterogeneous (patterns.csv: shares per head and the "
            "head's majority class)."
        ),
    )
    section.figures.append(Figure(folder.write_figure("patterns_by_layer", pattern_shares_by_layer(by_layer)),
                                  "Pattern shares per layer, and over all layers."))
    section.figures.append(Figure(folder.write_figure("patterns_grid", pattern_grid(patterns)), "Each head's majority pattern."))
    marks = ("pieces that begin a word after a space marked \u0120, as byte-level BPE writes them, the others bare" if kind is not None
             and not kind.sees_later_keys else "pieces that go on a word marked ##")
    section.figures.append(Figure(folder.write_figure("patterns_examples", pattern_thumbnails(examples, kind)),
                                  f"Example maps of each class, each from another head, drawn from the corpus ({marks})."))
    wide = by_layer.assign(layer=by_layer.layer.map(lambda layer: "all" if layer == -1 else layer)).pivot(index="layer", columns="pattern", values="share")
    section.tables.append(("Pattern shares per layer", wide.reset_index()))
    if thresholds is not None:
        section.notes.append(
            "Rules (shares of a map's attention mass; vertical = special-token columns + the heaviest other column, diagonal = "
            "the +-1 diagonals, block = inside the query's own sentence): vertical+diagonal if both >= {mixed_min} and their sum "
            ">= {mixed_total}; else vertical if >= {vertical}; else diagonal if >= {diagonal}; else block if >= {block} (pairs); "
            "else heterogeneous. Each rule also needs every feature it reads to exceed the uniform map's of the same sequence "
            "(each row uniform over the keys it saw; vertical column by column) by {margin}, so a uniform map is none of "
            "the classes.".format(**{"margin": 0.1, **thresholds})
        )
    return section


def confusion_figure(confusion: pd.DataFrame):
    """The cross-validated confusion matrix of the trained classifier beside the rules', on the hand-labelled maps."""
    from bertology.families.patterns.analyzer import PATTERNS

    figure, axes = plt.subplots(1, 2, figsize=(10.5, 4.2))
    for axis, method in zip(axes, ("trained", "rules")):
        grid = confusion[confusion.method == method].pivot(index="label", columns="predicted", values="count").reindex(index=PATTERNS, columns=PATTERNS)
        axis.imshow(grid.values, cmap="Blues")
        for (i, j), count in np.ndenumerate(grid.values):
            axis.text(j, i, str(int(count)), ha="center", va="center", fontsize=8, color="white" if count > grid.values.max() / 2 else "black")
        axis.set_xticks(range(len(PATTERNS)), PATTERNS, rotation=35, ha="right", fontsize=8)
        axis.set_yticks(range(len(PATTERNS)), PATTERNS, fontsize=8)
        axis.set_xlabel("predicted")
        axis.set_ylabel("hand label")
        axis.set_title("trained classifier (out of fold)" if method == "trained" else "rules")
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def training_section(folder: RunFolder, section: Section, training: pd.DataFrame, confusion: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """Add the confusion figure to ``section``; return the table of F1 per class, trained against the rules."""
    section.figures.append(Figure(folder.write_figure("pattern_confusion", confusion_figure(confusion)),
                                  "Hand labels against the classifier trained on them (cross-validated by text) and against the rules."))
    section.notes.append("A classifier was trained on the hand labels of this corpus (pattern_training.csv, pattern_confusion.csv) and saved as "
                         "classifier.json; `--classifier classifier.json` uses it instead of the rules.")
    wide = training.pivot(index="class", columns="method", values="f1").reindex(list(dict.fromkeys(training["class"])))
    support = training[training.method == "trained"].set_index("class").support
    return ("F1 per class on the hand labels: trained (cross-validated by text) and rules",
            wide.rename(columns={"trained": "f1 trained", "rules": "f1 rules"}).assign(support=support).reset_index())
