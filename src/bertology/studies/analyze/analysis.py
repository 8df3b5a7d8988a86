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
from typing import Any

import torch

from bertology.core.analyzer import Analyzer
from bertology.core.backends import BACKENDS, PassPlan, Resume, fingerprint, require_ray, run_local, run_ray
from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError, one_line_error
from bertology.core.measures.norms import CONTRIBUTION_VIEWS, WEIGHTING_TITLES, parse_weighting
from bertology.core.model.kinds import Kind, kind_named
from bertology.core.model.memory import parameter_devices
from bertology.core.model.models import LoadedModel, attention_blocks, default_model_path, load_model, load_tokenizer
from bertology.core.options import check_seed
from bertology.core.statistics.stats import MIN_SAMPLE
from bertology.core.storage import states
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run, package_versions
from bertology.core.text.corpora import Corpus, Example, has_frames, has_trees, open_corpus
from bertology.core.text.synthetic import require_synthetic_fits, synthetic_corpus, synthetic_probe_length
from bertology.families import Family, FamilyContext, FamilyResult, get_family, registered
from bertology.render.html import Report
from bertology.studies.analyze.weightings import combine_views, views_section
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
    owners = {option.name: (family, option) for family in registered().values() for option in family.options}
    for name in options:
        if name not in owners:
            raise BertologyError(f"unknown setting {name!r}: the families' settings are {', '.join(sorted(owners))}")
        family, option = owners[name]
        if family not in chosen:
            raise BertologyError(f"{option.flag_name} is a setting of {family.name}, which this run does not include")
    return {option.name: options.get(option.name, option.default) for family in chosen for option in family.options}


def first_analysed(engine: Engine, examples) -> Example:
    """The first example the pass analysed, not skipped (too long with ``overflow="skip"``, or of fewer than
    :data:`~bertology.core.engine.MIN_PIECES` pieces): the one the report's viewer shows."""
    for index, example in enumerate(examples):
        if list(engine.encode(iter([(index, example)]), RunStats())):
            return example
    raise BertologyError("no sequence to view: every one was skipped")

def _read_arguments(corpus, format: str, limit: int | None, seed: int, weighting, backend: str, workers: int | None,
                    address: str | None, checkpoint_every: int | None, out, parser: str | None, *, model=None,
                    trust_remote_code: bool = False, synthetic_repeats: int | None = None, synthetic_length: int | None = None) -> tuple:
    """Check the run's own arguments and open the corpus, before anything loads but the tokenizer of a synthetic probe (a
    user's first mistake is the one reported: the seed, the corpus, the weighting, the backend, the parser). With
    ``synthetic_repeats``, the corpus is Olsson et al.'s probe drawn from ``model``'s vocabulary with the run's seed, its
    first ``limit`` sequences alone (:func:`~bertology.core.text.synthetic.synthetic_corpus`; ``synthetic_length`` as
    :func:`~bertology.core.text.synthetic.synthetic_probe_length` has it). Returns the examples, the corpus facts and the
    views of attention."""
    check_seed(seed)
    if synthetic_repeats is None:
        examples, corpus_info = open_corpus(corpus, format, limit)
    else:
        if isinstance(model, LoadedModel):
            tokenizer = model.tokenizer
        else:
            source = default_model_path() if model is None else Path(str(model)).expanduser()
            tokenizer = load_tokenizer(str(source if source.exists() else model), trust_remote_code=trust_remote_code)
        examples, corpus_info = synthetic_corpus(tokenizer, synthetic_repeats, synthetic_length, seed, limit)
    views = parse_weighting(weighting)
    if backend not in BACKENDS:
        raise BertologyError(f"unknown backend {backend!r}: use local or ray")
    if backend == "ray":
        require_ray()  # a one-line error now, before anything loads, where Ray is not installed
    elif workers is not None or address is not None:
        raise BertologyError("--workers and --address go with --backend ray")
    if checkpoint_every is not None and out is None:
        raise BertologyError("--checkpoint-every saves into the run folder: give --out too")
    if parser not in (None, *PARSERS):
        raise BertologyError(f"unknown parser {parser!r}: use gold (CoNLL-U trees) or spacy")
    return examples, corpus_info, views


def _requested_families(analyses: Iterable[str] | None, include: Iterable[str], exclude: Iterable[str], options: dict, examples,
                        parser: str | None, corpus_name: str) -> tuple[list[Family], set[str], bool]:
    """The families the run asks for (:func:`_choose_families`; giving a family's own setting asks for the family), the
    names asked for by name (refused, not left out, where the model cannot run them), and whether the corpus has trees."""
    analyses = None if analyses is None else list(analyses)
    include = list(include)
    with_trees = parser == "spacy" or has_trees(examples)
    if analyses is None:
        owners = {option.name: name for name, family in registered().items() for option in family.options}
        include = [*include, *(owners[name] for name in options if name in owners)]
    chosen = _choose_families(analyses, include, exclude, with_trees, has_frames(examples), corpus_name)
    if not chosen:
        raise BertologyError("nothing to do: every analysis is switched off")
    return chosen, {*(analyses or ()), *include}, with_trees


def _run_settings(chosen: list[Family], options: dict, *, with_trees: bool, parser: str | None, views: list[str], batch_size: int,
                  batch_tokens: int | None, max_length: int | None, overflow: str, seed: int, limit: int | None, device: str, punct: str, correction: str,
                  min_sample: int) -> dict:
    """The run's settings (in the manifest), the shared ones then each chosen family's; each family checks its own."""
    settings = {
        "analyses": [family.name for family in chosen],
        "batch_size": batch_size,
        "batch_tokens": batch_tokens,
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
    return settings


def _count_examples(examples, corpus_info: dict) -> int:
    """The corpus's examples, counted (a file's checked whole) into ``corpus_info``; none is refused."""
    total = examples.validate() if isinstance(examples, Corpus) else len(examples)
    if total == 0:
        raise BertologyError("the corpus has no examples")
    corpus_info["examples"] = total
    return total


def cuda_devices(loaded: LoadedModel) -> list[torch.device]:
    """The CUDA devices the model's parameters are on (one, or several under a device map)."""
    return [device for device in parameter_devices(loaded.model) if device.type == "cuda"]


def peak_device_memory(devices: list[torch.device]) -> dict[str, int]:
    """The most memory torch's allocator held on each of ``devices`` since :func:`torch.cuda.reset_peak_memory_stats`, in bytes."""
    return {str(device): int(torch.cuda.max_memory_allocated(device)) for device in devices}


def _load(model, device: str, trust_remote_code: bool, dtype: str, device_map: str | dict | None) -> tuple[LoadedModel, dict[str, float]]:
    """The model (as given where it is loaded already), and the run's first timed phase."""
    began = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, trust_remote_code=trust_remote_code, dtype=dtype,
                                                                     device_map=device_map)
    return loaded, {"load": round(time.perf_counter() - began, 2)}


def _a(kind: Kind) -> str:
    """``an encoder``, ``a decoder``."""
    return f"{'an' if kind.name[0] in 'aeiou' else 'a'} {kind.name}"


def _fit_kind(chosen: list[Family], loaded: LoadedModel, settings: dict, asked: set[str], options: dict) -> tuple[list[Family], list[str]]:
    """The chosen families that have a meaning on this kind of model with these settings (:meth:`Family.fits`), and a warning
    for each left out. One asked for by name, or given a setting, is refused in one line instead. A family left out for its
    settings on a kind it supports is warned about; one made only for the other kind (the sinks on an encoder) is left out
    silently."""
    kind = loaded.kind
    unasked = [family for family in chosen if family.default_kinds is not None and kind.name not in family.default_kinds
               and family.name not in asked and not any(option.name in options for option in family.options)]
    if unasked:  # default on other kinds only (the decoder head types on an encoder): left out silently
        chosen = [family for family in chosen if family not in unasked]
        settings["analyses"] = [family.name for family in chosen]
        for family in unasked:
            for option in family.options:
                settings.pop(option.name, None)
    unfit = {family.name: reason for family in chosen if (reason := family.fits(kind, settings))}
    for name, reason in unfit.items():
        if name in asked:  # asked for by name: refused in one line
            raise BertologyError(f"{name} does not run on {loaded.name} ({_a(kind)}): {reason}")
        given = [option.flag_name for option in get_family(name).options if option.name in options]
        if given:
            raise BertologyError(f"{given[0]} is a setting of {name}, which does not run on {_a(kind)}: {reason}")
    if not unfit:
        return chosen, []
    chosen = [family for family in chosen if family.name not in unfit]
    if not chosen:
        raise BertologyError(f"nothing to do on {_a(kind)}: {'; '.join(f'{name}: {reason}' for name, reason in unfit.items())}")
    settings["analyses"] = [family.name for family in chosen]
    for name in unfit:
        for option in get_family(name).options:
            settings.pop(option.name, None)
    return chosen, [f"{name} left out on {_a(kind)}: {reason}" for name, reason in unfit.items() if kind.name in get_family(name).kinds]


def _fit_layout(chosen: list[Family], loaded: LoadedModel, settings: dict, asked: set[str]) -> tuple[list[Family], list[str]]:
    """Where bertology does not know the model's layout (where W_O and the layer norm are): norm shares are refused, a family
    that needs the blocks is refused where asked for by name and otherwise left out with a warning."""
    if loaded.layout is not None:
        return chosen, []
    if "norm" in settings["weighting"]:
        attention_blocks(loaded.model)  # its one-line error names the layouts it knows
    unknown = [family.name for family in chosen if family.needs_blocks]
    if set(unknown) & asked:  # asked for by name: refused in one line
        attention_blocks(loaded.model)
    chosen = [family for family in chosen if not family.needs_blocks]
    settings["analyses"] = [family.name for family in chosen]
    return chosen, [f"{', '.join(unknown)} left out: bertology does not know where {loaded.model.config.model_type} models keep "
                    "their output projection and layer norm"] if unknown else []


def _fit_model(chosen: list[Family], loaded: LoadedModel, settings: dict, asked: set[str], options: dict) -> tuple[list[Family], list[str]]:
    """The chosen families that run on this model, by its kind then its layout, with the warnings for those left out."""
    settings["kind"] = loaded.kind.name  # the families' analyzers are given the kind itself; the manifest names it
    chosen, kind_warnings = _fit_kind(chosen, loaded, settings, asked, options)
    chosen, layout_warnings = _fit_layout(chosen, loaded, settings, asked)
    return chosen, kind_warnings + layout_warnings


@dataclass
class FamilyPass:
    """The chosen families' analyzers in the one pass: each family once per view of attention it reads."""

    families: list[Family]
    #: Each family's views of attention (``weighting``): the run's, or the plain weights alone for one that reads no maps.
    views: dict[str, list[str]]
    #: ``(family, weighting)`` -> that family's analyzers under that view, by name.
    analyzers: dict[tuple[str, str], dict[str, Analyzer]]
    #: Every analyzer in the order the pass feeds them, with its family and view.
    fed: list[tuple[str, str, Analyzer]]
    plan: PassPlan


def _plan_pass(chosen: list[Family], settings: dict, kind: Kind, spacy_pipeline: str | None, parse: bool) -> FamilyPass:
    """Build the families' analyzers for a model of this ``kind``, and the plan a backend builds each shard's from."""
    family_views = {family.name: settings["weighting"] if family.weighted else ["attention"] for family in chosen}

    def build_analyzers() -> dict:
        return {(family.name, weighting): family.analyzers(settings, kind) for family in chosen for weighting in family_views[family.name]}

    analyzers = build_analyzers()
    fed = [(name, weighting, analyzer) for (name, weighting), own in analyzers.items() for analyzer in own.values()]
    plan = PassPlan(lambda: [analyzer for own in build_analyzers().values() for analyzer in own.values()],
                    [weighting for _, weighting, _ in fed], spacy_pipeline, parse=parse)
    return FamilyPass(chosen, family_views, analyzers, fed, plan)


def _resume_point(out, examples, corpus_info: dict, loaded: LoadedModel, settings: dict, checkpoint_every: int | None) -> Resume | None:
    """With ``out``, where the pass saves and resumes its analyzers' states, under the fingerprint of everything that makes
    its numbers: the model, its weights and tokenizer, the corpus, the settings, the version."""
    if out is None:
        return None
    content = corpus_info.get("sha256") or hashlib.sha256(repr(list(examples)).encode("utf-8")).hexdigest()  # in memory: the examples
    facts = {"model": {key: value for key, value in loaded.info().items() if key != "device"}, "config": loaded.model.config.to_json_string(),
             "weights": loaded.weights_digest(), "tokenizer": loaded.tokenizer_digest(), "state_format": states.STATE_FORMAT,
             "corpus": {"content": content, **{key: corpus_info.get(key) for key in ("format", "examples")}},
             # kind: the model's; the attention budget (auto: a share of the free memory) changes how the maps are computed, not
             # the numbers, and a family left out past it stays out of the resumed run (RunStats.left_out)
             "settings": {key: str(value) for key, value in settings.items() if key not in ("device", "kind", "attention_budget")},
             "bertology": package_versions()["bertology"]}
    return Resume(out, fingerprint(**facts), every_batches=checkpoint_every)


def _run_pass(backend: str, engine: Engine, examples, one_pass: FamilyPass, *, total: int, resume: Resume | None, model, device: str,
              trust_remote_code: bool, workers: int | None, address: str | None, progress: bool) -> RunStats:
    """The one pass over the corpus on the chosen backend; ``model`` as :func:`analyze` was given it (a Ray actor loads its own)."""
    in_order = [analyzer for *_, analyzer in one_pass.fed]
    if backend == "ray":
        stats = run_ray(engine, examples, one_pass.plan, in_order, model=model, device=device, trust_remote_code=trust_remote_code,
                        workers=workers, address=address, total=total, resume=resume, progress=progress)
    else:
        stats = run_local(engine, examples, one_pass.plan, in_order, total=total, resume=resume)
    stats.check_counted(engine.max_length)
    return stats


def _finish_family(analysis: Analysis, family: Family, one_pass: FamilyPass, engine: Engine) -> None:
    """Turn one family's analyzers into its results, under each view it read; a family that fails is recorded and loses
    nothing else."""
    warnings: list[str] = []
    views = one_pass.views[family.name]
    try:
        finished = {weighting: family.finish(one_pass.analyzers[family.name, weighting],
                                             FamilyContext(analysis.settings, engine, analysis.corpus, warnings, weighting))
                    for weighting in views}
    except Exception as exc:
        analysis.failures[family.name] = one_line_error(exc)
        return
    for weighting, result in finished.items():
        analysis.by_view.setdefault(weighting, {})[family.name] = result
    # Tables say their view in a weighting column whenever the run reads more than the plain weights.
    weighted = family.weighted and analysis.settings["weighting"] != ["attention"]
    analysis.results[family.name] = combine_views(finished) if weighted else finished[views[0]]
    analysis.warnings.extend(dict.fromkeys(warnings))


def _finish_families(analysis: Analysis, one_pass: FamilyPass, engine: Engine) -> None:
    """Finish every family that did not fail during the pass, or was left out of it, each timed; BertologyError where every
    family failed or was left out."""
    for position, message in analysis.stats.failed.items():  # an analyzer that failed during the pass takes its family out
        analysis.failures.setdefault(one_pass.fed[position][0], message)
    for position, message in analysis.stats.left_out.items():  # and one left out past the attention budget
        if one_pass.fed[position][0] not in analysis.failures:
            analysis.left_out.setdefault(one_pass.fed[position][0], message)
    for family in one_pass.families:
        if family.name in analysis.failures or family.name in analysis.left_out:
            continue
        began = time.perf_counter()
        _finish_family(analysis, family, one_pass, engine)
        analysis.phases[f"finish:{family.name}"] = round(time.perf_counter() - began, 2)
    if len(analysis.failures) + len(analysis.left_out) == len(one_pass.families):  # nothing left worth a run folder
        raise BertologyError("; ".join({**analysis.failures, **analysis.left_out}.values()))


def _calibration(analysis: Analysis, chosen: list[Family], examples, engine: Engine, spacy_pipeline: str | None, *, parse: bool,
                 backend: str, total: int, model, device: str, trust_remote_code: bool, workers: int | None, address: str | None) -> str:
    """The claims line of the null model (docs/methods.md#the-null-model: every head uniform over the keys it sees) on the
    run's model, corpus and settings: a second pass, its analyzers built afresh, its tables kept nowhere."""
    began = time.perf_counter()
    null_engine = engine.with_null("uniform")
    settings = {**analysis.settings, "null": "uniform"}
    one_pass = _plan_pass(chosen, settings, engine.model.kind, spacy_pipeline, parse=parse)
    stats = _run_pass(backend, null_engine, examples, one_pass, total=total, resume=None, model=model, device=device,
                      trust_remote_code=trust_remote_code, workers=workers, address=address, progress=engine.progress)
    null = Analysis(model=analysis.model, corpus=analysis.corpus, stats=stats, settings=settings, started=analysis.started, warnings=[],
                    phases={})
    _finish_families(null, one_pass, null_engine)
    analysis.phases["calibration"] = round(time.perf_counter() - began, 2)
    return null.claims_line()


#: The report's viewer shows at most this many pieces of the first example (a page of 8,192 pieces is neither readable nor
#: cheap: its first layer alone is heads x n^2 weights); ``bertology view --max-length N`` shows more.
REPORT_VIEWER_PIECES = 1024


def _add_viewer(analysis: Analysis, engine: Engine, examples, loaded: LoadedModel) -> None:
    """The attention viewer of the first example the pass analysed (its first :data:`REPORT_VIEWER_PIECES` pieces), with the
    contribution maps the run reads."""
    began = time.perf_counter()
    first = first_analysed(engine, examples)
    contributions = tuple(view for view in analysis.settings["weighting"] if view in CONTRIBUTION_VIEWS)
    analysis.view = attention_view(first.text, first.text_pair, model=loaded, max_length=min(engine.max_length, REPORT_VIEWER_PIECES),
                                   contributions=contributions)
    analysis.phases["viewer"] = round(time.perf_counter() - began, 2)


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
    batch_tokens: int | None = None,
    max_length: int | None = None,
    limit: int | None = None,
    overflow: str = "truncate",
    device: str = "auto",
    seed: int = 0,
    punct: str = "upos",
    synthetic_repeats: int | None = None,
    synthetic_length: int | None = None,
    correction: str = "fdr_bh",
    min_sample: int = MIN_SAMPLE,
    weighting: str | Iterable[str] = "attention",
    null: str | None = None,
    calibrate: bool = False,
    backend: str = "local",
    workers: int | None = None,
    address: str | None = None,
    checkpoint_every: int | None = None,
    attention_budget: int | str | None = "auto",
    trust_remote_code: bool = False,
    dtype: str = "auto",
    device_map: str | dict | None = None,
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
    ``synthetic_repeats``: instead of ``corpus``, Olsson et al.'s (2022) probe of induction heads: that many sequences of
    ``synthetic_length`` (default 50, given only with the probe) random whole-word pieces of the model's vocabulary (drawn
    with ``seed``), each repeated twice (:func:`~bertology.core.text.synthetic.synthetic_repeats`;
    docs/methods.md#decoder-head-types); ``limit`` draws only the first so many, and a probe longer than the run reads is
    refused before the pass (:func:`~bertology.core.text.synthetic.require_synthetic_fits`).
    ``weighting``: the view of attention every family reads, ``"attention"`` (the weights), ``"norm"``
    (Kobayashi et al. 2020's norm shares, docs/methods.md#norms-and-mixing) or both (``"attention,norm"``), in one pass.
    ``null="uniform"`` runs the null model instead of the model's attention (every head uniform over the keys it sees: the
    model with its queries zeroed, docs/methods.md#the-null-model), the calibration of every claim: it should make none;
    ``calibrate`` runs it after the run, in a second pass of the same model, corpus and settings, and puts its claims line
    beside the run's (``settings["calibration"]``, the summary, the report).
    ``backend``: ``"local"`` (this process) or ``"ray"`` (shards of the corpus across a Ray cluster: ``workers``
    actors on a local cluster started here, or the cluster at ``address``, ``"auto"`` or ``"ray://host:port"``;
    the tables equal the local ones to float rounding). With ``out``, the pass saves its analyzers' states in
    ``out/resume/`` at least every 30 seconds (or every ``checkpoint_every`` batches); the same call after an
    interruption resumes from them.
    ``attention_budget``: the most bytes of one layer's maps a batch holds at once (:class:`~bertology.core.engine.Engine`):
    past it each layer's maps are computed by blocks of query rows, and a family that needs whole maps is left out of the run
    with one line in ``left_out``; ``"auto"`` (the default), the smaller of 64 MiB and a sixteenth of the free memory of the
    devices that hold the layers (:mod:`bertology.core.model.memory`), recorded in ``settings`` as bytes; None: whole maps.
    ``dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``) and ``device_map`` (accelerate's, ``auto``; not with Ray)
    are :func:`~bertology.core.model.models.load_model`'s; the model's info in the manifest records both.
    With ``out`` (checked before anything runs), the run folder is written there. ``view`` adds the
    attention viewer (``viewer.html``) for the corpus's first example, linked from the report. A family
    that fails, during the pass or after it, loses nothing else: it is left out and recorded in
    ``failures`` (BertologyError when every family fails).
    """
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    synthetic_length = synthetic_probe_length(corpus, synthetic_repeats, synthetic_length)
    examples, corpus_info, views = _read_arguments(corpus, format, limit, seed, weighting, backend, workers, address, checkpoint_every, out,
                                                   parser, model=model, trust_remote_code=trust_remote_code,
                                                   synthetic_repeats=synthetic_repeats, synthetic_length=synthetic_length)
    chosen, asked, with_trees = _requested_families(analyses, include, exclude, options, examples, parser, corpus_info["name"])
    settings = _run_settings(chosen, options, with_trees=with_trees, parser=parser, views=views, batch_size=batch_size, batch_tokens=batch_tokens,
                             max_length=max_length, overflow=overflow, seed=seed, limit=limit, device=device, punct=punct, correction=correction,
                             min_sample=min_sample)
    total = _count_examples(examples, corpus_info)
    if device_map is not None and backend == "ray":
        raise BertologyError("--device-map spreads one model over this machine's devices: run it with --backend local")
    loaded, phases = _load(model, device, trust_remote_code, dtype, device_map)
    if dtype != "auto" and not isinstance(model, LoadedModel):
        model = loaded  # Ray's actors get the weights in the dtype asked for, shipped once
    chosen, warnings = _fit_model(chosen, loaded, settings, asked, options)
    torch.manual_seed(seed)
    engine = Engine(loaded, batch_size=batch_size, batch_tokens=batch_tokens, max_length=max_length, overflow=overflow, progress=progress,
                    punct=punct, null=null, attention_budget=attention_budget)
    settings["max_length"], settings["attention_budget"] = engine.max_length, engine.attention_budget  # auto: resolved, in bytes
    if synthetic_length is not None:
        require_synthetic_fits(loaded.tokenizer, synthetic_length, engine.max_length, loaded.max_length, loaded.name)
    if null is not None:
        settings["null"] = null
    one_pass = _plan_pass(chosen, settings, loaded.kind, spacy_pipeline, parse=parser == "spacy")
    resume = _resume_point(out, examples, corpus_info, loaded, settings, checkpoint_every)
    gpus = cuda_devices(loaded)
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
    stats = _run_pass(backend, engine, examples, one_pass, total=total, resume=resume, model=loaded if isinstance(model, LoadedModel) else model,
                      device=device, trust_remote_code=trust_remote_code, workers=workers, address=address, progress=progress)
    phases["pass"] = round(stats.seconds, 2)
    analysis = Analysis(model=loaded.info(), corpus=corpus_info, stats=stats, settings=settings, started=started, warnings=warnings,
                        phases=phases, device_memory=peak_device_memory(gpus))
    _finish_families(analysis, one_pass, engine)
    if calibrate and null is None:
        analysis.settings["calibration"] = _calibration(analysis, chosen, examples, engine, spacy_pipeline, parse=parser == "spacy",
                                                        backend=backend, total=total, model=model, device=device,
                                                        trust_remote_code=trust_remote_code, workers=workers, address=address)
    if view:
        _add_viewer(analysis, engine, examples, loaded)
    if out is not None:
        analysis.save(out, command=command)
    return analysis
