"""The run folder: tidy tables (CSV and Parquet), figures, report and manifest, written whole or not at all.

A run claims its ``out`` folder before any computing (:func:`claim`, :func:`claims_out`): ``out`` must
be new, empty, or a bertology run folder (it holds ``.bertology-run``, or an earlier bertology's
``manifest.json``) that no other live run holds (``.bertology-lock`` holds the pid of the run writing
it; the lock of a process that died is taken over). A file, a place that cannot be written, or a
folder of other files is refused at once, in one line.

The outputs are written into a staging folder beside ``out`` (``<out>.tmp-<random>``), each file
atomically, and :meth:`RunFolder.commit` swaps it in: it renames the previous run to
``<out>.old-<random>``, renames the staging folder to ``out`` and deletes the previous run. A run that
fails or is killed before the swap leaves the previous run exactly as it was (a failing run removes its
staging folder; a killed one leaves it beside ``out``); one killed between the two renames (the only
window) leaves both runs whole beside ``out``. Nothing of an earlier run stays next to a new one.

Work a run resumes (fine-tuning's ``checkpoint/``, pre-training's ``training/``, track's ``parts/``) is
written inside ``out`` as it is made; the commit drops it or, when asked, keeps it (hard links).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bertology.core.errors import BertologyError

MARKER = ".bertology-run"
LOCK = ".bertology-lock"
#: Text cells starting with these run as formulas in spreadsheets (OWASP, CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _random_name(parent: Path, stem: str) -> Path:
    return parent / f"{stem}{secrets.token_hex(4)}"


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(temporary_path)``, then rename the temporary file to ``path``; its mode follows the umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _random_name(path.parent, f".{path.name}.part-")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def link_tree(source: Path, target: Path) -> None:
    """Copy the folder ``source`` to ``target`` as hard links (copies where links are not possible)."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)


def spreadsheet_safe(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with each text cell that starts like a formula prefixed with ``'``; numbers stay as they are."""
    safe = table.copy()
    for column in table.select_dtypes(include=["object", "string", "category"]).columns:
        safe[column] = table[column].map(lambda v: "'" + v if isinstance(v, str) and v.startswith(FORMULA_STARTS) else v)
    return safe


def _lock_holder(folder: Path) -> int | None:
    """The pid in ``folder``'s lock if that process is alive (None: no lock, or a stale one)."""
    try:
        pid = int((folder / LOCK).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return pid


def _refuse_if_held(out: str | Path, folder: Path) -> None:
    holder = _lock_holder(folder)
    if holder is not None and holder != os.getpid():
        raise BertologyError(f"{out}: another run (pid {holder}) is writing this folder; wait for it to end or give another folder")


def _is_run_folder(folder: Path) -> bool:
    """Marked, or written before the marker existed (its manifest names bertology's version)."""
    if (folder / MARKER).is_file():
        return True
    try:
        return "bertology" in json.loads((folder / "manifest.json").read_text()).get("versions", {})
    except (OSError, ValueError, AttributeError):
        return False


def check_out(out: str | Path) -> None:
    """Refuse at once, in one line, an ``out`` no run may write; creates nothing."""
    path = Path(out).absolute()
    if path.exists() and not path.is_dir():
        raise BertologyError(f"{out}: is a file, not a folder; give a new folder or an earlier run folder")
    if path.is_dir():
        if any(path.iterdir()) and not _is_run_folder(path):
            raise BertologyError(f"{out}: not a bertology run folder (it holds other files, which the run would replace); give a new or empty folder")
        _refuse_if_held(out, path)
        places = [path, path.parent]  # the lock inside, the staging folder beside
    else:
        places = [next(parent for parent in path.parents if parent.exists())]
        if not places[0].is_dir():
            raise BertologyError(f"{out}: cannot write there: {places[0]} is a file")
    for place in places:
        if not os.access(place, os.W_OK | os.X_OK):
            raise BertologyError(f"{out}: cannot write there (no permission to write in {place})")


def check_file_out(out: str | Path) -> None:
    """Refuse at once, in one line, a single-file output (a page) that cannot be written; creates nothing."""
    path = Path(out).absolute()
    if path.is_dir():
        raise BertologyError(f"{out}: is a folder; give the file to write, for instance {Path(out) / 'view.html'}")
    parent = next(parent for parent in path.parents if parent.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise BertologyError(f"{out}: cannot write there ({parent} is not a folder you can write in)")


@dataclass
class _Claim:
    """One run's hold on its ``out`` folder."""

    out: Path  # resolved
    thread: int
    existed: bool
    fresh: bool  # new or empty when claimed
    depth: int = 0
    staging: Path | None = None


_claims: dict[Path, _Claim] = {}
_claims_lock = threading.RLock()


def _take(out: str | Path) -> _Claim:
    check_out(out)
    path = Path(out).resolve()
    existed = path.is_dir()
    held = _Claim(path, threading.get_ident(), existed, fresh=not existed or not any(path.iterdir()))
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not (path / MARKER).is_file():
            _mark(path)
        while True:
            try:
                handle = os.open(path / LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                _refuse_if_held(out, path)
                (path / LOCK).unlink(missing_ok=True)  # stale: its run died
        with os.fdopen(handle, "w") as lock:
            lock.write(f"{os.getpid()}\n")
    except OSError as exc:
        raise BertologyError(f"{out}: cannot write there ({exc.strerror or exc})") from exc
    return held


def _mark(folder: Path) -> None:
    atomic_write(folder / MARKER, lambda p: p.write_text("A bertology run folder: a new run writing here replaces it whole.\n"))


def _release(held: _Claim) -> None:
    """Remove an uncommitted staging folder, the lock, and ``out`` itself if it was new and stayed empty."""
    if held.staging is not None:
        shutil.rmtree(held.staging, ignore_errors=True)
    if _lock_holder(held.out) == os.getpid():
        (held.out / LOCK).unlink(missing_ok=True)
    if held.fresh and held.out.is_dir() and [p.name for p in held.out.iterdir()] == [MARKER]:
        (held.out / MARKER).unlink()
        if not held.existed:
            held.out.rmdir()


@contextmanager
def claim(out: str | Path) -> Iterator[_Claim]:
    """Hold ``out`` for one run: checked (:func:`check_out`), created and locked; released on the way out.

    The same thread may claim it again (a run that saves through an API that claims too)."""
    key = Path(out).resolve()
    with _claims_lock:
        held = _claims.get(key)
        if held is not None and held.thread != threading.get_ident():
            raise BertologyError(f"{out}: another run of this process is writing this folder; give another folder")
        if held is None:
            held = _claims[key] = _take(out)
        held.depth += 1
    try:
        yield held
    finally:
        with _claims_lock:
            held.depth -= 1
            if held.depth == 0:
                del _claims[key]
                _release(held)


def claims_out(function: Callable) -> Callable:
    """Decorate a function with an ``out`` argument: ``out`` (unless None) is claimed before it runs, for the whole call."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def claimed(*args, **kwargs):
        out = signature.bind(*args, **kwargs).arguments.get("out")
        if out is None:
            return function(*args, **kwargs)
        with claim(out):
            return function(*args, **kwargs)

    return claimed


class RunFolder:
    """One run's outputs: written into ``path``, a staging folder beside ``out``, and swapped in whole by :meth:`commit`.

    Within a claim of ``out`` (see :func:`claims_out`) every RunFolder writes into the claim's one staging
    folder, which the claim removes if the run fails before the commit. Used on its own, a RunFolder
    claims ``out`` itself; as a context manager it commits when its block ends without an error.
    """

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self._own = None
        with _claims_lock:
            held = _claims.get(self.out.resolve())
            if held is None or held.thread != threading.get_ident():
                self._own = claim(self.out)
                held = self._own.__enter__()
            if held.staging is None:
                held.staging = _random_name(held.out.parent, f"{held.out.name}.tmp-")
                held.staging.mkdir()
                _mark(held.staging)
        self._claim = held
        self.path = held.staging

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.commit()
        elif self._own is not None:
            self._own.__exit__(kind, error, traceback)

    def commit(self, keep: tuple[str, ...] = ()) -> Path:
        """Swap this run in for the previous one at ``out`` and return ``out``; ``keep``: folders of the previous run to carry over."""
        out = self._claim.out
        for name in keep:
            if (out / name).is_dir() and not (self.path / name).exists():
                link_tree(out / name, self.path / name)
        old = _random_name(out.parent, f"{out.name}.old-")
        os.rename(out, old)
        os.rename(self.path, out)  # the window: between these two renames, out is missing
        self._claim.staging = None
        shutil.rmtree(old)
        if self._own is not None:
            self._own.__exit__(None, None, None)
        return self.out

    def write_table(self, name: str, table: pd.DataFrame) -> tuple[Path, Path]:
        """``name.csv`` (text cells safe to open in a spreadsheet) and ``name.parquet`` (the exact values)."""
        csv = atomic_write(self.path / f"{name}.csv", lambda p: spreadsheet_safe(table).to_csv(p, index=False))
        parquet = atomic_write(self.path / f"{name}.parquet", lambda p: table.to_parquet(p, index=False))
        return csv, parquet

    def write_json(self, name: str, data: dict) -> Path:
        return atomic_write(self.path / name, lambda p: p.write_text(json.dumps(data, indent=2, default=str) + "\n"))

    def write_text(self, name: str, text: str) -> Path:
        return atomic_write(self.path / name, lambda p: p.write_text(text, encoding="utf-8"))

    def write_figure(self, name: str, figure) -> Path:
        """Save a matplotlib figure as ``name.png`` and close it."""
        import matplotlib.pyplot as plt

        try:
            return atomic_write(self.path / f"{name}.png", lambda p: figure.savefig(p, format="png", dpi=110, bbox_inches="tight"))
        finally:
            plt.close(figure)
