"""The attention budget, the memory a pass gives one layer's attention maps, and its default ``auto``.

See docs/methods.md#maps-by-blocks-of-queries.

``auto`` is the smaller of :data:`AUTO_BUDGET_CAP` and a :data:`AUTO_BUDGET_SHARE` of the memory free on each device that
holds the model's layers, measured once, when the engine is made (the model loaded): CUDA's free memory, else the machine's
available RAM (the CPU's, and MPS's unified memory). A model's own forward pass holds its weights and a few hidden states
(a 1,024-token batch of a 1,024-wide model: 4 MiB each), so 64 MiB of maps stays a small part of it, while one layer's whole
maps grow as ``heads x n x n`` (16 heads at 8,192 tokens: 4.3 GB in float32); the share keeps a machine short of memory
further within it. Whole maps of up to 64 MiB are never cut: all-MiniLM-L6-v2's largest batch (three sequences of 512
pieces, :data:`~bertology.core.engine.MAX_ATTENTION_ELEMENTS`) holds 38 MB a layer.
"""

from __future__ import annotations

from numbers import Integral
from pathlib import Path

import torch

from bertology.core.errors import BertologyError

#: ``auto``'s most bytes of one layer's maps: 64 MiB, float32.
AUTO_BUDGET_CAP = 2**26
#: ``auto``'s part of a device's free memory: a sixteenth.
AUTO_BUDGET_SHARE = 1 / 16
#: The words ``--attention-budget`` takes besides a number of bytes: ``auto`` (the default), ``none`` (whole maps, unbounded).
BUDGET_WORDS = ("auto", "none")
MEMINFO = Path("/proc/meminfo")


def available_ram() -> int | None:
    """The machine's available RAM in bytes: psutil's where it is installed, else Linux's ``MemAvailable``; None where neither
    says."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        return None
    kib = [int(line.split()[1]) for line in lines if line.startswith("MemAvailable:")]
    return kib[0] * 1024 if kib else None


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: CUDA's (``torch.cuda.mem_get_info``), else the machine's available RAM; None for a device that
    holds no memory (``meta``) or where nothing says."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None if device.type == "meta" else available_ram()


def parameter_devices(model: torch.nn.Module) -> list[torch.device]:
    """The devices the model's parameters are on (one, or several under a device map), in a fixed order."""
    return sorted({parameter.device for parameter in model.parameters()}, key=str)


def auto_attention_budget(model: torch.nn.Module) -> int:
    """``auto``: the smaller of :data:`AUTO_BUDGET_CAP` and :data:`AUTO_BUDGET_SHARE` of the free memory of every device that
    holds the model's layers (at least one byte)."""
    shares = [int(free * AUTO_BUDGET_SHARE) for free in map(free_memory, parameter_devices(model)) if free is not None]
    return max(1, min([AUTO_BUDGET_CAP, *shares]))


def resolved_attention_budget(given: int | str | None, model: torch.nn.Module) -> int | None:
    """The attention budget in bytes for ``given``: a number of bytes (at least 1; as text on the command line), ``"auto"``
    (:func:`auto_attention_budget`), or None or ``"none"`` (no budget: whole maps)."""
    if isinstance(given, str):
        word = given.strip().lower()
        if word == "auto":
            return auto_attention_budget(model)
        if word == "none":
            return None
        if not word.isdigit():
            raise BertologyError(f"--attention-budget {given!r}: give a number of bytes, {' or '.join(BUDGET_WORDS)}")
        given = int(word)
    if given is not None and (isinstance(given, bool) or not isinstance(given, Integral) or given < 1):
        raise BertologyError(f"the attention budget must be at least 1 byte, not {given!r}")
    return None if given is None else int(given)
