"""``bertology track``'s run (docs/methods.md#track-and-the-learning-curve-verdict): every checkpoint of one series on one
corpus through the general profile (Clark et al. 2019), the role tests (Pande et al. 2021), with trees the syntactic heads, on
a decoder its induction heads and attention sinks, and its loss on the corpus (:func:`_analyze_checkpoint`), each kept as a part
that a rerun reads back; then the verdicts on the series (:func:`track`).

The rooms it draws on: :mod:`~bertology.studies.track.checkpoints` (which checkpoints, in what order, of one series),
:mod:`~bertology.studies.track.parts` (the resume store), :mod:`~bertology.studies.track.result` (what is kept and written),
:mod:`~bertology.studies.track.hypothesis` (the learning-curve verdict), :mod:`~bertology.studies.track.induction`,
:mod:`~bertology.studies.track.sinks` and :mod:`~bertology.studies.track.losses`; the rules every verdict shares live in
:mod:`~bertology.studies.track.verdicts`.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bertology.core.backends import LocalBackend, RayBackend, backend_named
from bertology.core.engine import Engine, PassSettings
from bertology.core.errors import BertologyError, ModelError
from bertology.core.model.models import LANGUAGE_MODEL, LoadedModel, load_model, load_tokenizer, model_source
from bertology.core.options import check_seed
from bertology.core.storage.runfolder import claims_out, finished_run
from bertology.core.text.corpora import open_corpus
from bertology.core.text.parsing import spacy_trees
from bertology.core.text.synthetic import require_synthetic_fits, synthetic_corpus, synthetic_probe_length
from bertology.families.headtypes import HEAD_TYPE_MASS
from bertology.families.headtypes.analyzer import HeadTypes
from bertology.families.headtypes.copying import copying_scores
from bertology.families.profile.analyzer import GeneralProfile
from bertology.families.roles.analyzer import HeadRoles
from bertology.families.sinks.analyzer import SINK_EPS
from bertology.families.syntax.analyzer import RelationHeads
from bertology.studies.track.checkpoints import checked_series
from bertology.studies.track.hypothesis import hypothesis_verdict
from bertology.studies.track.induction import InductionReplicates, in_context_scores
from bertology.studies.track.losses import loss_series, measured_loss
from bertology.studies.track.parts import load_part, part_key, part_name, save_part
from bertology.studies.track.peaks import LayerPeaks
from bertology.studies.track.phase import phase_verdict
from bertology.studies.track.probe import PROBE_SEQUENCES, probe_checkpoint, series_probe
from bertology.studies.track.result import TRACK_COLUMNS, TRACK_LAYER_COLUMNS, CheckpointResult, TrackResult
from bertology.studies.track.sinks import follows_sinks, layer_sink_rates, sink_series


@claims_out(work="parts", words=("format", "parser", "punct", "device", "backend", "address"))
def track(
    checkpoints: list[str],
    corpus=None,
    *,
    format: str = "auto",
    parser: str | None = None,
    out: str | Path | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
    limit: int | None = None,
    bootstrap: int = 1000,
    tau: float = 3.0,
    min_dependents: int = 25,
    punct: str = "upos",
    seed: int = 0,
    device: str = "auto",
    trust_remote_code: bool = False,
    dtype: str = "auto",
    sink_eps: float = SINK_EPS,
    progress: bool = True,
    command: list[str] | None = None,
    steps: list[int] | None = None,
    backend: str = "local",
    workers: int | None = None,
    address: str | None = None,
    synthetic_repeats: int | None = None,
    synthetic_length: int | None = None,
    attention_budget: int | str | None = "auto",
    induction_probe: int = PROBE_SEQUENCES,
    head_type_mass: float = HEAD_TYPE_MASS,
) -> TrackResult:
    """Profile, roles and (with trees) syntactic heads of every checkpoint on one corpus, and the verdict.

    ``checkpoints``: model folders or hub names (``"default"`` or ``"all-MiniLM-L6-v2"``: the bundled model),
    ordered by ``steps`` (one per checkpoint, in the same order) or by the step each one tells
    (:func:`~bertology.studies.track.checkpoints.checkpoint_step`); checkpoints that are not one series
    (:func:`~bertology.studies.track.checkpoints.check_one_series`), or name two pre-training runs
    (:func:`~bertology.studies.track.runs.check_one_run`), are refused before any runs. ``corpus`` as in
    :func:`bertology.analyze` (trees from CoNLL-U or ``parser="spacy"`` add syntax). With ``out``,
    each checkpoint's results are saved under ``out/parts`` as soon as they exist (a rerun skips
    them) and the run folder is written at the end. ``punct``: the punctuation set, as in :func:`bertology.analyze`.
    On a decoder's checkpoints (docs/methods.md#decoders) the first token takes [CLS]'s place, nothing about [SEP] is
    reported, and ``Sink_eps`` at ``sink_eps`` is followed per layer (``track_layers``' ``sink_eps``) and overall (``verdict["sinks"]``).
    ``backend="ray"``: one checkpoint per Ray task across the cluster (``workers``, ``address`` as in
    :func:`bertology.analyze`); each part is saved as its task finishes. ``synthetic_repeats``: instead of ``corpus``, Olsson et
    al.'s probe of that many sequences of ``synthetic_length`` (default 50) random whole-word pieces repeated twice, drawn with
    ``seed`` from the series' vocabulary, the first ``limit`` alone (:func:`~bertology.core.text.synthetic.synthetic_corpus`;
    every checkpoint of one series shares it); one longer than ``max_length`` or the checkpoints' positions is refused before
    its pass (:func:`~bertology.core.text.synthetic.require_synthetic_fits`). ``attention_budget``: as in :func:`bertology.analyze`.
    A decoder's series also reads ``induction_probe`` sequences of :func:`~bertology.studies.track.probe.series_probe`, and the
    phase-change verdict (:func:`~bertology.studies.track.phase.phase_verdict`) names heads at ``head_type_mass``.
    """
    runner = backend_named(backend, workers, address)
    check_seed(seed)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    series = checked_series(checkpoints, steps, trust_remote_code)
    synthetic_length = synthetic_probe_length(corpus, synthetic_repeats, synthetic_length)
    examples, corpus_info = _track_examples(corpus, format, limit, parser, series[0][1], seed, synthetic_repeats, synthetic_length,
                                            trust_remote_code)
    with_trees = any(example.has_tree for example in examples)
    probe = series_probe(series[0][1], induction_probe, max_length, seed, trust_remote_code)
    settings = {"batch_size": batch_size, "max_length": max_length, "limit": limit, "bootstrap": bootstrap, "tau": tau,
                "min_dependents": min_dependents, "punct": punct, "seed": seed, "device": device, "trust_remote_code": trust_remote_code,
                "dtype": dtype, "attention_budget": attention_budget, "parser": parser or ("gold" if with_trees else None), "sink_eps": sink_eps,
                **({"synthetic_repeats": synthetic_repeats, "synthetic_length": synthetic_length} if synthetic_repeats is not None else {}),
                **({"induction_probe": induction_probe, "probe_length": probe[1], "head_type_mass": head_type_mass} if probe is not None else {})}
    results = _series_results(series, (examples, probe and probe[0]), with_trees, settings, corpus_info, out, progress, runner)
    verdict, emergence = _series_verdict(results, with_trees, settings)
    corpus_info["examples"] = len(examples)
    result = TrackResult(results, corpus_info, settings, verdict, emergence, started)
    if out is not None:
        result.save(out, command=command)
    return result


def _track_examples(corpus, format: str, limit: int | None, parser: str | None, first: str, seed: int, synthetic_repeats: int | None,
                    synthetic_length: int, trust_remote_code: bool) -> tuple[list, dict]:
    """The examples every checkpoint reads and what the corpus is: ``corpus`` (with ``parser="spacy"``, parsed), or the
    synthetic probe drawn from the vocabulary of the ``first`` checkpoint; refused when there is none."""
    if synthetic_repeats is None:
        source, corpus_info = open_corpus(corpus, format, limit)
    else:
        tokenizer = load_tokenizer(model_source(first), trust_remote_code=trust_remote_code)
        source, corpus_info = synthetic_corpus(tokenizer, synthetic_repeats, synthetic_length, seed, limit)
    examples = list(spacy_trees(source) if parser == "spacy" else source)
    if not examples:
        raise BertologyError("the corpus has no examples")
    return examples, corpus_info


def _series_results(series: list[tuple[int | None, str]], inputs: tuple[list, list | None], with_trees: bool, settings: dict,
                    corpus_info: dict, out: str | Path | None, progress: bool, runner: LocalBackend | RayBackend) -> list[CheckpointResult]:
    """Every checkpoint's result in training order: its part under ``out/parts`` where one of this corpus, these settings and
    these weights is saved (:func:`~bertology.studies.track.parts.load_part`), else computed (``runner.map``: here, or one Ray
    task each, loading the folder by its absolute path) and saved there at once. ``inputs``: the corpus's examples and a decoder's induction probe (None)."""
    examples = inputs[0]
    key = json.dumps({"corpus": corpus_info.get("sha256"), "examples": len(examples), **{k: v for k, v in settings.items() if k != "device"}},
                     sort_keys=True)
    parts = Path(out) / "parts" if out is not None else None
    finished = parts is not None and finished_run(Path(out))
    keys = {checkpoint: part_key(key, checkpoint) for _, checkpoint in series} if parts is not None else {}
    results = [load_part(parts, part_name(checkpoint), keys[checkpoint], 1 + settings["bootstrap"], finished) if parts is not None else None
               for _, checkpoint in series]
    todo = [k for k, (step, _) in enumerate(series) if results[k] is None or results[k].step != step]

    def keep(k: int, result: CheckpointResult) -> None:
        results[k] = result
        if parts is not None:
            save_part(parts, part_name(series[k][1]), keys[series[k][1]], result)

    remote = isinstance(runner, RayBackend)  # a task loads the folder by its absolute path (every node must see it), with no progress bar
    jobs = [(step, checkpoint, inputs, with_trees, settings, progress and not remote,
             str(Path(checkpoint).resolve()) if remote and Path(checkpoint).exists() else None) for step, checkpoint in (series[k] for k in todo)]
    for index, result in runner.map(_analyze_checkpoint, jobs, device=settings["device"]):
        keep(todo[index], result)
    return results


def _series_verdict(results: list[CheckpointResult], with_trees: bool, settings: dict) -> tuple[dict, pd.DataFrame | None]:
    """The verdicts on a series of one architecture (:func:`~bertology.studies.track.hypothesis.hypothesis_verdict`, a decoder's
    attention sinks and the phase change of its induction heads, :func:`~bertology.studies.track.phase.phase_verdict`) and
    each checkpoint's loss, with claim 2's table (None for one checkpoint)."""
    if len({r.kind.name for r in results}) > 1:
        raise BertologyError("the checkpoints mix encoders and decoders: a series must share one architecture")
    shapes = {r.means.shape for r in results}
    if len(shapes) > 1:
        raise BertologyError("the checkpoints differ in depth: a series must share one architecture")
    steps = [r.step for r in results]
    syntax = np.stack([r.syntax for r in results]) if with_trees and all(r.syntax is not None for r in results) else None
    kind = results[0].kind
    verdict, emergence = hypothesis_verdict(steps, [r.checkpoint for r in results], np.stack([r.means for r in results]), kind, syntax,
                                            excess=np.stack([r.excess for r in results]))
    if follows_sinks(kind):
        verdict["sinks"] = sink_series(results, settings["sink_eps"])
    if all(r.probe is not None for r in results):
        losses = [r.loss_replicates for r in results]
        loss = np.stack(losses) if all(replicates is not None and np.isfinite(replicates[0]) for replicates in losses) else None
        verdict["induction"] = phase_verdict(steps, [r.probe for r in results], loss, settings["head_type_mass"])
    verdict["losses"] = loss_series(steps, [r.checkpoint for r in results], [(r.measured_loss, r.measured_loss_name) for r in results])
    return verdict, emergence


def _analyze_checkpoint(step: int | None, checkpoint: str, inputs: tuple[list, list | None], with_trees: bool, settings: dict, progress: bool,
                        source: str | None = None, device: str | None = None) -> CheckpointResult:
    """One checkpoint's profile, roles and syntax on the corpus's examples (``inputs[0]``), a decoder's Sink_eps per layer
    (:func:`~.sinks.layer_sink_rates`), induction heads and in-context learning score, and on its induction probe
    (``inputs[1]``, :func:`~.probe.probe_checkpoint`), and, where it loads with a language-model head, its loss on the corpus
    (:func:`~.losses.measured_loss`, with paired bootstrap replicates). On a Ray task, ``source`` is where to load it from (the
    folder's absolute path) and ``device`` the task's own."""
    examples, probe = inputs
    loaded, with_lm_head = _load_checkpoint(source or checkpoint, settings, device)
    torch.manual_seed(settings["seed"])
    engine = Engine(loaded, PassSettings.of(settings), progress=progress)
    if "synthetic_length" in settings:  # before this checkpoint's pass: the first one's refuses before any runs
        require_synthetic_fits(loaded.tokenizer, settings["synthetic_length"], engine.settings.max_length, loaded.max_length, checkpoint)
    kind = loaded.kind
    profile, peaks = GeneralProfile(kind), LayerPeaks(kind, bootstrap=settings["bootstrap"], seed=settings["seed"])
    roles = HeadRoles(kind, tau=settings["tau"])
    relations = RelationHeads(kind, bootstrap=settings["bootstrap"], seed=settings["seed"]) if with_trees else None
    analyzers = [profile, peaks, roles] + ([relations] if relations is not None else [])
    follows_induction = not kind.sees_later_keys  # a decoder's: induction heads and the in-context learning score
    if follows_induction:
        head_types, induction = HeadTypes(kind), InductionReplicates(kind, bootstrap=settings["bootstrap"], seed=settings["seed"])
        analyzers += [head_types, induction]
    stats = engine.run(examples, analyzers, total=len(examples), desc=Path(checkpoint).name)
    try:
        stats.check_counted(engine.settings.max_length)
    except BertologyError as exc:
        raise BertologyError(f"{checkpoint}: {exc}") from None
    heads = profile.result()
    role_rows = roles.result().rename(columns={"mean": "value"}).assign(metric=lambda t: "role:" + t.role)
    frames = [heads, role_rows]
    syntax = None
    if relations is not None:
        best = relations.best(min_dependents=settings["min_dependents"])
        frames.append(best.rename(columns={"accuracy": "value"}).assign(metric=lambda t: "syntax:" + t.relation))
        syntax = relations.best_accuracy_replicates(settings["min_dependents"])
        syntax = syntax if np.isfinite(syntax[0]) else None  # no relation has enough dependents
    if follows_induction:  # the head-types family's table: each head's previous-token, duplicate-token and induction score
        frames.append(head_types.test().assign(metric=lambda t: "headtype:" + t.role))
        copying, _ = copying_scores(loaded)  # from the weights (Elhage et al. 2021); None: no unembedding, or an unknown architecture
        if copying is not None:
            for column in ("copying_score", "positive_eigenvalue_share"):  # Elhage et al.'s sum Re(lambda) / sum |lambda|, then the positive share
                frames.append(copying[["layer", "head"]].assign(metric=f"copying:{column}", value=copying[column], ci_low=np.nan, ci_high=np.nan))
    rows = pd.concat([frame.assign(step=step, checkpoint=checkpoint)[TRACK_COLUMNS] for frame in frames], ignore_index=True)
    layers = pd.concat([profile.layers()] + ([layer_sink_rates(heads, settings["sink_eps"])] if follows_sinks(kind) else []), ignore_index=True)
    layers = layers.assign(step=step, checkpoint=checkpoint)[TRACK_LAYER_COLUMNS]
    loss, loss_name, loss_replicates = (measured_loss(engine, examples, settings["seed"], progress, f"{Path(checkpoint).name} loss",
                                                      settings["bootstrap"]) if with_lm_head else (float("nan"), None, None))
    extra = {"loss_replicates": loss_replicates}
    if follows_induction:
        extra["induction"] = induction.replicate_means(loaded.num_layers, loaded.num_heads)
        extra["induction_excess"] = induction.replicate_excess(loaded.num_layers, loaded.num_heads)
        if with_lm_head:
            icl, count, early, late = in_context_scores(engine, examples, settings["seed"], settings["bootstrap"], progress,
                                                        f"{Path(checkpoint).name} in-context")
            extra.update(icl=icl, icl_sequences=count, icl_positions=(early, late))
        if probe is not None:
            extra["probe"] = probe_checkpoint(engine, loaded, probe, settings, with_lm_head, progress, Path(checkpoint).name)
    return CheckpointResult(step, checkpoint, rows, layers, peaks.replicate_means(), peaks.replicate_excess(), syntax, kind, loss, loss_name, **extra)


def _load_checkpoint(source: str, settings: dict, device: str | None) -> tuple[LoadedModel, bool]:
    """The checkpoint at ``source`` (``"default"`` or the bundled model's name: the bundled model) on ``device`` (else the
    settings'), with its language-model head where it has one; and whether it has."""
    options = {"device": device or settings["device"], "trust_remote_code": settings["trust_remote_code"], "dtype": settings["dtype"]}
    try:
        return load_model(source, head=LANGUAGE_MODEL, **options), True
    except ModelError:  # no language-model head (a bare encoder, a classifier): its attention is measured without one
        return load_model(source, **options), False
