"""Reading the files bertology keeps or is handed (states, checkpoints, classifiers, parts), validated before use.

Every load goes through these helpers, so that a damaged or forged file is refused in one line that names the
file and what is wrong (:class:`~bertology.core.errors.StateError`), never believed and never a traceback:

- :func:`read_json`: JSON with a nesting limit (checked before parsing, so ``[[[[...`` 200,000 deep is a message, not a
  ``RecursionError``) and without ``NaN``/``Infinity`` (which the JSON standard does not have).
- :func:`read_npz`: a NumPy ``.npz`` with ``allow_pickle=False``; a file that is no zip, or holds object arrays, is refused.
- :func:`field`, :func:`whole_number`, :func:`finite_array`: the checks of a loaded document's types, ranges and shapes.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from bertology.core.errors import StateError

#: The deepest nesting of arrays and objects a JSON file bertology reads may have (its own files nest a dozen deep).
MAX_JSON_DEPTH = 64


def json_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` in JSON ``text`` (brackets inside strings are not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for character in text:
        if in_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                in_string = False
        elif character == '"':
            in_string = True
        elif character in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif character in "]}":
            depth -= 1
    return deepest


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number as a float, refused where it overflows to infinity (``1e400``)."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is too large for a number")
    return value


def parse_json(text: str, where: str | Path, *, max_depth: int = MAX_JSON_DEPTH):
    """``text`` as JSON, refused in one line naming ``where`` when it is not JSON, nests deeper than ``max_depth``,
    or holds ``NaN``/``Infinity``."""
    if json_depth(text) > max_depth:
        raise StateError(where, f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise StateError(where, f"not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise StateError(where, f"not valid JSON ({exc})") from None


def read_json(path: Path, *, max_depth: int = MAX_JSON_DEPTH):
    """The JSON document in ``path`` (UTF-8), checked as :func:`parse_json` does; an unreadable file is refused in one line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise StateError(path, f"not UTF-8 text (invalid byte at {exc.start})") from None
    except OSError as exc:
        raise StateError(path, f"cannot read it ({exc.strerror or exc})") from None
    return parse_json(text, path, max_depth=max_depth)


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` file ``path``, read with ``allow_pickle=False``; anything else is refused in one line."""
    try:
        if not zipfile.is_zipfile(path):  # np.load would take other bytes for a pickle or a bare .npy
            raise zipfile.BadZipFile("no zip archive")
        with np.load(path, allow_pickle=False) as arrays:
            return {key: np.asarray(arrays[key]) for key in arrays.files}
    except (zipfile.BadZipFile, EOFError) as exc:
        raise StateError(path, f"not a NumPy .npz archive ({exc})") from None
    except OSError as exc:
        raise StateError(path, f"cannot read it ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # object arrays (pickles), damaged members
        raise StateError(path, f"not an array archive bertology wrote ({exc})") from None


def field(document, key: str, kinds, where: str | Path):
    """``document[key]``, which must be present and of one of ``kinds`` (``bool`` never counts as a number)."""
    if not isinstance(document, dict):
        raise StateError(where, f"expected a JSON object, found {type(document).__name__}")
    if key not in document:
        raise StateError(where, f"missing key {key!r}")
    value = document[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(kind.__name__ for kind in kinds)
        raise StateError(where, f"{key!r} must be {names}, not {json.dumps(value, default=str)[:60]}")
    return value


def whole_number(value, name: str, where: str | Path, *, low: int = 0, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; a float, a bool or a number out of range is refused in one line."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise StateError(where, f"{name} must be a whole number, not {value!r}"[:200])
    if value < low or (high is not None and value > high):
        bounds = f"from {low}" if high is None else f"from {low} to {high}"
        raise StateError(where, f"{name} = {value} is out of range (it must be {bounds})")
    return int(value)


def finite_array(value, name: str, where: str | Path, *, shape: tuple | None = None, ndim: int | None = None) -> np.ndarray:
    """``value`` as a numeric array of only finite values (and of ``shape``/``ndim`` where given; ``None`` in a shape: any size)."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        raise StateError(where, f"{name} is not an array of real numbers") from None
    if array.dtype.kind not in "biuf":  # not objects, strings or complex numbers
        raise StateError(where, f"{name} is not an array of real numbers")
    if ndim is not None and array.ndim != ndim:
        raise StateError(where, f"{name} has {array.ndim} dimensions, expected {ndim}")
    if shape is not None and (array.ndim != len(shape) or any(want is not None and got != want for got, want in zip(array.shape, shape))):
        raise StateError(where, f"{name} has shape {tuple(array.shape)}, expected {tuple('any' if s is None else s for s in shape)}")
    if array.dtype != bool and not np.isfinite(array).all():
        raise StateError(where, f"{name} holds NaN or infinite values")
    return array
