"""Helpers for the families' one-line findings that the command line prints after a run.

Only pandas is needed: a summary runs after the pass, on the family's tables.
"""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd

#: How a summary line names a view of attention when the run reads more than the plain weights.
VIEW_NAMES = {"attention": "attention weights", "norm": "norm shares"}


def by_view(table: pd.DataFrame) -> Iterator[tuple[str, pd.DataFrame]]:
    """``(prefix, rows)`` per view of attention: one ``("", table)`` for a table without a ``weighting`` column, else
    ``("[attention weights] ", its rows)`` and so on, in the run's order."""
    if "weighting" not in table.columns:
        yield "", table
        return
    for view, rows in table.groupby("weighting", sort=False):
        yield f"[{VIEW_NAMES.get(view, view)}] ", rows.drop(columns="weighting")


def trend(values: pd.Series, digits: int = 2) -> str:
    """A per-layer series (indexed by layer) in a few words: its first and last layers' values, and its highest and
    lowest where they lie between them: ``"0.12 in layer 0 to 0.30 in layer 5 (highest 0.41, layer 3)"``."""
    values = values.dropna()
    if values.empty:
        return "no value"
    first, last = values.index[0], values.index[-1]
    text = f"{values.iloc[0]:.{digits}f} in layer {first} to {values.iloc[-1]:.{digits}f} in layer {last}"
    extremes = [(name, layer) for name, layer in (("highest", values.idxmax()), ("lowest", values.idxmin())) if layer not in (first, last)]
    if extremes:
        text += " (" + ", ".join(f"{name} {values[layer]:.{digits}f}, layer {layer}" for name, layer in extremes) + ")"
    return text
