"""A self-contained HTML report: figures embedded as PNG data, tables inline, no network needed.

Each analysis family contributes :class:`Section` objects; :class:`Report` renders them with
jinja2 (autoescaped, so corpus text and token strings always render as text).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup


@dataclass
class Figure:
    """A PNG file of the run folder, embedded in the page."""

    path: Path
    caption: str

    def data_uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(Path(self.path).read_bytes()).decode("ascii")


@dataclass
class Section:
    title: str
    intro: str = ""
    figures: list[Figure] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    #: Tables shown folded away (a click opens them): rows on too little data for a claim (``--min-sample``, ``--min-dependents``).
    folded: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    head_links: tuple[str, int, int] | None = None  # (page, layers, heads): a grid of links to page#layer=L&head=H


def without_rows(section: Section, *tables: str) -> Section:
    """``section`` with a note that its tables have no rows on this corpus (nothing qualified): nothing to draw, no claim."""
    section.notes.append(f"No rows in {', '.join(tables)} on this corpus: nothing to draw and no claim to make.")
    return section


def _table_html(table: pd.DataFrame) -> Markup:
    # pandas escapes cell text by default (escape=True). A pivoted table's column-axis name would
    # otherwise show as an extra, empty column.
    table = table.rename_axis(columns=None)
    return Markup(table.to_html(index=False, classes="table", border=0, float_format=lambda x: f"{x:.3f}", na_rep="–"))


@dataclass
class Report:
    title: str
    summary: dict
    sections: list[Section] = field(default_factory=list)

    def render(self) -> str:
        environment = Environment(loader=PackageLoader("bertology", "render/templates"), autoescape=select_autoescape(["j2", "html"]))
        environment.filters["table"] = _table_html
        return environment.get_template("report.html.j2").render(report=self)

