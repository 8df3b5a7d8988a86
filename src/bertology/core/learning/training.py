"""Resumable training states of ``finetune`` and ``pretrain``, saved as plain tensors and checked before a resume.

A state holds the model, AdamW, the scheduler, the random states, the step and the losses, saved as tensors and plain
values and read with ``weights_only=True``, then checked against the run's own before a resume believes them.
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import random
import shutil
import sys
from numbers import Real
from pathlib import Path

import numpy as np
import torch

from bertology.core.errors import BertologyError, StateError
from bertology.core.storage.safeload import finite_array, whole_number


class TrainingDiverged(BertologyError):
    """A training run whose loss or weights stopped being finite numbers: stopped at that step, in one line naming the
    last good checkpoint, which is kept (nothing non-finite is saved)."""


def check_learning_rate(learning_rate) -> None:
    """Refuse, in one line and before any work, a learning rate that is not a finite number above 0 (NaN passes every
    comparison with a bound, so the command line's own check lets it through)."""
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, Real) or not (math.isfinite(learning_rate) and learning_rate > 0):
        raise BertologyError(f"--learning-rate must be a finite number above 0, not {learning_rate!r}")


def random_states() -> dict:
    """Python's, NumPy's, torch's and CUDA's random states as tensors and plain values (what a ``weights_only`` load reads)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), position, has_gauss, cached_gaussian],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_random_states(states: dict) -> None:
    """Set the random states saved by :func:`random_states` (checked by :func:`check_random_states`)."""
    random.setstate(states["python"])
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def check_generator_state(value, name: str, path: Path) -> None:
    """Refuse ``value`` unless it is the state of a torch CPU generator (torch checks its size and its Mersenne Twister)."""
    try:
        torch.Generator().set_state(value)
    except (TypeError, RuntimeError):
        raise StateError(path, f"{name} is not the state of a torch random generator") from None


def check_random_states(states, path: Path) -> None:
    """Refuse random states that :func:`restore_random_states` could not set or that would break the generators later."""
    if not isinstance(states, dict) or not {"python", "numpy", "torch", "cuda"} <= states.keys():
        raise StateError(path, "'random' must hold the python, numpy, torch and cuda random states")
    python = states["python"]
    try:
        random.Random().setstate(python)  # checks the version, the 625 words and the position
    except (TypeError, ValueError, OverflowError, KeyError, IndexError):
        raise StateError(path, "random['python'] is not a state of Python's random module") from None
    if not (python[2] is None or isinstance(python[2], float) and math.isfinite(python[2])):
        raise StateError(path, "random['python'] holds a cached Gaussian that is not a finite number")
    numpy = states["numpy"]
    if not isinstance(numpy, (list, tuple)) or len(numpy) != 5 or not isinstance(numpy[0], str) or numpy[0] != "MT19937":
        raise StateError(path, "random['numpy'] is not a NumPy MT19937 state (name, keys, position, has_gauss, cached_gaussian)")
    keys = finite_array(numpy[1], "random['numpy'] keys", path, shape=(624,))
    if keys.dtype.kind not in "iu" or keys.min() < 0 or keys.max() >= 2**32:
        raise StateError(path, "random['numpy'] keys must be 624 whole numbers from 0 to 2**32 - 1")
    whole_number(numpy[2], "random['numpy'] position", path, high=624)
    whole_number(numpy[3], "random['numpy'] has_gauss", path, high=1)
    finite_array(numpy[4], "random['numpy'] cached_gaussian", path, shape=())
    check_generator_state(states["torch"], "random['torch']", path)
    cuda = states["cuda"]
    if cuda is not None and not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.ndim == 1 for t in cuda)):
        raise StateError(path, "random['cuda'] must be None or a list of CUDA generator states (byte tensors)")


def _describe(value) -> str:
    """What ``value`` is, for a message: a tensor by its dtype and shape, anything else by its type."""
    if isinstance(value, torch.Tensor):
        unusual = "" if value.layout == torch.strided and value.device.type == "cpu" else f" ({value.layout} on {value.device.type})"
        return f"a {value.dtype} tensor of shape {list(value.shape)}{unusual}"
    return f"a {type(value).__name__}"


def check_saved_like(found, expected, name: str, path: Path) -> None:
    """Refuse ``found`` unless it is built like ``expected``: dicts with the same keys, lists and tuples as long,
    CPU tensors of the same dtype and shape with finite values, whole numbers where ``expected`` has them, finite numbers
    where it has floats, and the same flags, names and ``None`` (settings, such as an optimizer's ``amsgrad``)."""
    if isinstance(expected, torch.Tensor):
        if (not isinstance(found, torch.Tensor) or found.layout != torch.strided or found.device.type != "cpu"
                or found.dtype != expected.dtype or found.shape != expected.shape):
            raise StateError(path, f"{name} must be a {expected.dtype} tensor of shape {list(expected.shape)}, not {_describe(found)}")
        if found.is_floating_point() and not bool(torch.isfinite(found).all()):
            raise StateError(path, f"{name} holds NaN or infinite values")
    elif isinstance(expected, dict):
        if not isinstance(found, dict):
            raise StateError(path, f"{name} must be a dict, not {_describe(found)}")
        missing, extra = [key for key in expected if key not in found], [key for key in found if key not in expected]
        if missing or extra:
            what = f"lacks {missing[0]!r}" if missing else f"has an unexpected key {' '.join(repr(extra[0]).split())[:80]}"
            raise StateError(path, f"{name} {what} ({len(missing)} missing, {len(extra)} unexpected)")
        for key, value in expected.items():
            check_saved_like(found[key], value, f"{name}[{key!r}]", path)
    elif isinstance(expected, (list, tuple)):
        if not isinstance(found, (list, tuple)) or len(found) != len(expected):
            raise StateError(path, f"{name} must be a list of {len(expected)} values, not {_describe(found)}")
        for k, (item, value) in enumerate(zip(found, expected)):
            check_saved_like(item, value, f"{name}[{k}]", path)
    elif isinstance(expected, (bool, str)) or expected is None:
        if type(found) is not type(expected) or found != expected:
            raise StateError(path, f"{name} must be {expected!r}, not {repr(found)[:60] if type(found) is type(expected) else _describe(found)}")
    elif (isinstance(found, bool) or not isinstance(found, int if isinstance(expected, int) else (int, float))
          or not -sys.float_info.max <= found <= sys.float_info.max):
        raise StateError(path, f"{name} must be a finite {type(expected).__name__}, not {_describe(found)}")


def resume_training(path: Path, state: dict, network, optimizer: torch.optim.AdamW, scheduler) -> None:
    """Set ``network``, its AdamW ``optimizer``, ``scheduler`` and the random states from a state read by
    :func:`load_training_state`, each checked first against what it replaces (a damaged or forged part is refused in one
    line naming ``path``, never a traceback)."""
    check_saved_like(state["model"], network.state_dict(), "model", path)
    saved, fresh = state["optimizer"], optimizer.state_dict()
    if saved.keys() != fresh.keys() or not isinstance(saved["state"], dict):
        raise StateError(path, "optimizer must hold a dict 'state' and 'param_groups'")
    check_saved_like(saved["param_groups"], fresh["param_groups"], "optimizer['param_groups']", path)
    for group, own in zip(saved["param_groups"], fresh["param_groups"]):  # the same parameters and settings; lr as scheduled
        if {key: value for key, value in group.items() if key != "lr"} != {key: value for key, value in own.items() if key != "lr"}:
            raise StateError(path, "optimizer's parameter groups are not this run's (their parameters or settings differ)")
        if not 0 <= group["lr"] <= group["initial_lr"]:
            raise StateError(path, f"optimizer's learning rate {group['lr']} is outside 0 to the run's {group['initial_lr']}")
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for index, moments in saved["state"].items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(parameters):
            raise StateError(path, f"optimizer['state'] holds a state for {str(index)[:40]!r}, which is none of the model's {len(parameters)} parameters")
        shape = torch.empty_like(parameters[index], device="meta")  # AdamW's per-parameter state: a step and two moments
        check_saved_like(moments, {"step": torch.empty((), device="meta"), "exp_avg": shape, "exp_avg_sq": shape}, f"optimizer['state'][{index}]", path)
        if moments["step"] < 0 or (moments["exp_avg_sq"] < 0).any():
            raise StateError(path, f"optimizer['state'][{index}] holds a negative step or second moment")
    own = scheduler.state_dict()
    check_saved_like(state["scheduler"], own, "scheduler", path)
    if any(state["scheduler"][key] != value for key, value in own.items() if key not in ("last_epoch", "_step_count", "_last_lr")):
        raise StateError(path, "scheduler's settings are not this run's")
    if state["scheduler"]["last_epoch"] != state["step"]:
        raise StateError(path, f"the scheduler is at step {state['scheduler']['last_epoch']}, the state at step {state['step']}")
    network.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_random_states(state["random"])


#: What every training state holds (a fine-tuning state just these); a state without one of them is from an older bertology.
TRAINING_STATE_KEYS = ("model", "optimizer", "scheduler", "step", "losses", "settings", "random")


def load_training_state(path: Path, keys: tuple[str, ...] = ()) -> dict:
    """A state written by :func:`save_training_state`, loaded on the CPU with ``weights_only=True``: anything else is refused, never run.

    It must hold :data:`TRAINING_STATE_KEYS` and ``keys`` (one missing: a state saved by an older bertology, a one-line
    error); checked here: the step a whole number from 0, the settings a dict, the losses a list, the model's,
    optimizer's and scheduler's states dicts (:func:`resume_training` checks them against what they replace), the random
    states ones that can be set (:func:`check_random_states`). A damaged state is refused in one line naming ``path``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise StateError(path, "refused: not a training state of tensors and plain values (damaged, or loading it could run code); "
                               "delete it to start over") from exc
    except Exception as exc:  # torch's reader raises many kinds for damaged bytes (EOFError, KeyError, IndexError, MemoryError, ...)
        raise StateError(path, f"cannot read it as a training state ({' '.join(str(exc).split())[:120]}); delete it to start over") from None
    if not isinstance(state, dict):
        raise StateError(path, "not a training state; delete it to start over")
    missing = [key for key in dict.fromkeys((*keys, *TRAINING_STATE_KEYS)) if key not in state]
    if missing:
        raise StateError(path, f"a training state from an older bertology (missing {', '.join(missing)}); delete {path.parent} to start again")
    whole_number(state["step"], "step", path)
    for key, kind in (("model", dict), ("optimizer", dict), ("scheduler", dict), ("settings", dict), ("losses", list)):
        if not isinstance(state[key], kind):
            raise StateError(path, f"{key!r} must be a {kind.__name__}, not {_describe(state[key])}")
    check_random_states(state["random"], path)
    return state


#: Free space under which a failed write of a training state is taken for a full disk (torch does not say so itself).
FULL_DISK_BYTES = 2**20


def save_training_state(folder: Path, state: dict, tokenizer=None) -> None:
    """Atomically replace ``folder`` with ``state.pt`` holding ``state`` (tensors and plain values only) and the tokenizer if given."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        torch.save(state, partial / "state.pt")
    except RuntimeError as exc:  # torch's writer reports a full disk as "enforce fail at inline_container.cc" or "iostream error"
        full = shutil.disk_usage(partial).free < FULL_DISK_BYTES  # measured before the half-written state is removed
        shutil.rmtree(partial, ignore_errors=True)
        if not full:
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "state.pt")) from exc
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    partial.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
