"""Golden tables: the numbers of a refactor's before and after, compared byte for byte (companion of golden_tables.sh).

Two modes:

    python bench/golden_compare.py BEFORE AFTER
        Compare two folders written by ``bench/golden_tables.sh`` file by file, byte for byte. Prints every file
        that differs (with the first differing line of a text file), or is in one folder only; exit status 1 if
        any, 0 if every file is identical. The ``_meta/`` folder (logs, timings, the environment) is not compared.

    python bench/golden_compare.py BEFORE AFTER --rtol 1e-6 [--atol 1e-9]
        The same, but a CSV table that differs byte for byte passes where its text columns are equal and every number
        agrees within ``|a - b| <= atol + rtol |a|`` (NaN only against NaN); prints the largest differences of each.

    python bench/golden_compare.py --capture RUN_FOLDER DEST
        Copy the tables of one command's run folder into DEST (used by golden_tables.sh): every ``*.csv`` and
        ``*.json`` under RUN_FOLDER, at the same relative path, except

        - files that are not results of the analysis: ``manifest.json`` (command line, versions, start and end
          times, absolute paths), model-folder files (``config.json``, ``tokenizer*.json``,
          ``special_tokens_map.json``, ``generation_config.json``, ``vocab.json``, ``training_args.json``), and
          anything under a hidden folder or a ``parts/`` folder (track's resumable per-checkpoint state);
        - in a JSON document, every key (at any depth) that is a wall time, a date, a version or a path:
          a key with a word (split at ``_``, ``-``, spaces) among VOLATILE_WORDS, or whose value is an absolute
          path (a string starting with ``/`` or ``~``, or a drive letter); an absolute path inside a list
          becomes "<absolute path>"; a value drawn at random per run by design (RANDOM_PER_RUN: a pre-training
          run's identity ``run.id``) is left out too. The document is written back with ``json.dumps(indent=2)`` (key order kept);
        - in a CSV, a column whose header has such a word is dropped (the file is rewritten with the csv module);
          a CSV without such a column is copied as it is, byte for byte.

        Also writes DEST/weights.sha256: the sha256 of every ``*.safetensors`` file under RUN_FOLDER (a trained
        or pruned model is then compared bit for bit as well).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import re
import sys
from pathlib import Path

#: Key or column words that mark a wall time, a date, a version or a path, never a number of the analysis.
VOLATILE_WORDS = frozenset({
    "second", "seconds", "secs", "time", "times", "timing", "timings", "elapsed", "duration", "speedup", "throughput",
    "date", "dates", "created", "started", "finished", "timestamp", "stamp", "version", "versions", "path", "paths",
    "hostname", "host", "pid", "cwd",
})
#: JSON files that are not tables of the analysis.
SKIP_NAMES = frozenset({
    "manifest.json", "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "vocab.json", "added_tokens.json", "training_args.json",
})
SKIP_FOLDERS = frozenset({"parts"})
ABSOLUTE = re.compile(r"^(/|~|[A-Za-z]:[\\/])")
META = "_meta"


def volatile(key: str) -> bool:
    return any(word in VOLATILE_WORDS for word in re.split(r"[_\-\s.]+", key.lower()))


#: (object key, key) pairs whose value is drawn at random per run by design: a pre-training run's identity ``run.id``.
RANDOM_PER_RUN = frozenset({("run", "id")})


def clean(value, parent: str | None = None):
    """``value`` without volatile keys, random run identities and absolute paths (see the module's docstring)."""
    if isinstance(value, dict):
        return {key: clean(item, str(key)) for key, item in value.items()
                if not volatile(str(key)) and (parent, str(key)) not in RANDOM_PER_RUN and not (isinstance(item, str) and ABSOLUTE.match(item))}
    if isinstance(value, list):
        return [("<absolute path>" if isinstance(item, str) and ABSOLUTE.match(item) else clean(item)) for item in value]
    return value


def capture_csv(source: Path, target: Path) -> None:
    data = source.read_bytes()
    text = data.decode("utf-8")
    rows = list(csv.reader(io.StringIO(text, newline="")))
    drop = {i for i, name in enumerate(rows[0]) if volatile(name)} if rows else set()
    if not drop:
        target.write_bytes(data)
        return
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([cell for i, cell in enumerate(row) if i not in drop])
    target.write_text(out.getvalue(), encoding="utf-8", newline="")


def capture_json(source: Path, target: Path) -> None:
    document = json.loads(source.read_text(encoding="utf-8"))
    target.write_text(json.dumps(clean(document), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def capture(run: Path, dest: Path) -> list[str]:
    """Copy ``run``'s tables into ``dest``; returns their relative paths."""
    if not run.is_dir():
        raise SystemExit(f"capture: {run}: no such run folder")
    dest.mkdir(parents=True, exist_ok=True)
    written, digests = [], []
    for path in sorted(run.rglob("*")):
        relative = path.relative_to(run)
        if not path.is_file() or any(part.startswith(".") or part in SKIP_FOLDERS for part in relative.parts[:-1]):
            continue
        if path.suffix == ".safetensors":
            digests.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {relative.as_posix()}\n")
            continue
        if path.suffix not in (".csv", ".json") or path.name in SKIP_NAMES:
            continue
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        (capture_csv if path.suffix == ".csv" else capture_json)(path, target)
        written.append(relative.as_posix())
    if digests:
        (dest / "weights.sha256").write_text("".join(digests), encoding="utf-8")
        written.append("weights.sha256")
    return written


def files(folder: Path) -> dict[str, Path]:
    return {path.relative_to(folder).as_posix(): path for path in folder.rglob("*")
            if path.is_file() and path.relative_to(folder).parts[0] != META}


def first_difference(a: bytes, b: bytes) -> str:
    """Where two text files first differ, for the report."""
    try:
        lines_a, lines_b = a.decode("utf-8").splitlines(), b.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return f"binary, {len(a)} vs {len(b)} bytes"
    differing = sum(1 for x, y in zip(lines_a, lines_b) if x != y) + abs(len(lines_a) - len(lines_b))
    for number, (x, y) in enumerate(zip(lines_a, lines_b), 1):
        if x != y:
            return f"{differing} of {max(len(lines_a), len(lines_b))} lines differ; first at line {number}:\n      - {x[:200]}\n      + {y[:200]}"
    return f"{len(lines_a)} vs {len(lines_b)} lines (one is a prefix of the other)"


def numeric_difference(a: Path, b: Path, rtol: float, atol: float) -> str | None:
    """For two CSV tables of the same shape and columns whose text columns are equal: None where every number agrees within
    ``|x - y| <= atol + rtol |x|`` (NaN only against NaN), else why not; always with the largest differences found."""
    import numpy as np
    import pandas as pd

    x, y = pd.read_csv(a), pd.read_csv(b)
    if list(x.columns) != list(y.columns) or x.shape != y.shape:
        return f"columns or shape differ: {x.shape} {list(x.columns)[:6]} against {y.shape} {list(y.columns)[:6]}"
    worst_abs = worst_rel = 0.0
    for column in x.columns:
        if pd.api.types.is_numeric_dtype(x[column]) and pd.api.types.is_numeric_dtype(y[column]):
            u, v = x[column].to_numpy(np.float64), y[column].to_numpy(np.float64)
            if not np.array_equal(np.isnan(u), np.isnan(v)):
                return f"column {column}: NaN in one table where the other has a number"
            both = ~np.isnan(u)
            gap = np.abs(u[both] - v[both])
            if gap.size:
                worst_abs = max(worst_abs, float(gap.max()))
                worst_rel = max(worst_rel, float((gap / np.maximum(np.abs(u[both]), 1e-300)).max()))
                if not np.all(gap <= atol + rtol * np.abs(u[both])):
                    return f"column {column}: beyond tolerance (largest difference {gap.max():.3g})"
        elif not x[column].equals(y[column]):
            return f"column {column}: text differs"
    print(f"  within tolerance: {a.name}: largest absolute difference {worst_abs:.3g}, relative {worst_rel:.3g}")
    return None


def compare(before: Path, after: Path, rtol: float | None = None, atol: float = 0.0) -> int:
    for folder in (before, after):
        if not folder.is_dir():
            print(f"error: {folder}: no such folder", file=sys.stderr)
            return 2
    a, b = files(before), files(after)
    if not a and not b:
        print("error: both folders are empty", file=sys.stderr)
        return 2
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    differ, same, close = [], 0, 0
    for name in sorted(a.keys() & b.keys()):
        bytes_a, bytes_b = a[name].read_bytes(), b[name].read_bytes()
        if bytes_a == bytes_b:
            same += 1
        elif rtol is not None and name.endswith(".csv") and (why := numeric_difference(a[name], b[name], rtol, atol)) is None:
            close += 1
        else:
            differ.append((name, why if rtol is not None and name.endswith(".csv") else first_difference(bytes_a, bytes_b)))
    for name in only_a:
        print(f"only in {before}: {name}")
    for name in only_b:
        print(f"only in {after}: {name}")
    for name, how in differ:
        print(f"DIFFERS: {name}: {how}")
    problems = len(only_a) + len(only_b) + len(differ)
    within = f", {close} within rtol {rtol:g} / atol {atol:g}" if rtol is not None else ""
    print(f"{same} identical{within}, {len(differ)} differ, {len(only_a)} only in {before}, {len(only_b)} only in {after}")
    for folder in (before, after):  # a command that failed leaves a note (and fewer files) behind
        failed = folder / META / "FAILED"
        if failed.exists():
            print(f"note: {folder} was written by a run where commands failed: {failed.read_text().strip()}")
            problems += 1
    print(("IDENTICAL" if not close else "EQUAL WITHIN TOLERANCE") if problems == 0 else "DIFFERENT")
    return 0 if problems == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", action="store_true", help="copy RUN_FOLDER's tables into DEST instead of comparing")
    parser.add_argument("first", type=Path, help="BEFORE (or with --capture: RUN_FOLDER)")
    parser.add_argument("second", type=Path, help="AFTER (or with --capture: DEST)")
    parser.add_argument("--rtol", type=float, help="CSV tables that differ byte for byte may still agree number by number within "
                        "|a - b| <= atol + rtol |a| (text columns and NaN exactly): for changes that move float rounding")
    parser.add_argument("--atol", type=float, default=0.0)
    args = parser.parse_args()
    if args.capture:
        for name in capture(args.first, args.second):
            print(name)
        return 0
    return compare(args.first, args.second, args.rtol, args.atol)


if __name__ == "__main__":
    sys.exit(main())
