"""The Python API: ``bertology.analyze(...)`` for notebooks and scripts."""

from __future__ import annotations

import datetime as dt
import platform
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pandas as pd
import torch

from bertology.analyzers import GeneralProfile, HeadDistance, clark_labels
from bertology.corpora import Corpus, Example
from bertology.engine import Engine, RunStats
from bertology.errors import BertologyError
from bertology.models import LoadedModel, load_model
from bertology.reports.html import Report
from bertology.reports.profile import profile_section
from bertology.runfolder import RunFolder

_VERSIONED = ("bertology", "torch", "transformers", "tokenizers", "numpy", "pandas", "scipy", "scikit-learn", "statsmodels")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


@dataclass
class Analysis:
    """The result of :func:`analyze`: tidy tables, plus what is needed to write the run folder.

    ``heads``: ``layer, head, metric, value, ci_low, ci_high, n`` (long format, 0-based);
    ``layers``: the same per layer; ``labels``: heads that pass Clark's thresholds;
    ``head_distance``/``head_map``: pairwise JS distances and their 2-D MDS map (None if no
    sequence was sampled).
    """

    heads: pd.DataFrame
    layers: pd.DataFrame
    labels: pd.DataFrame
    head_distance: pd.DataFrame | None
    head_map: pd.DataFrame | None
    model: dict
    corpus: dict
    stats: RunStats
    settings: dict
    started: str
    out: Path | None = None
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """The facts shown at the top of the report."""
        stats = self.stats.as_dict()
        return {
            "model": f"{self.model['name']} ({self.model['model_type']}, {self.model['layers']} layers x {self.model['heads']} heads)",
            "corpus": f"{self.corpus['name']} ({self.corpus['format']})",
            "sequences": stats["sequences"],
            "tokens": stats["tokens"],
            "truncated": stats["truncated"],
            "skipped (too long)": stats["skipped"],
            "max length": self.settings["max_length"],
            "device": self.model["device"],
            "time": f"{stats['seconds']} s ({stats['sequences_per_second']} sequences/s)",
            "started": self.started,
        }

    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write tables, figures, ``report.html`` and ``manifest.json`` to ``out``; returns the report path."""
        folder = RunFolder(out)
        folder.write_table("heads", self.heads)
        folder.write_table("layers", self.layers)
        folder.write_table("head_labels", self.labels)
        if self.head_distance is not None:
            folder.write_table("head_distance", self.head_distance)
            folder.write_table("head_map", self.head_map)
        section = profile_section(folder, self.heads, self.layers, self.labels, self.head_map)
        report = Report(title=f"bertology: {self.model['name']} on {self.corpus['name']}", summary=self.summary(), sections=[section])
        report_path = folder.write_text("report.html", report.render())
        folder.write_json(
            "manifest.json",
            {
                "status": "complete",
                "command": command if command is not None else sys.argv,
                "model": self.model,
                "corpus": self.corpus,
                "settings": self.settings,
                "seed": self.settings["seed"],
                "stats": self.stats.as_dict(),
                "skipped_sources": self.stats.skipped_sources,
                "versions": package_versions(),
                "started": self.started,
                "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "warnings": self.warnings,
            },
        )
        self.out = folder.path
        return report_path

    def _repr_html_(self) -> str:
        summary = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in self.summary().items())
        wide = self.layers.pivot(index="layer", columns="metric", values="value")
        return f"<table>{summary}</table>" + wide.to_html(float_format=lambda x: f"{x:.3f}")


def _as_corpus(corpus, format: str, limit: int | None) -> tuple[Corpus | list[Example], dict]:
    if isinstance(corpus, Corpus):
        return corpus, {"name": corpus.name, "path": str(corpus.path) if corpus.path else None, "format": corpus.format, "sha256": corpus.sha256()}
    if corpus is None or isinstance(corpus, (str, Path)):
        loaded = Corpus(None if corpus is None else Path(corpus), format=format, limit=limit)
        return _as_corpus(loaded, format, limit)
    examples = [item if isinstance(item, Example) else Example(str(item)) for item in corpus]
    examples = examples[:limit] if limit is not None else examples
    return examples, {"name": "in-memory", "path": None, "format": "examples", "sha256": None}


def analyze(
    model: str | Path | LoadedModel | None = None,
    corpus: str | Path | Corpus | Iterable[str | Example] | None = None,
    *,
    format: str = "auto",
    out: str | Path | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    limit: int | None = None,
    overflow: str = "truncate",
    device: str = "auto",
    seed: int = 0,
    head_distance_sample: float = 0.1,
    trust_remote_code: bool = False,
    progress: bool = True,
    command: list[str] | None = None,
) -> Analysis:
    """Run the general head profile of ``model`` over ``corpus``.

    ``model``: hub name, local folder, an already loaded model, or None for the default
    all-MiniLM-L6-v2. ``corpus``: a file (``format`` auto-detected), a list of strings or
    :class:`~bertology.corpora.Example`, or None for the bundled sample corpus. With ``out``,
    the run folder (tables, figures, report.html, manifest.json) is written there.
    """
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    examples, corpus_info = _as_corpus(corpus, format, limit)
    total = examples.validate() if isinstance(examples, Corpus) else len(examples)
    if total == 0:
        raise BertologyError("the corpus has no examples")
    corpus_info["examples"] = total
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, trust_remote_code=trust_remote_code)
    torch.manual_seed(seed)
    engine = Engine(loaded, batch_size=batch_size, max_length=max_length, overflow=overflow, progress=progress)
    profile, distance = GeneralProfile(), HeadDistance(sample=head_distance_sample, seed=seed)
    stats = engine.run(examples, [profile, distance], total=total)
    if stats.sequences == 0:
        raise BertologyError(f"every sequence was longer than {engine.max_length} pieces and skipped: raise --max-length or truncate")
    heads = profile.result()
    warnings = []
    try:
        head_distance, head_map = distance.result(), distance.embedding()
    except ValueError as exc:
        head_distance = head_map = None
        warnings.append(str(exc))
    settings = {
        "batch_size": batch_size,
        "max_length": engine.max_length,
        "overflow": overflow,
        "seed": seed,
        "head_distance_sample": head_distance_sample,
        "limit": limit,
        "device": device,
    }
    analysis = Analysis(
        heads=heads,
        layers=profile.layers(),
        labels=clark_labels(heads),
        head_distance=head_distance,
        head_map=head_map,
        model=loaded.info(),
        corpus=corpus_info,
        stats=stats,
        settings=settings,
        started=started,
        warnings=warnings,
    )
    if out is not None:
        analysis.save(out, command=command)
    return analysis
