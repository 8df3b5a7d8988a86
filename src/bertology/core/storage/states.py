"""Analyzer states as plain files, never pickles: a JSON document for the structure and one ``.npz`` of arrays.

The arrays are read with ``allow_pickle=False``, so that a resumed analysis runs no code from its run folder.

:func:`encode` turns a value (an analyzer, with its moments, arrays, tensors, lists and dicts) into JSON with references
into ``arrays``; :func:`decode` rebuilds it. Objects are stored as their class's name and their ``__dict__``, and
rebuilt without calling any of their code (``cls.__new__`` and the dict set back; a class of one instance, whose
``shared_instance`` is it, gives that instance back), and only for classes bertology's own package defines, or the
modules of the registered analysis families (a user's family is already running in the process): any other class name in
a state file is refused.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from bertology.core.errors import BertologyError, StateError
from bertology.core.storage.safeload import field, read_json, read_npz
from bertology.core.storage.trusted import trusted_modules

#: The form of analyzers' states: part of every resume fingerprint, raised whenever an analyzer's attributes change
#: (a state of another form is refused as another run's, never half-believed). 2: pattern examples keep their tokens.
#: 3: layerwise analyzers (a batch's results pending between its layers, empty between batches).
STATE_FORMAT = 3
#: The deepest nesting a ``state.json`` may have (analyzers' states nest about 20 deep).
MAX_STATE_DEPTH = 256

def encode(value, arrays: dict[str, np.ndarray]):
    """``value`` as JSON-ready data; its arrays and tensors go into ``arrays`` under fresh keys."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError("an object array cannot be stored without pickle")
        key = f"a{len(arrays)}"
        arrays[key] = value
        return {"__array__": key}
    if isinstance(value, torch.Tensor):
        key = f"a{len(arrays)}"
        arrays[key] = value.detach().cpu().numpy()
        return {"__tensor__": key}
    if isinstance(value, list):
        return [encode(item, arrays) for item in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(item, arrays) for item in value]}
    if isinstance(value, (set, frozenset)):
        kind = "__set__" if isinstance(value, set) else "__frozenset__"
        return {kind: [encode(item, arrays) for item in sorted(value, key=repr)]}
    if isinstance(value, dict):
        return {"__dict__": [[encode(key, arrays), encode(item, arrays)] for key, item in value.items()]}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        cls = type(value)
        return {"__object__": f"{cls.__module__}:{cls.__qualname__}", "state": encode(vars(value), arrays)}
    raise TypeError(f"cannot store a {type(value).__name__} without pickle")




def _class(name: str):
    module_name, _, qualname = name.partition(":")
    if not (module_name == "bertology" or module_name.startswith("bertology.") or module_name in trusted_modules):
        raise BertologyError(f"refused: a state names the class {name}, which is neither bertology's nor a registered family's")
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except ImportError:
        raise BertologyError(f"refused: a state names the class {name}, whose module {module_name} does not exist") from None
    target = module
    for part in qualname.split("."):  # nested classes only: every step must be a class of that module
        target = getattr(target, part, None)
        if not isinstance(target, type) or target.__module__ != module_name:
            raise BertologyError(f"refused: {name} in a state is no class of {module_name}")
    if target.__qualname__ != qualname:
        raise BertologyError(f"refused: {name} in a state is no class of {module_name}")
    return target


def _array(arrays, key) -> np.ndarray:
    """The stored array ``key``: it must exist, and hold only finite values where it holds floats (a state never stores NaN)."""
    if not isinstance(key, str) or key not in arrays:
        raise BertologyError(f"refused: a state refers to the array {key!r}, which its arrays.npz does not hold")
    array = np.array(arrays[key])
    if array.dtype.kind in "fc" and not np.isfinite(array).all():
        raise BertologyError(f"refused: the state's array {key} holds NaN or infinite values")
    return array


def decode(data, arrays):
    """The value :func:`encode` stored (``arrays``: the loaded ``.npz``); a record of the wrong form is refused in one line."""
    if isinstance(data, list):
        return [decode(item, arrays) for item in data]
    if isinstance(data, float) and not np.isfinite(data):
        raise BertologyError("refused: a state holds a NaN or infinite number")
    if not isinstance(data, dict):
        return data
    if len(data) != 1 and set(data) != {"__object__", "state"}:
        raise BertologyError(f"refused: a state holds an unknown record {sorted(data)[:3]}")
    if "__array__" in data:
        return _array(arrays, data["__array__"])
    if "__tensor__" in data:
        return torch.from_numpy(_array(arrays, data["__tensor__"]))
    for kind, build in (("__tuple__", tuple), ("__set__", set), ("__frozenset__", frozenset)):
        if kind in data:
            if not isinstance(data[kind], list):
                raise BertologyError(f"refused: a state's {kind} record is not a list")
            try:
                return build(decode(item, arrays) for item in data[kind])
            except TypeError:  # an unhashable member of a set
                raise BertologyError(f"refused: a state's {kind} record holds a member that cannot be in a set") from None
    if "__dict__" in data:
        pairs = data["__dict__"]
        if not isinstance(pairs, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
            raise BertologyError("refused: a state's __dict__ record is not a list of [key, value] pairs")
        try:
            return {decode(key, arrays): decode(item, arrays) for key, item in pairs}
        except TypeError:
            raise BertologyError("refused: a state's __dict__ record has a key that cannot be a key") from None
    if "__object__" in data:
        if not isinstance(data["__object__"], str) or "state" not in data:
            raise BertologyError("refused: a state's __object__ record does not name a class")
        cls = _class(data["__object__"])
        attributes = decode(data["state"], arrays)
        if not isinstance(attributes, dict) or not all(isinstance(key, str) for key in attributes):
            raise BertologyError(f"refused: the state of a {cls.__name__} is not a dict of attributes")
        shared = cls.__dict__.get("shared_instance")  # a class of one instance (a model's kind) gives that one back
        if isinstance(shared, cls) and not attributes:
            return shared
        instance = cls.__new__(cls)
        instance.__dict__.update(attributes)  # no __init__ or __setstate__ runs
        return instance
    raise BertologyError(f"refused: a state holds an unknown record {sorted(data)[:3]}")


def _number(value) -> bool:
    """A finite real number a float can hold (a bool is none)."""
    if not isinstance(value, (int, float, np.number)) or isinstance(value, (bool, np.bool_, np.complexfloating)):
        return False
    try:
        return bool(np.isfinite(float(value)))
    except OverflowError:  # an int past the float range
        return False


def check_like(saved, fresh, where: str = "state") -> None:
    """Refuse ``saved`` (a loaded state) unless it has the form of ``fresh`` (the same analyzer built anew): the same
    classes and attributes, arrays and tensors of the same dtype and number of dimensions (and shape, where ``fresh``
    already has one), numbers where it has numbers. ``None`` in ``fresh`` (not made yet) takes anything of the right
    form: an object's own ``check_state()``, where it has one, checks its invariants."""
    if fresh is None:  # made after the first batch: no form to hold it against, but its objects' own invariants
        if isinstance(saved, dict):
            for key, item in saved.items():
                check_like(item, None, f"{where}[{key!r}]")
        elif isinstance(saved, (list, tuple)):
            for index, item in enumerate(saved):
                check_like(item, None, f"{where}[{index}]")
        elif hasattr(saved, "__dict__") and not isinstance(saved, (type, np.ndarray, torch.Tensor)):
            check_like(saved, saved, where)
        return
    if _number(fresh):
        if not _number(saved):
            raise BertologyError(f"refused: {where} should be a finite number, not {str(saved)[:40]}")
        return
    if isinstance(fresh, (np.ndarray, torch.Tensor)):
        if type(saved) is not type(fresh) or saved.dtype != fresh.dtype or saved.ndim != fresh.ndim:
            raise BertologyError(f"refused: {where} should be a {type(fresh).__name__} of {fresh.dtype} with {fresh.ndim} dimensions")
        if fresh.ndim and min(fresh.shape) > 0 and tuple(saved.shape) != tuple(fresh.shape):
            raise BertologyError(f"refused: {where} has shape {tuple(saved.shape)}, not {tuple(fresh.shape)}")
        return
    if type(saved) is not type(fresh):
        raise BertologyError(f"refused: {where} should be a {type(fresh).__name__}, not a {type(saved).__name__}")
    if isinstance(fresh, dict):
        for key, item in saved.items():  # entries a fresh analyzer has not made yet are held to their own invariants
            check_like(item, fresh.get(key), f"{where}[{key!r}]")
    elif isinstance(fresh, (list, tuple)):
        for index, item in enumerate(saved):
            check_like(item, fresh[index] if index < len(fresh) else None, f"{where}[{index}]")
    elif hasattr(fresh, "__dict__") and not isinstance(fresh, type):
        missing = sorted(set(vars(fresh)) ^ set(vars(saved)))
        if missing:
            raise BertologyError(f"refused: {where} ({type(fresh).__name__}) has other attributes than this bertology's ({missing[0]})")
        for key, value in vars(fresh).items():
            check_like(vars(saved)[key], value, f"{where}.{key}")
    if hasattr(saved, "check_state"):  # the class's own invariants (moments: one shape, counts >= 0)
        try:
            saved.check_state()
        except ValueError as exc:
            raise BertologyError(f"refused: {where}: {exc}") from None


def save(folder: Path, document: dict, values) -> None:
    """Replace ``folder`` atomically with ``state.json`` (``document`` plus the encoded ``values``) and ``arrays.npz``."""
    arrays: dict[str, np.ndarray] = {}
    encoded = encode(values, arrays)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    for stale in partial.iterdir():
        stale.unlink()
    with open(partial / "arrays.npz", "wb") as handle:
        np.savez(handle, **arrays)
        handle.flush()
        os.fsync(handle.fileno())
    with open(partial / "state.json", "w", encoding="utf-8") as handle:
        json.dump({**document, "values": encoded}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    old = folder.with_name(folder.name + ".old")
    _remove(old)
    if folder.exists():
        os.replace(folder, old)
    os.replace(partial, folder)  # killed just before this line, the previous state is still whole in .old
    _remove(old)


def _remove(folder: Path) -> None:
    if folder.is_dir():
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def load(folder: Path) -> tuple[dict, object]:
    """``(document, values)`` from a folder :func:`save` wrote; anything that is not such a state (damaged, forged, from
    another bertology) is refused in one line naming the file, never believed."""
    old = folder.with_name(folder.name + ".old")
    if not folder.exists() and old.exists():  # a save was killed between its two renames
        folder = old
    where = folder / "state.json"
    try:
        document = read_json(where, max_depth=MAX_STATE_DEPTH)
        field(document, "values", (dict, list), where)
        arrays = read_npz(folder / "arrays.npz")
        values = decode(document.pop("values"), arrays)
    except StateError as exc:
        raise BertologyError(f"{exc.path}: not a state bertology can resume from ({exc.message}); delete {folder} to start over") from None
    except BertologyError as exc:
        raise BertologyError(f"{where}: not a state bertology can resume from ({exc}); delete {folder} to start over") from None
    except RecursionError:
        raise BertologyError(f"{where}: nested too deep to be a state bertology wrote; delete {folder} to start over") from None
    return document, values
