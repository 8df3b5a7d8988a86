"""The run folder: tidy tables (CSV and Parquet), figures, report and manifest, written whole or not at all.

A run claims its ``out`` folder before any computing (:func:`claim`, :func:`claims_out`): ``out`` must be new, empty, or
a bertology run folder (it holds ``.bertology-run``, or an earlier bertology's ``manifest.json``) that no other live run
holds and that holds nothing but what its earlier run wrote, as it wrote it: a run lists its files in the marker at the
swap (:mod:`~bertology.core.storage.inventory`), the work folders below are its own, and an earlier bertology's folder,
which lists nothing, is refused while it holds anything else. The run holds an exclusive ``flock`` on
``.bertology-lock`` for as long as it claims ``out`` (the file also holds its pid, for the message); the kernel releases
the lock when the process ends, however it ends, so a lock is never stale. Refused at once, in one line, because
replacing ``out`` would lose something: a file, a place that cannot be written, a folder of other files, a file or
folder of the user's (or a table they edited) in a run folder, a run folder that holds other run folders (``--out runs``
once, then default outputs ``runs/<command>-...`` inside it), an ``out`` that is or holds one of the run's inputs
(``--model runs/ft --out runs/ft``), and an ``out`` that is or holds the current folder.

The outputs are written into a staging folder beside ``out`` (``<out>.tmp-<random>``), each file atomically, and
:meth:`RunFolder.commit` swaps it in: it renames the previous run to ``<out>.old-<random>``, renames the staging folder
to ``out`` and deletes the previous run. A run that fails or is killed before the swap leaves the previous run exactly
as it was (a failing run removes its staging folder; a killed one leaves it beside ``out``); one killed between the two
renames (the only window) leaves both runs whole beside ``out``. Nothing of an earlier run stays next to a new one. A
file of the user's put into ``out`` while the run ran stops the swap: both it and the new run (in its staging folder)
are kept.

Work a run resumes (fine-tuning's ``checkpoint/``, pre-training's ``training/``, track's ``parts/``) is
written inside ``out`` as it is made; the commit drops it or, when asked, keeps it (hard links). These
folders hold model weights, states and tables, never a run folder, so they do not stop ``out`` from
being replaced. If the previous run cannot be deleted after the swap, a :class:`RunFolderWarning` says
so and it is left as ``<out>.old-<random>``.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import functools
import inspect
import json
import os
import platform
import secrets
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pandas as pd

from bertology.core.errors import BertologyError
from bertology.core.storage.inventory import MARKER, foreign_refusal, marker_text, take_inventory

LOCK = ".bertology-lock"
#: Text cells starting with these run as formulas in spreadsheets (OWASP, CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


#: The folders inside ``out`` where a command keeps work it resumes, with what they hold: a run of another command
#: (``claims_out(work=...)`` names a command's own) is refused while one is there, as replacing ``out`` would lose it.
#: ``NAME.old``/``NAME.partial`` are the same work caught between two renames of an atomic save.
WORK_FOLDERS = {
    "resume": "an unfinished analysis's saved states",
    "checkpoint": "an unfinished fine-tuning's checkpoint",
    "training": "an unfinished pre-training's state and checkpoints",
    "parts": "track's saved per-checkpoint results",
}
_WORK_SUFFIXES = ("", ".old", ".partial")
#: The top-level names in ``out`` that are the run's own whatever they hold: the marker, the lock, the work folders.
OWN_NAMES = frozenset({MARKER, LOCK, *(f"{name}{suffix}" for name in WORK_FOLDERS for suffix in _WORK_SUFFIXES)})
#: Where a path may start inside an option's text: ``NAME=words:FILE``, ``KEY:PATH`` (the check looks at every such tail).
PATH_SEPARATORS = "=:"


class RunFolderWarning(UserWarning):
    """Something about a run folder the user should know that loses no work (a previous run left to delete)."""


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


def _read_pid(handle: int) -> int:
    try:
        return int(os.pread(handle, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return 0


def _lock_holder(folder: Path) -> int | None:
    """The pid of the live run that holds ``folder``'s lock (0 if it has not written it yet); None when no run holds it.

    A run holds the lock with ``flock`` while it lives: a lock file no process holds (its run died) is free."""
    try:
        handle = os.open(folder / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(handle)
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None
    finally:
        os.close(handle)


def _refuse_if_held(out: str | Path, folder: Path) -> None:
    holder = _lock_holder(folder)
    if holder is not None and holder != os.getpid():
        who = f"another run (pid {holder})" if holder else "another run"
        raise BertologyError(f"{out}: {who} is writing this folder; wait for it to end or give another folder")


def _lock(folder: Path, out: str | Path) -> int:
    """Take ``folder``'s lock (an exclusive ``flock`` on its lock file, which then holds this pid); returns the open handle.

    A lock file unlinked by the run that held it, between this run's open and flock, is opened again."""
    path = folder / LOCK
    for _ in range(20):
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: by a live run, or for an instant by check_out peeking
            os.close(handle)
            _refuse_if_held(out, folder)
            time.sleep(0.05)
            continue
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is None or not os.path.samestat(os.fstat(handle), current):
            os.close(handle)
            continue
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"{os.getpid()}\n".encode(), 0)
        return handle
    raise BertologyError(f"{out}: another run is writing this folder; wait for it to end or give another folder")


def _unlock(folder: Path, handle: int) -> None:
    """Remove ``folder``'s lock file if it is still the one ``handle`` holds, then let the lock go."""
    try:
        if os.path.samestat(os.fstat(handle), os.stat(folder / LOCK)):
            (folder / LOCK).unlink()
    except OSError:
        pass
    finally:
        os.close(handle)


def _manifest(folder: Path) -> dict:
    """``folder``'s ``manifest.json`` as a dict; empty where there is none or it is not a JSON object."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _is_run_folder(folder: Path) -> bool:
    """Marked, or written before the marker existed (its manifest names bertology's version)."""
    if (folder / MARKER).is_file():
        return True
    versions = _manifest(folder).get("versions")
    return isinstance(versions, dict) and "bertology" in versions


def _nested_run_folder(folder: Path) -> Path | None:
    """The first run folder found below ``folder`` (not ``folder`` itself), or None."""
    for place, subfolders, _ in os.walk(folder):
        subfolders.sort()
        for name in subfolders:
            if _is_run_folder(Path(place) / name):
                return Path(place) / name
    return None


def _path_candidates(text: str) -> list[str]:
    """``text`` and every tail of it after one of :data:`PATH_SEPARATORS`: a path given inside an option's value
    (``neg=words:W/list.txt``) is an input too."""
    return [text] + [text[k + 1:] for k, character in enumerate(text) if character in PATH_SEPARATORS and text[k + 1:]]


def _existing_paths(values) -> list[tuple[object, Path]]:
    """``(as given, resolved)`` for each str or path in ``values`` (lists, tuples and dict values looked into) that names,
    or holds after a separator (:func:`_path_candidates`), an existing path."""
    found = []
    for value in values:
        if isinstance(value, (list, tuple, set, frozenset, dict)):
            found += _existing_paths(value.values() if isinstance(value, dict) else value)
            continue
        text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
        if not isinstance(text, str) or "\n" in text or len(text) > 4096:  # sentences of a corpus given as a list are no paths
            continue
        for candidate in _path_candidates(text):
            try:
                path = Path(candidate).expanduser()
                if path.exists():
                    found.append((value, path.resolve()))
            except (OSError, ValueError, RuntimeError):  # RuntimeError: "~name" of a user this machine does not know
                continue
    return found


def finished_run(folder: Path) -> bool:
    """Whether ``folder`` holds a finished run (its manifest says ``complete``): work kept beside it (track's parts) is
    then a cache of that run, not unfinished work."""
    return _manifest(folder).get("status") == "complete"


def _unfinished_work(folder: Path, work: str | None) -> str | None:
    """The first of :data:`WORK_FOLDERS` in ``folder`` that is not ``work`` (the running command's own), or None; a
    finished run's kept parts are its cache, not unfinished work."""
    for name in WORK_FOLDERS:
        if name == work or (name == "parts" and finished_run(folder)):
            continue
        if any((folder / f"{name}{suffix}").exists() for suffix in _WORK_SUFFIXES):
            return name
    return None


def check_out(out: str | Path, inputs=(), work: str | None = None) -> None:
    """Refuse at once, in one line, an ``out`` no run may write; creates nothing.

    ``inputs``: what the run reads (strs or paths, lists or tuples of them; those that name no existing path
    are left out): an ``out`` that is or holds one of them is refused, as replacing ``out`` would delete it.
    ``work``: the folder of :data:`WORK_FOLDERS` the running command resumes from; any other one in ``out`` is refused."""
    path = Path(out).absolute()
    resolved = path.resolve()
    try:
        here = Path.cwd().resolve()
    except OSError:
        here = None
    if here is not None and (resolved == here or resolved in here.parents):
        where = "is the current folder" if resolved == here else "holds the current folder"
        raise BertologyError(f"{out}: {where}, and a run replaces its out folder whole; give another folder or run from outside it")
    for given, source in _existing_paths(inputs):
        if source == resolved or resolved in source.parents:
            where = "is" if source == resolved else "holds"
            raise BertologyError(f"{out}: {where} the input {given}, which replacing the run folder would delete; give another folder")
    if path.exists() and not path.is_dir():
        raise BertologyError(f"{out}: is a file, not a folder; give a new folder or an earlier run folder")
    if path.is_dir():
        if any(path.iterdir()) and not _is_run_folder(path):
            raise BertologyError(f"{out}: not a bertology run folder (it holds other files, which the run would replace); give a new or empty folder")
        unfinished = _unfinished_work(path, work)
        if unfinished is not None:
            raise BertologyError(f"{out}: holds {WORK_FOLDERS[unfinished]} ({unfinished}/), which this run would delete; finish it with the "
                                 f"command that made it, or give another folder (delete {Path(out) / unfinished} to drop that work)")
        nested = _nested_run_folder(path)
        if nested is not None:
            raise BertologyError(f"{out}: holds another run folder ({nested.relative_to(path)}), which replacing it would delete; "
                                 f"give a folder of its own, for instance {Path(out) / 'NAME'}")
        _refuse_if_held(out, path)
        foreign = foreign_refusal(out, path, OWN_NAMES)
        if foreign is not None:
            raise BertologyError(foreign)
        for place in (path, path.parent):  # the lock inside, the staging folder beside
            _check_writable(out, place)
    else:
        _check_writable(out, _nearest_existing(path))


def _nearest_existing(path: Path) -> Path:
    return next(parent for parent in path.parents if parent.exists())


def _check_writable(out: str | Path, place: Path) -> None:
    """Refuse ``out`` unless ``place`` (where it would be created) is a folder this process may write in."""
    if not place.is_dir():
        raise BertologyError(f"{out}: cannot write there: {place} is a file")
    if not os.access(place, os.W_OK | os.X_OK):
        raise BertologyError(f"{out}: cannot write there (no permission to write in {place})")


#: How many bytes at the start of an existing file :func:`check_file_out` reads for the command's mark.
MARK_WINDOW = 4096


def check_file_out(out: str | Path, made_by: str | None = None) -> None:
    """Refuse at once, in one line, a single-file output (a page) that cannot be written or would replace someone's file;
    creates nothing.

    An existing file (or what a link there points to) is replaced only when it is an earlier output of the same command:
    its first :data:`MARK_WINDOW` bytes hold ``made_by`` (the command's mark, e.g. the viewer's title); with ``made_by``
    None every existing file is refused. A replaced file is replaced whole (:func:`atomic_write`)."""
    path = Path(out).absolute()
    if path.is_dir():
        raise BertologyError(f"{out}: is a folder; give the file to write, for instance {Path(out) / 'view.html'}")
    if path.exists() or path.is_symlink():
        if not path.is_file():  # a device, a pipe, a link to nothing: never opened, never replaced
            raise BertologyError(f"{out}: exists and is not a regular file, so it is not replaced; give a new file")
        try:
            with open(path, "rb") as handle:
                start = handle.read(MARK_WINDOW)
        except OSError as exc:
            raise BertologyError(f"{out}: exists and cannot be read ({exc.strerror or exc}), so it is not replaced; give a new file") from exc
        if made_by is None or made_by.encode("utf-8") not in start:
            raise BertologyError(f"{out}: exists and is not an earlier output of this command, so it is not replaced; give a new file "
                                 "or delete it first")
    _check_writable(out, _nearest_existing(path))


@dataclass
class _Claim:
    """One run's hold on its ``out`` folder."""

    out: Path  # resolved
    thread: int
    existed: bool
    made_parents: list[Path]  # folders above out this claim created (deepest first), removed again if they stay empty
    fresh: bool  # new or empty when claimed
    depth: int = 0
    staging: Path | None = None
    lock: int | None = None  # the open lock file, flocked while the claim lasts


_claims: dict[Path, _Claim] = {}
_claims_lock = threading.RLock()


def _take(out: str | Path, inputs=(), work: str | None = None) -> _Claim:
    check_out(out, inputs, work)
    path = Path(out).resolve()
    existed = path.is_dir()
    made_parents = [parent for parent in path.parents if not parent.exists()]
    held = _Claim(path, threading.get_ident(), existed, made_parents, fresh=not existed or not any(path.iterdir()))
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not (path / MARKER).is_file():
            _mark(path)
        held.lock = _lock(path, out)
    except OSError as exc:
        raise BertologyError(f"{out}: cannot write there ({exc.strerror or exc})") from exc
    return held


def _mark(folder: Path, inventory: dict | None = None) -> None:
    """Write ``folder``'s marker: the run's inventory (:func:`~bertology.core.storage.inventory.take_inventory`), empty by default."""
    atomic_write(folder / MARKER, lambda p: p.write_text(marker_text(inventory)))


def _release(held: _Claim) -> None:
    """Remove an uncommitted staging folder, the lock, and ``out`` itself if it was new and stayed empty."""
    if held.staging is not None:
        shutil.rmtree(held.staging, ignore_errors=True)
    try:
        if held.fresh and held.out.is_dir() and {p.name for p in held.out.iterdir()} <= {MARKER, LOCK}:
            (held.out / MARKER).unlink(missing_ok=True)
            if held.lock is not None:
                _unlock(held.out, held.lock)
                held.lock = None
            if not held.existed:
                held.out.rmdir()
                for parent in held.made_parents:  # a run that wrote nothing leaves no folder of its own behind
                    parent.rmdir()
    except OSError:
        pass
    if held.lock is not None:
        _unlock(held.out, held.lock)
        held.lock = None


@contextmanager
def claim(out: str | Path, inputs=(), work: str | None = None) -> Iterator[_Claim]:
    """Hold ``out`` for one run: checked (:func:`check_out`, with the run's ``inputs`` and its own ``work`` folder), created
    and locked; released on the way out.

    The same thread may claim it again (a run that saves through an API that claims too)."""
    key = Path(out).resolve()
    with _claims_lock:
        held = _claims.get(key)
        if held is not None and held.thread != threading.get_ident():
            raise BertologyError(f"{out}: another run of this process is writing this folder; give another folder")
        if held is None:
            held = _claims[key] = _take(out, inputs, work)
        held.depth += 1
    try:
        yield held
    finally:
        with _claims_lock:
            held.depth -= 1
            if held.depth == 0:
                del _claims[key]
                _release(held)


def claims_out(function: Callable | None = None, *, work: str | None = None, words: tuple[str, ...] = ()) -> Callable:
    """Decorate a function with an ``out`` argument: ``out`` (unless None) is claimed before it runs, for the whole call.

    Every other argument (``**options`` included) that is a str or a path (or a list, tuple or dict of them) naming an
    existing path, or holding one after a separator (``NAME=words:FILE``), is an input of the run (:func:`check_out`),
    except ``command`` (the command line as recorded) and the arguments named in ``words``: those whose values are words
    (``analyses=["roles"]`` with ``out="roles"`` is a rerun, not an input inside ``out``). ``work``: the folder of
    :data:`WORK_FOLDERS` the function resumes from (``@claims_out(work="checkpoint")``); ``out`` holding any other one is refused."""
    if function is None:
        return functools.partial(claims_out, work=work, words=words)
    not_inputs = {"out", "command", *words}
    signature = inspect.signature(function)
    keywords = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(function)
    def claimed(*args, **kwargs):
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        arguments.update(arguments.pop(keywords, None) or {})
        out = arguments.get("out")
        if out is None:
            return function(*args, **kwargs)
        inputs = [value for name, value in arguments.items() if name not in not_inputs]
        with claim(out, inputs, work):
            return function(*args, **kwargs)

    return claimed


#: zlib level 1: a quarter less time to write a figure than the default 6, for files about a tenth larger.
_PNG = {"compress_level": 1}


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

    def _give_up(self, error: BaseException) -> None:
        """End the claim this RunFolder made itself, if it did, after ``error``: its staging folder goes (unless kept), the
        previous run stays as it was."""
        if self._own is not None:
            self._own.__exit__(type(error), error, error.__traceback__)

    def commit(self, keep: tuple[str, ...] = ()) -> Path:
        """Swap this run in for the previous one at ``out`` and return ``out``; ``keep``: folders of the previous run to carry over."""
        out = self._claim.out
        try:
            for name in keep:
                if (out / name).is_dir() and not (self.path / name).exists():
                    link_tree(out / name, self.path / name)
            _mark(self.path, take_inventory(self.path, OWN_NAMES))
            appeared = foreign_refusal(self.out, out, OWN_NAMES)
            if appeared is not None:  # put there while this run ran: both it and this run's outputs stay
                self._claim.staging = None
                raise BertologyError(f"{appeared} (it came while this run ran: the run's outputs are left in {self.path})")
        except BaseException as error:
            self._give_up(error)
            raise
        handover = _lock(self.path, out)  # the new out is locked before it is out
        old = _random_name(out.parent, f"{out.name}.old-")
        try:
            os.rename(out, old)
            try:
                os.rename(self.path, out)  # the window: between these two renames, out is missing
            except BaseException:
                os.rename(old, out)
                raise
        except BaseException as error:
            os.close(handover)
            self._give_up(error)
            raise
        self._claim.staging = None
        previous, self._claim.lock = self._claim.lock, handover
        if previous is not None:
            os.close(previous)
        try:
            shutil.rmtree(old)
        except OSError as exc:
            warnings.warn(f"{self.out}: the new run is in place, but the previous one could not be deleted ({exc.strerror or exc}); "
                          f"it is left in {old}", RunFolderWarning, stacklevel=2)
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
        """Save a matplotlib figure as ``name.png`` and close it (laid out tight unless it has a layout engine, or margins set
        by hand and ``figure.fixed_layout`` true)."""
        import matplotlib
        import matplotlib.pyplot as plt

        try:
            # Laid out by the figure's own layout engine (tight, unless it has one) within its one draw; bbox_inches="tight"
            # would draw every figure twice, once to measure and once to save.
            if figure.get_layout_engine() is None and not getattr(figure, "fixed_layout", False):
                figure.set_layout_engine("tight")
            # Glyphs drawn without FreeType's hinting: a tenth of the default report's drawing time, no difference to the eye
            # at 110 dpi (the user's own rcParams stay as they are)
            with matplotlib.rc_context({"text.hinting": "no_hinting"}):
                return atomic_write(self.path / f"{name}.png", lambda p: figure.savefig(p, format="png", dpi=110, pil_kwargs=_PNG))
        finally:
            plt.close(figure)


#: The packages whose versions every manifest records.
_VERSIONED = ("bertology", "torch", "transformers", "tokenizers", "numpy", "pandas", "scipy", "scikit-learn", "statsmodels", "spacy")


def package_versions() -> dict[str, str]:
    """Python's version and each of :data:`_VERSIONED`'s ("not installed" where missing)."""
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def complete_run(folder: RunFolder, manifest: dict, *, report: str | None = None, status: str = "complete", command: list[str] | None = None,
           keep: tuple[str, ...] = ()) -> Path:
    """The one way every run ends: write ``report.html`` (the rendered ``report``, where the run has one) and
    ``manifest.json`` (``status``, the command line, the run's own facts in ``manifest``, package versions and the
    finishing time), then swap the folder in whole (:meth:`RunFolder.commit`, carrying ``keep`` over); returns ``out``."""
    if report is not None:
        folder.write_text("report.html", report)
    folder.write_json("manifest.json", {"status": status, "command": command if command is not None else sys.argv, **manifest,
                                        "versions": package_versions(), "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
    return folder.commit(keep=keep)
