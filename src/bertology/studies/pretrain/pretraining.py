"""Pre-training a small BERT, or a small GPT-2-style decoder, from scratch: the checkpoint series that training-dynamics
analyses track.

The encoder's recipe is BERT's (Devlin et al. 2019), the decoder's (``objective="causal-lm"``, ``bertology pretrain
--causal``) GPT-2's (Radford et al. 2019), both scaled down and on the same sentences and the same validation text, so that
``track`` can follow the attention sink's emergence (Gu et al. 2025, docs/methods.md#decoders); each objective's vocabulary,
instances, model and losses are its class's in :mod:`~bertology.studies.pretrain.objectives`. The corpus is plain text, one
document per file (:mod:`~bertology.studies.pretrain.corpus`); the model is trained with AdamW, a linear warm-up and decay
(:mod:`~bertology.studies.pretrain.training`).

Checkpoints are saved at log-spaced steps (step 0, the random initialisation, included), each a
model folder (config, weights, tokenizer) that every bertology command accepts as ``--model``.

Yardstick for "the model has learnt something": the unigram cross-entropy
``-mean_t ln p(t)`` over the validation pieces ``t`` the loss scores (masked LM: the masked ones; causal LM: every
piece but a run's first), where ``p`` is the add-one smoothed piece frequency of the training text; the model's loss
is measured on the same pieces (validation = the last ``validation_share`` of every document's sentences).

A corpus too small to hold any sentence out (a document holds one out from 26 sentences at the default 2%; a
one-sentence corpus never does) is validated on fixed training instances, and the run says so: a warning line, the
field ``corpus.validated_on_training_text`` of the manifest and ``pretraining.json``, and the report's words. It is not
refused: a toy or smoke-test corpus is what such a run is for, and its scores still show whether the model fits its text;
but they are no measure of generalisation, and nothing may pass them off as one.

A run that diverges stops at that step with one line that names the last good checkpoint (the training module's
docstring says how).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch
from transformers.utils import logging as hf_logging

from bertology.core.errors import BertologyError, CorpusError
from bertology.core.learning.training import check_learning_rate
from bertology.core.model.models import resolve_device
from bertology.core.storage.digests import file_digest
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run, link_tree
from bertology.studies.pretrain.corpus import RunCorpus, Validation, corpus_files, read_corpus, validation_set
from bertology.studies.pretrain.objectives import Objective, check_attention_only_shape, objective_named
from bertology.studies.pretrain.settings import PretrainSettings
from bertology.studies.pretrain.symbols import SyntheticCorpus, synthetic_corpus, synthetic_settings
from bertology.studies.pretrain.training import PretrainingRun, optimiser, resume_or_start, run_identity, train


def _start(training: Path, settings: PretrainSettings, goal: Objective, files: list[Path],
           torch_device: torch.device) -> tuple[PretrainingRun, RunCorpus | SyntheticCorpus, list[dict], Validation]:
    """The run, resumed from the training state kept in ``training`` where there is one, its corpus (or synthetic task), the
    first epoch's instances and the validation set; refused where the corpus makes no training instance."""
    hf_logging.disable_progress_bar()
    torch.manual_seed(settings.seed)
    state = resume_or_start(training, settings, goal)
    text = (synthetic_corpus(settings, goal) if settings.synthetic is not None
            else read_corpus(files, settings, goal, training / "state" if state is not None else None))
    rows = text.epoch_rows(0)
    if not rows:
        raise CorpusError(files[0], None, "too little text to make one training instance")
    validation = validation_set(text, settings, torch_device)
    network = goal.build_model(text.tokenizer, settings).to(torch_device)
    optimizer, scheduler = optimiser(network, settings)
    collator = goal.collator(text.tokenizer, settings, seed=settings.seed)
    collator.create_rng()  # the causal LM draws nothing from it; its state is saved all the same
    run = PretrainingRun(settings, goal, training, network, text.tokenizer, optimizer, scheduler, collator, validation.batches, torch_device,
                         identity=run_identity(settings))
    if state is not None:
        run.resume(state)
    return run, text, rows, validation


def _summary(run: PretrainingRun, corpus: RunCorpus | SyntheticCorpus, validation: Validation, rows: list[dict], out: str | Path, resumed_from: int,
             seconds: float) -> dict:
    """``pretraining.json``: the objective, corpus, model, settings, final validation scores against the unigram yardstick,
    and the run's facts."""
    goal, settings, network = run.goal, run.settings, run.network
    final = dict(zip(goal.scores, run.evaluations[-1][2:]))
    return {
        "objective": settings.objective,
        "loss": goal.loss,
        "corpus": {**corpus.facts(), "validation_instances": len(validation.rows), "validated_on_training_text": validation.on_training_text},
        "model": {"architecture": goal.architecture_of(settings), "parameters": sum(p.numel() for p in network.base_model.parameters()),
                  "vocab_size": len(run.tokenizer)},
        "settings": goal.recorded_settings(asdict(settings)),
        "device": str(run.device),
        "steps": settings.steps,
        "epochs": round(run.epoch + run.position / max(len(rows), 1), 2),
        "resumed_from_step": resumed_from or None,
        "seconds": round(seconds, 1),
        "final_checkpoint": str((Path(out) / "checkpoints" / run.evaluations[-1][1]).resolve()),
        **{f"val_{score}": value for score, value in final.items()},
        "unigram_cross_entropy": validation.unigram,
        f"train_{goal.step_losses[0]}_last_50": run.recent_loss(),
    }


def _write_run(out: str | Path, run: PretrainingRun, summary: dict, command: list[str] | None) -> dict:
    """Replace ``out`` whole with the finished run: its checkpoints, ``loss.csv``, ``checkpoints.csv``, ``pretraining.json``
    (``summary``, returned), the report and the manifest."""
    from bertology.studies.pretrain.report import pretraining_report  # matplotlib: imported when a run is saved, not with the API

    goal = run.goal
    folder = RunFolder(out)  # replaces out whole, training/ with it
    link_tree(run.training / "checkpoints", folder.path / "checkpoints")
    loss_table = pd.DataFrame(run.losses, columns=["step", *goal.step_losses, "learning_rate"])
    checkpoint_table = pd.DataFrame(run.evaluations, columns=["step", "checkpoint", *(f"val_{score}" for score in goal.scores)])
    folder.write_table("loss", loss_table)
    folder.write_table("checkpoints", checkpoint_table)
    folder.write_json("pretraining.json", summary)
    manifest = {key: summary[key] for key in ("objective", "loss", "corpus", "model", "settings", "device", "steps", "resumed_from_step")}
    complete_run(folder, manifest, report=pretraining_report(folder, summary, loss_table, checkpoint_table), command=command)
    return summary


def _corpus_files(corpus: list[str | Path] | str | Path | None, synthetic: str | None) -> list[Path]:
    """The corpus's text files (:func:`~bertology.studies.pretrain.corpus.corpus_files`), none for a synthetic task; refused in
    one line where both or neither are given."""
    paths = [] if corpus is None else [corpus] if isinstance(corpus, (str, Path)) else list(corpus)
    if synthetic is not None:
        if paths:
            raise BertologyError(f"--synthetic {synthetic} makes the corpus: give no corpus with it")
        return []
    if not paths:
        raise BertologyError("give a corpus (text files or folders of .txt files), or --synthetic repeats")
    return corpus_files(paths)


def _checked_recipe(goal: Objective, hidden: int, heads: int, learning_rate: float, attention_only: bool, synthetic: str | None,
                    vocab_size: int | None, max_length: int, task: dict) -> dict:
    """The run's vocabulary size and synthetic task (:func:`~bertology.studies.pretrain.symbols.synthetic_settings`: ``task``
    holds its ``repeat_share``, ``min_period`` and ``max_period``), refused in one line, before any work, where the model's
    shape, the learning rate or ``attention_only`` (a decoder's: :func:`~bertology.studies.pretrain.objectives.attention_only_decoder`)
    does not fit; a keyword that is none of the task's is refused as Python refuses it."""
    unknown = sorted(set(task) - {"repeat_share", "min_period", "max_period"})
    if unknown:
        raise TypeError(f"pretrain() got an unexpected keyword argument {unknown[0]!r}")
    if hidden % heads:
        raise BertologyError(f"--hidden {hidden} is not divisible by --heads {heads}")
    if attention_only and goal.masks:
        raise BertologyError("--attention-only builds a decoder without MLP blocks (Olsson et al. 2022): give --causal with it")
    if attention_only:
        check_attention_only_shape(hidden, heads)
    check_learning_rate(learning_rate)
    return synthetic_settings(synthetic, goal, vocab_size, task.get("repeat_share"), task.get("min_period"), task.get("max_period"), max_length)


@claims_out(work="training", words=("device", "objective", "synthetic"))
def pretrain(
    corpus: list[str | Path] | str | Path | None,
    out: str | Path,
    *,
    objective: str = "masked-lm",
    vocab_size: int | None = None,
    layers: int = 4,
    heads: int = 8,
    hidden: int = 256,
    intermediate: int | None = None,
    max_length: int = 128,
    batch_size: int = 32,
    steps: int = 1500,
    learning_rate: float = 1e-3,
    warmup: float = 0.06,
    weight_decay: float = 0.01,
    mask_probability: float = 0.15,
    checkpoints: int = 12,
    linear_checkpoints: bool = False,
    synthetic: str | None = None,
    attention_only: bool = False,
    validation_share: float = 0.02,
    seed: int = 0,
    device: str = "auto",
    save_every: int = 200,
    max_steps: int | None = None,
    progress: bool = True,
    command: list[str] | None = None,
    **task,
) -> dict:
    """Pre-train a model of the given size from scratch on ``corpus`` (text files or folders of ``*.txt``): a BERT with the
    masked-LM and next-sentence losses (``objective="masked-lm"``), or a GPT-2-style decoder with the causal LM loss
    (``"causal-lm"``; ``mask_probability`` plays no part). :mod:`~bertology.studies.pretrain.objectives` says what each records.
    ``synthetic="repeats"`` with ``task`` (``repeat_share``, ``min_period``, ``max_period``) and ``attention_only``: :func:`_checked_recipe`.

    Writes to ``out``: ``checkpoints/step-NNNNNN/`` (model folders, each with a ``pretraining_step.json``: its step, validation
    scores and the run's identity, :func:`~bertology.studies.pretrain.training.run_identity`), ``checkpoints.csv`` (step,
    validation scores), ``loss.csv`` (training losses per step), ``loss_curve.png``, ``report.html`` and ``pretraining.json`` (the
    objective and its loss, settings, corpus, unigram baseline, final losses, wall time). While training, the checkpoints so far and
    the training state (saved every ``save_every`` steps, read back with ``weights_only=True``) are kept in ``out/training/``: the
    same call resumes an interrupted run, and an earlier run in ``out`` stays whole until the new one replaces it at the end.
    ``max_steps`` stops early (tests use it to interrupt).

    A batch with no piece to score (none masked, or runs of one piece: only a tiny corpus has them) is passed over, not a step: its
    LM loss would be NaN. A run that diverges stops in one line with the checkpoints so far kept, and a corpus too small to hold
    text out is validated on training text and says so (the module's docstring says why)."""
    goal = objective_named(objective)  # the one place the objective's name is read: every difference is the objective's to make
    task = _checked_recipe(goal, hidden, heads, learning_rate, attention_only, synthetic, vocab_size, max_length, task)
    started, files = time.perf_counter(), _corpus_files(corpus, synthetic)
    settings = PretrainSettings([str(f) for f in files], layers=layers, heads=heads, hidden=hidden, intermediate=0 if attention_only else
                                intermediate or 4 * hidden, max_length=max_length, batch_size=batch_size, steps=steps, learning_rate=learning_rate,
                                warmup=warmup, weight_decay=weight_decay, mask_probability=mask_probability, checkpoints=checkpoints,
                                validation_share=validation_share, seed=seed, corpus_sha256=[file_digest(Path(f), {}) for f in files] or None,
                                objective=goal.name, linear_checkpoints=linear_checkpoints, attention_only=attention_only, **task)
    run, text, rows, validation = _start(Path(out) / "training", settings, goal, files, resolve_device(device))  # the unfinished run's work
    resumed_from = run.step
    rows = train(run, text, rows, steps if max_steps is None else min(steps, max_steps), save_every, progress)
    if run.step < steps:
        return {"interrupted_at_step": run.step, "steps": steps}
    return _write_run(out, run, _summary(run, text, validation, rows, out, resumed_from, time.perf_counter() - started), command)
