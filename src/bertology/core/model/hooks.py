"""Named hook points inside every attention layer (in the spirit of TransformerLens).

bertology registers its own attention function with transformers' ``AttentionInterface`` under the
name ``"bertology"``. It computes eager attention and, where a :class:`Hooks` object is active,
passes two tensors through the handlers registered for each point:

``key``
    the key vectors of every head, ``[batch, head, key, head_dim]`` (after any rotary embedding), read-only in spirit:
    handlers read them (a sink's key norm, Gu et al. 2025); a replacement changes the scores.
``value``
    the value vectors ``x W_V + b_V`` of every head, shape ``[batch, head, key, head_dim]``, before they
    are mixed. Handlers read them (Kobayashi et al.'s norms) or return a replacement.
``pattern``
    the attention probabilities ``softmax(q k^T / sqrt(d) + mask)``, shape ``[batch, head, query, key]``,
    after the softmax and before dropout, in float32 at least (:func:`statistics_dtype`) whatever the weights' dtype.
    Handlers read it (statistics) or return a replacement (e.g. uniform attention, Kovaleva et al. 2019).
``head_output``
    each head's output ``pattern @ v``, shape ``[batch, head, query, head_dim]``, before the heads
    are concatenated and projected. Handlers may return a replacement (e.g. zeroing a head,
    or Michel et al. 2019's gate ``xi_h``).
``layer_input``
    the layer's input ``x`` (the residual, TransformerLens's ``resid_pre``), ``[batch, n, dim]``, as the module that first
    reads it receives it (:attr:`~bertology.core.model.layouts.AttentionBlock.input_module`: a post-norm block's attention,
    a pre-norm block's whole layer), before accelerate's hook moves it to the layer's device. Handlers may return a replacement.
``attn_out``
    the attention's output through the output projection, ``z W_O + b_O`` (TransformerLens's ``attn_out``),
    ``[batch, n, dim]``, before it joins the residual. Handlers may return a replacement.

The last two are points of the layer's modules, not of the attention function: :meth:`Hooks.attach` is given the model's
attention blocks (:func:`~bertology.core.model.models.attention_blocks`) where a handler reads them. A module that several
layers share (ALBERT's) fires once a layer.

Handlers are called as ``handler(layer, tensor)`` and return ``None`` (leave it) or a tensor. The
layer index is counted per forward pass, so models that share one attention module across layers
(ALBERT) or keep no ``layer_idx`` (DistilBERT) are numbered correctly too. While a handler runs,
:attr:`Hooks.key_mask` says which keys each query may see: the real tokens (not padding), and in a decoder
only those at or before the query (causal attention).

Maps by blocks of queries: where :attr:`Hooks.query_rows` is set and a layer has more queries, the attention function
computes the maps ``query_rows`` rows at a time (every head), passes each block through ``pattern`` (:attr:`Hooks.rows`
says which rows, :attr:`Hooks.key_mask` holds those rows) and writes that block of ``head_output``, so a layer never holds
more than one block of its maps; ``head_output`` then fires once for the whole layer. Every row of a block is whole (a
softmax over every key), so a metric that is a sum over rows folds the blocks.

Decoders with grouped-query attention (Llama, Qwen2, Mistral, ...) keep fewer key-value heads than query
heads; the attention function repeats them for the query heads that share them (as transformers' eager
attention does), so every hook point has one entry per query head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from bertology.core.model.kinds import uniform_rows
from bertology.core.model.layouts import AttentionBlock

ATTN_IMPLEMENTATION = "bertology"
#: The hook points of the attention function, then those of each layer's modules (:data:`BLOCK_POINTS`).
HOOK_POINTS = ("key", "value", "pattern", "head_output", "layer_input", "attn_out")
BLOCK_POINTS = ("layer_input", "attn_out")

Handler = Callable[[int, torch.Tensor], "torch.Tensor | None"]
_ACTIVE: ContextVar["Hooks | None"] = ContextVar("bertology_hooks", default=None)


class Hooks:
    """A set of handlers for the named hook points, made active around a forward pass by :meth:`attach`."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {point: [] for point in HOOK_POINTS}
        self._layer = 0
        self._block_calls = dict.fromkeys(BLOCK_POINTS, 0)  # each block point's calls in this forward pass: the layer
        #: bool ``[batch, 1, query, key]``, True for the keys each query may see (real, unpadded keys; in a decoder
        #: those at or before the query), for the rows being run; None where every query sees every key (nothing is padded).
        self.key_mask: torch.Tensor | None = None
        #: Compute the maps this many query rows at a time (None: every row at once; see the module docstring).
        self.query_rows: int | None = None
        #: The query rows the ``pattern`` being fired holds (a block of them), None for every row.
        self.rows: slice | None = None

    def add(self, point: str, handler: Handler) -> "Hooks":
        """Register ``handler`` at ``point`` (one of :data:`HOOK_POINTS`); returns self for chaining."""
        if point not in self._handlers:
            raise ValueError(f"unknown hook point {point!r}; known: {', '.join(HOOK_POINTS)}")
        self._handlers[point].append(handler)
        return self

    def clear(self) -> None:
        """Drop every handler (and what they hold), the pass they served being over."""
        for handlers in self._handlers.values():
            handlers.clear()

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
    def attach(self, model: nn.Module, blocks: Sequence[AttentionBlock] | None = None) -> Iterator["Hooks"]:
        """Make these hooks active for ``model``'s forward passes inside the ``with`` block; ``blocks``, the model's attention
        blocks, where a handler is registered at a point of the layers' modules (:data:`BLOCK_POINTS`)."""
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise ValueError("model was not loaded with attn_implementation='bertology' (use bertology.core.model.models.load_model)")

        def reset_layer_count(*_):
            self._layer = 0
            self._block_calls = dict.fromkeys(BLOCK_POINTS, 0)

        handles = [model.register_forward_pre_hook(reset_layer_count), *self._attach_blocks(blocks)]
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)
            for handle in handles:
                handle.remove()

    def _attach_blocks(self, blocks: Sequence[AttentionBlock] | None) -> list:
        """Torch hooks on the modules of ``blocks`` that fire :data:`BLOCK_POINTS` (those with handlers; a module that several
        layers share, once)."""
        if not any(self._handlers[point] for point in BLOCK_POINTS):
            return []
        if blocks is None:
            raise ValueError(f"the hook points {' and '.join(BLOCK_POINTS)} need the model's attention blocks (Hooks.attach(model, blocks))")

        def layer_input(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            replaced = self._fire("layer_input", self._block_call("layer_input"), x)
            if replaced is x:
                return None
            return ((replaced, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": replaced})

        def attn_out(module, args, projected):
            return self._fire("attn_out", self._block_call("attn_out"), projected)

        handles = []
        if self._handlers["layer_input"]:
            inputs = {id(block.input_module): block.input_module for block in blocks}
            handles += [module.register_forward_pre_hook(layer_input, with_kwargs=True) for module in inputs.values()]
        if self._handlers["attn_out"]:
            outputs = {id(block.output): block.output for block in blocks}
            handles += [module.register_forward_hook(attn_out) for module in outputs.values()]
        return handles

    def _block_call(self, point: str) -> int:
        """The layer a block point fires for: its calls so far in this forward pass."""
        layer = self._block_calls[point]
        self._block_calls[point] += 1
        return layer


def _visible_keys(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[batch, 1, query, key]`` bool from a boolean mask (transformers' SDPA mask: itself) or a model's own additive one (0
    allowed, the dtype's minimum not)."""
    if attention_mask is None:
        return None
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _repeat_key_value_heads(tensor: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Grouped-query attention: ``[batch, kv_head, n, d]`` -> ``[batch, head, n, d]``, query head h reading key-value
    head ``h // (head / kv_head)`` (transformers' ``repeat_kv``)."""
    groups = query_heads // tensor.shape[1]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype bertology computes softmaxes, per-row metrics and statistics in for tensors of ``dtype``: float32 for
    half-precision weights (bfloat16, float16: 8 and 11 bits of mantissa, about 3 significant digits), else ``dtype``
    itself (float32, float64). As transformers' eager attention for Llama and its kin, ``softmax(..., dtype=torch.float32)``."""
    return torch.promote_types(dtype, torch.float32)


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
    """Eager attention (Vaswani et al. 2017) with the ``value``, ``pattern`` and ``head_output`` hook points.

    The scores are computed in the model's dtype and the softmax in :func:`statistics_dtype` (float32 for half-precision
    weights, as transformers' ``eager_attention_forward`` of Llama does); the ``pattern`` hook point and the returned
    weights are that float32 pattern, cast to the values' dtype only for ``pattern @ value``.
    ``softcap`` (Gemma 2): scores are capped as ``c tanh(s / c)`` before the mask, as transformers' eager attention does."""
    hooks = _ACTIVE.get()
    layer = -1
    key = _repeat_key_value_heads(key, query.shape[1])
    value = _repeat_key_value_heads(value, query.shape[1])
    # transformers leaves a causal layer's mask to SDPA's is_causal where nothing is padded and no window applies
    # (its SDPA mask, register_attention): the causal mask is then made here, block by block, as sdpa_attention_forward decides it
    is_causal = kwargs.get("is_causal")
    causal = attention_mask is None and query.shape[2] > 1 and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if hooks is not None:
        layer = hooks._next_layer()
        key = hooks._fire("key", layer, key)
        value = hooks._fire("value", layer, value)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    width = query.shape[2]
    if hooks is None or hooks.query_rows is None or hooks.query_rows >= width:
        mask = _rows_mask(attention_mask, causal, slice(None), width, key.shape[2], query.device)
        if hooks is not None:
            hooks.key_mask = _visible_keys(mask)
        pattern, head_output = _attention_rows(module, query, key, value, mask, scaling, dropout, kwargs.get("softcap"), hooks, layer)
    else:  # by blocks of query rows: one block of the maps at a time, never the whole [batch, head, n, n]
        pattern, head_output = None, value.new_empty(*query.shape[:3], value.shape[-1])
        for start in range(0, width, hooks.query_rows):
            rows = slice(start, min(start + hooks.query_rows, width))
            block_mask = _rows_mask(attention_mask, causal, rows, width, key.shape[2], query.device)
            hooks.rows, hooks.key_mask = rows, _visible_keys(block_mask)
            head_output[:, :, rows] = _attention_rows(module, query[:, :, rows], key, value, block_mask, scaling, dropout,
                                                      kwargs.get("softcap"), hooks, layer)[1]
        hooks.rows = None
    if hooks is not None:
        head_output = hooks._fire("head_output", layer, head_output)
    return head_output.transpose(1, 2).contiguous(), pattern


def _rows_mask(attention_mask: torch.Tensor | None, causal: bool, rows: slice, queries: int, keys: int,
               device: torch.device) -> torch.Tensor | None:
    """The mask of the query rows ``rows`` (``[batch or 1, 1, r, keys]``): the model's, sliced; where transformers left a causal
    layer's mask to ``is_causal``, query i sees the keys up to its own position, ``j <= i + keys - queries`` (bool
    ``[1, 1, r, keys]``, as SDPA's causal mask aligns them); None where every query sees every key."""
    if attention_mask is not None:
        return attention_mask[:, :, rows] if attention_mask.shape[2] > 1 else attention_mask
    if not causal:
        return None
    positions = torch.arange(queries, device=device)[rows] + (keys - queries)
    return (torch.arange(keys, device=device)[None, :] <= positions[:, None])[None, None]


def _attention_rows(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float, dropout: float, softcap: float | None, hooks: Hooks | None, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pattern, pattern @ value)`` of the queries ``query [batch, head, rows, d]`` (every row, or a block of them) against
    every key, the ``pattern`` hook point fired on the pattern."""
    scores = torch.matmul(query, key.transpose(2, 3))
    scores *= scaling  # in place: no second n x n tensor per head (the product is no input of its own gradient)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # transformers' SDPA mask: an unseen key's score becomes the
        scores.masked_fill_(~attention_mask, torch.finfo(scores.dtype).min)  # dtype's minimum, as eager_mask's additive one makes it
    elif attention_mask is not None:  # a model that makes its own additive mask
        scores += attention_mask
    pattern = nn.functional.softmax(scores, dim=-1, dtype=statistics_dtype(scores.dtype))
    del scores
    if hooks is not None:
        pattern = hooks._fire("pattern", layer, pattern)
    dropped = nn.functional.dropout(pattern, p=dropout, training=module.training)
    return pattern, torch.matmul(dropped.to(value.dtype), value)


def uniform_attention(hooks: Hooks) -> Handler:
    """A ``pattern`` handler that replaces every head's attention by the uniform row over the keys it sees.

    ``1 / |S_i|`` on the keys the model's own mask lets query i see (:attr:`Hooks.key_mask`: padding, causality, a
    sliding window): the null model of docs/methods.md#the-null-model, the same as zeroing every query projection (all
    scores equal), on the user's own model, tokenizer and corpus. Later layers read the outputs of these uniform heads.
    """

    def handler(layer: int, pattern: torch.Tensor) -> torch.Tensor:
        seen = hooks.key_mask
        if seen is None:  # no mask: every query sees every key
            return torch.full_like(pattern, 1.0 / pattern.shape[-1])
        return uniform_rows(seen.expand_as(pattern), pattern.dtype)

    return handler


def active_hooks() -> Hooks | None:
    """The :class:`Hooks` attached for the forward pass being run, if any."""
    return _ACTIVE.get()


def register_attention() -> None:
    """Register the ``"bertology"`` attention function with transformers, and transformers' SDPA mask as its mask.

    The mask is bool ``[batch, 1, query, key]`` (True: the query sees the key), or None where SDPA would need none, a
    bidirectional layer whose every query sees every key or a causal layer with nothing padded and no window
    (:func:`bertology_attention` then makes each block's causal mask itself). One byte a cell at most, where
    ``eager_mask``'s additive mask takes the weights' dtype: 268 MB for one 8,192-token sequence in float32.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, bertology_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
