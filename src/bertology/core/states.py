"""Analyzer states as plain files, never pickles: a JSON document for the structure and one ``.npz`` of arrays
(read with ``allow_pickle=False``), so that a resumed analysis runs no code from its run folder.

:func:`encode` turns a value (an analyzer, with its moments, arrays, tensors, lists and dicts) into JSON with
references into ``arrays``; :func:`decode` rebuilds it. Objects are stored as their class's name and their
``__dict__``, and rebuilt without calling any of their code (``cls.__new__`` and the dict set back), and only
for classes bertology's own package defines, or the modules of the registered analysis families (a user's
family is already running in the process): any other class name in a state file is refused.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from bertology.core.errors import BertologyError

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


def _allowed_modules() -> set[str]:
    from bertology.families import registered

    return {type(family).__module__ for family in registered().values()}


def _class(name: str):
    module_name, _, qualname = name.partition(":")
    if not (module_name == "bertology" or module_name.startswith("bertology.") or module_name in _allowed_modules()):
        raise BertologyError(f"refused: a state names the class {name}, which is neither bertology's nor a registered family's")
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    target = module
    for part in qualname.split("."):  # nested classes only: every step must be a class of that module
        target = getattr(target, part, None)
        if not isinstance(target, type) or target.__module__ != module_name:
            raise BertologyError(f"refused: {name} in a state is no class of {module_name}")
    if target.__qualname__ != qualname:
        raise BertologyError(f"refused: {name} in a state is no class of {module_name}")
    return target


def decode(data, arrays):
    """The value :func:`encode` stored (``arrays``: the loaded ``.npz``)."""
    if isinstance(data, list):
        return [decode(item, arrays) for item in data]
    if not isinstance(data, dict):
        return data
    if "__array__" in data:
        return np.array(arrays[data["__array__"]])
    if "__tensor__" in data:
        return torch.from_numpy(np.array(arrays[data["__tensor__"]]))
    if "__tuple__" in data:
        return tuple(decode(item, arrays) for item in data["__tuple__"])
    if "__set__" in data:
        return {decode(item, arrays) for item in data["__set__"]}
    if "__frozenset__" in data:
        return frozenset(decode(item, arrays) for item in data["__frozenset__"])
    if "__dict__" in data:
        return {decode(key, arrays): decode(item, arrays) for key, item in data["__dict__"]}
    if "__object__" in data:
        cls = _class(data["__object__"])
        instance = cls.__new__(cls)
        instance.__dict__.update(decode(data["state"], arrays))  # no __init__ or __setstate__ runs
        return instance
    raise BertologyError(f"refused: a state holds an unknown record {sorted(data)[:3]}")


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
    """``(document, values)`` from a folder :func:`save` wrote; anything that is not such a state is refused in one line."""
    old = folder.with_name(folder.name + ".old")
    if not folder.exists() and old.exists():  # a save was killed between its two renames
        folder = old
    try:
        document = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        with np.load(folder / "arrays.npz", allow_pickle=False) as arrays:
            values = decode(document.pop("values"), {key: arrays[key] for key in arrays.files})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BertologyError(f"{folder}: not a state bertology can resume from ({exc}); delete it to start over") from exc
    return document, values
