"""The resume store of ``track``: each checkpoint's :class:`~bertology.studies.track.result.CheckpointResult` is saved under
``out/parts`` as soon as it exists (:func:`save_part`; the ``.npz``, written last, marks it complete), keyed by the run's corpus
and settings and the checkpoint's weights and tokenizer (:func:`part_key`), and read back only when that key matches and every
array and table is what bertology writes (:func:`load_part`); a damaged part is refused in one line naming the file to delete."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from bertology.core.errors import StateError
from bertology.core.model.kinds import DECODER, ENCODER, Kind, kind_named
from bertology.core.model.models import load_tokenizer
from bertology.core.storage.digests import folder_weights_digest, tokenizer_digest
from bertology.core.storage.runfolder import atomic_write
from bertology.core.storage.safeload import field as document_field
from bertology.core.storage.safeload import parse_json, read_npz, whole_number
from bertology.studies.track.checkpoints import MAX_STEP
from bertology.studies.track.peaks import peak_metrics
from bertology.studies.track.probe import ProbeResult
from bertology.studies.track.result import TRACK_COLUMNS, TRACK_LAYER_COLUMNS, CheckpointResult
from bertology.studies.track.verdicts import json_value


def part_name(checkpoint: str) -> str:
    """A file name for one checkpoint's part: readable, and unique by a hash of the checkpoint."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", checkpoint.rstrip("/"))[-60:]
    return f"{readable}-{hashlib.blake2b(checkpoint.encode(), digest_size=4).hexdigest()}"


def _damaged_part(path: Path, marker: Path, what: str) -> StateError:
    """The one-line refusal of a damaged part: the file, what is wrong, and that deleting the part's ``marker`` (``.npz``)
    computes the checkpoint again."""
    return StateError(path, f"{what}; delete {marker} to compute this checkpoint again")


def part_key(settings_key: str, checkpoint: str) -> str:
    """What a checkpoint's part must have been computed with to be used: the run's corpus and settings, and the
    checkpoint's weights and tokenizer (content hashes of a local folder's weight files, cached, and of its tokenizer; a hub
    name stands for itself)."""
    if not Path(checkpoint).is_dir():
        return json.dumps({"settings": json.loads(settings_key), "weights": checkpoint}, sort_keys=True)
    return json.dumps({"settings": json.loads(settings_key), "weights": folder_weights_digest(Path(checkpoint)),
                       "tokenizer": tokenizer_digest(load_tokenizer(checkpoint))}, sort_keys=True)


def load_part(parts: Path, name: str, key: str, replicates: int, finished: bool) -> CheckpointResult | None:
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
    if part_name(checkpoint) != name:
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
    extra = _part_extras(arrays, meta, kind, replicates, means.shape[1], marker)
    if extra is None:  # a sound decoder's part written before track followed induction heads or read its probe: computed again
        return None
    loss, loss_name = measured
    return CheckpointResult(step, checkpoint, *tables, means, excess, syntax, kind, np.nan if loss is None else float(loss), loss_name, **extra)


def _part_extras(arrays: dict, meta: dict, kind: Kind, replicates: int, layers: int, marker: Path) -> dict | None:
    """What a part holds beyond the profile: a decoder's induction scores (:func:`_part_induction`) and induction probe
    (:func:`_part_probe`), and the measured loss's replicates where it has them; None where a decoder's part lacks either."""
    extra = _part_induction(arrays, meta, kind, replicates, layers, marker)
    if extra is not None and not kind.sees_later_keys:
        extra["probe"] = _part_probe(arrays, meta, replicates, layers, marker)
        if extra["probe"] is None:
            return None
    if extra is not None and "loss_replicates" in arrays and arrays["loss_replicates"].size:
        extra["loss_replicates"] = _part_losses(arrays["loss_replicates"], replicates, marker)
    return extra


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


#: A decoder's part's arrays of the induction probe (:class:`~bertology.studies.track.probe.ProbeResult`'s fields).
PROBE_SHARES = ("induction", "previous", "period_scores", "maps")
PROBE_EXCESS = ("induction_excess", "previous_excess", "period_excess")


def _part_probe(arrays: dict, meta: dict, replicates: int, layers: int, marker: Path) -> ProbeResult | None:
    """A decoder's part's induction probe (:class:`~bertology.studies.track.probe.ProbeResult`): its scores ``[replicates, layers,
    head]`` (shares, their excess in [-1, 1]), its periods (whole numbers from 1, one row of ``period_scores`` and
    ``period_excess`` each), its in-context learning score ``[replicates]`` or empty, and its maps ``[layers, head, n, n]``;
    None where the part has none (written before track read the probe)."""
    members = [f"probe_{name}" for name in (*PROBE_SHARES, *PROBE_EXCESS, "periods", "icl")]
    if any(member not in arrays for member in members) or "probe_sequences" not in meta:
        return None
    heads = arrays["probe_induction"].shape[-1] if arrays["probe_induction"].ndim == 3 else None
    periods = arrays["probe_periods"]
    if periods.dtype.kind not in "iu" or periods.ndim != 1 or not periods.size or (periods < 1).any():
        raise _damaged_part(marker, marker, f"'probe_periods' is a {periods.dtype} array of shape {periods.shape}, not whole periods from 1")
    scores, by_period = (replicates, layers, heads), (len(periods), layers, heads)
    shapes = {"induction": scores, "previous": scores, "period_scores": by_period, "maps": (layers, heads, None, None),
              "induction_excess": scores, "previous_excess": scores, "period_excess": by_period}
    values = {name: _part_shares(arrays[f"probe_{name}"], f"probe_{name}", shapes[name], marker, low=-1.0 if name in PROBE_EXCESS else 0.0)
              for name in (*PROBE_SHARES, *PROBE_EXCESS)}
    icl = arrays["probe_icl"]
    if icl.dtype.kind != "f" or (icl.size and (icl.shape != (replicates,) or np.isinf(icl).any())):
        raise _damaged_part(marker, marker, f"'probe_icl' has shape {icl.shape} or infinite values")
    try:
        sequences = whole_number(document_field(meta, "probe_sequences", int, marker), "probe_sequences", marker)
        second_copy = whole_number(document_field(meta, "probe_second_copy", int, marker), "probe_second_copy", marker,
                                   high=values["maps"].shape[-1] - 1)
        positions = document_field(meta, "probe_icl_positions", (list, type(None)), marker)
    except StateError as exc:
        raise _damaged_part(marker, marker, f"its 'meta' is damaged: {exc.message}") from None
    if icl.size and (positions is None or len(positions) != 2):
        raise _damaged_part(marker, marker, "'probe_icl_positions' must be the two positions of its in-context learning score")
    return ProbeResult(values["induction"], values["induction_excess"], values["previous"], values["previous_excess"], periods,
                       values["period_scores"], values["period_excess"], icl if icl.size else None,
                       tuple(int(p) for p in positions) if icl.size else None, sequences, values["maps"], second_copy)


def _part_losses(values: np.ndarray, replicates: int, marker: Path) -> np.ndarray:
    """A part's measured loss under each bootstrap replicate ``[replicates]``: losses (at least 0) or NaN."""
    if values.dtype.kind != "f" or values.shape != (replicates,) or np.isinf(values).any() or (values[np.isfinite(values)] < 0).any():
        raise _damaged_part(marker, marker, f"'loss_replicates' has shape {values.shape} or values that are not losses")
    return values


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


def save_part(parts: Path, name: str, key: str, result: CheckpointResult) -> None:
    """One checkpoint's results, written before the next checkpoint starts; the ``.npz``, written last, marks the part complete."""
    atomic_write(parts / f"{name}.rows.parquet", lambda p: result.rows.to_parquet(p, index=False))
    atomic_write(parts / f"{name}.layers.parquet", lambda p: result.layers.to_parquet(p, index=False))
    probe = result.probe
    meta = json.dumps({"step": result.step, "checkpoint": result.checkpoint, "kind": result.kind.name,
                       "measured_loss": json_value(result.measured_loss), "measured_loss_name": result.measured_loss_name,
                       "icl_sequences": result.icl_sequences, "icl_positions": result.icl_positions,
                       **({"probe_sequences": probe.sequences, "probe_icl_positions": probe.icl_positions,
                           "probe_second_copy": probe.second_copy} if probe is not None else {})})
    syntax = result.syntax if result.syntax is not None else np.array([])
    induction = result.induction if result.induction is not None else np.array([])
    induction_excess = result.induction_excess if result.induction_excess is not None else np.array([])
    icl = result.icl if result.icl is not None else np.array([])
    losses = result.loss_replicates if result.loss_replicates is not None else np.array([])
    probed = {} if probe is None else {f"probe_{name}": getattr(probe, name) for name in (*PROBE_SHARES, *PROBE_EXCESS, "periods")}
    if probe is not None:
        probed["probe_icl"] = probe.icl if probe.icl is not None else np.array([])

    def write(path: Path) -> None:
        with path.open("wb") as handle:
            np.savez(handle, key=key, meta=meta, means=result.means, excess=result.excess, syntax=syntax, induction=induction,
                     induction_excess=induction_excess, icl=icl, loss_replicates=losses, **probed)

    atomic_write(parts / f"{name}.npz", write)
