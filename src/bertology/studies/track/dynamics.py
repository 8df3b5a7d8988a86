"""Training dynamics: head behaviour tracked over checkpoints, and a verdict on the learning-curve hypothesis.

The hypothesis (docs/methods.md#track-and-the-learning-curve-verdict): heads pass through phases, over depth and over
pre-training. Broad and [CLS] attention come early, [SEP] and dependency relations in the middle,
punctuation deep. :func:`track` runs the general profile (Clark et al. 2019), the role tests
(Pande et al. 2021) and, with trees, the syntactic heads over a series of checkpoints on one
corpus, and :func:`hypothesis_verdict` tests two claims:

1. **Depth** (final checkpoint): with ``m_l`` the mean over sequences of layer l's attention to a
   token set (a sequence's layer value is the mean of its heads), the layer ``argmax_l m_l`` of
   [CLS] is below that of [SEP], which is below that of punctuation. Uncertainty: the Poisson
   bootstrap over sequences (:class:`~bertology.studies.track.peaks.LayerPeaks`); the statistic is the
   share of replicates in which the whole order holds.
2. **Training** (two or more checkpoints): each pattern's strength at step s is
   ``max_l m_l(s)``. Its half-rise step is where it first covers half of its rise,
   ``first + (final - first) / 2`` (a random network already attends uniformly, so "half its final
   value" is measured above that starting point), interpolated linearly in ``ln(1 + step)``
   between checkpoints. A pattern **emerges** only when the 95% interval of its first-to-last change (paired
   replicates) excludes 0, it rises and ends beyond the uniform head on the same sequences
   (:mod:`~bertology.studies.track.verdicts`) and its half-rise step is located more narrowly than the run (:func:`emergence_verdict`);
   else there is "no evidence" that it does, and the order is not judged (verdict ``no evidence``). The order
   [CLS] before [SEP] before punctuation is tested on paired replicates (the same sequence weights at every
   checkpoint). With trees, the mean over relations of the best head's accuracy (Clark et al.'s syntactic heads) is
   tracked the same way.

On a decoder (docs/methods.md#decoders; e.g. ``bertology pretrain --causal``) [SEP] has no meaning and the first token,
the candidate attention sink, takes [CLS]'s place (:func:`~bertology.studies.track.peaks.peak_metrics`): the
claims become "first-token attention peaks below punctuation" and "it emerges before punctuation", and ``Sink_eps``
(Gu et al. 2025, "When Attention Sink Emerges in Language Models"), the share of heads whose mean attention to the first
token exceeds eps and the uniform head's on the same sequences (:func:`layer_sink_rates`), is followed per layer and overall
over the checkpoints.

Two patterns **tie** when they peak in the same layer (emerge at the same step) or their 95% intervals overlap. A claim
is **contradicted** when a pair is reversed in the data, with intervals apart, in at least 95% of the replicates; else a
**tie** when a pair ties; else **supported** when the order holds in the data and in at least 95% of the replicates;
else **inconclusive** (:func:`_order_verdict`). Each checkpoint's recorded validation loss (:func:`checkpoint_loss`)
goes with the verdict, beside its loss measured on the track corpus where it has a language-model head (:func:`measured_loss`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer

from bertology.core.backends import BACKENDS, map_on_ray
from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError, ModelError, StateError
from bertology.core.learning.tasks import DEFAULT_MASK_SHARE, NEXT_TOKEN_LOSS, masked_positions, next_token_losses
from bertology.core.model.kinds import DECODER, ENCODER, Kind, kind_named, kind_of
from bertology.core.model.models import DEFAULT_MODEL, LANGUAGE_MODEL, default_model_path, load_model, loading_errors
from bertology.core.options import check_seed
from bertology.core.storage.runfolder import RunFolder, atomic_write, claims_out, complete_run, finished_run
from bertology.core.storage.safeload import field as document_field
from bertology.core.storage.safeload import parse_json, read_json, read_npz, whole_number
from bertology.core.text.corpora import open_corpus
from bertology.core.text.parsing import spacy_trees
from bertology.core.text.synthetic import require_synthetic_fits, synthetic_corpus, synthetic_probe_length
from bertology.families.headtypes.analyzer import HeadTypes
from bertology.families.headtypes.copying import copying_scores
from bertology.families.profile.analyzer import EXCESS_TOLERANCE, GeneralProfile
from bertology.families.roles.analyzer import HeadRoles, excess_over_uniform
from bertology.families.sinks.analyzer import SINK_EPS, sink_rates
from bertology.families.syntax.analyzer import RelationHeads
from bertology.studies.track.induction import InductionReplicates, in_context_scores, induction_verdict
from bertology.studies.track.peaks import LayerPeaks, peak_layers, peak_metrics
from bertology.studies.track.runs import check_one_run
from bertology.studies.track.verdicts import described, excess_claim, interval, near_peak_span, not_beyond_words, rise_beyond_uniform

LEVEL = 0.95
METRIC_NAMES = {"cls": "[CLS]", "sep": "[SEP]", "first": "the first token", "punct": "punctuation",
                "syntax": "dependency relations (best head per relation)"}
#: The two claims (depth, training) by the kind of model: on an encoder's token sets and on a decoder's (:func:`peak_metrics`).
CLAIMS = {
    "encoder": ("In the final model the layer where [CLS] attention peaks is below the layer where [SEP] peaks, "
                   "which is below the layer where punctuation peaks.",
                   "Over training, [CLS] attention emerges before [SEP] attention, which emerges before attention to punctuation."),
    "decoder": ("In the final decoder the layer where attention to the first token (the candidate attention sink) peaks is "
                           "below the layer where attention to punctuation peaks.",
                           "Over training, attention to the first token (the attention sink) emerges before attention to punctuation."),
}
TRACK_COLUMNS = ["step", "checkpoint", "layer", "head", "metric", "value", "ci_low", "ci_high"]
TRACK_LAYER_COLUMNS = ["step", "checkpoint", "layer", "metric", "value", "ci_low", "ci_high"]
#: The largest training step bertology takes from a checkpoint (steps are kept as 64-bit integers).
MAX_STEP = 2**63 - 1


def checkpoint_step(name: str) -> int | None:
    """The training step of a checkpoint: its ``pretraining_step.json`` (written by ``bertology pretrain``),
    its ``trainer_state.json`` (Hugging Face Trainer: ``global_step``), else its name.

    Names end in ``checkpoint-N`` (Trainer), ``step-N``, ``step_N``, ``stepN`` (Pythia's revisions) or
    ``step_Nk`` (MultiBERTs; k = thousands).

    >>> checkpoint_step("google/multiberts-seed_0-step_20k"), checkpoint_step("runs/pt/checkpoints/step-001500")
    (20000, 1500)
    >>> checkpoint_step("runs/finetune/checkpoint-500"), checkpoint_step("pythia-70m/revision=step1000")
    (500, 1000)
    """
    for marker, key in (("pretraining_step.json", "step"), ("trainer_state.json", "global_step")):
        path = Path(name) / marker
        if path.is_file():
            return whole_number(document_field(read_json(path), key, int, path), key, path, high=MAX_STEP)
    match = re.search(r"(?:step|checkpoint)[-_]?(\d+)(k?)$", str(name).rstrip("/").split("/")[-1], flags=re.IGNORECASE)
    if match is None:
        return None
    return int(match.group(1)) * (1000 if match.group(2) else 1)


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
            "measured": [_json_value(loss) for loss, _ in measured], "measured_names": [name for _, name in measured], "statement": statement}


def measured_loss(engine: Engine, examples: list, seed: int, progress: bool = False, desc: str = "loss") -> tuple[float, str | None]:
    """The mean loss of ``engine``'s model, loaded with its language-model head (``load_model(head="language-model")``), over
    the sequences of the track pass (:meth:`~bertology.core.engine.Engine.encode`: the same truncation and the same sequences
    left out), in the engine's batches, on its device; the sums are accumulated in float64. Returns ``(loss, what it is)``.

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
        return float("nan"), None
    total, count = 0.0, 0
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
            total += float(summed.double().sum())
            count += int(counted.sum())
            bar.update(len(items))
    if not count:
        return float("nan"), None
    what = (f"{NEXT_TOKEN_LOSS}, mean over {count} predicted pieces" if causal else
            f"masked-LM loss, mean over {count} masked pieces ({DEFAULT_MASK_SHARE:.0%} of each sequence's, seed {seed})")
    return total / count, what


def parse_steps(text: str) -> list[int]:
    """``--steps 0,500,1000`` -> ``[0, 500, 1000]``."""
    steps = []
    for item in text.split(","):
        if not re.fullmatch(r"[0-9]{1,19}", item.strip()) or int(item) > MAX_STEP:  # MAX_STEP has 19 digits
            raise BertologyError(f"--steps: {item.strip()!r} is not a whole number of steps (give e.g. --steps 0,500,1000)")
        steps.append(int(item))
    return steps


def find_checkpoints(directory: str | Path) -> list[str]:
    """Model folders (with ``config.json``) directly in ``directory`` or in its ``checkpoints/`` folder."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BertologyError(f"{directory}: no such folder of checkpoints")
    for folder in (directory / "checkpoints", directory):
        found = sorted(str(path.parent) for path in folder.glob("*/config.json"))
        if found:
            return found
    raise BertologyError(f"{directory}: no model folders (sub-folders with config.json) in it or in its checkpoints/ folder")


def ordered_checkpoints(checkpoints: list[str], steps: list[int] | None = None) -> list[tuple[int | None, str]]:
    """``(step, checkpoint)`` pairs in training order.

    ``steps``: one per checkpoint, in the same order; else every checkpoint must tell its step
    (:func:`checkpoint_step`) unless there is only one (step None).
    """
    if not checkpoints:
        raise BertologyError("no checkpoints given: pass model folders or hub names, or --checkpoints DIR")
    if steps is not None and len(steps) != len(checkpoints):
        raise BertologyError(f"--steps: {len(steps)} given for {len(checkpoints)} checkpoints; give one step per checkpoint, in the same order")
    if steps is None:
        steps = [checkpoint_step(c) for c in checkpoints]
    if len(checkpoints) == 1:
        return [(steps[0], checkpoints[0])]
    unknown = [c for c, s in zip(checkpoints, steps) if s is None]
    if unknown:
        raise BertologyError(f"{unknown[0]}: cannot tell its training step (name it like checkpoint-500, step-1500 or step_20k, or give --steps)")
    if len(set(steps)) < len(steps):
        raise BertologyError("two checkpoints have the same training step")
    return sorted(zip(steps, checkpoints))


#: A text whose pieces tell apart two tokenizers of one vocabulary that add special tokens, normalise or split otherwise.
PROBE_TEXT = "The cat sat on the mat."


def series_facts(checkpoint: str, trust_remote_code: bool = False) -> dict:
    """What the checkpoints of one series share, read from the checkpoint's config and tokenizer (no weights): its kind
    (encoder or decoder), model type, layers, heads, its tokenizer's vocabulary and the pieces it makes of :data:`PROBE_TEXT`
    (special tokens included). Not the task head (``architectures``): a series may run from a pre-trained model to its
    fine-tuned classifier."""
    source = str(default_model_path()) if checkpoint in ("default", DEFAULT_MODEL) else checkpoint
    with loading_errors(source):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    return {"kind": kind_of(config).name, "model type": config.model_type,
            "layers": getattr(config, "num_hidden_layers", None), "heads": getattr(config, "num_attention_heads", None),
            "vocabulary": tokenizer.get_vocab(), "pieces": tokenizer.convert_ids_to_tokens(tokenizer(PROBE_TEXT)["input_ids"])}


#: How a checkpoint differs from the first in each fact of :func:`series_facts` but its tokenizer's.
_SERIES_WORDS = {"kind": "it is {}, not {}", "model type": "its model type is {}, not {}", "layers": "it has {} layers, not {}",
                 "heads": "it has {} heads per layer, not {}"}


def _series_difference(fact: str, value, first_value) -> str:
    """How a checkpoint's ``fact`` (:func:`series_facts`) differs from the first checkpoint's, in words."""
    if fact == "vocabulary":
        piece = next(piece for piece in sorted(value.keys() | first_value.keys()) if value.get(piece) != first_value.get(piece))
        return (f"its tokenizer has another vocabulary ({len(value)} pieces, not {len(first_value)}; {piece!r} is "
                f"{'absent' if piece not in value else value[piece]}, not {'absent' if piece not in first_value else first_value[piece]})")
    if fact == "pieces":
        return f"its tokenizer cuts {PROBE_TEXT!r} into {' '.join(value)}, not {' '.join(first_value)}"
    if fact == "kind":  # a decoder, an encoder
        value, first_value = (f"{'an' if name[0] in 'aeiou' else 'a'} {name}" for name in (value, first_value))
    return _SERIES_WORDS[fact].format(value, first_value)


def check_one_series(checkpoints: list[str], trust_remote_code: bool = False) -> None:
    """Refuse checkpoints that are not one series, before any of them runs: the first (in the order given) whose
    :func:`series_facts` differ from the first checkpoint's is named in one line, with its first difference."""
    first, *others = checkpoints
    expected = series_facts(first, trust_remote_code)
    for checkpoint in others:
        facts = series_facts(checkpoint, trust_remote_code)
        fact = next((fact for fact in expected if facts[fact] != expected[fact]), None)
        if fact is not None:
            raise BertologyError(f"{checkpoint}: not of one series with {first}: {_series_difference(fact, facts[fact], expected[fact])}")


def _json_value(value):
    """Plain Python values for verdict.json: NaN (a pattern that never rises) becomes null."""
    if isinstance(value, (float, np.floating)):
        return None if np.isnan(value) else float(value)
    return value.item() if isinstance(value, np.generic) else value


def _order_verdict(data: np.ndarray, replicates: np.ndarray, intervals: list[tuple[float, float]]) -> tuple[str, list[dict]]:
    """The verdict on an order ``data[0] < data[1] < ...`` (peak layers or half-rise steps) with ``replicates [B, k]`` and each
    value's 95% interval ``intervals[k]``; and, per adjacent pair, what it rests on.

    A pair is a **tie** when its two values are equal in the data or their intervals overlap (the order cannot be told).
    The verdict is **contradicted** when some pair is reversed in the data, with intervals apart, and reversed in at least 95%
    of the replicates; else **tie** when some pair ties; else **supported** when the whole order holds in the data and in at
    least 95% of the replicates; else **inconclusive**.
    """
    pairs = []
    for i in range(len(data) - 1):
        (low_a, high_a), (low_b, high_b) = intervals[i], intervals[i + 1]
        overlap = bool(high_a >= low_b and high_b >= low_a)
        state = "tie" if data[i] == data[i + 1] or overlap else ("<" if data[i] < data[i + 1] else ">")
        reversed_share = float((replicates[:, i] > replicates[:, i + 1]).mean()) if len(replicates) else float("nan")
        pairs.append({"state": state, "reversed_share": reversed_share})
    holds = bool(_in_order(data))
    probability = float(_in_order(replicates).mean()) if len(replicates) else float("nan")
    if any(p["state"] == ">" and p["reversed_share"] >= LEVEL for p in pairs):
        return "contradicted", pairs
    if any(p["state"] == "tie" for p in pairs):
        return "tie", pairs
    if holds and probability >= LEVEL:
        return "supported", pairs
    return "inconclusive", pairs


def _in_order(values: np.ndarray) -> np.ndarray:
    """``values [..., k]`` -> True where ``values[..., 0] < values[..., 1] < ...`` (NaN never in order)."""
    return np.all(np.diff(values, axis=-1) > 0, axis=-1)


def _order(metrics: tuple[str, ...]) -> str:
    """``[CLS] < [SEP] < punctuation`` (a decoder's ``first token < punctuation``): the order a claim tests."""
    return " < ".join(METRIC_NAMES[metric].removeprefix("the ") for metric in metrics)


def depth_verdict(means: np.ndarray, kind: Kind, step: int | None = None, checkpoint: str | None = None, *, excess: np.ndarray) -> dict:
    """Claim 1 on a ``kind`` of model from ``means [1 + B, layer, metric]`` (the metrics :func:`peak_metrics` of ``kind``;
    row 0 is the data) and ``excess`` (the same shape: the layer means' excess over the uniform head on the same sequences,
    :meth:`~bertology.studies.track.peaks.LayerPeaks.replicate_excess`).

    The order is judged (:func:`_order_verdict`) only where every pattern is beyond the uniform head in its peak layer
    (:func:`~bertology.studies.track.verdicts.excess_claim`), else ``no evidence``; a layer within the families' tolerance of
    a peak ties with it (:func:`~bertology.studies.track.verdicts.near_peak_span`)."""
    metrics = peak_metrics(kind)
    peaks = peak_layers(means, metrics)
    rows = list(peaks.itertuples())
    replicate_peaks = means[1:].argmax(axis=1)
    holds = bool(_in_order(peaks.peak_layer.to_numpy()))
    probability = float(_in_order(replicate_peaks).mean())
    pairwise = {f"{a}<{b}": float((replicate_peaks[:, i] < replicate_peaks[:, i + 1]).mean())
                for i, (a, b) in enumerate(zip(metrics, metrics[1:]))}
    span_low, span_high = near_peak_span(means[0])
    intervals = [(min(r.ci_low, low), max(r.ci_high, high)) for r, low, high in zip(rows, span_low, span_high)]
    claims = [excess_claim(excess[:, r.peak_layer, k]) for k, r in enumerate(rows)]
    beyond = all(claim["beyond"] for claim in claims)
    verdict, pairs = _order_verdict(peaks.peak_layer.to_numpy(), replicate_peaks, intervals) if beyond else ("no evidence", [])
    where = ", ".join(
        f"{METRIC_NAMES[r.metric]} peaks in layer {r.peak_layer} (95% interval {low:.0f}-{high:.0f}, mean attention {means[0, r.peak_layer, k]:.3f}, "
        f"{described(claims[k])} over the uniform head)" for k, (r, (low, high)) in enumerate(zip(rows, intervals))
    )
    ties = [f"{METRIC_NAMES[a.metric]} and {METRIC_NAMES[b.metric]} tie ("
            + (f"both peak in layer {a.peak_layer}" if a.peak_layer == b.peak_layer
               else f"intervals {interval_a[0]:.0f}-{interval_a[1]:.0f} and {interval_b[0]:.0f}-{interval_b[1]:.0f} overlap")
            + ")" for a, b, interval_a, interval_b, pair in zip(rows, rows[1:], intervals, intervals[1:], pairs) if pair["state"] == "tie"]
    unclaimed = [f"{METRIC_NAMES[r.metric]} is no more than the uniform head's in layer {r.peak_layer} (tolerance {EXCESS_TOLERANCE:g})"
                 for r, claim in zip(rows, claims) if not claim["beyond"]]
    return {
        "claim": CLAIMS[kind.name][0],
        "step": step,
        "checkpoint": checkpoint,
        "peaks": {r.metric: {"layer": int(r.peak_layer), "ci_low": float(low), "ci_high": float(high), "agreement": float(r.agreement),
                             "value": float(means[0, r.peak_layer, k]), "excess": _json_value(claims[k]["excess"]),
                             "excess_ci_low": _json_value(claims[k]["low"]), "beyond_uniform": claims[k]["beyond"]}
                  for k, (r, (low, high)) in enumerate(zip(rows, intervals))},
        "layer_means": {metric: means[0, :, k].round(4).tolist() for k, metric in enumerate(metrics)},
        "order_holds": holds,
        "probability": probability,
        "pairwise_probability": pairwise,
        "pairs": {f"{a}<{b}": pair["state"] for (a, b), pair in zip(zip(metrics, metrics[1:]), pairs)},
        "replicates": int(len(means) - 1),
        "verdict": verdict,
        "statement": f"{where} (layers 0-based). The order {_order(metrics)} holds in {probability:.1%} of "
                     f"{len(means) - 1} bootstrap replicates over sequences" + "".join(f"; {words}" for words in ties + unclaimed)
                     + (": no evidence on the order." if unclaimed else f": {verdict}."),
    }


def _crossing_index(strength: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``strength [checkpoint, ...]`` -> (the half-rise target, whether the series rises (final > first), the index of the
    first checkpoint at or above the target; 1 where it does not rise)."""
    first, final = strength[0], strength[-1]
    target = first + 0.5 * (final - first)
    rises = final > first
    above = strength >= target[None]
    return target, rises, np.where(rises, above.argmax(axis=0), 1)  # never 0 when it rises


def crossing_steps(steps: np.ndarray, strength: np.ndarray) -> np.ndarray:
    """Where each series first covers half of its rise, interpolated in ``ln(1 + step)``.

    ``strength [checkpoint, ...]`` -> ``[...]`` steps; NaN where the series does not rise
    (final <= first).
    """
    target, rises, k = _crossing_index(strength)
    before = np.take_along_axis(strength, (k - 1)[None], axis=0)[0]
    after = np.take_along_axis(strength, k[None], axis=0)[0]
    x = np.log1p(steps.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.clip((target - before) / (after - before), 0.0, 1.0)
    crossed = np.expm1(x[k - 1] + share * (x[k] - x[k - 1]))
    return np.where(rises, crossed, np.nan)


def crossing_brackets(steps: np.ndarray, strength: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoints' steps that bracket each series' half-rise crossing: the one before it and the one at or after it;
    where a series does not rise (or is NaN), the whole run (the first and the last checkpoint)."""
    _, rises, k = _crossing_index(strength)
    rises = rises & np.isfinite(strength).all(axis=0)
    steps = np.asarray(steps)
    return np.where(rises, steps[k - 1], steps[0]), np.where(rises, steps[k], steps[-1])


def emergence_verdict(steps: list[int], strength: np.ndarray, kind: Kind, syntax: bool = False, *, excess: np.ndarray) -> tuple[dict, pd.DataFrame]:
    """Claim 2 on a ``kind`` of model from ``strength [checkpoint, 1 + B, metric]``; the metrics are :func:`peak_metrics`
    of ``kind``, then, with ``syntax``, ``syntax``; ``excess [checkpoint, 1 + B, metric of peak_metrics]``: each pattern's
    strongest layer's excess over the uniform head on the same sequences.

    A pattern **emerges** only when (a) the 95% interval of its first-to-last change (paired bootstrap replicates:
    ``strength[-1, b] - strength[0, b]``) lies above 0, (b) its excess over the uniform head rises, and ends, beyond the
    families' tolerance (:func:`~bertology.studies.track.verdicts.rise_beyond_uniform`; the syntax row, an accuracy the uniform
    head is not scored on here, needs its change beyond that tolerance) and (c) its half-rise step is located more narrowly than the run:
    the checkpoints that bracket the crossing in the replicates (a replicate that does not rise: the whole run), from the
    2.5th percentile of the lower to the 97.5th of the upper, do not span from the first checkpoint to the last (with two
    checkpoints they always do). Otherwise the table says ``no evidence``. The order of the claim is judged
    (:func:`_order_verdict`, on the half-rise steps and their 95% intervals) only when every one of its patterns emerges;
    else the verdict is ``no evidence``.

    Returns the verdict and a table ``metric, first, final, change, change_low, change_high, emerges, half_step, ci_low,
    ci_high, bracket_low, bracket_high, located_low, located_high, excess_change_low, final_excess, final_excess_low,
    beyond_uniform``.
    """
    peak_metrics_ = peak_metrics(kind)
    metrics = (*peak_metrics_, *(("syntax",) if syntax else ()))
    steps_array = np.asarray(steps)
    crossed = crossing_steps(steps_array, strength)  # [1 + B, metric]
    lows, highs = crossing_brackets(steps_array, strength[:, 1:])  # [B, metric]
    rows = []
    for k, metric in enumerate(metrics):
        point = crossed[0, k]
        low, high = interval(crossed[1:, k])
        change_low, change_high = interval(strength[-1, 1:, k] - strength[0, 1:, k])
        if lows.shape[0]:
            located_low = float(np.percentile(lows[:, k], 2.5, method="lower"))
            located_high = float(np.percentile(highs[:, k], 97.5, method="higher"))
        else:
            located_low, located_high = float(steps_array[0]), float(steps_array[-1])
        located = bool(np.isfinite(point)) and not (located_low <= steps_array[0] and located_high >= steps_array[-1])
        # the checkpoint at or after the crossing (rounded: exp(log(s)) may land a hair above a checkpoint's own step)
        after = int(np.searchsorted(steps_array, round(float(point), 6))) if np.isfinite(point) else None
        beyond = (rise_beyond_uniform(excess[:, :, k]) if k < len(peak_metrics_) else
                  {"excess_change_low": np.nan, "final_excess": np.nan, "final_excess_low": np.nan,
                   "beyond_uniform": excess_claim(strength[-1, :, k] - strength[0, :, k])["beyond"]})
        rows.append({"metric": metric, "first": float(strength[0, 0, k]), "final": float(strength[-1, 0, k]),
                     "change": float(strength[-1, 0, k] - strength[0, 0, k]), "change_low": change_low, "change_high": change_high,
                     "emerges": "yes" if bool(change_low > 0) and beyond["beyond_uniform"] and located else "no evidence",
                     "half_step": float(point), "ci_low": float(low), "ci_high": float(high),
                     "bracket_low": int(steps_array[after - 1]) if after else None, "bracket_high": int(steps_array[after]) if after else None,
                     "located_low": located_low, "located_high": located_high, **beyond})
    table = pd.DataFrame(rows)
    main = crossed[:, : len(peak_metrics_)]
    holds = bool(_in_order(main[0]))
    probability = float(_in_order(main[1:]).mean()) if main.shape[0] > 1 else float("nan")
    emerged = bool((table.emerges.iloc[: len(peak_metrics_)] == "yes").all())
    if emerged:
        verdict, pairs = _order_verdict(main[0], main[1:], [(r.ci_low, r.ci_high) for r in table.iloc[: len(peak_metrics_)].itertuples()])
    else:
        verdict, pairs = "no evidence", []

    ties = [f"{METRIC_NAMES[a]} and {METRIC_NAMES[b]} tie (half-rise intervals overlap)"
            for (a, b), pair in zip(zip(peak_metrics_, peak_metrics_[1:]), pairs) if pair["state"] == "tie"]
    if emerged:
        ending = (f". The order {_order(peak_metrics_)} holds in {probability:.1%} of {strength.shape[1] - 1} paired bootstrap replicates"
                  + (f"; {'; '.join(ties)}" if ties else "") + f": {verdict}.")
    else:
        ending = f". Not every pattern of the order {_order(peak_metrics_)} emerges: no evidence on the order."
    result = {
        "claim": CLAIMS[kind.name][1],
        "steps": [int(s) for s in steps],
        "strength": "max over layers of the layer mean; emerged = the step where it first covers half of its rise from the first checkpoint",
        "patterns": {row.metric: {k: _json_value(v) for k, v in row._asdict().items() if k not in ("Index", "metric")} for row in table.itertuples()},
        "order_holds": holds,
        "probability": _json_value(probability),
        "pairs": {f"{a}<{b}": pair["state"] for (a, b), pair in zip(zip(peak_metrics_, peak_metrics_[1:]), pairs)},
        "replicates": int(strength.shape[1] - 1),
        "verdict": verdict,
        "statement": "; ".join(_described_emergence(row, steps) for row in table.itertuples()) + ending,
    }
    if syntax:
        k = metrics.index("syntax")
        last = len(peak_metrics_) - 1  # punctuation
        between = _in_order(np.stack([crossed[1:, 0], crossed[1:, k], crossed[1:, last]], axis=-1))
        result[f"syntax_between_{peak_metrics_[0]}_and_punct_probability"] = float(between.mean()) if between.size else None
        if emerged and table.emerges.iloc[k] == "yes":
            result["statement"] += (f" Dependency heads emerge between {METRIC_NAMES[peak_metrics_[0]]} and punctuation in "
                                    f"{between.mean():.1%} of the replicates.")
    return result, table


def _described_emergence(row, steps: list[int]) -> str:
    """A row of :func:`emergence_verdict`'s table in words: its change, where it crosses half of it, and that it emerges or why not."""
    change = (f"{METRIC_NAMES[row.metric]} goes from {row.first:.3f} at step {steps[0]} to {row.final:.3f} at step {steps[-1]} "
              f"(change {row.change:+.3f}, 95% interval {row.change_low:+.3f} to {row.change_high:+.3f})")
    if np.isfinite(row.half_step):
        change += (f", crosses half of that rise at step {row.half_step:.0f} (95% interval {row.ci_low:.0f}-{row.ci_high:.0f}; "
                   f"between checkpoints {row.bracket_low:.0f} and {row.bracket_high:.0f}, in 95% of the replicates between "
                   f"{row.located_low:.0f} and {row.located_high:.0f})")
    if row.emerges == "yes":
        return change + ": it emerges"
    why = []
    if not row.change_low > 0:
        why.append("the change's interval does not exclude 0" if row.change_high >= 0 or np.isnan(row.change_high) else "it falls")
    if not row.beyond_uniform:
        why.append(not_beyond_words(row._asdict()) if np.isfinite(row.final_excess) else f"its change does not clear {EXCESS_TOLERANCE:g}")
    if not (np.isfinite(row.half_step) and not (row.located_low <= steps[0] and row.located_high >= steps[-1])):
        why.append("its half-rise step is not located more narrowly than the run")
    return change + f": no evidence that it emerges ({' and '.join(why)})"


def hypothesis_verdict(steps: list[int], checkpoints: list[str], means: np.ndarray, kind: Kind,
                       syntax: np.ndarray | None = None, *, excess: np.ndarray) -> tuple[dict, pd.DataFrame | None]:
    """Both claims on a ``kind`` of model from ``means [checkpoint, 1 + B, layer, metric]`` (the metrics :func:`peak_metrics`
    of ``kind``), their ``excess`` over the uniform head (the same shape) and optionally ``syntax [checkpoint, 1 + B]``."""
    verdict = {"depth": depth_verdict(means[-1], kind, step=steps[-1], checkpoint=checkpoints[-1], excess=excess[-1])}
    if len(steps) < 2:
        verdict["training"] = {"verdict": "not applicable", "statement": "One checkpoint: there is no training series to order (depth only)."}
        return verdict, None
    strength = means.max(axis=2)  # [checkpoint, 1 + B, metric]
    if syntax is not None:
        strength = np.concatenate([strength, syntax[..., None]], axis=-1)
    verdict["training"], table = emergence_verdict(steps, strength, kind, syntax=syntax is not None, excess=excess.max(axis=2))
    return verdict, table


@dataclass
class CheckpointResult:
    """What :func:`track` keeps of one checkpoint (each is saved as soon as it is computed)."""

    step: int | None  # None: a single checkpoint whose step is unknown (an empty cell in the tables)
    checkpoint: str
    rows: pd.DataFrame  # TRACK_COLUMNS
    layers: pd.DataFrame  # step, checkpoint, layer, metric, value, ci_low, ci_high
    means: np.ndarray  # [1 + B, layer, metric] of `metrics`
    excess: np.ndarray  # [1 + B, layer, metric]: the means' excess over the uniform head on the same sequences (LayerPeaks)
    syntax: np.ndarray | None  # [1 + B]: mean over relations of the best head's accuracy
    kind: Kind  # the checkpoint's kind of model
    measured_loss: float = float("nan")  # its loss on the track corpus (measured_loss); NaN: no language-model head
    measured_loss_name: str | None = None  # what that loss is; None where none is measured
    induction: np.ndarray | None = None  # a decoder's [1 + B, layer, head]: each head's induction score (InductionReplicates)
    induction_excess: np.ndarray | None = None  # the same, less the uniform head's on the same sequences
    icl: np.ndarray | None = None  # a decoder's [1 + B]: the in-context learning score (in_context_scores); None: no LM head
    icl_sequences: int = 0  # the sequences long enough for it
    icl_positions: tuple[int, int] | None = None  # (early, late): the 1-based tokens it compares

    @property
    def metrics(self) -> tuple[str, ...]:
        """The token sets of ``means`` (:func:`peak_metrics`): an encoder's ([CLS], [SEP], punctuation) or a decoder's (the
        first token, punctuation)."""
        return peak_metrics(self.kind)


def follows_sinks(kind: Kind) -> bool:
    """Whether :func:`track` follows ``Sink_eps`` (Gu et al. 2025) on a ``kind`` of model: where the first token is an anchor
    (a decoder's, the candidate attention sink), whose attention per head the profile measures (``first``)."""
    return "first" in kind.anchors


@dataclass
class TrackResult:
    """The result of :func:`track`: tidy tables over checkpoints and the verdict on the hypothesis.

    ``table``: ``step, checkpoint, layer, head, metric, value, ci_low, ci_high`` (profile metrics
    per head; ``role:<role>`` mean sieve scores; ``syntax:<relation>`` for the best head of each
    relation). ``layers``: profile metrics per layer, and a decoder's ``sink_eps`` (the layer's Sink_eps, no interval).
    ``peaks``: where [CLS]/[SEP]/punctuation (a decoder's first token and punctuation) peak at each checkpoint.
    ``emergence``: claim 2's table (None for one checkpoint). ``losses``: each checkpoint's recorded and measured loss.
    """

    results: list[CheckpointResult]
    corpus: dict
    settings: dict
    verdict: dict
    emergence: pd.DataFrame | None
    started: str
    warnings: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int | None]:
        return [r.step for r in self.results]

    @property
    def kind(self) -> Kind:
        """The series' kind of model (every checkpoint is of one kind)."""
        return self.results[0].kind

    @property
    def metrics(self) -> tuple[str, ...]:
        """The token sets whose peaks and emergence the claims order (:attr:`CheckpointResult.metrics`)."""
        return self.results[0].metrics

    @property
    def table(self) -> pd.DataFrame:
        return pd.concat([r.rows for r in self.results], ignore_index=True)

    @property
    def layers(self) -> pd.DataFrame:
        return pd.concat([r.layers for r in self.results], ignore_index=True)

    @property
    def peaks(self) -> pd.DataFrame:
        return pd.concat([peak_layers(r.means, r.metrics).assign(step=r.step, checkpoint=r.checkpoint) for r in self.results], ignore_index=True)

    @property
    def losses(self) -> pd.DataFrame:
        """``step, checkpoint, recorded_loss, recorded_loss_name, measured_loss, measured_loss_name``: the validation loss each
        checkpoint recorded when it was saved (:func:`checkpoint_loss`) and its loss measured on the track corpus
        (:func:`measured_loss`); NaN (and no name) where none."""
        losses = self.verdict["losses"]
        return pd.DataFrame({"step": self.steps, "checkpoint": [r.checkpoint for r in self.results],
                             "recorded_loss": [np.nan if v is None else v for v in losses["values"]], "recorded_loss_name": losses["names"],
                             "measured_loss": [r.measured_loss for r in self.results], "measured_loss_name": [r.measured_loss_name for r in self.results]})

    @property
    def induction(self) -> pd.DataFrame | None:
        """A decoder's ``step, checkpoint, layer, head, value, ci_low, ci_high``: each head's induction score (the mean over
        sequences, :class:`~bertology.studies.track.induction.InductionReplicates`) and the 2.5th-97.5th percentiles of its
        bootstrap replicates; None for an encoder's series."""
        if any(r.induction is None for r in self.results):
            return None
        frames = []
        for r in self.results:
            with warnings.catch_warnings():  # a head with no score in any replicate (no repeated token) has no interval: NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                low, high = np.nanpercentile(r.induction[1:], [2.5, 97.5], axis=0) if len(r.induction) > 1 else (r.induction[0] * np.nan,) * 2
            layer, head = np.indices(r.induction.shape[1:])
            frames.append(pd.DataFrame({"step": r.step, "checkpoint": r.checkpoint, "layer": layer.ravel(), "head": head.ravel(),
                                        "value": r.induction[0].ravel(), "ci_low": np.ravel(low), "ci_high": np.ravel(high)}))
        return pd.concat(frames, ignore_index=True)

    @property
    def in_context(self) -> pd.DataFrame | None:
        """A decoder's ``step, checkpoint, early, late, value, ci_low, ci_high, n``: the in-context learning score (the loss of the
        ``late``-th token less the ``early``-th's, :func:`~bertology.studies.track.induction.in_context_scores`) over the ``n``
        sequences long enough, with its bootstrap interval; None where a checkpoint has no language-model head or for an encoder."""
        if any(r.icl is None for r in self.results):
            return None
        rows = []
        for r in self.results:
            low, high = interval(r.icl[1:])
            rows.append((r.step, r.checkpoint, *r.icl_positions, _json_value(r.icl[0]), low, high, r.icl_sequences))
        return pd.DataFrame(rows, columns=["step", "checkpoint", "early", "late", "value", "ci_low", "ci_high", "n"]).astype({"value": float})

    def syntax_series(self) -> pd.DataFrame | None:
        """``step, value, ci_low, ci_high``: mean over relations of the best head's accuracy, with its bootstrap interval."""
        if any(r.syntax is None for r in self.results):
            return None
        rows = [(r.step, r.syntax[0], *np.nanpercentile(r.syntax[1:], [2.5, 97.5])) for r in self.results]
        return pd.DataFrame(rows, columns=["step", "value", "ci_low", "ci_high"])

    def strength(self) -> pd.DataFrame:
        """``step, metric, value``: each pattern's strength (max over layers of the layer mean; syntax: the mean best-head accuracy)."""
        rows = [(r.step, metric, float(r.means[0, :, k].max())) for r in self.results for k, metric in enumerate(r.metrics)]
        rows += [(r.step, "syntax", float(r.syntax[0])) for r in self.results if r.syntax is not None]
        return pd.DataFrame(rows, columns=["step", "metric", "value"])

    @claims_out(work="parts")
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write ``track.csv``/``.parquet``, ``track_layers``, ``peaks``, ``emergence``, ``losses``, ``verdict.json``, figures,
        ``report.html`` (replacing ``out`` whole, its saved ``parts/`` kept)."""
        from bertology.studies.track.report import track_report

        folder = RunFolder(out)
        folder.write_table("track", self.table)
        folder.write_table("track_layers", self.layers)
        folder.write_table("peaks", self.peaks)
        if self.emergence is not None:
            folder.write_table("emergence", self.emergence)
        folder.write_table("losses", self.losses)
        for name, table in (("induction", self.induction), ("in_context", self.in_context)):
            if table is not None:
                folder.write_table(name, table)
        folder.write_json("verdict.json", self.verdict)
        manifest = {"kind": self.kind.name, "corpus": self.corpus, "settings": self.settings,
                    "checkpoints": [{"step": r.step, "checkpoint": r.checkpoint} for r in self.results], "started": self.started,
                    "warnings": self.warnings}
        return complete_run(folder, manifest, report=track_report(folder, self), command=command, keep=("parts",)) / "report.html"


def _part_name(checkpoint: str) -> str:
    """A file name for one checkpoint's part: readable, and unique by a hash of the checkpoint."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", checkpoint.rstrip("/"))[-60:]
    return f"{readable}-{hashlib.blake2b(checkpoint.encode(), digest_size=4).hexdigest()}"


def _damaged_part(path: Path, marker: Path, what: str) -> StateError:
    """The one-line refusal of a damaged part: the file, what is wrong, and that deleting the part's ``marker`` (``.npz``)
    computes the checkpoint again."""
    return StateError(path, f"{what}; delete {marker} to compute this checkpoint again")


def _part_key(settings_key: str, checkpoint: str) -> str:
    """What a checkpoint's part must have been computed with to be used: the run's corpus and settings, and the
    checkpoint's weights and tokenizer (content hashes of a local folder's weight files, cached, and of its tokenizer; a hub
    name stands for itself)."""
    from bertology.core.model.models import load_tokenizer
    from bertology.core.storage.digests import folder_weights_digest, tokenizer_digest

    if not Path(checkpoint).is_dir():
        return json.dumps({"settings": json.loads(settings_key), "weights": checkpoint}, sort_keys=True)
    return json.dumps({"settings": json.loads(settings_key), "weights": folder_weights_digest(Path(checkpoint)),
                       "tokenizer": tokenizer_digest(load_tokenizer(checkpoint))}, sort_keys=True)


def _load_part(parts: Path, name: str, key: str, replicates: int, finished: bool) -> CheckpointResult | None:
    """The saved part ``name``: None when there is none, or when it was computed with other settings or weights (``key``)
    in a run that finished (``finished``); in an unfinished run such a part is refused, never overwritten.

    It is checked before use: the ``.npz``'s arrays (``meta`` naming this part's checkpoint, a whole-number or null step
    and the model's kind (:func:`_part_kind`), its measured loss (a part without one, written before track measured losses, is
    None: computed again); ``means [replicates, layer, metric]`` and ``syntax [replicates]`` or empty,
    shares in [0, 1], NaN only in bootstrap replicates; ``excess``, the shape of ``means`` in [-1, 1], where a part written
    before track compared with the uniform head has none: computed again) and the two tables (their columns, this checkpoint's rows, of the
    layers of ``means``); a damaged part is refused (:func:`_damaged_part`).
    """
    marker = parts / f"{name}.npz"
    if not marker.is_file():
        return None
    try:
        arrays = read_npz(marker)
    except StateError as exc:
        raise _damaged_part(marker, marker, exc.message) from None
    for member, kind in (("key", "U"), ("meta", "U"), ("means", "f"), ("syntax", "f")):
        if member not in arrays:
            raise _damaged_part(marker, marker, f"no array {member!r} in it")
        if arrays[member].dtype.kind != kind or (kind == "U") != (arrays[member].ndim == 0):
            raise _damaged_part(marker, marker, f"{member!r} is a {arrays[member].dtype} array of shape {arrays[member].shape}, not what bertology writes")
    if str(arrays["key"]) != key:
        if finished:
            return None
        raise StateError(marker, "a part of an unfinished track run with other settings, corpus or weights: run that command again "
                                 f"to finish it, or give another --out (delete {parts} to start over)")
    try:
        meta = parse_json(str(arrays["meta"]), marker)
        checkpoint = document_field(meta, "checkpoint", str, marker)
        step = document_field(meta, "step", (int, type(None)), marker)
        step = None if step is None else whole_number(step, "step", marker, high=MAX_STEP)
        kind = _part_kind(meta, marker)
        measured = ((document_field(meta, "measured_loss", (int, float, type(None)), marker),
                     document_field(meta, "measured_loss_name", (str, type(None)), marker)) if "measured_loss" in meta else None)
        if measured is not None and measured[0] is not None and not 0 <= measured[0] <= np.finfo(np.float64).max:
            raise StateError(marker, f"'measured_loss' = {measured[0]} is not a loss (a finite number, at least 0)")
    except StateError as exc:
        raise _damaged_part(marker, marker, f"its 'meta' is damaged: {exc.message}") from None
    if _part_name(checkpoint) != name:
        raise _damaged_part(marker, marker, f"it is the part of another checkpoint ({checkpoint[:80]!r})")
    means = _part_shares(arrays["means"], "means", (replicates, None, len(peak_metrics(kind))), marker)
    syntax = _part_shares(arrays["syntax"], "syntax", (replicates,), marker) if arrays["syntax"].size else None
    tables = []
    for table, columns in (("rows", TRACK_COLUMNS), ("layers", TRACK_LAYER_COLUMNS)):
        tables.append(_part_table(parts / f"{name}.{table}.parquet", columns, step, checkpoint, marker))
        if set(tables[-1]["layer"]) != set(range(means.shape[1])):
            raise _damaged_part(marker, marker, f"'means' has {means.shape[1]} layers, not those of {name}.{table}.parquet")
    if measured is None or "excess" not in arrays:  # a sound part written before track measured losses, or compared with the uniform head
        return None
    excess = _part_shares(arrays["excess"], "excess", means.shape, marker, low=-1.0)
    extra = _part_induction(arrays, meta, kind, replicates, means.shape[1], marker)
    if extra is None:  # a sound decoder's part written before track followed induction heads: computed again
        return None
    loss, loss_name = measured
    return CheckpointResult(step, checkpoint, *tables, means, excess, syntax, kind, np.nan if loss is None else float(loss), loss_name, **extra)


def _part_induction(arrays: dict, meta: dict, kind: Kind, replicates: int, layers: int, marker: Path) -> dict | None:
    """A decoder's part's induction scores ``[replicates, layers, head]`` (shares in [0, 1], or NaN where no token repeats) and
    in-context learning score ``[replicates]`` or empty (no language-model head), with its count and positions; None where
    the part has none (written before track followed them); ``{}`` for an encoder's part."""
    if kind.sees_later_keys:
        return {}
    if any(member not in arrays for member in ("induction", "induction_excess", "icl")) or "icl_sequences" not in meta:
        return None
    induction, excess, icl = arrays["induction"], arrays["induction_excess"], arrays["icl"]
    for member, values, low in (("induction", induction, 0), ("induction_excess", excess, -1)):
        if (values.dtype.kind != "f" or values.ndim != 3 or values.shape[:2] != (replicates, layers) or values.shape != induction.shape
                or not (np.isnan(values) | ((values >= low) & (values <= 1 + 1e-4))).all()):
            raise _damaged_part(marker, marker, f"{member!r} has shape {values.shape} or values that are not shares in [{low}, 1]")
    if icl.dtype.kind != "f" or (icl.size and (icl.shape != (replicates,) or np.isinf(icl).any())):
        raise _damaged_part(marker, marker, f"'icl' has shape {icl.shape} or infinite values")
    try:
        count = whole_number(document_field(meta, "icl_sequences", int, marker), "icl_sequences", marker)
        positions = document_field(meta, "icl_positions", (list, type(None)), marker)
    except StateError as exc:
        raise _damaged_part(marker, marker, f"its 'meta' is damaged: {exc.message}") from None
    if icl.size and (positions is None or len(positions) != 2):
        raise _damaged_part(marker, marker, "'icl_positions' must be the two positions of its in-context learning score")
    return {"induction": induction, "induction_excess": excess, "icl": icl if icl.size else None, "icl_sequences": count,
            "icl_positions": tuple(int(p) for p in positions) if icl.size else None}


def _part_kind(meta: dict, marker: Path) -> Kind:
    """The kind of model a part's ``meta`` names (``kind``: ``encoder`` or ``decoder``); a part written before kinds says
    ``causal`` (true: a decoder's), one written before decoders nothing (an encoder's)."""
    if "kind" in meta:
        name = document_field(meta, "kind", str, marker)
        try:
            return kind_named(name)
        except ValueError as exc:
            raise StateError(marker, str(exc)) from None
    if "causal" in meta:
        return DECODER if document_field(meta, "causal", bool, marker) else ENCODER
    return ENCODER


def _part_shares(values: np.ndarray, member: str, shape: tuple, marker: Path, low: float = 0.0) -> np.ndarray:
    """A part's array ``values``, refused unless of floats of ``shape`` (None: any size but 0) and shares in [``low``, 1], NaN only
    past row 0 (a bootstrap replicate that drew no sequence)."""
    if values.dtype.kind != "f":
        raise _damaged_part(marker, marker, f"{member!r} is a {values.dtype} array, not what bertology writes")
    if values.ndim != len(shape) or any(got == 0 or want not in (None, got) for got, want in zip(values.shape, shape)):
        wanted = ", ".join("any" if want is None else str(want) for want in shape)
        raise _damaged_part(marker, marker, f"{member!r} has shape {values.shape}, expected ({wanted})")
    known = values[~np.isnan(values)]
    if not np.isfinite(values[0]).all() or not ((known >= low) & (known <= 1 + 1e-4)).all():
        raise _damaged_part(marker, marker, f"{member!r} holds values that are not shares in [{low:g}, 1] (or NaN in its first row)")
    return values


def _part_table(path: Path, columns: list[str], step: int | None, checkpoint: str, marker: Path) -> pd.DataFrame:
    """A part's table, refused unless readable, with ``columns`` (numbers, but for step, checkpoint and the metric's name)
    and only rows of ``step`` and ``checkpoint``."""
    try:
        table = pd.read_parquet(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise _damaged_part(path, marker, f"cannot read it as a table ({' '.join(str(exc).split())[:120]})") from None
    if list(table.columns) != columns:
        raise _damaged_part(path, marker, f"its columns are {', '.join(map(str, table.columns))[:120]}, not {', '.join(columns)}")
    for column in columns:
        if column in ("step", "checkpoint"):  # checked below
            continue
        holds_its_kind = pd.api.types.is_string_dtype if column == "metric" else pd.api.types.is_numeric_dtype
        if not holds_its_kind(table[column]):
            raise _damaged_part(path, marker, f"its column {column!r} holds {table[column].dtype} values, not what bertology writes")
    steps = table["step"].isna() if step is None else table["step"] == step
    if not (steps & (table["checkpoint"] == checkpoint)).all():
        raise _damaged_part(path, marker, "it holds rows of another step or checkpoint")
    return table


def _save_part(parts: Path, name: str, key: str, result: CheckpointResult) -> None:
    """One checkpoint's results, written before the next checkpoint starts; the ``.npz``, written last, marks the part complete."""
    atomic_write(parts / f"{name}.rows.parquet", lambda p: result.rows.to_parquet(p, index=False))
    atomic_write(parts / f"{name}.layers.parquet", lambda p: result.layers.to_parquet(p, index=False))
    meta = json.dumps({"step": result.step, "checkpoint": result.checkpoint, "kind": result.kind.name,
                       "measured_loss": _json_value(result.measured_loss), "measured_loss_name": result.measured_loss_name,
                       "icl_sequences": result.icl_sequences, "icl_positions": result.icl_positions})
    syntax = result.syntax if result.syntax is not None else np.array([])
    induction = result.induction if result.induction is not None else np.array([])
    induction_excess = result.induction_excess if result.induction_excess is not None else np.array([])
    icl = result.icl if result.icl is not None else np.array([])

    def write(path: Path) -> None:
        with path.open("wb") as handle:
            np.savez(handle, key=key, meta=meta, means=result.means, excess=result.excess, syntax=syntax, induction=induction,
                     induction_excess=induction_excess, icl=icl)

    atomic_write(parts / f"{name}.npz", write)


def _analyze_checkpoint(step: int | None, checkpoint: str, examples: list, with_trees: bool, settings: dict, progress: bool,
                        source: str | None = None, device: str | None = None) -> CheckpointResult:
    """One checkpoint's profile, roles and syntax, a decoder's Sink_eps per layer (:func:`layer_sink_rates`) and, where it
    loads with a language-model head, its loss on the same sequences (:func:`measured_loss`). On a Ray task, ``source`` is
    where to load it from (the folder's absolute path) and ``device`` the task's own."""
    source = source or checkpoint
    name = None if source in ("default", DEFAULT_MODEL) else source
    options = {"device": device or settings["device"], "trust_remote_code": settings["trust_remote_code"], "dtype": settings["dtype"]}
    try:
        loaded, with_lm_head = load_model(name, head=LANGUAGE_MODEL, **options), True
    except ModelError:  # no language-model head (a bare encoder, a classifier): its attention is measured without one
        loaded, with_lm_head = load_model(name, **options), False
    torch.manual_seed(settings["seed"])
    engine = Engine(loaded, batch_size=settings["batch_size"], max_length=settings["max_length"], progress=progress, punct=settings["punct"])
    if "synthetic_length" in settings:  # before this checkpoint's pass: the first one's refuses before any runs
        require_synthetic_fits(loaded.tokenizer, settings["synthetic_length"], engine.max_length, loaded.max_length, checkpoint)
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
        stats.check_counted(engine.max_length)
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
    loss, loss_name = (measured_loss(engine, examples, settings["seed"], progress, f"{Path(checkpoint).name} loss") if with_lm_head
                       else (float("nan"), None))
    extra = {}
    if follows_induction:
        extra["induction"] = induction.replicate_means(loaded.num_layers, loaded.num_heads)
        extra["induction_excess"] = induction.replicate_excess(loaded.num_layers, loaded.num_heads)
        if with_lm_head:
            icl, count, early, late = in_context_scores(engine, examples, settings["seed"], settings["bootstrap"], progress,
                                                        f"{Path(checkpoint).name} in-context")
            extra.update(icl=icl, icl_sequences=count, icl_positions=(early, late))
    return CheckpointResult(step, checkpoint, rows, layers, peaks.replicate_means(), peaks.replicate_excess(), syntax, kind, loss, loss_name, **extra)


def layer_sink_rates(heads: pd.DataFrame, eps: float) -> pd.DataFrame:
    """A decoder's ``Sink_eps`` per layer (Gu et al. 2025; the sinks family's :func:`~bertology.families.sinks.analyzer.sink_rates`):
    ``layer, metric = "sink_eps", value, ci_low, ci_high`` (no interval: NaN), from the profile's per-head ``first``, the mean
    over sequences of ``(1/(n-1)) sum_{i>=1} a[i, 0]``, which is the sinks family's ``alpha_0``.

    As in the sinks family, a head is a sink head only when it does more than the uniform head on the same sequences (the
    profile's ``uniform``; docs/methods.md#the-null-model), whose ``alpha_0`` is ``mean_{i>=1} 1/(i+1)``, above 0.3 on sequences
    of five pieces or fewer: its mean ``alpha_0 > eps`` (strictly), its mean excess over the uniform head beyond float noise
    (:func:`~bertology.families.roles.analyzer.excess_over_uniform` > 0) and the 95% interval of that excess above 0
    (``excess_ci_low`` > :data:`~bertology.families.profile.analyzer.EXCESS_TOLERANCE`, the profile's own test for a label;
    it stands in for the sinks family's ``p_excess``, which the profile does not compute)."""
    first = heads[heads.metric == "first"]
    beyond_uniform = (excess_over_uniform(first.value, first.uniform) > 0) & (first.excess_ci_low > EXCESS_TOLERANCE)
    # a head no more than the uniform one enters sink_rates without a mean (NaN > eps is false): it is no sink head
    rates = sink_rates(first.assign(quantity="attention", value=first.value.where(beyond_uniform)), eps)
    rates = rates[rates.layer != "all"]
    return pd.DataFrame({"layer": rates.layer.astype(int), "metric": "sink_eps", "value": rates.rate, "ci_low": np.nan, "ci_high": np.nan})


def sink_series(results: list[CheckpointResult], eps: float) -> dict:
    """A decoder's ``Sink_eps`` over its checkpoints (in training order): per layer, and overall (the mean over layers: every
    layer has the same heads), with the sentence that says when sinks appear."""
    steps = [r.step for r in results]
    grid = [r.layers[r.layers.metric == "sink_eps"].sort_values("layer").value.tolist() for r in results]
    overall = [float(np.mean(rates)) for rates in grid]
    where = ", ".join(f"{rate:.0%} at {'step unknown' if step is None else f'step {step}'}" for step, rate in zip(steps, overall))
    statement = (f"Sink_{eps:g} (the share of heads whose mean attention to the first token exceeds {eps:g}, and exceeds the uniform "
                 f"head's on the same sequences with its 95% interval, Gu et al. 2025): {where}.")
    if not any(overall):
        statement += " No head is a sink head at any checkpoint: no attention sink appears."
    return {"eps": eps, "steps": steps, "by_layer": grid, "overall": overall, "statement": statement}


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
) -> TrackResult:
    """Profile, roles and (with trees) syntactic heads of every checkpoint on one corpus, and the verdict.

    ``checkpoints``: model folders or hub names (``"default"`` or ``"all-MiniLM-L6-v2"``: the bundled model),
    ordered by ``steps`` (one per checkpoint, in the same order) or by the step each one tells
    (:func:`checkpoint_step`); checkpoints that are not one series (:func:`check_one_series`), or name two pre-training runs
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
    its pass (:func:`~bertology.core.text.synthetic.require_synthetic_fits`).
    """
    if backend not in BACKENDS:
        raise BertologyError(f"unknown backend {backend!r}: use local or ray")
    check_seed(seed)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    series = ordered_checkpoints([str(c) for c in checkpoints], steps)
    check_one_series([checkpoint for _, checkpoint in series], trust_remote_code)
    check_one_run([checkpoint for _, checkpoint in series])
    synthetic_length = synthetic_probe_length(corpus, synthetic_repeats, synthetic_length)
    if synthetic_repeats is None:
        source, corpus_info = open_corpus(corpus, format, limit)
    else:
        from bertology.core.model.models import load_tokenizer

        first = series[0][1]
        tokenizer = load_tokenizer(str(default_model_path()) if first in ("default", DEFAULT_MODEL) else first, trust_remote_code=trust_remote_code)
        source, corpus_info = synthetic_corpus(tokenizer, synthetic_repeats, synthetic_length, seed, limit)
    examples = list(spacy_trees(source) if parser == "spacy" else source)
    if not examples:
        raise BertologyError("the corpus has no examples")
    with_trees = any(example.has_tree for example in examples)
    settings = {"batch_size": batch_size, "max_length": max_length, "limit": limit, "bootstrap": bootstrap, "tau": tau,
                "min_dependents": min_dependents, "punct": punct, "seed": seed, "device": device, "trust_remote_code": trust_remote_code,
                "dtype": dtype, "parser": parser or ("gold" if with_trees else None), "sink_eps": sink_eps,
                **({"synthetic_repeats": synthetic_repeats, "synthetic_length": synthetic_length} if synthetic_repeats is not None else {})}
    key = json.dumps({"corpus": corpus_info.get("sha256"), "examples": len(examples), **{k: v for k, v in settings.items() if k != "device"}}, sort_keys=True)
    parts = Path(out) / "parts" if out is not None else None
    finished = parts is not None and finished_run(Path(out))
    keys = {checkpoint: _part_key(key, checkpoint) for _, checkpoint in series} if parts is not None else {}
    results = [_load_part(parts, _part_name(checkpoint), keys[checkpoint], 1 + bootstrap, finished) if parts is not None else None
               for _, checkpoint in series]
    todo = [k for k, (step, _) in enumerate(series) if results[k] is None or results[k].step != step]

    def keep(k: int, result: CheckpointResult) -> None:
        results[k] = result
        if parts is not None:
            _save_part(parts, _part_name(series[k][1]), keys[series[k][1]], result)

    if backend == "ray" and todo:
        jobs = [(step, checkpoint, examples, with_trees, settings, False, str(Path(checkpoint).resolve()) if Path(checkpoint).exists() else checkpoint)
                for step, checkpoint in (series[k] for k in todo)]
        for index, result in map_on_ray(_analyze_checkpoint, jobs, device=device, workers=workers, address=address):
            keep(todo[index], result)
    else:
        for k in todo:
            keep(k, _analyze_checkpoint(*series[k], examples, with_trees, settings, progress))
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
        verdict["sinks"] = sink_series(results, sink_eps)
    if all(r.induction is not None and r.icl is not None for r in results):
        verdict["induction"] = induction_verdict(steps, np.stack([r.induction for r in results]), np.stack([r.icl for r in results]),
                                                 min(r.icl_sequences for r in results), excess=np.stack([r.induction_excess for r in results]))
    verdict["losses"] = loss_series(steps, [r.checkpoint for r in results], [(r.measured_loss, r.measured_loss_name) for r in results])
    corpus_info["examples"] = len(examples)
    result = TrackResult(results, corpus_info, settings, verdict, emergence, started)
    if out is not None:
        result.save(out, command=command)
    return result
