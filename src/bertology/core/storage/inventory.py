"""A run folder's inventory: what the run wrote there, so that a later run replaces that and nothing of the user's.

At the swap (:meth:`~bertology.core.storage.runfolder.RunFolder.commit`) the run lists in its marker every file it wrote,
with its size, modification time and sha256, and every folder (:func:`take_inventory`). A later run into the same ``out``
looks, before any computing, for what that list does not name or names with other bytes (:func:`foreign_entries`): such an
entry is the user's (notes, figures, an edited table), and replacing the folder whole would delete it. A file whose size
and modification time are those listed is taken as unchanged without reading it; one whose time differs (a copied folder)
is read and compared by its sha256. A marker without a list (an earlier bertology's, or none) lists nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

#: The file that marks a run folder and holds its inventory.
MARKER = ".bertology-run"
#: The marker's first words, for a person who opens it.
ABOUT = "A bertology run folder: a new run writing here replaces it whole, and is refused while it holds what this list does not name."


def marker_text(inventory: dict | None = None) -> str:
    """The marker's text: ``inventory`` (:func:`take_inventory`), or an empty one (a run folder claimed, nothing written yet)."""
    return json.dumps(inventory or {"about": ABOUT, "files": {}, "folders": []}, indent=1) + "\n"


def _sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _entries(folder: Path, relative: str = "", skip: frozenset[str] = frozenset()) -> list[tuple[str, os.DirEntry]]:
    """``(relative path, entry)`` of what ``folder/relative`` holds, sorted by name; top-level names in ``skip`` left out."""
    with os.scandir(folder / relative) as listing:
        return sorted(((f"{relative}{entry.name}", entry) for entry in listing if relative or entry.name not in skip), key=lambda pair: pair[0])


def take_inventory(folder: Path, skip: frozenset[str]) -> dict:
    """Every file under ``folder`` (``bytes``, ``mtime_ns``, ``sha256``) and every folder, by path relative to it; the
    top-level names in ``skip`` (the marker, the lock, work a command resumes) and what they hold left out."""
    files, folders = {}, []
    pending = [""]
    while pending:
        for relative, entry in _entries(folder, pending.pop(), skip):
            if entry.is_dir(follow_symlinks=False):
                folders.append(relative)
                pending.append(f"{relative}/")
            elif entry.is_file(follow_symlinks=False):
                status = entry.stat(follow_symlinks=False)
                files[relative] = {"bytes": status.st_size, "mtime_ns": status.st_mtime_ns, "sha256": _sha256(entry.path)}
    return {"about": ABOUT, "files": files, "folders": sorted(folders)}


def read_inventory(marker: Path) -> dict | None:
    """The inventory in the marker file ``marker``; None where it holds none (an earlier bertology's marker, or no marker)."""
    try:
        inventory = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(inventory, dict) or not isinstance(inventory.get("files"), dict) or not isinstance(inventory.get("folders"), list):
        return None
    return inventory


def _changed(entry: os.DirEntry, listed: object) -> str | None:
    """Why the file ``entry`` is not the one ``listed`` (its inventory record), or None when it is."""
    if not isinstance(listed, dict):
        return "which the earlier run did not write"
    try:
        status = entry.stat(follow_symlinks=False)
        if status.st_size != listed.get("bytes"):
            return "changed since the earlier run wrote it"
        if status.st_mtime_ns == listed.get("mtime_ns") or _sha256(entry.path) == listed.get("sha256"):
            return None
    except OSError:
        return "which cannot be read"
    return "changed since the earlier run wrote it"


def foreign_entries(folder: Path, inventory: dict, skip: frozenset[str]) -> list[tuple[str, str]]:
    """``(relative path, why)`` of each entry under ``folder`` that ``inventory`` does not name as it is, in sorted order:
    a file not listed or not the bytes listed, a folder not listed (named with a trailing ``/``, not looked into), a link
    or anything else. The top-level names in ``skip`` are the run's own whatever they hold."""
    files, folders = inventory["files"], set(inventory["folders"])
    foreign, pending = [], [""]
    while pending:
        place = pending.pop(0)
        try:
            entries = _entries(folder, place, skip)
        except OSError:
            foreign.append((place or ".", "which cannot be read"))
            continue
        for relative, entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if relative in folders:
                    pending.append(f"{relative}/")
                else:
                    foreign.append((f"{relative}/", "which the earlier run did not write"))
            elif entry.is_file(follow_symlinks=False):
                why = _changed(entry, files.get(relative))
                if why is not None:
                    foreign.append((relative, why))
            else:
                foreign.append((relative, "which the earlier run did not write"))
    return sorted(foreign)


def foreign_refusal(out: str | Path, folder: Path, own: frozenset[str]) -> str | None:
    """The one line that refuses ``out`` while the run folder ``folder`` holds what its earlier run did not write, as it
    wrote it (:func:`foreign_entries`; the top-level names in ``own`` are the run's); None when it holds nothing else. A
    folder of an earlier bertology, whose marker lists nothing, is refused while it holds anything but ``own``."""
    inventory = read_inventory(folder / MARKER)
    foreign = foreign_entries(folder, inventory or {"files": {}, "folders": []}, own)
    if not foreign:
        return None
    (first, why), more = foreign[0], f" ({len(foreign) - 1} more besides)" if len(foreign) > 1 else ""
    if inventory is None:
        return (f"{out}: a run folder of an earlier bertology, which did not list the files it wrote, so yours cannot be told from its own "
                f"(the first: {first}{more}); a new run replaces the folder whole: move out what you keep and delete it, or choose another --out")
    them = "them" if more else "it"
    return (f"{out}: holds {first}, {why}{more}; a new run replaces the folder whole and would delete {them}: move {them} out of the "
            "folder or choose another --out")
