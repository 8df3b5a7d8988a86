"""Which checkpoints ``track`` follows and in what order: the training step each one tells (:func:`checkpoint_step`) or
``--steps`` gives, the model folders of a ``--checkpoints`` folder, and the check that they are one series (one kind of
model, model type, depth, heads and tokenizer: :func:`check_one_series`) of one pre-training run (:func:`checked_series`) before
any of them runs."""

from __future__ import annotations

import re
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from bertology.core.errors import BertologyError
from bertology.core.model.kinds import kind_of
from bertology.core.model.models import loading_errors, model_source
from bertology.core.storage.safeload import field as document_field
from bertology.core.storage.safeload import read_json, whole_number
from bertology.studies.track.runs import check_one_run

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
    source = model_source(checkpoint)
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


def checked_series(checkpoints: list[str], steps: list[int] | None, trust_remote_code: bool = False) -> list[tuple[int | None, str]]:
    """``(step, checkpoint)`` pairs in training order (:func:`ordered_checkpoints`), refused before any runs unless they are one
    series (:func:`check_one_series`) of one pre-training run (:func:`~bertology.studies.track.runs.check_one_run`)."""
    series = ordered_checkpoints([str(c) for c in checkpoints], steps)
    check_one_series([checkpoint for _, checkpoint in series], trust_remote_code)
    check_one_run([checkpoint for _, checkpoint in series])
    return series
