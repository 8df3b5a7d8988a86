"""Named hook points inside every attention layer (in the spirit of TransformerLens).

bertology registers its own attention function with transformers' ``AttentionInterface`` under the
name ``"bertology"``. It computes eager attention and, where a :class:`Hooks` object is active,
passes two tensors through the handlers registered for each point:

``value``
    the value vectors ``x W_V + b_V`` of every head, shape ``[batch, head, key, head_dim]``, before they
    are mixed. Handlers read them (Kobayashi et al.'s norms) or return a replacement.
``pattern``
    the attention probabilities ``softmax(q k^T / sqrt(d) + mask)``, shape ``[batch, head, query, key]``,
    after the softmax and before dropout. Handlers read it (statistics) or return a replacement
    (e.g. uniform attention, Kovaleva et al. 2019).
``head_output``
    each head's output ``pattern @ v``, shape ``[batch, head, query, head_dim]``, before the heads
    are concatenated and projected. Handlers may return a replacement (e.g. zeroing a head,
    or Michel et al. 2019's gate ``xi_h``).

Handlers are called as ``handler(layer, tensor)`` and return ``None`` (leave it) or a tensor. The
layer index is counted per forward pass, so models that share one attention module across layers
(ALBERT) or keep no ``layer_idx`` (DistilBERT) are numbered correctly too. While a handler runs,
:attr:`Hooks.key_mask` says which keys are real tokens (not padding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

ATTN_IMPLEMENTATION = "bertology"
HOOK_POINTS = ("value", "pattern", "head_output")

Handler = Callable[[int, torch.Tensor], "torch.Tensor | None"]
_ACTIVE: ContextVar["Hooks | None"] = ContextVar("bertology_hooks", default=None)


class Hooks:
    """A set of handlers for the named hook points, made active around a forward pass by :meth:`attach`."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {point: [] for point in HOOK_POINTS}
        self._layer = 0
        #: bool ``[batch, 1, 1, key]``, True for real (unpadded) keys, for the layer being run;
        #: None where the model passed no mask (nothing is padded).
        self.key_mask: torch.Tensor | None = None

    def add(self, point: str, handler: Handler) -> "Hooks":
        """Register ``handler`` at ``point`` (one of :data:`HOOK_POINTS`); returns self for chaining."""
        if point not in self._handlers:
            raise ValueError(f"unknown hook point {point!r}; known: {', '.join(HOOK_POINTS)}")
        self._handlers[point].append(handler)
        return self

    def _fire(self, point: str, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        for handler in self._handlers[point]:
            replaced = handler(layer, tensor)
            if replaced is not None:
                tensor = replaced
        return tensor

    def _next_layer(self) -> int:
        layer = self._layer
        self._layer += 1
        return layer

    def skip_layer(self) -> None:
        """Count a layer whose attention was not run (its output was replayed from a cache)."""
        self._layer += 1

    @contextmanager
    def attach(self, model: nn.Module) -> Iterator["Hooks"]:
        """Make these hooks active for ``model``'s forward passes inside the ``with`` block."""
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise ValueError("model was not loaded with attn_implementation='bertology' (use bertology.core.models.load_model)")

        def reset_layer_count(*_):
            self._layer = 0

        handle = model.register_forward_pre_hook(reset_layer_count)
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)
            handle.remove()


def _real_keys(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[batch, 1, 1, key]`` bool from a boolean mask or eager_mask's additive one (0 allowed, the dtype's minimum not)."""
    if attention_mask is None:
        return None
    rows = attention_mask[..., :1, :]
    return rows if rows.dtype == torch.bool else rows > torch.finfo(rows.dtype).min / 2


def bertology_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention (Vaswani et al. 2017) with the ``value``, ``pattern`` and ``head_output`` hook points."""
    hooks = _ACTIVE.get()
    layer = -1
    if hooks is not None:
        layer = hooks._next_layer()
        hooks.key_mask = _real_keys(attention_mask)
    if hooks is not None:
        value = hooks._fire("value", layer, value)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3))
    scores *= scaling  # in place: no second n x n tensor per head (the product is no input of its own gradient)
    if attention_mask is not None:
        scores += attention_mask
    pattern = nn.functional.softmax(scores, dim=-1)
    if hooks is not None:
        pattern = hooks._fire("pattern", layer, pattern)
    dropped = nn.functional.dropout(pattern, p=dropout, training=module.training)
    head_output = torch.matmul(dropped, value)
    if hooks is not None:
        head_output = hooks._fire("head_output", layer, head_output)
    return head_output.transpose(1, 2).contiguous(), pattern


def active_hooks() -> Hooks | None:
    """The :class:`Hooks` attached for the forward pass being run, if any."""
    return _ACTIVE.get()


def register_attention() -> None:
    """Register the ``"bertology"`` attention function and its (additive, eager-style) mask with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, bertology_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
