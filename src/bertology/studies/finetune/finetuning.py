"""Fine-tuning an encoder on a GLUE-style classification task, with resumable checkpoints.

Tasks: SST-2 and CoLA (single sentences), MRPC and RTE (pairs), read from a folder with
``train.tsv`` and ``dev.tsv`` in GLUE's format, or any TSV pair with named text and label columns.
Training is a standard loop: AdamW with linear warm-up and decay (``transformers``'
``get_linear_schedule_with_warmup``), length-padded batches in a seeded order. Every
``checkpoint_every`` steps the model, optimiser, scheduler and random states are saved in
``out/checkpoint/``, so an interrupted run started again with the same command resumes where it
stopped; the state holds only tensors and plain values and is read with ``weights_only=True``, so a
planted pickle is refused, never run. The result is a model folder (safetensors, tokenizer, config,
``metrics.json``) that every bertology command accepts as ``--model``; it replaces ``out`` whole at
the end (:class:`~bertology.core.storage.runfolder.RunFolder`), the checkpoint with it.

Metrics on dev, as GLUE reports them: accuracy (SST-2, RTE), F1 and accuracy (MRPC), Matthews
correlation (CoLA), each against the majority-class baseline (the most frequent training label).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup

from bertology.core.errors import BertologyError, StateError
from bertology.core.learning.tasks import TaskData, collate_rows, encode_examples, predict_logits, seeded_subset, task_metrics
from bertology.core.learning.training import (
    TrainingDiverged,
    check_learning_rate,
    load_training_state,
    random_states,
    resume_training,
    save_training_state,
)
from bertology.core.model.models import (
    UNUSED_WITHOUT_TASK_HEAD,
    first_non_finite,
    load_tokenizer,
    loading_errors,
    model_source,
    require_safetensors,
    require_usable,
    resolve_device,
)
from bertology.core.options import check_seed
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run
from bertology.core.storage.safeload import finite_array


@dataclass
class FinetuneSettings:
    """What a fine-tuning run does (saved with its checkpoints: a resume must match)."""

    model: str
    task: str
    max_length: int = 128
    batch_size: int = 32
    epochs: float = 1.0
    learning_rate: float = 5e-5
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_train_examples: int | None = None
    seed: int = 0
    data: str = ""  # sha256 of the task's examples (texts and labels, both splits): a resume never mixes two data sets
    weights: str = ""  # sha256 of the starting model's weight files (a local folder; a hub name stands for itself)
    tokenizer: str = ""  # sha256 of the starting model's tokenizer (core.digests.tokenizer_digest): a resume reads the same pieces


def task_digest(task: TaskData) -> str:
    """sha256 of every example of ``task`` (both splits: text, pair and label, in order)."""
    import hashlib

    combined = hashlib.sha256()
    for split, examples in (("train", task.train), ("dev", task.dev)):
        for example in examples:
            combined.update(json.dumps([split, example.text, example.text_pair, example.label]).encode("utf-8") + b"\n")
    return combined.hexdigest()


@dataclass
class _Training:
    """What the steps of a fine-tuning run pass between them: the model, its tokenizer and device, the encoded examples,
    the step counts, the optimiser and its schedule, and the folder of the resumable checkpoint."""

    settings: FinetuneSettings
    network: torch.nn.Module
    tokenizer: object
    device: torch.device
    train: list  # the training examples (the seeded subset)
    train_rows: list[dict]
    dev_rows: list[dict]
    steps_per_epoch: int
    total_steps: int
    optimizer: torch.optim.Optimizer
    scheduler: object
    checkpoint: Path


def _load_classifier(source: str, task: TaskData, label_ids: dict, settings: FinetuneSettings, trust_remote_code: bool,
                     torch_device: torch.device) -> tuple[torch.nn.Module, object, FinetuneSettings]:
    """The starting model with a new classification head for ``task``'s labels, on ``torch_device``, its tokenizer, and
    ``settings`` with the tokenizer's digest; refused if its weights are not whole and finite or its tokenizer does not fit."""
    from bertology.core.storage.digests import tokenizer_digest

    if Path(source).is_dir():
        require_safetensors(source)
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code)
    settings = replace(settings, tokenizer=tokenizer_digest(tokenizer))
    with loading_errors(source):
        network, loading = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=len(task.labels), id2label=dict(enumerate(task.labels)), label2id=label_ids,
            trust_remote_code=trust_remote_code, ignore_mismatched_sizes=True, use_safetensors=True, output_loading_info=True,
        )
    require_usable(network, loading, tokenizer, source, unused=UNUSED_WITHOUT_TASK_HEAD, new_head=True)  # the head (and BERT's pooler) are trained here
    network.to(torch_device)
    return network, tokenizer, settings


def _prepare_training(task: TaskData, out: Path, network: torch.nn.Module, tokenizer, settings: FinetuneSettings, label_ids: dict,
                      torch_device: torch.device) -> _Training:
    """The encoded training (seeded subset) and dev examples, the step counts, and AdamW (no decay on biases and layer-norm
    weights) with linear warm-up and decay."""
    train = seeded_subset(task.train, settings.max_train_examples, settings.seed)
    train_rows = encode_examples(tokenizer, train, label_ids, settings.max_length)
    dev_rows = encode_examples(tokenizer, task.dev, label_ids, settings.max_length)
    steps_per_epoch = math.ceil(len(train_rows) / settings.batch_size)
    total_steps = max(1, math.ceil(steps_per_epoch * settings.epochs))

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {"params": [p for n, p in network.named_parameters() if not n.endswith(no_decay)], "weight_decay": settings.weight_decay},
        {"params": [p for n, p in network.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(settings.warmup * total_steps), total_steps)
    return _Training(settings, network, tokenizer, torch_device, train, train_rows, dev_rows, steps_per_epoch, total_steps, optimizer, scheduler,
                     out / "checkpoint")


def _resume(run: _Training) -> tuple[int, list[float]]:
    """The step and training losses to go on from: those of the checkpoint in ``out`` (its model, optimiser, scheduler and
    random states restored) where there is one of this very run, else step 0; a checkpoint of another run is refused."""
    checkpoint = run.checkpoint
    if not (checkpoint / "state.pt").is_file():
        return 0, []
    # Loaded on the CPU: RNG states must stay CPU tensors; load_state_dict moves the rest to the model's device.
    state = load_training_state(checkpoint / "state.pt")
    if state.get("settings") != asdict(run.settings):
        raise BertologyError(f"{checkpoint}: a checkpoint of a run with other settings, data or starting weights is there; "
                             "use another --out or delete it")
    if state["step"] > run.total_steps:
        raise StateError(checkpoint / "state.pt", f"step {state['step']} is past the run's {run.total_steps} steps; delete {checkpoint} to start over")
    finite_array(state["losses"], "losses", checkpoint / "state.pt", shape=(state["step"],))  # one per step
    resume_training(checkpoint / "state.pt", state, run.network, run.optimizer, run.scheduler)
    return state["step"], state["losses"]


def _diverged(run: _Training, at: int, what: str) -> TrainingDiverged:
    """The error that stops a run diverged at step ``at``, saying which checkpoint is kept."""
    checkpoint = run.checkpoint
    kept = f"its last checkpoint is kept in {checkpoint}" if (checkpoint / "state.pt").is_file() else "no checkpoint was saved yet"
    return TrainingDiverged(f"fine-tuning diverged at step {at}: {what} (--learning-rate {run.settings.learning_rate:g}); stopped, {kept}; "
                            "lower --learning-rate")


def _train(run: _Training, step: int, losses: list[float], stop_at: int, checkpoint_every: int, progress: bool) -> int:
    """Train from ``step`` to ``stop_at`` (appending to ``losses``), saving the checkpoint every ``checkpoint_every`` steps
    and at ``stop_at``; returns the step reached. A loss or weight that is not finite stops the run, nothing of it saved."""
    network, settings, batch_size = run.network, run.settings, run.settings.batch_size
    network.train()
    with tqdm(total=run.total_steps, initial=step, unit="step", desc="fine-tuning", disable=not progress) as bar:
        while step < stop_at:
            epoch, position = divmod(step, run.steps_per_epoch)
            order = np.random.default_rng((settings.seed, epoch)).permutation(len(run.train_rows))
            chunk = order[position * batch_size : (position + 1) * batch_size]
            loss = network(**collate_rows(run.tokenizer, [run.train_rows[i] for i in chunk], run.device)).loss
            if not math.isfinite(loss.item()):  # stopped before the step and before any save: the last checkpoint stays good
                raise _diverged(run, step + 1, f"its loss is {loss.item()}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
            if step % checkpoint_every == 0 or step == stop_at:
                if first_non_finite(network) is not None:  # never saved: a checkpoint holds finite weights only
                    raise _diverged(run, step, "a weight is no longer finite")
                save_training_state(run.checkpoint, {
                    "model": network.state_dict(), "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(), "step": step,
                    "losses": losses, "settings": asdict(settings), "random": random_states(),
                })
    return step


def _metrics(run: _Training, task: TaskData, source: str, losses: list[float], resumed_from: int, seconds: float) -> dict:
    """``metrics.json``: the dev metrics of the trained model against the majority-class baseline, and the run's facts."""
    predicted = predict_logits(run.network, run.tokenizer, run.dev_rows, run.settings.batch_size * 2, run.device).argmax(-1)
    gold = [e.label for e in task.dev]
    majority = max(task.labels, key=[e.label for e in run.train].count)
    return {
        "task": task.name,
        "model": source,
        "metric": task_metrics(task, gold, [task.labels[i] for i in predicted]),
        "majority_baseline": task_metrics(task, gold, [majority] * len(gold)),
        "majority_label": majority,
        "train_examples": len(run.train_rows),
        "dev_examples": len(run.dev_rows),
        "steps": run.total_steps,
        "resumed_from_step": resumed_from or None,
        "seconds": round(seconds, 1),
        "loss_curve": [round(float(np.mean(losses[i : i + 50])), 4) for i in range(0, len(losses), 50)],
        "settings": asdict(run.settings),
    }


@claims_out(work="checkpoint", words=("device",))
def finetune(
    task: TaskData,
    out: str | Path,
    *,
    model: str | Path | None = None,
    max_length: int = 128,
    batch_size: int = 32,
    epochs: float = 1.0,
    learning_rate: float = 5e-5,
    warmup: float = 0.1,
    weight_decay: float = 0.01,
    max_train_examples: int | None = None,
    seed: int = 0,
    device: str = "auto",
    checkpoint_every: int = 200,
    max_steps: int | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    command: list[str] | None = None,
) -> dict:
    """Fine-tune ``model`` (default: all-MiniLM-L6-v2) on ``task``; write the model folder ``out`` and return its metrics.

    ``out`` is checked and claimed before anything else. ``max_steps`` stops training early (the run
    can be resumed later: tests use it to interrupt).
    """
    check_seed(seed)
    check_learning_rate(learning_rate)
    out = Path(out)
    source = model_source(model)
    from bertology.core.storage.digests import folder_weights_digest

    settings = FinetuneSettings(source, task.name, max_length, batch_size, epochs, learning_rate, warmup, weight_decay, max_train_examples, seed,
                                data=task_digest(task), weights=folder_weights_digest(Path(source)) if Path(source).is_dir() else source)
    torch_device = resolve_device(device)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    label_ids = {label: i for i, label in enumerate(task.labels)}
    network, tokenizer, settings = _load_classifier(source, task, label_ids, settings, trust_remote_code, torch_device)
    run = _prepare_training(task, out, network, tokenizer, settings, label_ids, torch_device)
    step, losses = _resume(run)
    resumed_from = step

    started = time.perf_counter()
    stop_at = run.total_steps if max_steps is None else min(run.total_steps, max_steps)
    step = _train(run, step, losses, stop_at, checkpoint_every, progress)
    seconds = time.perf_counter() - started
    if step < run.total_steps:
        return {"interrupted_at_step": step, "total_steps": run.total_steps}

    metrics = _metrics(run, task, source, losses, resumed_from, seconds)
    folder = RunFolder(out)  # the model replaces out whole; the checkpoint goes with the previous contents
    network.save_pretrained(folder.path)
    tokenizer.save_pretrained(folder.path)
    folder.write_json("metrics.json", metrics)
    complete_run(folder, {"task": task.name, "settings": metrics["settings"]}, command=command)
    return metrics
