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
    default_model_path,
    first_non_finite,
    load_tokenizer,
    loading_errors,
    require_finite_weights,
    require_safetensors,
    require_tokenizer_fits,
    require_whole_weights,
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
    source = str(default_model_path()) if model is None else str(model)
    from bertology.core.storage.digests import folder_weights_digest, tokenizer_digest

    settings = FinetuneSettings(source, task.name, max_length, batch_size, epochs, learning_rate, warmup, weight_decay, max_train_examples, seed,
                                data=task_digest(task), weights=folder_weights_digest(Path(source)) if Path(source).is_dir() else source)
    torch_device = resolve_device(device)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    label_ids = {label: i for i, label in enumerate(task.labels)}
    if Path(source).is_dir():
        require_safetensors(source)
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code)
    settings = replace(settings, tokenizer=tokenizer_digest(tokenizer))
    with loading_errors(source):
        network, loading = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=len(task.labels), id2label=dict(enumerate(task.labels)), label2id=label_ids,
            trust_remote_code=trust_remote_code, ignore_mismatched_sizes=True, use_safetensors=True, output_loading_info=True,
        )
    require_whole_weights(network, loading, source, unused=UNUSED_WITHOUT_TASK_HEAD, new_head=True)  # the head (and BERT's pooler) are trained here
    require_finite_weights(network, source)
    require_tokenizer_fits(tokenizer, network, source)
    network.to(torch_device)

    train = seeded_subset(task.train, max_train_examples, seed)
    train_rows = encode_examples(tokenizer, train, label_ids, max_length)
    dev_rows = encode_examples(tokenizer, task.dev, label_ids, max_length)
    steps_per_epoch = math.ceil(len(train_rows) / batch_size)
    total_steps = max(1, math.ceil(steps_per_epoch * epochs))

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {"params": [p for n, p in network.named_parameters() if not n.endswith(no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in network.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(warmup * total_steps), total_steps)

    checkpoint = out / "checkpoint"
    step, losses = 0, []
    if (checkpoint / "state.pt").is_file():
        # Loaded on the CPU: RNG states must stay CPU tensors; load_state_dict moves the rest to the model's device.
        state = load_training_state(checkpoint / "state.pt")
        if state.get("settings") != asdict(settings):
            raise BertologyError(f"{checkpoint}: a checkpoint of a run with other settings, data or starting weights is there; "
                                 "use another --out or delete it")
        if state["step"] > total_steps:
            raise StateError(checkpoint / "state.pt", f"step {state['step']} is past the run's {total_steps} steps; delete {checkpoint} to start over")
        finite_array(state["losses"], "losses", checkpoint / "state.pt", shape=(state["step"],))  # one per step
        resume_training(checkpoint / "state.pt", state, network, optimizer, scheduler)
        step, losses = state["step"], state["losses"]
    resumed_from = step

    def diverged(at: int, what: str) -> TrainingDiverged:
        kept = f"its last checkpoint is kept in {checkpoint}" if (checkpoint / "state.pt").is_file() else "no checkpoint was saved yet"
        return TrainingDiverged(f"fine-tuning diverged at step {at}: {what} (--learning-rate {learning_rate:g}); stopped, {kept}; lower --learning-rate")

    started = time.perf_counter()
    network.train()
    stop_at = total_steps if max_steps is None else min(total_steps, max_steps)
    with tqdm(total=total_steps, initial=step, unit="step", desc="fine-tuning", disable=not progress) as bar:
        while step < stop_at:
            epoch, position = divmod(step, steps_per_epoch)
            order = np.random.default_rng((seed, epoch)).permutation(len(train_rows))
            chunk = order[position * batch_size : (position + 1) * batch_size]
            loss = network(**collate_rows(tokenizer, [train_rows[i] for i in chunk], torch_device)).loss
            if not math.isfinite(loss.item()):  # stopped before the step and before any save: the last checkpoint stays good
                raise diverged(step + 1, f"its loss is {loss.item()}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
            if step % checkpoint_every == 0 or step == stop_at:
                if first_non_finite(network) is not None:  # never saved: a checkpoint holds finite weights only
                    raise diverged(step, "a weight is no longer finite")
                save_training_state(checkpoint, {
                    "model": network.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "losses": losses, "settings": asdict(settings), "random": random_states(),
                })
    seconds = time.perf_counter() - started
    if step < total_steps:
        return {"interrupted_at_step": step, "total_steps": total_steps}

    predicted = predict_logits(network, tokenizer, dev_rows, batch_size * 2, torch_device).argmax(-1)
    gold = [e.label for e in task.dev]
    majority = max(task.labels, key=[e.label for e in train].count)
    metrics = {
        "task": task.name,
        "model": source,
        "metric": task_metrics(task, gold, [task.labels[i] for i in predicted]),
        "majority_baseline": task_metrics(task, gold, [majority] * len(gold)),
        "majority_label": majority,
        "train_examples": len(train_rows),
        "dev_examples": len(dev_rows),
        "steps": total_steps,
        "resumed_from_step": resumed_from or None,
        "seconds": round(seconds, 1),
        "loss_curve": [round(float(np.mean(losses[i : i + 50])), 4) for i in range(0, len(losses), 50)],
        "settings": asdict(settings),
    }
    folder = RunFolder(out)  # the model replaces out whole; the checkpoint goes with the previous contents
    network.save_pretrained(folder.path)
    tokenizer.save_pretrained(folder.path)
    folder.write_json("metrics.json", metrics)
    complete_run(folder, {"task": task.name, "settings": metrics["settings"]}, command=command)
    return metrics
