"""Content hashes of a model's weights, for the fingerprints that decide whether saved work may be resumed.

A model folder's weights are hashed file by file (sha256 of every ``*.safetensors``), each digest cached by the file's
resolved path, size and modification time in ``$XDG_CACHE_HOME/bertology/weight-digests.json`` (default
``~/.cache``), so that a large model is read once, not at every resume. A model that was not loaded from a folder
(built in memory) is hashed from its parameters and buffers themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from bertology.core.errors import StateError
from bertology.core.storage.runfolder import atomic_write
from bertology.core.storage.safeload import read_json

#: How many files' digests the cache keeps (the most recently hashed): a bound on its size.
CACHE_ENTRIES = 512


def cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bertology" / "weight-digests.json"


def _read_cache(path: Path) -> dict:
    """The cache's entries; a missing or damaged cache is empty (it only saves time: every entry is checked before use)."""
    try:
        entries = read_json(path)
    except StateError:  # missing or damaged: recomputed, never believed
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, entries: dict) -> None:
    """Write the cache atomically; a place that cannot be written only costs the next run a hash."""
    kept = dict(list(entries.items())[-CACHE_ENTRIES:])
    try:
        atomic_write(path, lambda partial: partial.write_text(json.dumps(kept), encoding="utf-8"))
    except OSError:
        pass


def file_digest(path: Path, cache: dict) -> str:
    """sha256 of the file at ``path``, from ``cache`` where its path, size and modification time match an entry (which it adds)."""
    resolved = str(Path(path).resolve())
    status = os.stat(resolved)
    entry = cache.get(resolved)
    if isinstance(entry, dict) and entry.get("size") == status.st_size and entry.get("mtime_ns") == status.st_mtime_ns \
            and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    with open(resolved, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    cache.pop(resolved, None)
    cache[resolved] = {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "sha256": digest}
    return digest


def folder_weights_digest(folder: Path) -> str:
    """sha256 over the names and contents of the ``*.safetensors`` files in ``folder`` (the weights bertology loads)."""
    path = cache_path()
    cache = _read_cache(path)
    before = dict(cache)
    combined = hashlib.sha256()
    for weights in sorted(Path(folder).glob("*.safetensors")):
        combined.update(f"{weights.name}\0{file_digest(weights, cache)}\n".encode())
    if cache != before:
        _write_cache(path, cache)
    return combined.hexdigest()


def tensors_digest(module: torch.nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and values of ``module``'s parameters and buffers."""
    combined = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        value = tensor.detach().to("cpu").contiguous()
        combined.update(f"{name}\0{value.dtype}\0{tuple(value.shape)}\n".encode())
        combined.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return combined.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what decides a fast tokenizer's pieces: its whole serialisation (``tokenizer.json``: normaliser, pre-tokeniser,
    vocabulary, merges, post-processor, added tokens) and the settings of its ``tokenizer_config.json`` that the pieces depend
    on (the special tokens, the length and the sides it pads and cuts); the same tokenizer read from another folder has the
    same digest."""
    settings = {"special": tokenizer.special_tokens_map, "model_max_length": tokenizer.model_max_length,
                "padding_side": tokenizer.padding_side, "truncation_side": tokenizer.truncation_side}
    combined = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    combined.update(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))
    return combined.hexdigest()
