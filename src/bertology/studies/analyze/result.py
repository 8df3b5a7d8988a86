"""The result of ``analyze``: each family's tables and what the run folder needs (:class:`Analysis`).

:meth:`Analysis.save` writes the run folder whole.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, is_dataclass
from html import escape
from pathlib import Path
from typing import Any

from bertology.core.engine import RunStats
from bertology.core.errors import one_line_error
from bertology.core.measures.norms import WEIGHTING_TITLES
from bertology.core.model.kinds import kind_named
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run
from bertology.families import FamilyResult, get_family, registered
from bertology.render.html import Report
from bertology.studies.analyze.weightings import views_section
from bertology.studies.view.report import viewer_section
from bertology.studies.view.viewer import AttentionView, head_labels


def _json_setting(value):
    """Settings as JSON: a sequence item by item, a dataclass with the generated repr (pattern thresholds) by its fields,
    anything else as text (a token class as its own repr)."""
    if isinstance(value, (list, tuple)):
        return [_json_setting(item) for item in value]
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return asdict(value) if is_dataclass(value) and value.__dataclass_params__.repr else str(value)


class UnknownTable(KeyError):
    """:meth:`Analysis.table` was asked for a name that this run did not make and no registered family declares."""

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0])


def declared_outputs() -> set[str]:
    """The names of every table, document and in-memory result the registered families declare."""
    return {name for family in registered().values() for name in (*family.outputs, *family.optional_outputs, *family.in_memory)}


@dataclass
class Analysis:
    """The result of :func:`analyze`: each family's tables, plus what is needed to write the run folder.

    ``results`` maps each family that ran to its :class:`~bertology.families.FamilyResult`; :meth:`table` gives any table
    (or document, or in-memory result) by its name, from whichever family made it: ``table("heads")``, ``"layers"``,
    ``"head_labels"``, ``"head_distance"``, ``"head_map"`` (profile); ``"roles"``, ``"role_shares"`` (roles); ``"patterns"``,
    ``"patterns_by_layer"``, ``"pattern_examples"`` (patterns); ``"syntax"``, ``"syntax_best"``, ``"syntax_baselines"``,
    ``"probe"`` (syntax); ``"classes"`` (classes); ``"frames"`` (frames); ``"layer_probes"``, ``"layer_probe_summary"``
    (layers); ``"rollout"``; ``"mixing"``; ``"sinks"``, ``"sink_rates"``, ... (sinks); with hand labels,
    ``"pattern_training"``, ``"pattern_confusion"``, ``"classifier"`` (patterns); and those of users' families. A table of
    a family that did not run, or failed, is None; ``failures`` maps each failed family to its error (the run folder is
    then ``partial``), ``left_out`` each family left out past the attention budget to the one line that says why (the run
    is complete: the budget is one of its settings). Where the run reads norm shares (``weighting="norm"`` or
    ``"attention,norm"``), every table of a family that reads the maps has a first column ``weighting`` and holds each
    view's rows; ``by_view`` keeps each view's results apart.
    """

    model: dict
    corpus: dict
    stats: RunStats
    settings: dict
    started: str
    results: dict[str, FamilyResult] = field(default_factory=dict)
    out: Path | None = None
    warnings: list[str] = field(default_factory=list)
    view: AttentionView | None = None
    failures: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    #: Seconds of each phase of the run: ``load`` (the model), ``pass``, ``finish:FAMILY`` (tests, probes), ``viewer``,
    #: ``report`` (figures, sections and page); in the manifest and the report.
    phases: dict[str, float] = field(default_factory=dict)
    #: The pass's peak memory on each CUDA device the model uses (torch's allocator, bytes; :func:`peak_device_memory`);
    #: empty on other devices. In the manifest.
    device_memory: dict[str, int] = field(default_factory=dict)
    #: Each view of attention's own results (``weighting`` -> family -> result), for the report's sections.
    by_view: dict[str, dict[str, FamilyResult]] = field(default_factory=dict)

    def table(self, name: str) -> Any:
        """The table (a DataFrame), document (a dict) or in-memory result ``name``, from the family that made it. None where
        a registered family declares ``name`` but this run did not make it (the family did not run, or failed, or makes it
        only on some runs); :class:`UnknownTable`, a KeyError that names the known outputs, for any other name."""
        for result in self.results.values():
            if name in result:
                return result.get(name)
        declared = declared_outputs()
        if name in declared:
            return None
        made = sorted({key for result in self.results.values() for store in (result.tables, result.documents, result.extras) for key in store})
        raise UnknownTable(f"no table {name!r}: this run made {', '.join(made) or 'none'}; the registered families declare "
                           f"{', '.join(sorted(declared))}")

    def claims(self) -> dict[str, list[str]]:
        """What the run claims of its heads, by family (:meth:`~bertology.families.Family.claims`); a null model's run
        (``settings["null"]``) should claim nothing."""
        registry = registered()
        return {name: registry[name].claims(result) for name, result in self.results.items()}

    def claims_line(self) -> str:
        """One line: how many claims, by family, and under the null model whether there should be any."""
        counts = {name: len(lines) for name, lines in self.claims().items() if lines}
        total = sum(counts.values())
        by_family = f" ({', '.join(f'{name} {count}' for name, count in counts.items())})" if counts else ""
        null = self.settings.get("null")
        if null is None:
            return f"claims: {total}{by_family}"
        verdict = "as a null model should" if total == 0 else "a null model should make none: these tests are not calibrated"
        return f"null model {null}: {total} claims{by_family}, {verdict}"

    def summary(self) -> dict:
        """The facts shown at the top of the report."""
        stats = self.stats.as_dict()
        trees = self.settings["parser"]
        return {
            "model": f"{self.model['name']} ({self.model['model_type']}, {self.model['layers']} layers x {self.model['heads']} heads)",
            "corpus": f"{self.corpus['name']} ({self.corpus['format']}{', trees: ' + trees if trees else ''})",
            "analyses": ", ".join(self.settings["analyses"]),
            **({"null model": self.claims_line()} if self.settings.get("null") else {}),
            **({"claims": self.claims_line(), "null model": self.settings["calibration"]} if self.settings.get("calibration") else {}),
            "sequences": stats["sequences"],
            "tokens": stats["tokens"],
            "truncated": stats["truncated"],
            "skipped (too long)": stats["skipped"],
            "skipped (fewer than 2 pieces)": stats["degenerate"],
            "max length": self.settings["max_length"],
            "device": self.model["device"],
            "time": f"{stats['seconds']} s ({stats['sequences_per_second']} sequences/s)",
            **({"phases": ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())} if self.phases else {}),
            "started": self.started,
            **({"failed": "; ".join(f"{family}: {message}" for family, message in self.failures.items())} if self.failures else {}),
            **({"left out": "; ".join(self.left_out.values())} if self.left_out else {}),
        }

    @claims_out
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write every family's tables, figures and report section, ``report.html`` and ``manifest.json`` to ``out``,
        replacing it whole; returns the report path."""
        import gc

        # The figures make many short-lived objects, and the collections they set off walked the whole heap (the model, the
        # results): a third of the report's time. None runs during the save (its garbage, some 40 MB, goes at the next).
        collecting = gc.isenabled()
        gc.disable()
        try:
            began = time.perf_counter()
            folder = RunFolder(out)
            sections = []
            for name, result in self.results.items():
                for table_name, table in result.tables.items():
                    folder.write_table(table_name, table)
                for document_name, document in result.documents.items():
                    folder.write_json(f"{document_name}.json", document)
            # The families' own sections show the first view; with a second one, a section sets them side by side.
            views = self.settings["weighting"]
            for name in self.results:
                family = get_family(name)
                weighting = views[0] if family.weighted else "attention"
                try:
                    section = family.section(folder, self.by_view[weighting][name], self.settings)
                except OSError:  # the disk, not the family: the save stops and the previous run stays whole
                    raise
                except Exception as exc:  # a figure that fails loses nothing else: the family's tables are written already
                    self.failures[name] = f"its report section: {one_line_error(exc)}"
                    continue
                if section is not None:
                    if family.weighted and views != ["attention"]:
                        section.title += f" — {WEIGHTING_TITLES[weighting]}"
                    sections.append(section)
            if len(views) > 1:
                sections.append(views_section(folder, self.by_view, views, kind_named(self.settings["kind"])))
            if self.view is not None:
                self.view.labels = head_labels(folder.path)
                self.view.save(folder.path / "viewer.html")
                sections.append(viewer_section(self.view))
            self.phases["report"] = round(time.perf_counter() - began, 2)  # the page's rendering itself is a few milliseconds
            report = Report(title=f"bertology: {self.model['name']} on {self.corpus['name']}", summary=self.summary(), sections=sections)
            manifest = {"failures": self.failures, "left_out": self.left_out, "model": self.model, "corpus": self.corpus,
                        "settings": {name: _json_setting(value) for name, value in self.settings.items()}, "seed": self.settings["seed"],
                        "stats": self.stats.as_dict(), "phases": self.phases, "peak_device_memory": self.device_memory,
                        "skipped_sources": self.stats.skipped_sources, "started": self.started,
                        "warnings": self.warnings}
            self.out = complete_run(folder, manifest, report=report.render(), status="partial" if self.failures else "complete", command=command)
            return self.out / "report.html"
        finally:
            if collecting:
                gc.enable()

    def _repr_html_(self) -> str:
        summary = "".join(f"<tr><th style='text-align:left'>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>" for k, v in self.summary().items())
        html = f"<table>{summary}</table>"
        for name, result in self.results.items():
            overview = get_family(name).overview(result)
            if overview is not None:
                html += overview.to_html(float_format=lambda x: f"{x:.3f}")
        return html

