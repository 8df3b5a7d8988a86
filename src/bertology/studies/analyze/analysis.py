"""The Python API: ``bertology.analyze(...)`` for notebooks and scripts.

One call runs every requested analysis family (:mod:`bertology.families`: bertology's ``profile``,
``roles``, ``patterns`` and ``syntax``, and any family a user registers) over the corpus in a single
pass of the model. This module names no family: it iterates over the registry.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch

from bertology.core.backends import RayBackend, backend_named
from bertology.core.engine import Engine, PassSettings
from bertology.core.errors import BertologyError
from bertology.core.measures.norms import parse_weighting
from bertology.core.model.models import LoadedModel, load_model, load_tokenizer, model_source
from bertology.core.options import check_seed
from bertology.core.statistics.stats import MIN_SAMPLE
from bertology.core.storage.runfolder import claims_out
from bertology.core.text.corpora import Corpus, Example, open_corpus
from bertology.core.text.synthetic import require_synthetic_fits, synthetic_corpus, synthetic_probe_length
from bertology.studies.analyze.choosing import fit_model, requested_families, run_settings
from bertology.studies.analyze.passing import add_viewer, calibration, cuda_devices, finish_families, peak_device_memory, plan_pass, resume_point, run_pass
from bertology.studies.analyze.result import Analysis

PARSERS = ("gold", "spacy")


def _read_arguments(corpus, format: str, limit: int | None, passing: PassSettings, weighting, backend: str, workers: int | None,
                    address: str | None, checkpoint_every: int | None, out, parser: str | None, *, model=None,
                    synthetic_repeats: int | None = None, synthetic_length: int | None = None) -> tuple:
    """Check the run's own arguments and open the corpus, before anything loads but the tokenizer of a synthetic probe (a
    user's first mistake is the one reported: the seed, the corpus, the weighting, the backend, the parser). With
    ``synthetic_repeats``, the corpus is Olsson et al.'s probe drawn from ``model``'s vocabulary with the run's seed
    (``passing``'s, which also says how the tokenizer loads), its first ``limit`` sequences alone
    (:func:`~bertology.core.text.synthetic.synthetic_corpus`; ``synthetic_length`` as
    :func:`~bertology.core.text.synthetic.synthetic_probe_length` has it). Returns the examples, the corpus facts and the
    views of attention."""
    check_seed(passing.seed)
    if synthetic_repeats is None:
        examples, corpus_info = open_corpus(corpus, format, limit)
    else:
        if isinstance(model, LoadedModel):
            tokenizer = model.tokenizer
        else:
            tokenizer = load_tokenizer(model_source(model), trust_remote_code=passing.trust_remote_code)
        examples, corpus_info = synthetic_corpus(tokenizer, synthetic_repeats, synthetic_length, passing.seed, limit)
    views = parse_weighting(weighting)
    runner = backend_named(backend, workers, address)  # a one-line error now, before anything loads
    if checkpoint_every is not None and out is None:
        raise BertologyError("--checkpoint-every saves into the run folder: give --out too")
    if parser not in (None, *PARSERS):
        raise BertologyError(f"unknown parser {parser!r}: use gold (CoNLL-U trees) or spacy")
    return examples, corpus_info, views, runner



def _count_examples(examples, corpus_info: dict) -> int:
    """The corpus's examples, counted (a file's checked whole) into ``corpus_info``; none is refused."""
    total = examples.validate() if isinstance(examples, Corpus) else len(examples)
    if total == 0:
        raise BertologyError("the corpus has no examples")
    corpus_info["examples"] = total
    return total



def _load(model, passing: PassSettings) -> tuple[LoadedModel, dict[str, float]]:
    """The model (as given where it is loaded already, else as ``passing`` says), and the run's first timed phase."""
    began = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=passing.device, trust_remote_code=passing.trust_remote_code,
                                                                     dtype=passing.dtype, device_map=passing.device_map)
    return loaded, {"load": round(time.perf_counter() - began, 2)}


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
    passing = PassSettings(batch_size=batch_size, batch_tokens=batch_tokens, max_length=max_length, overflow=overflow, seed=seed, device=device,
                           punct=punct, null=null, attention_budget=attention_budget, dtype=dtype, device_map=device_map,
                           trust_remote_code=trust_remote_code)
    synthetic_length = synthetic_probe_length(corpus, synthetic_repeats, synthetic_length)
    examples, corpus_info, views, runner = _read_arguments(corpus, format, limit, passing, weighting, backend, workers, address, checkpoint_every,
                                                           out, parser, model=model, synthetic_repeats=synthetic_repeats,
                                                           synthetic_length=synthetic_length)
    chosen, asked, with_trees = requested_families(analyses, include, exclude, options, examples, parser, corpus_info["name"])
    asked_settings = run_settings(chosen, options, passing, with_trees=with_trees, parser=parser, views=views, limit=limit, correction=correction,
                                  min_sample=min_sample)
    total = _count_examples(examples, corpus_info)
    if device_map is not None and isinstance(runner, RayBackend):
        raise BertologyError("--device-map spreads one model over this machine's devices: run it with --backend local")
    loaded, phases = _load(model, passing)
    if dtype != "auto" and not isinstance(model, LoadedModel):
        model = loaded  # Ray's actors get the weights in the dtype asked for, shipped once
    fitted = fit_model(chosen, loaded, asked_settings, asked, options)
    torch.manual_seed(seed)
    engine = Engine(loaded, passing, progress=progress)
    settings = {**fitted.settings, **asdict(engine.settings)}  # on this model: max_length at most its own, the attention budget in bytes
    if synthetic_length is not None:
        require_synthetic_fits(loaded.tokenizer, synthetic_length, engine.settings.max_length, loaded.max_length, loaded.name)
    one_pass = plan_pass(fitted.families, settings, loaded.kind, spacy_pipeline, parse=parser == "spacy")
    resume = resume_point(out, examples, corpus_info, loaded, settings, checkpoint_every)
    gpus = cuda_devices(loaded)
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
    stats = run_pass(runner, engine, examples, one_pass, total=total, resume=resume, model=loaded if isinstance(model, LoadedModel) else model)
    phases["pass"] = round(stats.seconds, 2)
    analysis = Analysis(model=loaded.info(), corpus=corpus_info, stats=stats, settings=settings, started=started, warnings=fitted.warnings,
                        phases=phases, device_memory=peak_device_memory(gpus))
    finish_families(analysis, one_pass, engine)
    if calibrate and null is None:
        analysis.settings["calibration"] = calibration(analysis, fitted.families, examples, engine, spacy_pipeline, parse=parser == "spacy",
                                                       runner=runner, total=total, model=model)
    if view:
        add_viewer(analysis, engine, examples, loaded)
    if out is not None:
        analysis.save(out, command=command)
    return analysis
