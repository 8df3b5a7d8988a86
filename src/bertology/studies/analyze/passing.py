"""The pass of ``analyze`` and what follows it: planning, resuming, running, finishing families, calibration, viewer.

The chosen families' analyzers run in one pass (:func:`plan_pass`, :func:`run_pass`), which resumes from saved states
(:func:`resume_point`); each family is then finished into its tables (:func:`finish_families`), the null model's claims are
set beside the run's (:func:`calibration`) and the report gets its viewer (:func:`add_viewer`)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from bertology.core.analyzer import Analyzer
from bertology.core.backends import LocalBackend, PassPlan, RayBackend, Resume, fingerprint
from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError, one_line_error
from bertology.core.measures.norms import CONTRIBUTION_VIEWS
from bertology.core.model.kinds import Kind
from bertology.core.model.memory import parameter_devices
from bertology.core.model.models import LoadedModel
from bertology.core.storage import states
from bertology.core.storage.runfolder import package_versions
from bertology.core.text.corpora import Example
from bertology.families import Family, FamilyContext
from bertology.studies.analyze.result import Analysis
from bertology.studies.analyze.weightings import combine_views
from bertology.studies.view.viewer import attention_view


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


def plan_pass(chosen: list[Family], settings: dict, kind: Kind, spacy_pipeline: str | None, parse: bool) -> FamilyPass:
    """Build the families' analyzers for a model of this ``kind``, and the plan a backend builds each shard's from."""
    family_views = {family.name: settings["weighting"] if family.weighted else ["attention"] for family in chosen}

    def build_analyzers() -> dict:
        return {(family.name, weighting): family.analyzers(settings, kind) for family in chosen for weighting in family_views[family.name]}

    analyzers = build_analyzers()
    fed = [(name, weighting, analyzer) for (name, weighting), own in analyzers.items() for analyzer in own.values()]
    plan = PassPlan(lambda: [analyzer for own in build_analyzers().values() for analyzer in own.values()],
                    [weighting for _, weighting, _ in fed], spacy_pipeline, parse=parse)
    return FamilyPass(chosen, family_views, analyzers, fed, plan)


#: The settings a resumed run may change: where the model runs (its device, device map and dtype as asked: the model's own
#: facts say its dtype), the kind (the model's), and the attention budget (auto: a share of the free memory), which changes
#: how the maps are computed, not the numbers (a family left out past it stays out of the resumed run: RunStats.left_out).
UNFINGERPRINTED = ("device", "device_map", "dtype", "trust_remote_code", "kind", "attention_budget")


def resume_point(out, examples, corpus_info: dict, loaded: LoadedModel, settings: dict, checkpoint_every: int | None) -> Resume | None:
    """With ``out``, where the pass saves and resumes its analyzers' states, under the fingerprint of everything that makes
    its numbers: the model, its weights and tokenizer, the corpus, the settings, the version."""
    if out is None:
        return None
    content = corpus_info.get("sha256") or hashlib.sha256(repr(list(examples)).encode("utf-8")).hexdigest()  # in memory: the examples
    facts = {"model": {key: value for key, value in loaded.info().items() if key != "device"}, "config": loaded.model.config.to_json_string(),
             "weights": loaded.weights_digest(), "tokenizer": loaded.tokenizer_digest(), "state_format": states.STATE_FORMAT,
             "corpus": {"content": content, **{key: corpus_info.get(key) for key in ("format", "examples")}},
             "settings": {key: str(value) for key, value in settings.items() if key not in UNFINGERPRINTED},
             "bertology": package_versions()["bertology"]}
    return Resume(out, fingerprint(**facts), every_batches=checkpoint_every)


def run_pass(runner: LocalBackend | RayBackend, engine: Engine, examples, one_pass: FamilyPass, *, total: int, resume: Resume | None,
             model) -> RunStats:
    """The one pass over the corpus on ``runner``'s backend; ``model`` as :func:`~bertology.studies.analyze.analysis.analyze`
    was given it (a Ray actor loads its own, as the engine's settings say)."""
    in_order = [analyzer for *_, analyzer in one_pass.fed]
    stats = runner.run_pass(engine, examples, one_pass.plan, in_order, model=model, total=total, resume=resume)
    stats.check_counted(engine.settings.max_length)
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


def finish_families(analysis: Analysis, one_pass: FamilyPass, engine: Engine) -> None:
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


def calibration(analysis: Analysis, chosen: list[Family], examples, engine: Engine, spacy_pipeline: str | None, *, parse: bool,
                runner: LocalBackend | RayBackend, total: int, model) -> str:
    """The claims line of the null model (docs/methods.md#the-null-model: every head uniform over the keys it sees) on the
    run's model, corpus and settings: a second pass, its analyzers built afresh, its tables kept nowhere."""
    began = time.perf_counter()
    null_engine = engine.with_null("uniform")
    settings = {**analysis.settings, "null": "uniform"}
    one_pass = plan_pass(chosen, settings, engine.model.kind, spacy_pipeline, parse=parse)
    stats = run_pass(runner, null_engine, examples, one_pass, total=total, resume=None, model=model)
    null = Analysis(model=analysis.model, corpus=analysis.corpus, stats=stats, settings=settings, started=analysis.started, warnings=[],
                    phases={})
    finish_families(null, one_pass, null_engine)
    analysis.phases["calibration"] = round(time.perf_counter() - began, 2)
    return null.claims_line()


#: The report's viewer shows at most this many pieces of the first example (a page of 8,192 pieces is neither readable nor
#: cheap: its first layer alone is heads x n^2 weights); ``bertology view --max-length N`` shows more.
REPORT_VIEWER_PIECES = 1024


def add_viewer(analysis: Analysis, engine: Engine, examples, loaded: LoadedModel) -> None:
    """The attention viewer of the first example the pass analysed (its first :data:`REPORT_VIEWER_PIECES` pieces), with the
    contribution maps the run reads."""
    began = time.perf_counter()
    first = first_analysed(engine, examples)
    contributions = tuple(view for view in analysis.settings["weighting"] if view in CONTRIBUTION_VIEWS)
    analysis.view = attention_view(first.text, first.text_pair, model=loaded, max_length=min(engine.settings.max_length, REPORT_VIEWER_PIECES),
                                   contributions=contributions)
    analysis.phases["viewer"] = round(time.perf_counter() - began, 2)


def first_analysed(engine: Engine, examples) -> Example:
    """The first example the pass analysed, not skipped (too long with ``overflow="skip"``, or of fewer than
    :data:`~bertology.core.engine.MIN_PIECES` pieces): the one the report's viewer shows."""
    for index, example in enumerate(examples):
        if list(engine.encode(iter([(index, example)]), RunStats())):
            return example
    raise BertologyError("no sequence to view: every one was skipped")

def cuda_devices(loaded: LoadedModel) -> list[torch.device]:
    """The CUDA devices the model's parameters are on (one, or several under a device map)."""
    return [device for device in parameter_devices(loaded.model) if device.type == "cuda"]


def peak_device_memory(devices: list[torch.device]) -> dict[str, int]:
    """The most memory torch's allocator held on each of ``devices`` since :func:`torch.cuda.reset_peak_memory_stats`, in bytes."""
    return {str(device): int(torch.cuda.max_memory_allocated(device)) for device in devices}


