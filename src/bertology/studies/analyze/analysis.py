"""The Python API: ``bertology.analyze(...)`` for notebooks and scripts.

One call runs every requested analysis family (:mod:`bertology.families`: bertology's ``profile``,
``roles``, ``patterns`` and ``syntax``, and any family a user registers) over the corpus in a single
pass of the model. This module names no family: it iterates over the registry.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, is_dataclass
from html import escape
from pathlib import Path

import torch

from bertology.core.backends import BACKENDS, PassPlan, Resume, fingerprint, require_ray, run_local, run_ray
from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError, one_line_error
from bertology.core.measures.norms import CONTRIBUTION_VIEWS, WEIGHTING_TITLES, parse_weighting
from bertology.core.model.models import LoadedModel, attention_blocks, load_model
from bertology.core.options import check_seed
from bertology.core.statistics.stats import MIN_SAMPLE
from bertology.core.storage import states
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run, package_versions
from bertology.core.text.corpora import Corpus, Example, has_frames, has_trees, open_corpus
from bertology.families import Family, FamilyContext, FamilyResult, get_family, registered
from bertology.render.html import Report
from bertology.studies.analyze.views import combine_views, views_section
from bertology.studies.view.report import viewer_section
from bertology.studies.view.viewer import AttentionView, attention_view, head_labels

PARSERS = ("gold", "spacy")


def _json_setting(value):
    """Settings as JSON: a sequence item by item, a dataclass with the generated repr (pattern thresholds) by its fields,
    anything else as text (a token class as its own repr)."""
    if isinstance(value, (list, tuple)):
        return [_json_setting(item) for item in value]
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return asdict(value) if is_dataclass(value) and value.__dataclass_params__.repr else str(value)


@dataclass
class Analysis:
    """The result of :func:`analyze`: each family's tables, plus what is needed to write the run folder.

    ``results`` maps each family that ran to its :class:`~bertology.families.FamilyResult`; every table
    (and document) is also an attribute by its name: ``heads``, ``layers``, ``head_labels``,
    ``head_distance``, ``head_map`` (profile); ``roles``, ``role_shares`` (roles); ``patterns``,
    ``patterns_by_layer``, ``pattern_examples`` (patterns); ``syntax``, ``syntax_best``,
    ``syntax_baselines``, ``probe`` (syntax); ``classes`` (classes); ``frames`` (frames); ``layer_probes``,
    ``layer_probe_summary`` (layers); ``rollout``; ``mixing``; with hand labels, ``pattern_training``,
    ``pattern_confusion``, ``classifier`` (patterns); and those of users' families. A table of a family that
    did not run, or failed, is None; ``failures`` maps each failed family to its error (the run folder
    is then ``partial``). Where the run reads norm shares (``weighting="norm"`` or ``"attention,norm"``), every
    table of a family that reads the maps has a first column ``weighting`` and holds each view's rows;
    ``by_view`` keeps each view's results apart.
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
    #: Seconds of each phase of the run: ``load`` (the model), ``pass``, ``finish:FAMILY`` (tests, probes), ``viewer``,
    #: ``report`` (figures, sections and page); in the manifest and the report.
    phases: dict[str, float] = field(default_factory=dict)
    #: Each view of attention's own results (``weighting`` -> family -> result), for the report's sections.
    by_view: dict[str, dict[str, FamilyResult]] = field(default_factory=dict)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        for result in self.__dict__.get("results", {}).values():
            if name in result:
                return result.get(name)
        if any(name in (*family.outputs, *family.optional_outputs, *family.in_memory) for family in registered().values()):
            return None
        raise AttributeError(f"{type(self).__name__!r} has no table or attribute {name!r}")

    def summary(self) -> dict:
        """The facts shown at the top of the report."""
        stats = self.stats.as_dict()
        trees = self.settings["parser"]
        return {
            "model": f"{self.model['name']} ({self.model['model_type']}, {self.model['layers']} layers x {self.model['heads']} heads)",
            "corpus": f"{self.corpus['name']} ({self.corpus['format']}{', trees: ' + trees if trees else ''})",
            "analyses": ", ".join(self.settings["analyses"]),
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
        }

    @claims_out
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write every family's tables, figures and report section, ``report.html`` and ``manifest.json`` to ``out``,
        replacing it whole; returns the report path."""
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
            sections.append(views_section(folder, self.by_view, views))
        if self.view is not None:
            self.view.labels = head_labels(folder.path)
            self.view.save(folder.path / "viewer.html")
            sections.append(viewer_section(self.view))
        self.phases["report"] = round(time.perf_counter() - began, 2)  # the page's rendering itself is a few milliseconds
        report = Report(title=f"bertology: {self.model['name']} on {self.corpus['name']}", summary=self.summary(), sections=sections)
        manifest = {"failures": self.failures, "model": self.model, "corpus": self.corpus,
                    "settings": {name: _json_setting(value) for name, value in self.settings.items()}, "seed": self.settings["seed"],
                    "stats": self.stats.as_dict(), "phases": self.phases, "skipped_sources": self.stats.skipped_sources, "started": self.started,
                    "warnings": self.warnings}
        self.out = complete_run(folder, manifest, report=report.render(), status="partial" if self.failures else "complete", command=command)
        return self.out / "report.html"

    def _repr_html_(self) -> str:
        summary = "".join(f"<tr><th style='text-align:left'>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>" for k, v in self.summary().items())
        html = f"<table>{summary}</table>"
        for name, result in self.results.items():
            overview = get_family(name).overview(result)
            if overview is not None:
                html += overview.to_html(float_format=lambda x: f"{x:.3f}")
        return html


def _choose_families(analyses: Iterable[str] | None, include: Iterable[str], exclude: Iterable[str], with_trees: bool,
                     with_frames: bool, corpus_name: str) -> list[Family]:
    """The families to run: those asked for; or every default family (those that need trees or frames only where
    the corpus has them), with ``include`` added and ``exclude`` left out."""
    def applies(family: Family) -> bool:
        return (with_trees or not family.needs_trees) and (with_frames or not family.needs_frames)

    if analyses is None:
        include, exclude = {get_family(name).name for name in include}, {get_family(name).name for name in exclude}
        analyses = [name for name, family in registered().items()
                    if name not in exclude and (name in include or family.default and applies(family))]
    chosen = [get_family(name) for name in dict.fromkeys(analyses)]
    for family in chosen:
        if family.needs_trees and not with_trees:
            raise BertologyError(f"{family.name} needs dependency trees: give a CoNLL-U corpus or --parser spacy ({corpus_name} has none)")
        if family.needs_frames and not with_frames:
            raise BertologyError(f"{family.name} needs frame annotations: give a frame-annotated .jsonl corpus (--frames) ({corpus_name} has none)")
    return chosen


def _family_settings(chosen: list[Family], options: dict) -> dict:
    """Every chosen family's options, the given value or the default; an option of no chosen family is refused."""
    owners = {option.name: family for family in registered().values() for option in family.options}
    for name in options:
        if name not in owners:
            raise BertologyError(f"unknown setting {name!r}: the families' settings are {', '.join(sorted(owners))}")
        if owners[name] not in chosen:
            raise BertologyError(f"{name} is a setting of {owners[name].name}, which this run does not include")
    return {option.name: options.get(option.name, option.default) for family in chosen for option in family.options}


def first_analysed(engine: Engine, examples) -> Example:
    """The first example the pass analysed, not skipped (too long with ``overflow="skip"``, or of fewer than
    :data:`~bertology.core.engine.MIN_PIECES` pieces): the one the report's viewer shows."""
    for index, example in enumerate(examples):
        if list(engine.encode(iter([(index, example)]), RunStats())):
            return example
    raise BertologyError("no sequence to view: every one was skipped")


@claims_out(work="resume", words=("analyses", "include", "exclude", "format", "parser", "device", "punct", "overflow", "correction",
                                     "weighting", "backend", "address", "heatmap_relation"))
def analyze(
    model: str | Path | LoadedModel | None = None,
    corpus: str | Path | Corpus | Iterable[str | Example] | None = None,
    *,
    analyses: Iterable[str] | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    format: str = "auto",
    parser: str | None = None,
    spacy_pipeline: str | None = None,
    out: str | Path | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    limit: int | None = None,
    overflow: str = "truncate",
    device: str = "auto",
    seed: int = 0,
    punct: str = "upos",
    correction: str = "fdr_bh",
    min_sample: int = MIN_SAMPLE,
    weighting: str | Iterable[str] = "attention",
    backend: str = "local",
    workers: int | None = None,
    address: str | None = None,
    checkpoint_every: int | None = None,
    trust_remote_code: bool = False,
    view: bool = True,
    progress: bool = True,
    command: list[str] | None = None,
    **options,
) -> Analysis:
    """Run the requested analysis families over ``corpus`` in one pass of ``model``.

    ``model``: hub name, local folder, an already loaded model, or None for the default
    all-MiniLM-L6-v2. ``corpus``: a file (``format`` auto-detected), a list of strings or
    :class:`~bertology.core.text.corpora.Example`, or None for the bundled sample corpus. ``analyses``: names
    of registered families (:func:`bertology.families.registered`); by default every default family, the
    ones that need trees (syntax) only when the corpus has them (CoNLL-U, or ``parser="spacy"``), with the
    families named in ``include`` added and those in ``exclude`` left out.
    ``options``: the families' own settings by name (``tau=2``, ``bootstrap=500``, ...; each family's
    ``options`` lists them with their defaults and help); a setting of a family that does not run is
    refused. ``correction`` is the multiple-testing method (statsmodels' ``multipletests``) of every
    family that tests, and ``min_sample`` the fewest observations (sequences, sentences) a test needs before its p-value
    and verdict are reported (docs/methods.md#statistics-conventions; syntax relations use ``min_dependents``); ``punct`` the
    punctuation set: ``upos`` (every punctuation-only piece) or
    ``clark`` (the pieces "." and "," only, as in Clark et al.'s code; docs/methods.md#head-profile).
    ``weighting``: the view of attention every family reads, ``"attention"`` (the weights), ``"norm"``
    (Kobayashi et al. 2020's norm shares, docs/methods.md#norms-and-mixing) or both (``"attention,norm"``), in one pass.
    ``backend``: ``"local"`` (this process) or ``"ray"`` (shards of the corpus across a Ray cluster: ``workers``
    actors on a local cluster started here, or the cluster at ``address``, ``"auto"`` or ``"ray://host:port"``;
    the tables equal the local ones to float rounding). With ``out``, the pass saves its analyzers' states in
    ``out/resume/`` at least every 30 seconds (or every ``checkpoint_every`` batches); the same call after an
    interruption resumes from them.
    With ``out`` (checked before anything runs), the run folder is written there. ``view`` adds the
    attention viewer (``viewer.html``) for the corpus's first example, linked from the report. A family
    that fails, during the pass or after it, loses nothing else: it is left out and recorded in
    ``failures`` (BertologyError when every family fails).
    """
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    check_seed(seed)
    examples, corpus_info = open_corpus(corpus, format, limit)
    views = parse_weighting(weighting)
    if backend not in BACKENDS:
        raise BertologyError(f"unknown backend {backend!r}: use local or ray")
    if backend == "ray":
        require_ray()  # a one-line error now, before anything loads, where Ray is not installed
    elif workers is not None or address is not None:
        raise BertologyError("--workers and --address go with --backend ray")
    if checkpoint_every is not None and out is None:
        raise BertologyError("checkpoint_every saves into the run folder: give out too")
    if parser not in (None, *PARSERS):
        raise BertologyError(f"unknown parser {parser!r}: use gold (CoNLL-U trees) or spacy")
    with_trees = parser == "spacy" or has_trees(examples)
    if analyses is None:  # giving a family's own setting asks for the family
        owners = {option.name: name for name, family in registered().items() for option in family.options}
        include = [*include, *(owners[name] for name in options if name in owners)]
    chosen = _choose_families(analyses, include, exclude, with_trees, has_frames(examples), corpus_info["name"])
    if not chosen:
        raise BertologyError("nothing to do: every analysis is switched off")
    settings = {
        "analyses": [family.name for family in chosen],
        "batch_size": batch_size,
        "max_length": max_length,
        "overflow": overflow,
        "seed": seed,
        "limit": limit,
        "device": device,
        "punct": punct,
        "parser": parser or ("gold" if with_trees else None),
        "correction": correction,
        "min_sample": min_sample,
        "weighting": views,
        **_family_settings(chosen, options),
    }
    for family in chosen:
        family.prepare(settings)
    total = examples.validate() if isinstance(examples, Corpus) else len(examples)
    if total == 0:
        raise BertologyError("the corpus has no examples")
    corpus_info["examples"] = total
    began = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, trust_remote_code=trust_remote_code)
    phases = {"load": round(time.perf_counter() - began, 2)}
    asked = {*(analyses or ()), *include}
    settings["causal"] = loaded.causal  # a decoder: the families' analyzers leave out what has no meaning there
    unfit = {family.name: family.fits(loaded.causal, settings) for family in chosen if family.fits(loaded.causal, settings)}
    kind = "a decoder" if loaded.causal else "an encoder"
    for name, reason in unfit.items():
        if name in asked:  # asked for by name: refused in one line
            raise BertologyError(f"{name} does not run on {loaded.name} ({kind}): {reason}")
        given = [option.name for option in get_family(name).options if option.name in options]
        if given:
            raise BertologyError(f"{given[0]} is a setting of {name}, which does not run on {kind}: {unfit[name]}")
    if unfit:
        chosen = [family for family in chosen if family.name not in unfit]
        if not chosen:
            raise BertologyError(f"nothing to do on {kind}: {'; '.join(f'{name}: {reason}' for name, reason in unfit.items())}")
        settings["analyses"] = [family.name for family in chosen]
        for name in unfit:
            for option in get_family(name).options:
                settings.pop(option.name, None)
    fit_warnings = [f"{name} left out on {kind}: {reason}" for name, reason in unfit.items() if not get_family(name).decoders_only]
    if loaded.layout is None:  # norms and mixing need to know where W_O and the layer norm are
        if "norm" in views:
            attention_blocks(loaded.model)  # its one-line error names the layouts it knows
        unknown = [family.name for family in chosen if family.needs_blocks]
        if set(unknown) & {*(analyses or ()), *include}:  # asked for by name: refused in one line
            attention_blocks(loaded.model)
        chosen = [family for family in chosen if not family.needs_blocks]
        settings["analyses"] = [family.name for family in chosen]
        late_warnings = [f"{', '.join(unknown)} left out: bertology does not know where {loaded.model.config.model_type} models keep "
                         "their output projection and layer norm"] if unknown else []
    else:
        late_warnings = []
    late_warnings = fit_warnings + late_warnings
    contribution_views = [view for view in views if view in CONTRIBUTION_VIEWS]
    torch.manual_seed(seed)
    engine = Engine(loaded, batch_size=batch_size, max_length=max_length, overflow=overflow, progress=progress, punct=punct)
    settings["max_length"] = engine.max_length
    family_views = {family.name: views if family.weighted else ["attention"] for family in chosen}

    def build_analyzers() -> dict:
        return {(family.name, weighting): family.analyzers(settings) for family in chosen for weighting in family_views[family.name]}

    analyzers = build_analyzers()
    fed = [(name, weighting, analyzer) for (name, weighting), own in analyzers.items() for analyzer in own.values()]
    plan = PassPlan(lambda: [analyzer for own in build_analyzers().values() for analyzer in own.values()],
                    [weighting for _, weighting, _ in fed], spacy_pipeline, parse=parser == "spacy")
    resume = None
    if out is not None:
        content = corpus_info.get("sha256") or hashlib.sha256(repr(list(examples)).encode("utf-8")).hexdigest()  # in memory: the examples
        facts = {"model": {key: value for key, value in loaded.info().items() if key != "device"}, "config": loaded.model.config.to_json_string(),
                 "weights": loaded.weights_digest(), "tokenizer": loaded.tokenizer_digest(), "state_format": states.STATE_FORMAT,
                 "corpus": {"content": content, **{key: corpus_info.get(key) for key in ("format", "examples")}},
                 "settings": {key: str(value) for key, value in settings.items() if key not in ("device", "causal")},  # causal: the model's
                 "bertology": package_versions()["bertology"]}
        resume = Resume(out, fingerprint(**facts), every_batches=checkpoint_every)
    in_order = [analyzer for *_, analyzer in fed]
    if backend == "ray":
        stats = run_ray(engine, examples, plan, in_order, model=loaded if isinstance(model, LoadedModel) else model,
                        device=device, trust_remote_code=trust_remote_code, workers=workers, address=address, total=total, resume=resume,
                        progress=progress)
    else:
        stats = run_local(engine, examples, plan, in_order, total=total, resume=resume)
    stats.check_counted(engine.max_length)

    phases["pass"] = round(stats.seconds, 2)
    analysis = Analysis(model=loaded.info(), corpus=corpus_info, stats=stats, settings=settings, started=started, warnings=late_warnings,
                        phases=phases)
    for position, message in stats.failed.items():  # an analyzer that failed during the pass takes its family out
        analysis.failures.setdefault(fed[position][0], message)
    for family in chosen:
        if family.name in analysis.failures:
            continue
        warnings: list[str] = []
        began = time.perf_counter()
        try:
            finished = {weighting: family.finish(analyzers[family.name, weighting], FamilyContext(settings, engine, corpus_info, warnings, weighting))
                        for weighting in family_views[family.name]}
        except Exception as exc:
            analysis.failures[family.name] = one_line_error(exc)
        else:
            for weighting, result in finished.items():
                analysis.by_view.setdefault(weighting, {})[family.name] = result
            # Tables say their view in a weighting column whenever the run reads more than the plain weights.
            analysis.results[family.name] = combine_views(finished) if family.weighted and views != ["attention"] else finished[family_views[family.name][0]]
            analysis.warnings.extend(dict.fromkeys(warnings))
        phases[f"finish:{family.name}"] = round(time.perf_counter() - began, 2)
    if len(analysis.failures) == len(chosen):  # nothing left worth a run folder
        raise BertologyError("; ".join(analysis.failures.values()))
    if view:
        began = time.perf_counter()
        first = first_analysed(engine, examples)
        analysis.view = attention_view(first.text, first.text_pair, model=loaded, max_length=engine.max_length,
                                       contributions=tuple(contribution_views))
        phases["viewer"] = round(time.perf_counter() - began, 2)
    if out is not None:
        analysis.save(out, command=command)
    return analysis
