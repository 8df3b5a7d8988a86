"""Non-finite attention maps and hidden states: a pass refuses them in one line, never makes tables of them.

A model run in float16 whose scores ``q . k`` pass float16's largest value (65504) gets infinite scores, and its softmax
rows NaN; every later layer of that sequence follows. Each batch's maps and hidden states are checked where the engine
hands them over (:class:`FiniteWatch`), on their own devices, and read back once at the batch's end.
"""

from __future__ import annotations

import numpy as np
import torch

from bertology.core.errors import BertologyError

#: float16's largest finite value: a score or activation past it is infinite.
FLOAT16_MAX = torch.finfo(torch.float16).max
#: How many words (and at most how many characters) of the first non-finite sequence the error quotes.
QUOTED_WORDS, QUOTED_CHARS = 8, 80


class NonFiniteError(BertologyError):
    """A batch whose attention maps or hidden states hold NaN or infinities: the pass fails whole (no analyzer is isolated
    from it, no table made), and a resumable pass drops its saved progress, as no run with these settings can finish."""


def dtype_advice(dtype: torch.dtype) -> str:
    """What a user does about maps or activations that are NaN or infinite with weights of ``dtype``."""
    if dtype == torch.float16:
        return (f"float16's range (largest {FLOAT16_MAX:.0f}) is too narrow for this model's activations; run with --dtype float32 "
                "or --dtype bfloat16 (float32's range)")
    if dtype == torch.bfloat16:
        return "bfloat16's precision breaks this model; run with --dtype float32"
    return "not a precision too narrow: the model's weights or a value in its config.json break it"


def finite_maps(pattern: torch.Tensor) -> torch.Tensor:
    """``[batch]``: whether every weight of a sequence's maps ``[batch, head, rows, keys]`` is finite. One reduction, no mask
    the size of the maps: each weight lies in [0, 1] (a softmax in float32 or wider), so their sum (at most ``head x rows``)
    is finite exactly when every one is (NaN and infinities carry through a sum)."""
    return torch.isfinite(pattern.sum(dim=tuple(range(1, pattern.dim()))))


def finite_states(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[layer + 1, batch]``: whether every real token's vector of ``states [layer + 1, batch, n, dim]`` is finite
    (``mask [batch, n]``: padding is no token of the sequence). ``aminmax`` carries NaN, and an infinity is a min or a max."""
    low, high = torch.aminmax(states, dim=-1)
    return ((torch.isfinite(low) & torch.isfinite(high)) | ~mask.to(states.device)).all(dim=-1)


def _named(key: tuple[int, int]) -> str:
    layer, maps = key
    if maps:
        return f"layer {layer}'s attention maps are"
    return "the embeddings are" if layer == 0 else f"layer {layer - 1}'s output (hidden states) is"


class FiniteWatch:
    """One batch's finite flags, ``[layer + 1, 2, batch]`` bool on each device that checked something.

    In the order the forward pass makes them: entry ``(l, 0)`` the hidden states that enter layer l (l = 0: the
    embeddings; the last: the last layer's output), ``(l, 1)`` layer l's maps (``layers``: the model's). Each check ANDs
    into its entry in place and the flags stay on their device until :meth:`require`, which reads them all back at once.
    Nothing is kept per check: a flag per block of query rows, a small allocation, would outlive the blocks after it and
    split the allocator's free chunks under them (8 layers of 16 heads at 8,192 tokens: 64 blocks a layer, about 110 MiB
    more peak RSS).
    """

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.flags: dict[torch.device, torch.Tensor] = {}

    def _entries(self, device: torch.device, batch: int) -> torch.Tensor:
        """The flags on ``device``, every one True (finite) until a check says otherwise; made at its first check."""
        if device not in self.flags:
            with torch.inference_mode(False):  # a normal tensor: checks inside and outside inference mode update it in place
                self.flags[device] = torch.ones((self.layers + 1, 2, batch), dtype=torch.bool, device=device)
        return self.flags[device]

    def maps(self, layer: int, pattern: torch.Tensor) -> None:
        """Layer ``layer``'s maps, or a block of their query rows."""
        self._entries(pattern.device, pattern.shape[0])[layer, 1].logical_and_(finite_maps(pattern))

    def states(self, states: torch.Tensor, mask: torch.Tensor) -> None:
        """Every layer's hidden states ``[layer + 1, batch, n, dim]``."""
        self._entries(states.device, states.shape[1])[: states.shape[0], 0].logical_and_(finite_states(states, mask))

    def require(self, items: list, dtype: torch.dtype, device: torch.device) -> None:
        """Refuse, in one line, a batch whose maps or hidden states hold NaN or infinities: it names the first layer that
        does (in forward order), its first sequence in the corpus (``items``: the batch's :class:`~bertology.core.engine.Encoded`)
        and what to do about ``dtype``. One read back to the host, where anything was checked."""
        if not self.flags:
            return
        parts = [flags if flags.device == device else flags.to(device) for flags in self.flags.values()]  # a device map's layers
        flags = parts[0] if len(parts) == 1 else torch.stack(parts).all(dim=0)
        if bool(flags.all()):
            return
        flags = flags.cpu().numpy()
        key = tuple(int(index) for index in np.argwhere(~flags.all(axis=-1))[0])  # row-major: the first layer, states before maps
        bad = np.flatnonzero(~flags[key])
        item = min((items[b] for b in bad), key=lambda item: item.index)
        words = item.example.text.split()
        quoted = " ".join(words[:QUOTED_WORDS])
        quoted = quoted[:QUOTED_CHARS] + (" ..." if len(words) > QUOTED_WORDS or len(quoted) > QUOTED_CHARS else "")
        where = f"example {item.index + 1} (" + (f"{item.example.source}: " if item.example.source else "") + f"{quoted!r})"
        others = f" and {len(bad) - 1} more of its batch" if len(bad) > 1 else ""
        name = str(dtype).removeprefix("torch.")
        raise NonFiniteError(f"{_named(key)} NaN or infinite in {name} on {where}{others}: {dtype_advice(dtype)}")
