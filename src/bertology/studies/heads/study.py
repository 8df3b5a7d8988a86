"""Which heads matter for a task: the study behind ``ablate``, ``importance`` and ``prune``.

The task is a classifier's (a fine-tuned model and its dev examples) or, for a decoder, next-token prediction on a text
corpus (:class:`~bertology.core.learning.tasks.LanguageModel`: the causal LM loss, its metrics ``lm_loss`` and ``perplexity``).

* :class:`~bertology.studies.heads.ablation.LeaveOneOut` (Kovaleva et al. 2019; Wang et al. 2022): each head, and each layer,
  ablated (zero, mean, resample or uniform);
* :class:`~bertology.studies.heads.importance.GradientImportance` (Michel et al. 2019): ``I_h = E_x |dL(x)/d xi_h|``;
* :func:`~bertology.studies.heads.pruning.pruning_curve` and :func:`~bertology.studies.heads.pruning.prune_and_time`
  (Michel et al. 2019): the iterative pruning curve, and one point of it removed physically and timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from statsmodels.stats.multitest import multipletests

from bertology.core.errors import BertologyError
from bertology.core.learning.tasks import (
    NEXT_TOKEN_LOSS,
    LanguageModel,
    TaskData,
    TaskModel,
    encode_examples,
    load_language_model,
    load_task_model,
    seeded_subset,
)
from bertology.core.model.interventions import Intervention
from bertology.core.options import check_seed
from bertology.core.storage.runfolder import claims_out
from bertology.core.text.corpora import Example, open_corpus
from bertology.studies import get_study
from bertology.studies.heads import DEFAULT_IMPORTANCE_SPLIT
from bertology.studies.heads.ablation import LeaveOneOut, ablation_table, loss_ablation_table
from bertology.studies.heads.importance import GradientImportance, check_normalisation, importance_table
from bertology.studies.heads.pruning import prune_and_time, pruning_curve, task_scorer
from bertology.studies.heads.replacements import ABLATIONS, MEAN_OVER


@dataclass
class HeadStudy:
    """What an ``ablate``, ``importance`` or ``prune`` run found. Tables are tidy; :meth:`save` writes the run folder.

    ``task`` names the task, or the corpus of a decoder's next-token task (then ``corpus`` describes it); ``loss`` names
    the loss the importance differentiates. ``examples`` dev examples (texts of the corpus) were evaluated; the importance
    was measured on ``importance_examples`` examples of ``settings["importance_split"]`` (of the corpus; None: not
    measured). ``settings`` holds only the options that applied.
    """

    model: dict
    task: str
    examples: int
    baseline: dict[str, float]
    settings: dict
    loss: str
    corpus: dict | None = None
    importance_examples: int | None = None
    ablation: pd.DataFrame | None = None
    importance: pd.DataFrame | None = None
    pruning: pd.DataFrame | None = None
    pruned: dict | None = None

    @property
    def unit(self) -> str:
        """What one evaluated example is: a dev example of the task, or a text of the corpus."""
        return "dev examples" if self.corpus is None else "texts"

    @claims_out
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write every table there is, figures, ``report.html`` and ``manifest.json``, replacing ``out`` whole; returns the report path."""
        from bertology.core.storage.runfolder import RunFolder, complete_run
        from bertology.render.html import Report
        from bertology.studies.heads.report import importance_section

        folder = RunFolder(out)
        for name in ("ablation", "importance", "pruning"):
            if getattr(self, name) is not None:
                folder.write_table(name, getattr(self, name))
        if self.pruned is not None:
            folder.write_json("pruned.json", self.pruned)
        summary = {"model": self.model["name"], "task" if self.corpus is None else "corpus": self.task, "loss": self.loss, self.unit: self.examples,
                   **{f"{metric} (no intervention)": f"{value:.4f}" for metric, value in self.baseline.items()}}
        section = importance_section(folder, self)
        report = Report(f"bertology: which heads matter for {self.task}", summary, [section]).render()
        return complete_run(folder, {"model": self.model, "task": self.task, "corpus": self.corpus, "loss": self.loss, "examples": self.examples,
                               "importance_examples": self.importance_examples, "baseline": self.baseline, "settings": self.settings},
                      report=report, command=command) / "report.html"


def _defaults(command: str, names: tuple[str, ...]) -> dict:
    """The defaults of ``names`` as the study's command ``command`` declares them (one declaration for the API and the CLI)."""
    return {option.name: option.default for option in get_study(command).options if option.name in names}


ABLATE_DEFAULTS = _defaults("ablate", ("intervention", "bootstrap", "correction", "min_sample"))
#: The options of mean and resample ablation, and their defaults (the command line leaves them None, so that an intervention
#: they do not apply to can refuse them).
REFERENCE_DEFAULTS = {"reference": None, "mean_over": "positions", "resamples": 5}
#: The command line leaves ``importance_split`` None, so that a corpus run can refuse it; a task's default is train.
IMPORTANCE_DEFAULTS = {**_defaults("importance", ("importance_split", "importance_examples", "normalise")), "importance_split": DEFAULT_IMPORTANCE_SPLIT}
PRUNE_DEFAULTS = _defaults("prune", ("step", "prune_to"))


def _applying(given: dict, defaults: dict, applies: bool, where: str) -> dict:
    """``defaults`` with the options ``given`` (not None) when they apply; given where they do not: refused."""
    given = {name: value for name, value in given.items() if value is not None}
    if given and not applies:
        raise BertologyError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only to {where}")
    return {**defaults, **given} if applies else {}


def _check_settings(settings: dict) -> None:
    """Refuse impossible values of the options that apply, before any computing."""
    if "intervention" in settings:
        if settings["intervention"] not in ABLATIONS:
            raise BertologyError(f"unknown intervention {settings['intervention']!r}; use {', '.join(ABLATIONS[:-1])} or {ABLATIONS[-1]}")
        try:
            multipletests([0.5], method=settings["correction"])
        except ValueError:
            raise BertologyError(f"unknown correction {settings['correction']!r} (statsmodels multipletests: fdr_bh, bonferroni, holm, ...)") from None
    if "normalise" in settings:
        if "importance_split" in settings and settings["importance_split"] not in ("train", "dev"):
            raise BertologyError(f"--importance-split must be train or dev, not {settings['importance_split']!r}")
        if settings["importance_examples"] < 1:
            raise BertologyError("--importance-examples must be at least 1")
        check_normalisation(settings["normalise"])
    if "step" in settings and not 0 < settings["step"] <= 1:
        raise BertologyError(f"--step must be in (0, 1], not {settings['step']}")


#: The interventions each option of mean and resample ablation applies to.
REFERENCE_APPLIES = {"reference": ("mean", "resample"), "mean_over": ("mean",), "resamples": ("resample",)}


def _ablate_settings(ablate: bool, given: dict) -> dict:
    """``ablate``'s settings: ``intervention``, ``bootstrap``, ``correction`` and ``min_sample`` (defaults where None), and the
    options of mean and resample ablation (``reference``, ``mean_over``, ``resamples``) that apply to the intervention;
    one given where it does not apply, or an impossible value, is refused in one line."""
    reference = {name: given.pop(name) for name in REFERENCE_APPLIES}
    settings = _applying(given, ABLATE_DEFAULTS, ablate, "ablate")
    _applying(reference, {}, ablate, "ablate")
    _check_settings(settings)
    for name, value in reference.items():
        if value is not None and settings["intervention"] not in REFERENCE_APPLIES[name]:
            raise BertologyError(f"--{name.replace('_', '-')} applies only to --intervention {' or '.join(REFERENCE_APPLIES[name])}")
    applying = {name: REFERENCE_DEFAULTS[name] if reference[name] is None else reference[name]
                for name in REFERENCE_APPLIES if settings.get("intervention") in REFERENCE_APPLIES[name]}
    if applying.get("mean_over", "positions") not in MEAN_OVER:
        raise BertologyError(f"unknown --mean-over {applying['mean_over']!r}; use {' or '.join(MEAN_OVER)}")
    if applying.get("resamples", 1) < 1:
        raise BertologyError(f"--resamples must be at least 1, not {applying['resamples']}")
    if applying.get("reference") is not None:
        applying["reference"] = str(applying["reference"])
    return {**settings, **applying}


def _open_reference(reference: str | None, format: str) -> list[Example] | None:
    """The examples of the ``reference`` file (None: none given), refused in one line where it is missing or holds no text."""
    if reference is None:
        return None
    examples, info = open_corpus(Path(reference), format)
    examples = list(examples)
    if not examples:
        raise BertologyError(f"{info['name']}: the --reference holds no text to take z_h from")
    return examples


def _reference_rows(task_model: TaskModel | LanguageModel, examples: list[Example] | None, name: str | None) -> list[dict] | None:
    """``examples`` encoded for ``task_model`` (unlabelled), refused where none is usable (a decoder's need two pieces)."""
    if examples is None:
        return None
    if isinstance(task_model, LanguageModel):
        rows = task_model.encode(examples)
        if not rows:
            raise BertologyError(f"{Path(name).name}: no text of the --reference has two pieces or more, so none is usable")
        return rows
    return encode_examples(task_model.tokenizer, examples, None, task_model.max_length)


def _check_request(task: TaskData | None, corpus, importance_split: str | None, prune_to: int | None) -> None:
    """Refuse a request that gives both a task and a corpus or neither, or asks a corpus for what only a task has."""
    if (task is None) == (corpus is None):
        raise BertologyError("give a task (for a fine-tuned classifier) or a corpus (for a causal language model), one of the two")
    if corpus is not None and importance_split is not None:
        raise BertologyError("--importance-split applies only to a task (a corpus has no splits)")
    if corpus is not None and prune_to is not None:
        raise BertologyError("--prune-to removes heads physically, which bertology knows for encoders (BERT, RoBERTa, ELECTRA, DistilBERT), "
                             "not decoders; leave it out to draw the pruning curve with the heads masked")


def _load_model(model: str | Path | TaskModel | LanguageModel, corpus, device: str | None, max_length: int | None,
                prune_to: int | None) -> TaskModel | LanguageModel:
    """``model`` as given (already loaded) or loaded from its path (a classifier for a task, a decoder for a corpus);
    refused where it does not fit the request, has had heads removed, or cannot be pruned to ``prune_to`` heads."""
    loaded = isinstance(model, (TaskModel, LanguageModel))
    loading = _applying({"device": device, "max_length": max_length}, {"device": "auto", "max_length": 128}, not loaded,
                        "a model given by its path (a loaded model keeps its own)")
    task_model = model if loaded else (load_task_model if corpus is None else load_language_model)(model, **loading)
    if isinstance(task_model, LanguageModel) != (corpus is not None):
        raise BertologyError("a corpus needs a LanguageModel (a decoder with its LM head), a task a TaskModel (a fine-tuned classifier)")
    if task_model.info()["pruned_heads"]:
        raise BertologyError(f"{task_model.name}: heads were removed from this model; disabling and pruning start from a model with all its heads")
    if prune_to is not None and not task_model.num_layers <= prune_to < task_model.num_layers * task_model.num_heads:
        raise BertologyError(f"--prune-to must be between {task_model.num_layers} (one head per layer) and {task_model.num_layers * task_model.num_heads - 1}")
    return task_model


@dataclass
class _Evaluation:
    """What a head study evaluates on: the encoded examples (a seeded subset of a task's dev split, or of a corpus's texts),
    their gold labels (a task's), the metrics of a head intervention, and the words for the task and its loss."""

    rows: list[dict]
    gold: np.ndarray | None
    score: Callable[[Intervention | None], dict]
    name: str
    loss: str
    corpus_info: dict | None = None
    texts: list[str] | None = None  # a corpus's texts, from which the importance subset is drawn too


def _evaluation(task_model: TaskModel | LanguageModel, task: TaskData | None, corpus, format: str, max_examples: int | None, seed: int,
                batch_size: int) -> _Evaluation:
    """The examples the metrics are measured on and the metric function: a task's dev subset and its task metric, or a
    corpus's texts and the causal LM metrics (refused where no text has a next token to predict)."""
    if corpus is None:
        rows, gold = task_model.encode(seeded_subset(task.dev, max_examples, seed), "dev")
        return _Evaluation(rows, gold, task_scorer(task_model, task, rows, gold, batch_size * 2), task.name, f"{task.name} cross-entropy of the gold label")
    texts, corpus_info = open_corpus(corpus, format)
    texts = list(texts)
    corpus_info["examples"] = len(texts)
    rows = task_model.encode(seeded_subset(texts, max_examples, seed))
    if not rows:
        raise BertologyError(f"{corpus_info['name']}: no text of two pieces or more, so no next token to predict")
    return _Evaluation(rows, None, partial(task_model.score, rows, batch_size * 2), corpus_info["name"], NEXT_TOKEN_LOSS, corpus_info, texts)


def _ablation(task_model: TaskModel | LanguageModel, task: TaskData | None, evaluation: _Evaluation, settings: dict,
              reference: list[Example] | None, batch_size: int, seed: int, progress: bool) -> pd.DataFrame:
    """The leave-one-out table: the task metric (or a decoder's ``lm_loss`` and ``perplexity``) with each head, and each
    layer, ablated as ``settings`` say, mean and resample ablation taking ``z_h`` from ``reference`` (None: the evaluated examples)."""
    loo = LeaveOneOut(task_model, settings["intervention"], reference=_reference_rows(task_model, reference, settings.get("reference")),
                      mean_over=settings.get("mean_over", "positions"), resamples=settings.get("resamples", 1), seed=seed, batch_size=batch_size,
                      progress=progress)
    base, variants = loo.predict(evaluation.rows)
    common = {"replicates": settings["bootstrap"], "seed": seed, "correction": settings["correction"], "min_sample": settings["min_sample"]}
    if task is None:
        pieces = np.array([len(row["input_ids"]) - 1 for row in evaluation.rows])
        return loss_ablation_table(base[:, 0], variants[..., 0], pieces, loo.variants(), settings["intervention"], **common)
    return ablation_table(task, evaluation.gold, base, variants, loo.variants(), settings["intervention"], **common)


def _importance(study: HeadStudy, task_model: TaskModel | LanguageModel, task: TaskData | None, evaluation: _Evaluation, settings: dict,
                batch_size: int, seed: int, progress: bool, folder) -> list[dict]:
    """Measure each head's gradient importance on a seeded subset of the importance split (or of the corpus's texts) into
    ``study`` (and ``folder``); returns the subset's encoded examples, which the pruning curve reuses."""
    if evaluation.texts is None:
        split = settings["importance_split"]
        importance_rows, _ = task_model.encode(seeded_subset(task.dev if split == "dev" else task.train, settings["importance_examples"], seed), split)
    else:
        importance_rows = task_model.encode(seeded_subset(evaluation.texts, settings["importance_examples"], seed))
    study.importance_examples = len(importance_rows)
    scores = GradientImportance(task_model, batch_size=batch_size, progress=progress).attribute(importance_rows)
    study.importance = importance_table(scores, settings["normalise"])
    if folder is not None:
        folder.write_table("importance", study.importance)
    return importance_rows


def _prune(study: HeadStudy, task_model: TaskModel | LanguageModel, task: TaskData | None, evaluation: _Evaluation, importance_rows: list[dict],
           settings: dict, prune_to: int | None, batch_size: int, progress: bool, folder, out: str | Path | None) -> None:
    """Draw the pruning curve into ``study`` (and ``folder``); with ``prune_to``, remove that point's heads physically, save
    the smaller model (in ``folder``, or ``pruned-N-heads`` here) and time it."""
    curve = pruning_curve(task_model, importance_rows, evaluation.score, step=settings["step"], keep_at=prune_to, normalise=settings["normalise"],
                          batch_size=batch_size, progress=progress)
    study.pruning = curve.table
    if folder is not None:
        folder.write_table("pruning", study.pruning)
    if prune_to is not None:
        target = folder.path / f"pruned-{prune_to}-heads" if folder is not None else Path(f"pruned-{prune_to}-heads")
        study.pruned = prune_and_time(task_model, task, curve.masks[task_model.num_layers * task_model.num_heads - prune_to], evaluation.rows,
                                      evaluation.gold, target, batch_size=batch_size * 2)
        if folder is not None:  # saved in the staging folder, which becomes out
            study.pruned["model"] = str(Path(out) / target.name)


@claims_out(words=("intervention", "mean_over", "correction", "importance_split", "normalise", "format", "device"))
def study_heads(model: str | Path | TaskModel | LanguageModel, task: TaskData | None = None, *, corpus=None, format: str = "auto",
                ablate: bool = False, importance: bool = False, prune: bool = False, intervention: str | None = None, reference: str | Path | None = None,
                mean_over: str | None = None, resamples: int | None = None, max_examples: int | None = None,
                importance_split: str | None = None, importance_examples: int | None = None, normalise: str | None = None, bootstrap: int | None = None,
                correction: str | None = None, min_sample: int | None = None, step: float | None = None, prune_to: int | None = None, batch_size: int = 16,
                max_length: int | None = None, seed: int = 0, device: str | None = None, out: str | Path | None = None, progress: bool = True,
                command: list[str] | None = None) -> HeadStudy:
    """Evaluate ``model`` on ``task``'s dev split with heads disabled (``ablate``), measure each head's gradient
    importance (``importance``) and draw the pruning curve (``prune``; ``prune_to`` also removes heads physically).

    Ablation options (``intervention`` zero, ``bootstrap`` 10000, ``correction`` fdr_bh, ``min_sample`` 10; for mean ablation
    ``reference`` and ``mean_over`` positions, for resample ablation ``reference`` and ``resamples`` 5), importance options
    (``importance_split`` train, ``importance_examples`` 1000, ``normalise`` layer) and pruning options (``step``
    0.1, ``prune_to``) take their defaults when left None; one given for a study that is not run is refused, and
    so are ``device`` and ``max_length`` (defaults auto, 128) with an already loaded ``TaskModel`` or ``LanguageModel``.

    Importance is measured on a seeded subset of ``importance_examples`` examples of ``importance_split``
    (all of the split if it has fewer; train by default, so that the pruning order is not chosen on the examples
    it is evaluated on). With ``out``, each table is written as soon as it is computed, then the report.

    Instead of a task, a ``corpus`` (a text file read as ``format`` says, or texts) and a decoder (a causal language model,
    loaded with its LM head): the loss is the causal LM loss, each text's mean next-token cross-entropy over its real pieces
    (docs/methods.md#decoders), and the metrics ``lm_loss`` (per predicted piece over all texts) and ``perplexity``.
    The importance is measured on a seeded subset of ``importance_examples`` texts and the curve evaluated on one of
    ``max_examples`` (all by default): the corpus has no splits, so the two overlap; ``ablate`` measures ``lm_loss`` and
    ``perplexity``. ``importance_split`` and ``prune_to`` (physical removal, which bertology knows for encoders only) do not apply.
    """
    from bertology.core.storage.runfolder import RunFolder

    check_seed(seed)
    _check_request(task, corpus, importance_split, prune_to)
    settings = {**_ablate_settings(ablate, {"intervention": intervention, "bootstrap": bootstrap, "correction": correction, "min_sample": min_sample,
                                            "reference": reference, "mean_over": mean_over, "resamples": resamples}),
                **_applying({"importance_split": importance_split, "importance_examples": importance_examples, "normalise": normalise},
                            IMPORTANCE_DEFAULTS, importance or prune, "importance or prune"),
                **_applying({"step": step, "prune_to": prune_to}, PRUNE_DEFAULTS, prune, "prune")}
    if corpus is not None:
        settings.pop("importance_split", None)
    _check_settings(settings)
    reference_examples = _open_reference(settings.get("reference"), format)
    task_model = _load_model(model, corpus, device, max_length, prune_to)
    torch.manual_seed(seed)
    evaluation = _evaluation(task_model, task, corpus, format, max_examples, seed, batch_size)
    baseline = evaluation.score(None)
    settings.update(max_examples=max_examples, batch_size=batch_size, max_length=task_model.max_length, seed=seed, device=str(task_model.device))
    study = HeadStudy(task_model.info(), evaluation.name, len(evaluation.rows), baseline, settings, evaluation.loss, evaluation.corpus_info)
    folder = RunFolder(out) if out is not None else None
    if ablate:
        study.ablation = _ablation(task_model, task, evaluation, settings, reference_examples, batch_size, seed, progress)
        if folder is not None:
            folder.write_table("ablation", study.ablation)
    if importance or prune:
        importance_rows = _importance(study, task_model, task, evaluation, settings, batch_size, seed, progress, folder)
        if prune:
            _prune(study, task_model, task, evaluation, importance_rows, settings, prune_to, batch_size, progress, folder, out)
    if out is not None:
        study.save(out, command)
    return study
