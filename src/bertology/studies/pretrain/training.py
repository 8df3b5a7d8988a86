"""A pre-training run under way: its state (:class:`PretrainingRun`: the model, what trains it, how far it has gone), the
training loop (:func:`train`), its checkpoints at log-spaced (or evenly spaced) steps, each evaluated on the fixed
validation batches, and its training state, saved to resume from and refused where damaged.

A run that diverges (a loss, a validation score or a weight that is not a finite number, as ``--learning-rate 1e30``
gives within two steps) stops at that step with one line (:class:`~bertology.core.learning.training.TrainingDiverged`) that
names the last good checkpoint; nothing non-finite is saved, so every checkpoint and training state kept is a good one.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast, get_linear_schedule_with_warmup

from bertology.core.errors import BertologyError, CorpusError, StateError
from bertology.core.learning.training import (
    TrainingDiverged,
    check_generator_state,
    load_training_state,
    random_states,
    resume_training,
    save_training_state,
)
from bertology.core.model.models import first_non_finite, quiet_transformers
from bertology.core.storage.safeload import finite_array, whole_number
from bertology.studies.pretrain.corpus import RunCorpus, collate
from bertology.studies.pretrain.objectives import Objective
from bertology.studies.pretrain.settings import PretrainSettings

#: What a pre-training state holds (:meth:`PretrainingRun.save_state`); a state without one of them is from an older bertology.
PRETRAIN_STATE_KEYS = ("model", "optimizer", "scheduler", "mask_rng", "random", "step", "epoch", "position", "losses", "evaluations", "settings")
CHECKPOINT_PREFIX = "step-"


def checkpoint_steps(steps: int, count: int, linear: bool = False) -> list[int]:
    """Step 0 and ``count - 1`` log-spaced steps from ``min(10, steps)`` to ``steps`` (fewer where they coincide); with
    ``linear``, ``count`` evenly spaced steps from 0 to ``steps``: dense through the middle of the run, where a phase
    change such as the induction heads' (Olsson et al. 2022) falls, not only at its start."""
    if count < 2:
        return [steps]
    if linear:
        return sorted({0, *np.round(np.linspace(0, steps, count)).astype(int).tolist(), steps})
    spaced = np.geomspace(min(10, steps), steps, count - 1) if steps > 0 else np.array([])
    return sorted({0, *np.round(spaced).astype(int).tolist(), steps})


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def run_identity(settings: PretrainSettings) -> dict:
    """What tells one pre-training run from another, written into each of its checkpoints' ``pretraining_step.json`` (``run``;
    ``bertology track`` refuses a series of checkpoints of two runs): a random ``id`` drawn when the run starts (a resume keeps
    it), its ``seed`` and its ``recipe``, a digest of its settings but the seed and the corpus files' names."""
    recipe = json.dumps({key: value for key, value in asdict(settings).items() if key not in ("seed", "corpus")}, sort_keys=True)
    return {"id": uuid.uuid4().hex, "seed": settings.seed, "recipe": hashlib.sha256(recipe.encode()).hexdigest()[:16]}


def check_pretraining_state(path: Path, state: dict, steps: int, objective: Objective) -> None:
    """Refuse a pre-training state (read by :func:`~bertology.core.learning.training.load_training_state`) whose own parts are
    damaged: a step past ``steps``, the masking generator's state, epoch and position whole numbers from 0, a row of
    finite (step, the ``objective``'s losses, learning rate) per step, and per checkpoint saved an evaluation
    (step, checkpoint name, its validation scores)."""
    step = whole_number(state["step"], "step", path, high=steps)
    check_generator_state(state["mask_rng"], "mask_rng", path)
    whole_number(state["epoch"], "epoch", path)
    whole_number(state["position"], "position", path)
    if len(state["losses"]) != step:
        raise StateError(path, f"'losses' has {len(state['losses'])} rows for {step} steps")
    if step:
        finite_array(state["losses"], "losses", path, shape=(step, 2 + len(objective.step_losses)))
    if not isinstance(state["evaluations"], list):
        raise StateError(path, "'evaluations' must be a list")
    width = 2 + len(objective.scores)
    for row in state["evaluations"]:
        if not (isinstance(row, (list, tuple)) and len(row) == width
                and row[1] == checkpoint_name(whole_number(row[0], "an evaluation's step", path, high=step))):
            raise StateError(path, f"'evaluations' must hold (step, checkpoint name, validation {', '.join(objective.score_names)}) rows")
        finite_array(row[2:], f"an evaluation's {' and '.join(objective.score_names)}", path, shape=(width - 2,))


def resume_or_start(training: Path, settings: PretrainSettings, objective: Objective) -> dict | None:
    """The training state saved in ``training`` by an unfinished run of these very settings, or None (and ``training``
    cleared) where none was saved; the state of a run with other settings is refused, and so is a damaged one."""
    state_folder = training / "state"
    state = load_training_state(state_folder / "state.pt", PRETRAIN_STATE_KEYS) if (state_folder / "state.pt").is_file() else None
    if state is None:
        shutil.rmtree(training, ignore_errors=True)  # a start that never saved a state: nothing to resume
    elif state.get("settings") != asdict(settings):
        raise BertologyError(f"{state_folder}: the training state of a run with other settings or another corpus is there; use another --out or delete it")
    else:
        check_pretraining_state(state_folder / "state.pt", state, settings.steps, objective)
    return state


def optimiser(network: torch.nn.Module, settings: PretrainSettings) -> tuple[torch.optim.Optimizer, object]:
    """AdamW (no decay on biases and layer-norm weights) and its linear warm-up and decay over the run's steps."""
    undecayed = [p.ndim < 2 for p in network.parameters()]  # biases and layer-norm weights (BERT's LayerNorm, GPT-2's ln_*)
    groups = [
        {"params": [p for p, flat in zip(network.parameters(), undecayed) if not flat], "weight_decay": settings.weight_decay},
        {"params": [p for p, flat in zip(network.parameters(), undecayed) if flat], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(0.9, 0.98), eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, max(1, int(settings.warmup * settings.steps)), settings.steps)
    return optimizer, scheduler


@dataclass
class PretrainingRun:
    """A pre-training run under way: the model and what trains it, where its work is kept (``training``), and how far
    it has gone (step, epoch and position in the epoch's instances, the losses so far and the checkpoints saved)."""

    settings: PretrainSettings
    goal: Objective
    training: Path
    network: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    optimizer: torch.optim.Optimizer
    scheduler: object
    collator: DataCollatorForLanguageModeling
    validation_batches: list[dict[str, torch.Tensor]]
    device: torch.device
    step: int = 0
    epoch: int = 0
    position: int = 0
    losses: list = field(default_factory=list)
    evaluations: list = field(default_factory=list)
    identity: dict = field(default_factory=dict)  # run_identity: drawn when the run starts, kept by a resume

    def resume(self, state: dict) -> None:
        """Go on from a saved training state: its weights, optimiser, schedule, random states, progress and the run's identity
        (a state saved before runs had one keeps the one drawn now)."""
        path = self.training / "state" / "state.pt"
        resume_training(path, state, self.network, self.optimizer, self.scheduler)  # and torch's random state: dropout
        identity = state.get("run", self.identity)
        if not (isinstance(identity, dict) and set(identity) == {"id", "seed", "recipe"} and isinstance(identity["id"], str)
                and isinstance(identity["recipe"], str) and identity["seed"] == self.settings.seed):
            raise StateError(path, f"'run' must be this run's identity (id, seed {self.settings.seed}, recipe), not {str(identity)[:80]}")
        self.identity = identity
        self.collator.generator.set_state(state["mask_rng"])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.losses, self.evaluations = state["losses"], state["evaluations"]

    def stop_if_diverged(self, at: int, values: dict[str, float], weights: bool = False) -> None:
        """Stop the run at step ``at`` where one of ``values`` (losses or validation scores) or, with ``weights``, a weight
        is not a finite number, before anything of that step is saved; what was saved before is kept."""
        what = next((f"its {name} is {value}" for name, value in values.items() if not math.isfinite(value)), None)
        if what is None and weights and first_non_finite(self.network) is not None:
            what = "its weights are no longer finite numbers"
        if what is not None:
            kept = (f"the last good checkpoint is {(self.training / 'checkpoints' / self.evaluations[-1][1]).resolve()}" if self.evaluations
                    else "no checkpoint was saved")
            raise TrainingDiverged(f"pre-training diverged at step {at}: {what} (--learning-rate {self.settings.learning_rate:g}); stopped, {kept}; "
                                   "lower --learning-rate and give another --out")

    def save_state(self) -> None:
        self.stop_if_diverged(self.step, {}, weights=True)
        save_training_state(self.training / "state", {
            "model": self.network.state_dict(), "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "mask_rng": self.collator.generator.get_state(), "random": random_states(), "step": self.step, "epoch": self.epoch,
            "position": self.position, "losses": self.losses, "evaluations": self.evaluations, "settings": asdict(self.settings),
            "run": self.identity,
        }, self.tokenizer)

    def save_checkpoint(self) -> None:
        scores = self.goal.evaluate(self.network, self.validation_batches)
        self.stop_if_diverged(self.step, {f"validation {score}": value for score, value in scores.items()}, weights=True)
        name = checkpoint_name(self.step)
        target = self.training / "checkpoints" / name
        with quiet_transformers():
            self.network.save_pretrained(target)
            self.tokenizer.save_pretrained(target)
        marker = {"step": self.step, **scores, "run": self.identity}
        (target / "pretraining_step.json").write_text(json.dumps(marker, indent=2, allow_nan=False) + "\n")
        self.evaluations.append((self.step, name, *scores.values()))

    def take_step(self, batch: dict[str, torch.Tensor]) -> None:
        """One optimiser step on ``batch``, its losses recorded; a loss that is not finite stops the run before the step."""
        parts = self.goal.training_losses(self.network, batch)
        values = [part.item() for part in parts]
        self.stop_if_diverged(self.step + 1, dict(zip(self.goal.step_losses, values)))
        sum(parts).backward()
        torch.nn.utils.clip_grad_norm_(self.network.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.step += 1
        self.losses.append((self.step, *values, self.scheduler.get_last_lr()[0]))

    def recent_loss(self) -> float:
        """The mean of the last 50 steps' LM losses (the first of :attr:`Objective.step_losses`)."""
        return float(np.mean([row[1] for row in self.losses[-50:]]))


def train(run: PretrainingRun, corpus: RunCorpus, rows: list[dict], stop_at: int, save_every: int, progress: bool) -> list[dict]:
    """Train up to step ``stop_at``, saving the checkpoints at their steps (step 0 first) and the training state every
    ``save_every`` steps and at the end; returns the instances of the epoch it stopped in. A batch with no piece to score
    is passed over; an epoch and more of them is refused."""
    goal, batch_size, steps = run.goal, run.settings.batch_size, run.settings.steps
    saved_steps = set(checkpoint_steps(steps, run.settings.checkpoints, run.settings.linear_checkpoints))
    done = {row[0] for row in run.evaluations}
    run.network.train()
    if run.step == 0 and 0 not in done:
        run.save_checkpoint()
    if run.epoch:  # resumed in a later epoch
        rows = corpus.epoch_rows(run.epoch)
    unscored = 0  # batches in a row with no piece to score
    with tqdm(total=steps, initial=run.step, unit="step", desc="pre-training", disable=not progress) as bar:
        while run.step < stop_at:
            if run.position >= len(rows):
                run.epoch, run.position = run.epoch + 1, 0
                rows = corpus.epoch_rows(run.epoch)
            batch = collate(run.collator, rows[run.position : run.position + batch_size], run.device)
            run.position += batch_size
            if not len(goal.scored_labels(batch)):  # no piece masked, or runs of one piece (a tiny corpus): no LM loss, so no step
                unscored += 1
                if unscored > len(rows):  # a whole epoch and more
                    raise CorpusError(corpus.files[0], None, "too little text to train on: no training batch has a piece masked or a next piece")
                continue
            unscored = 0
            run.take_step(batch)
            bar.update(1)
            bar.set_postfix({goal.step_losses[0].removesuffix("_loss"): f"{run.recent_loss():.3f}"})
            if run.step in saved_steps:
                run.save_checkpoint()
            if run.step in saved_steps or run.step % save_every == 0 or run.step == stop_at:
                run.save_state()
    return rows
