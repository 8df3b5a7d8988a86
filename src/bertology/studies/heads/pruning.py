"""Michel et al. (2019)'s pruning: the iterative pruning curve by normalised gradient importance.

The heads of one point of the curve are removed physically, and the smaller model is saved and timed against the full
one.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from bertology.core.learning.tasks import LanguageModel, TaskData, TaskModel, task_score
from bertology.core.model.interventions import Intervention, prune_heads
from bertology.studies.heads.importance import GradientImportance, normalise_importance


@dataclass
class PruningCurve:
    """The metric after each pruning step, and the head mask (1 kept, 0 pruned) of every step. ``table``: ``heads_pruned,
    share_pruned, metric, value, removed`` (the heads that step removed, ``layer-head`` ids, 0-based, space-separated)."""

    table: pd.DataFrame
    masks: dict[int, np.ndarray] = field(repr=False)


def pruning_curve(task_model: TaskModel | LanguageModel, importance_rows: list[dict], score: Callable[[Intervention | None], dict[str, float]], *,
                  step: float = 0.1, keep_at: int | None = None, normalise: str = "layer", batch_size: int = 32, progress: bool = True) -> PruningCurve:
    """Michel et al.'s iterative pruning curve: the task's metrics as the least important heads are masked, step by
    step.

    Each step masks the ``step`` share (of all heads) least important by normalised importance
    (:func:`normalise_importance`; per layer by default, so a layer with large raw importances still loses heads),
    recomputes the importance on ``importance_rows`` and evaluates (``score(masking)``: the metrics with those heads
    masked, e.g. :func:`task_scorer`), until each layer has one head. ``keep_at`` makes one step stop exactly at that
    many heads left.
    """
    layers, heads = task_model.num_layers, task_model.num_heads
    total = layers * heads
    per_step = max(1, math.ceil(step * total))
    mask = np.ones((layers, heads))
    scorer = GradientImportance(task_model, batch_size=batch_size, progress=False)
    rows, masks = [], {}

    def record(pruned: int) -> None:
        values = score(_masking(mask))
        before = masks[max(masks)] if masks else np.ones_like(mask)
        removed = " ".join(f"{layer}-{head}" for layer, head in zip(*np.nonzero((before == 1) & (mask == 0))))
        rows.extend({"heads_pruned": pruned, "share_pruned": pruned / total, "metric": metric, "value": value, "removed": removed}
                    for metric, value in values.items())
        masks[pruned] = mask.copy()

    record(0)
    with tqdm(total=total - layers, unit="head", desc="pruning", disable=not progress) as bar:
        while (mask.sum(1) > 1).any():
            importance = normalise_importance(scorer.attribute(importance_rows, mask), normalise)
            left = int(mask.sum())
            count = per_step if keep_at is None or left <= keep_at else min(per_step, left - keep_at)
            for layer, head in sorted(zip(*np.nonzero(mask)), key=lambda lh: importance[lh]):
                if count == 0:
                    break
                if mask[layer].sum() > 1:
                    mask[layer, head] = 0
                    count -= 1
            bar.update(left - int(mask.sum()))
            record(total - int(mask.sum()))
    return PruningCurve(pd.DataFrame(rows), masks)


def task_scorer(task_model: TaskModel, task: TaskData, rows: list[dict], gold: np.ndarray, batch_size: int) -> Callable[[Intervention | None], dict]:
    """The task's metrics on ``rows`` under an intervention (None: the intact model), for :func:`pruning_curve`."""
    return lambda intervention: task_score(task, gold, task_model.logits(rows, batch_size, intervention))


def _masking(mask: np.ndarray) -> Intervention | None:
    pruned = frozenset((int(layer), int(head)) for layer, head in zip(*np.nonzero(mask == 0)))
    return Intervention(masked=pruned) if pruned else None


def _seconds(task_model: TaskModel, rows: list[dict], batch_size: int) -> float:
    started = time.perf_counter()
    task_model.logits(rows, batch_size)
    return time.perf_counter() - started


def prune_and_time(task_model: TaskModel, task: TaskData, mask: np.ndarray, rows: list[dict], gold: np.ndarray, out: Path, *,
                   batch_size: int = 64, repeats: int = 3) -> dict:
    """Remove the heads that ``mask`` prunes, save the smaller model to ``out``, and compare it with the full
    model on ``rows``: metric of each, and the best of ``repeats`` timed passes of each, interleaved."""
    small = TaskModel(copy.deepcopy(task_model.model), task_model.tokenizer, str(out), task_model.labels, task_model.device,
                      task_model.num_layers, task_model.num_heads, task_model.max_length)
    prune_heads(small.model, {layer: list(np.nonzero(mask[layer] == 0)[0]) for layer in range(mask.shape[0])})
    full_logits, small_logits = task_model.logits(rows, batch_size), small.logits(rows, batch_size)
    times = {"full": [], "pruned": []}
    for _ in range(repeats):
        times["full"].append(_seconds(task_model, rows, batch_size))
        times["pruned"].append(_seconds(small, rows, batch_size))
    out.mkdir(parents=True, exist_ok=True)
    small.model.save_pretrained(out)
    task_model.tokenizer.save_pretrained(out)
    parameters = [sum(p.numel() for p in m.parameters()) for m in (task_model.model, small.model)]
    return {
        "heads_kept": int(mask.sum()), "heads_pruned": int(mask.size - mask.sum()), "model": str(out),
        "metric_full": task_score(task, gold, full_logits), "metric_pruned": task_score(task, gold, small_logits),
        "max_logit_difference_vs_masked": float(np.abs(small_logits - task_model.logits(rows, batch_size, _masking(mask))).max()),
        "parameters_full": parameters[0], "parameters_pruned": parameters[1],
        "seconds_full": min(times["full"]), "seconds_pruned": min(times["pruned"]),
        "speedup": min(times["full"]) / min(times["pruned"]), "examples": len(rows), "repeats": repeats,
        "pruned_heads": {str(k): v for k, v in small.model.config.bertology_pruned_heads.items()},
    }
