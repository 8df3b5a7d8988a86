"""The loss that goes with ``track``'s verdict: each checkpoint's validation loss as it was recorded when it was saved
(:func:`checkpoint_loss`), and its loss measured on the track corpus where it loads with a language-model head
(:func:`measured_loss`), in words for the report (:func:`loss_series`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from bertology.core.engine import Engine, RunStats
from bertology.core.errors import StateError
from bertology.core.learning.tasks import DEFAULT_MASK_SHARE, NEXT_TOKEN_LOSS, masked_positions, next_token_losses
from bertology.core.model.kinds import DECODER
from bertology.core.statistics.stats import bootstrap_weights
from bertology.core.storage.safeload import read_json
from bertology.studies.track.verdicts import json_value

#: The validation losses a checkpoint's own marker file records: ``bertology pretrain``'s (masked LM, causal LM) and a Trainer's.
LOSS_KEYS = (("pretraining_step.json", "mlm_loss", "masked-LM validation loss"), ("pretraining_step.json", "lm_loss", "causal LM validation loss"))


def checkpoint_loss(name: str) -> dict | None:
    """The validation loss recorded with a checkpoint when it was saved, where it has a language-model head: ``pretraining_step.json``'s
    ``mlm_loss`` or ``lm_loss`` (``bertology pretrain``: its own validation split) or ``trainer_state.json``'s last ``eval_loss``
    (Hugging Face Trainer); None when it records none. ``{"loss": value, "name": what it is, "source": the file}``. It is not
    measured on the track corpus."""
    folder = Path(name)
    for marker, key, words in LOSS_KEYS:
        path = folder / marker
        if path.is_file():
            document = _readable_json(path)
            value = document.get(key) if isinstance(document, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
                return {"loss": float(value), "name": words, "source": str(path)}
    path = folder / "trainer_state.json"
    if path.is_file():
        document = _readable_json(path)
        history = document.get("log_history") if isinstance(document, dict) else None
        losses = [entry["eval_loss"] for entry in history if isinstance(entry, dict) and isinstance(entry.get("eval_loss"), (int, float))] \
            if isinstance(history, list) else []
        if losses:
            return {"loss": float(losses[-1]), "name": "Trainer eval_loss", "source": str(path)}
    return None


def _readable_json(path: Path):
    """A marker file's JSON document for :func:`checkpoint_loss`; None where it cannot be read (a damaged loss record is no loss)."""
    try:
        return read_json(path)
    except StateError:
        return None


def loss_series(steps: list[int | None], checkpoints: list[str], measured: list[tuple[float, str | None]] | None = None) -> dict:
    """Each checkpoint's recorded validation loss (:func:`checkpoint_loss`; null where none) and its loss measured on the track
    corpus (``measured``: one ``(loss, what it is)`` per checkpoint from :func:`measured_loss`, ``(NaN, None)`` where it has no
    language-model head; None: none measured), with the sentences the report shows."""
    found = [checkpoint_loss(c) for c in checkpoints]
    measured = measured if measured is not None else [(float("nan"), None)] * len(checkpoints)
    labels = ["step unknown" if s is None else f"step {s}" for s in steps]
    where = ", ".join(f"{label}: " + ("none recorded" if f is None else f"{f['loss']:.3f}") for label, f in zip(labels, found))
    names = sorted({f["name"] for f in found if f is not None})
    statement = (f"Validation loss recorded with each checkpoint ({', '.join(names)}; on its own validation split, not the track corpus): {where}."
                 if names else "No checkpoint records a validation loss (no pretraining_step.json loss or Trainer eval_loss).")
    measured_names = sorted({name for _, name in measured if name is not None})
    if measured_names:
        where = ", ".join(f"{label}: " + ("none (no language-model head)" if name is None else f"{loss:.3f}")
                          for label, (loss, name) in zip(labels, measured))
        statement += f" Loss measured here on the track corpus ({', '.join(measured_names)}): {where}."
    else:
        statement += " No checkpoint loads with a language-model head: no loss is measured on the track corpus (measured_loss NaN)."
    return {"steps": steps, "values": [None if f is None else f["loss"] for f in found], "names": [None if f is None else f["name"] for f in found],
            "measured": [json_value(loss) for loss, _ in measured], "measured_names": [name for _, name in measured], "statement": statement}


def measured_loss(engine: Engine, examples: list, seed: int, progress: bool = False, desc: str = "loss",
                  bootstrap: int = 0) -> tuple[float, str | None, np.ndarray]:
    """The mean loss of ``engine``'s model, loaded with its language-model head (``load_model(head="language-model")``), over
    the sequences of the track pass (:meth:`~bertology.core.engine.Engine.encode`: the same truncation and the same sequences
    left out), in the engine's batches, on its device; the sums are accumulated in float64. Returns ``(loss, what it is,
    replicates [1 + bootstrap])``, the last the same mean under each sequence's Poisson bootstrap weights (row 0 the loss;
    :func:`~bertology.core.statistics.stats.bootstrap_weights`, paired with every other score of the track pass).

    A decoder's: the next-token cross-entropy ``-log softmax(logits[i])[x_{i+1}]`` averaged over every predicted piece of the
    corpus (:func:`~bertology.core.learning.tasks.next_token_losses`). An encoder's: the masked-LM cross-entropy averaged over
    every masked piece, with :data:`~bertology.core.learning.tasks.DEFAULT_MASK_SHARE` (15%) of each sequence's
    non-special pieces replaced by the mask token, drawn by :func:`~bertology.core.learning.tasks.masked_positions`
    from a generator keyed by ``seed`` and the sequence, so every checkpoint sees the same masks; ``(NaN, None)`` where the
    tokenizer has no mask token."""
    model = engine.model
    causal = model.kind is DECODER
    mask_id = model.tokenizer.mask_token_id
    if not causal and mask_id is None:
        return float("nan"), None, np.full(1 + bootstrap, np.nan)
    totals, counts = np.zeros(1 + bootstrap), np.zeros(1 + bootstrap)
    with torch.inference_mode(), tqdm(total=len(examples), unit="seq", desc=desc, disable=not progress) as bar:
        for items in engine.batches(engine.encode(enumerate(examples), RunStats())):
            tensors = engine.collate(items)
            input_ids = tensors["input_ids"]
            if causal:
                logits = model.model(**engine.model_inputs(tensors)).logits
                summed, counted = next_token_losses(logits, input_ids, tensors["mask"])
            else:
                targets, masked = torch.full_like(input_ids, -100), input_ids.clone()  # -100: cross_entropy's ignore_index
                for b, item in enumerate(items):
                    chosen = torch.as_tensor(masked_positions(item, DEFAULT_MASK_SHARE, seed), dtype=torch.long, device=input_ids.device)
                    targets[b, chosen], masked[b, chosen] = input_ids[b, chosen], mask_id
                logits = model.model(**engine.model_inputs(tensors, masked)).logits
                summed = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
                counted = targets != -100
            weights = np.stack([bootstrap_weights(seed, bootstrap, item.example) for item in items])  # [batch, 1 + B]
            totals += weights.T @ summed.double().reshape(len(items), -1).sum(dim=1).cpu().numpy()
            counts += weights.T @ counted.reshape(len(items), -1).sum(dim=1).double().cpu().numpy()
            bar.update(len(items))
    if not counts[0]:
        return float("nan"), None, np.full(1 + bootstrap, np.nan)
    count = int(counts[0])
    what = (f"{NEXT_TOKEN_LOSS}, mean over {count} predicted pieces" if causal else
            f"masked-LM loss, mean over {count} masked pieces ({DEFAULT_MASK_SHARE:.0%} of each sequence's, seed {seed})")
    with np.errstate(invalid="ignore", divide="ignore"):
        replicates = totals / counts
    return float(replicates[0]), what, replicates

