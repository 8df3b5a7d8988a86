"""The Python API: ``bertology.analyze(...)`` for notebooks and scripts.

One call runs every requested analysis family over the corpus in a single pass of the model:
``profile`` (Clark et al.'s general head profile and the head map), ``roles`` (Pande et al.'s
sieve scores and t-tests), ``patterns`` (Kovaleva et al.'s pattern classes) and ``syntax``
(syntactic heads and the parsing probe; needs trees from CoNLL-U or ``parser="spacy"``).
"""

from __future__ import annotations

import datetime as dt
import platform
import sys
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from html import escape
from importlib import metadata
from pathlib import Path

import pandas as pd
import torch

from bertology.families.profile.analyzer import GeneralProfile, HeadDistance, clark_labels
from bertology.families.patterns.analyzer import HeadPatterns, PatternThresholds, RuleClassifier
from bertology.families.roles.analyzer import HeadRoles, role_shares
from bertology.families.syntax.analyzer import RelationHeads
from bertology.core.corpora import Corpus, Example, open_corpus
from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError, one_line_error
from bertology.core.models import LoadedModel, load_model
from bertology.core.parsing import spacy_trees
from bertology.families.syntax.probes import ProbeData, cross_validate, evaluate
from bertology.reports.html import Report
from bertology.families.profile.report import profile_section
from bertology.families.patterns.report import patterns_section
from bertology.families.roles.report import roles_section
from bertology.families.syntax.report import syntax_section
from bertology.reports.viewer import viewer_section
from bertology.core.runfolder import RunFolder, claims_out
from bertology.viewer import AttentionView, attention_view, head_labels

FAMILIES = ("profile", "roles", "patterns", "syntax")
DEFAULT_FAMILIES = ("profile", "roles", "patterns")
#: The family each of :func:`analyze`'s analyzers belongs to.
_FAMILY_OF = {"profile": "profile", "distance": "profile", "roles": "roles", "patterns": "patterns", "relations": "syntax", "probe": "syntax"}
#: Role shares are always reported at these tau values too (Pande et al. discuss 1 to 3).
REPORTED_TAUS = (1.0, 2.0, 3.0)
PARSERS = ("gold", "spacy")
_VERSIONED = ("bertology", "torch", "transformers", "tokenizers", "numpy", "pandas", "scipy", "scikit-learn", "statsmodels", "spacy")


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

    Profile: ``heads`` (``layer, head, metric, value, ci_low, ci_high, n``, long format, 0-based),
    ``layers`` (per layer), ``labels`` (heads past Clark's thresholds), ``head_distance`` and
    ``head_map`` (pairwise JS distances and their MDS map; None if no sequence was sampled).
    Roles: ``roles`` (``layer, head, role, mean, ci_low, ci_high, t, p, p_adj, has_role, n``) and
    ``role_shares`` (share of heads per role at several tau). Patterns: ``patterns`` (``layer, head,
    pattern, share, n, majority``), ``pattern_layers`` and ``pattern_examples``. Syntax: ``syntax``
    (``relation, direction, layer, head, accuracy, n``), ``syntax_best`` (one row per relation),
    ``syntax_baselines`` and ``probe`` (UAS figures). Families not run are None, and so are those that
    failed: ``failures`` maps each of them to its error message (the run folder is then ``partial``).
    """

    model: dict
    corpus: dict
    stats: RunStats
    settings: dict
    started: str
    heads: pd.DataFrame | None = None
    layers: pd.DataFrame | None = None
    labels: pd.DataFrame | None = None
    head_distance: pd.DataFrame | None = None
    head_map: pd.DataFrame | None = None
    roles: pd.DataFrame | None = None
    role_shares: pd.DataFrame | None = None
    patterns: pd.DataFrame | None = None
    pattern_layers: pd.DataFrame | None = None
    pattern_examples: dict | None = None
    pattern_thresholds: dict | None = None
    syntax: pd.DataFrame | None = None
    syntax_best: pd.DataFrame | None = None
    syntax_baselines: pd.DataFrame | None = None
    probe: dict | None = None
    out: Path | None = None
    warnings: list[str] = field(default_factory=list)
    view: AttentionView | None = None
    failures: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict:
        """The facts shown at the top of the report."""
        stats = self.stats.as_dict()
        return {
            "model": f"{self.model['name']} ({self.model['model_type']}, {self.model['layers']} layers x {self.model['heads']} heads)",
            "corpus": f"{self.corpus['name']} ({self.corpus['format']}{', trees: ' + self.settings['parser'] if self.syntax is not None else ''})",
            "analyses": ", ".join(self.settings["analyses"]),
            "sequences": stats["sequences"],
            "tokens": stats["tokens"],
            "truncated": stats["truncated"],
            "skipped (too long)": stats["skipped"],
            "max length": self.settings["max_length"],
            "device": self.model["device"],
            "time": f"{stats['seconds']} s ({stats['sequences_per_second']} sequences/s)",
            "started": self.started,
            **({"failed": "; ".join(f"{family}: {message}" for family, message in self.failures.items())} if self.failures else {}),
        }

    @claims_out
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write tables, figures, ``report.html`` and ``manifest.json`` to ``out``, replacing it whole; returns the report path."""
        folder = RunFolder(out)
        sections = []
        if self.heads is not None:
            folder.write_table("heads", self.heads)
            folder.write_table("layers", self.layers)
            folder.write_table("head_labels", self.labels)
            if self.head_distance is not None:
                folder.write_table("head_distance", self.head_distance)
                folder.write_table("head_map", self.head_map)
            sections.append(profile_section(folder, self.heads, self.layers, self.labels, self.head_map, self.settings["punct"]))
        if self.roles is not None:
            folder.write_table("roles", self.roles)
            folder.write_table("role_shares", self.role_shares)
            sections.append(roles_section(folder, self.roles, self.role_shares, self.settings["tau"], self.settings["correction"]))
        if self.patterns is not None:
            folder.write_table("patterns", self.patterns)
            folder.write_table("patterns_by_layer", self.pattern_layers)
            sections.append(patterns_section(folder, self.patterns, self.pattern_layers, self.pattern_examples, self.pattern_thresholds))
        if self.syntax is not None:
            folder.write_table("syntax", self.syntax)
            folder.write_table("syntax_best", self.syntax_best)
            folder.write_table("syntax_baselines", self.syntax_baselines)
            if self.probe is not None:
                folder.write_json("probe.json", self.probe)
            sections.append(
                syntax_section(folder, self.syntax, self.syntax_best, self.probe, self.settings["heatmap_relation"], self.settings["min_dependents"])
            )
        if self.view is not None:
            self.view.labels = head_labels(folder.path)
            self.view.save(folder.path / "viewer.html")
            sections.append(viewer_section(self.view))
        report = Report(title=f"bertology: {self.model['name']} on {self.corpus['name']}", summary=self.summary(), sections=sections)
        folder.write_text("report.html", report.render())
        folder.write_json(
            "manifest.json",
            {
                "status": "partial" if self.failures else "complete",
                "failures": self.failures,
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
        self.out = folder.commit()
        return self.out / "report.html"

    def _repr_html_(self) -> str:
        summary = "".join(f"<tr><th style='text-align:left'>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>" for k, v in self.summary().items())
        html = f"<table>{summary}</table>"
        if self.layers is not None:
            html += self.layers.pivot(index="layer", columns="metric", values="value").to_html(float_format=lambda x: f"{x:.3f}")
        if self.syntax_best is not None:
            html += self.syntax_best.head(10).to_html(index=False, float_format=lambda x: f"{x:.3f}")
        return html


def _has_trees(examples: Corpus | list[Example]) -> bool:
    if isinstance(examples, Corpus):
        return examples.format == "conllu"
    return any(example.has_tree for example in examples)


@claims_out
def analyze(
    model: str | Path | LoadedModel | None = None,
    corpus: str | Path | Corpus | Iterable[str | Example] | None = None,
    *,
    analyses: Iterable[str] | None = None,
    format: str = "auto",
    parser: str | None = None,
    out: str | Path | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    limit: int | None = None,
    overflow: str = "truncate",
    device: str = "auto",
    seed: int = 0,
    head_distance_sample: float = 0.1,
    punct: str = "upos",
    bootstrap: int = 1000,
    min_dependents: int = 25,
    correction: str = "fdr_bh",
    heatmap_relation: str = "all",
    tau: float = 3.0,
    role_window: int = 2,
    pattern_thresholds: PatternThresholds | None = None,
    probe: bool = True,
    probe_test: str | Path | None = None,
    probe_folds: int = 5,
    probe_epochs: int = 20,
    spacy_pipeline: str | None = None,
    trust_remote_code: bool = False,
    view: bool = True,
    progress: bool = True,
    command: list[str] | None = None,
) -> Analysis:
    """Run the requested analyses of ``model`` over ``corpus`` in one pass of the model.

    ``model``: hub name, local folder, an already loaded model, or None for the default
    all-MiniLM-L6-v2. ``corpus``: a file (``format`` auto-detected), a list of strings or
    :class:`~bertology.core.corpora.Example`, or None for the bundled sample corpus. ``analyses``: a
    subset of :data:`FAMILIES`; by default profile, roles and patterns, plus syntax when the corpus
    has trees (CoNLL-U) or ``parser="spacy"`` (the roles then include syntactic roles). ``correction``
    is the multiple-testing method (statsmodels' ``multipletests``) for syntax and roles alike.
    ``punct`` is the profile's punctuation set: ``upos`` (every punctuation-only piece) or ``clark``
    (the pieces "." and "," only, as in Clark et al.'s code; METHODS.md section 1).
    With ``out`` (checked before anything runs), the run folder is written there. ``view`` adds the
    attention viewer (``viewer.html``) for the corpus's first example, linked from the report. A family
    that fails after the pass loses nothing else: it is left out and recorded in ``failures``
    (BertologyError when every family fails).
    """
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    examples, corpus_info = open_corpus(corpus, format, limit)
    if parser not in (None, *PARSERS):
        raise BertologyError(f"unknown parser {parser!r}: use gold (CoNLL-U trees) or spacy")
    with_trees = parser == "spacy" or _has_trees(examples)
    families = tuple(analyses) if analyses is not None else DEFAULT_FAMILIES + (("syntax",) if with_trees else ())
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise BertologyError(f"unknown analyses {sorted(unknown)}: choose from {', '.join(FAMILIES)}")
    if "syntax" in families and not with_trees:
        raise BertologyError(f"syntax needs dependency trees: give a CoNLL-U corpus or --parser spacy ({corpus_info['name']} has none)")
    total = examples.validate() if isinstance(examples, Corpus) else len(examples)
    if total == 0:
        raise BertologyError("the corpus has no examples")
    corpus_info["examples"] = total
    test_corpus = Corpus(Path(probe_test), format="conllu") if probe_test is not None and "syntax" in families else None
    if test_corpus is not None:
        test_corpus.validate()
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, trust_remote_code=trust_remote_code)
    torch.manual_seed(seed)
    engine = Engine(loaded, batch_size=batch_size, max_length=max_length, overflow=overflow, progress=progress, punct=punct)

    analyzers: dict[str, object] = {}
    if "profile" in families:
        analyzers.update(profile=GeneralProfile(), distance=HeadDistance(sample=head_distance_sample, seed=seed))
    if "roles" in families:
        analyzers["roles"] = HeadRoles(tau=tau, window=role_window, correction=correction)
    if "patterns" in families:
        analyzers["patterns"] = HeadPatterns(RuleClassifier(pattern_thresholds or PatternThresholds()), seed=seed)
    if "syntax" in families:
        analyzers["relations"] = RelationHeads(bootstrap=bootstrap, seed=seed)
        if probe:
            analyzers["probe"] = ProbeData()
    stream = spacy_trees(examples, spacy_pipeline) if parser == "spacy" else examples
    stats = engine.run(stream, list(analyzers.values()), total=total, isolate=True)
    if stats.sequences == 0:
        raise BertologyError(f"every sequence was longer than {engine.max_length} pieces and skipped: raise --max-length or truncate")

    settings = {
        "analyses": list(families),
        "batch_size": batch_size,
        "max_length": engine.max_length,
        "overflow": overflow,
        "seed": seed,
        "limit": limit,
        "device": device,
        "head_distance_sample": head_distance_sample,
        "punct": punct,
        "parser": parser or ("gold" if with_trees else None),
        "bootstrap": bootstrap,
        "min_dependents": min_dependents,
        "correction": correction,
        "heatmap_relation": heatmap_relation,
        "tau": tau,
        "role_window": role_window,
        "pattern_thresholds": analyzers["patterns"].thresholds() if "patterns" in analyzers else None,
        "probe_test": str(probe_test) if probe_test else None,
        "probe_folds": probe_folds,
        "probe_epochs": probe_epochs,
    }
    analysis = Analysis(model=loaded.info(), corpus=corpus_info, stats=stats, settings=settings, started=started)
    keys = list(analyzers)
    for position, message in stats.failed.items():  # an analyzer that failed during the pass takes its family out
        analysis.failures.setdefault(_FAMILY_OF[keys[position]], message)
    analyzers = {key: analyzer for key, analyzer in analyzers.items() if _FAMILY_OF[key] not in analysis.failures}
    if "profile" in analyzers:
        with _finishing(analysis, "profile"):
            _finish_profile(analysis, analyzers["profile"], analyzers["distance"])
    if "roles" in analyzers:
        with _finishing(analysis, "roles"):
            roles = analyzers["roles"]
            analysis.roles = roles.result()
            taus = sorted(set(REPORTED_TAUS) | {tau})
            analysis.role_shares = pd.concat([role_shares(roles.test(tau=value)).assign(tau=value) for value in taus], ignore_index=True)
    if "patterns" in analyzers:
        with _finishing(analysis, "patterns"):
            patterns = analyzers["patterns"]
            analysis.patterns, analysis.pattern_layers = patterns.result(), patterns.by_layer()
            analysis.pattern_examples, analysis.pattern_thresholds = patterns.examples(), patterns.thresholds()
    if "relations" in analyzers:
        with _finishing(analysis, "syntax"):
            _finish_syntax(analysis, analyzers["relations"], analyzers.get("probe"), engine, test_corpus, probe_folds, probe_epochs, seed)
    if len(analysis.failures) == len(families):  # nothing left worth a run folder
        raise BertologyError("; ".join(analysis.failures.values()))
    if view:
        first = next(iter(examples))
        analysis.view = attention_view(first.text, first.text_pair, model=loaded, max_length=engine.max_length)
    if out is not None:
        analysis.save(out, command=command)
    return analysis


@contextmanager
def _finishing(analysis: Analysis, family: str):
    """Finish one family; if that fails, its results are dropped and its error is recorded in ``analysis.failures``."""
    before = dict(vars(analysis))
    try:
        yield
    except Exception as exc:
        vars(analysis).update(before)
        analysis.failures[family] = one_line_error(exc)


def _finish_profile(analysis: Analysis, profile: GeneralProfile, distance: HeadDistance) -> None:
    analysis.heads = profile.result()
    analysis.layers = profile.layers()
    analysis.labels = clark_labels(analysis.heads)
    try:
        analysis.head_distance, analysis.head_map = distance.result(), distance.embedding()
    except ValueError as exc:
        analysis.warnings.append(str(exc))


def _finish_syntax(analysis, relations: RelationHeads, probe_data: ProbeData | None, engine: Engine, test_corpus, folds: int, epochs: int, seed: int) -> None:
    settings = analysis.settings
    analysis.syntax = relations.result()
    if analysis.syntax.empty:
        raise BertologyError("no sentence had a dependency tree with a scorable dependent")
    analysis.syntax_best = relations.best(min_dependents=settings["min_dependents"], correction=settings["correction"])
    analysis.syntax_baselines = relations.baselines()
    if probe_data is None:
        return
    sentences = probe_data.ordered()
    if test_corpus is not None:
        test_data = ProbeData()
        engine.run(test_corpus, [test_data])
        analysis.probe = {"evaluation": f"trained on {analysis.corpus['name']}, tested on {test_corpus.name}", **evaluate(sentences, test_data.ordered(), epochs=epochs, seed=seed)}
    elif len(sentences) >= 2 * folds:
        analysis.probe = cross_validate(sentences, folds=folds, epochs=epochs, seed=seed)
    else:
        analysis.warnings.append(f"parsing probe skipped: {len(sentences)} sentences are too few for {folds}-fold cross-validation")
