"""How much each input token contributes to each token's new representation, beyond norms (docs/methods.md#norms-and-mixing).

ALTI (Ferrando, Gallego & Costa-jussa 2022, "Measuring the Mixing of Contextual Information in the Transformer"; the
authors' code, mt-upc/transformer-contributions, ``ModelWrapper.get_contributions``): a post-norm attention block's output,
residual and layer norm included, is written as ``y_i = sum_j T_i(x_j) + (L(b_O) / s_i + beta)`` with

    T_i(x_j) = L(sum_h a_h[i, j] v_j^h W_O^h + [i == j] x_i) / s_i,    L(z) = gamma * (z - mean(z)),

``v_j^h = x_j W_V^h + b_V^h`` (the value bias travels with its token), ``s_i = sqrt(var(s) + eps)`` the real scale of the
vector the layer norm normalises; the contribution of j to i is ``c[i, j] = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1)``,
each row normalised to sum 1, and rolled out across layers as ``R_l = c_l R_{l-1}`` (the residual is already inside c).
In a pre-norm block (a decoder's: GPT-2, Llama, ...) no norm follows: ``y_i = x_i + sum_j sum_h a_h[i, j] v_j^h W_O^h + b_O``
with ``v_j = LN(x_j) W_V + b_V`` (token j's own norm, so all of it is j's), ``T_i(x_j) = sum_h a_h[i, j] v_j^h W_O^h + [i == j] x_i``,
as in Ferrando et al. (2023, "Explaining How Transformers Use Context to Build Predictions", ALTI on GPT-2's pre-norm blocks);
where an RMS norm follows the attention before the residual (Gemma 2, OLMo 2), its linear part with the real scale, as
ALTI linearises an encoder's layer norm.

Value zeroing (Mohebbi, Zuidema, Chrupala & Alishahi 2023, "Quantifying Context Mixing in Transformers"; the authors'
code, hmohebbi/ValueZeroing): the layer is run again with token t's value vectors set to zero (in every head, or in one
head for a per-head score), the attention weights left as they are, the feed-forward included; the score of i on t is the
cosine distance ``1 - cos`` between token i's layer output with and without t's values; rows normalised to sum 1. On a
decoder the layer's own rest (``AttentionBlock.rest_of_layer``: GPT-2's ``h + MLP(ln_2(h))``, Llama's, a parallel residual's) is rerun,
and a token no query sees (a later one) scores exactly 0.

Both are computed on the model's device in chunks: never the whole ``n x n x d`` tensor of one sequence at once, and in
float32 at least whatever the weights' dtype (:func:`~bertology.core.model.hooks.statistics_dtype`); value zeroing's reruns
of the layer run in the layer's own dtype, their outputs compared in float32.
"""

from __future__ import annotations

import torch

from bertology.core.errors import BertologyError
from bertology.core.measures.norms import layer_norm_scale, rows_normalised
from bertology.core.model.hooks import statistics_dtype
from bertology.core.model.layouts import AttentionBlock

#: The contribution measures an analyzer can ask the engine's pass for (in its ``needs``): each layer's maps ``c[b, i, j]``.
CONTRIBUTION_MEASURES = ("alti", "value_zeroing")
#: Most elements of one chunk of ``[batch, rows, n, d]`` vectors (ALTI's ``T_i(x_j)``, value zeroing's reruns).
CHUNK_ELEMENTS = 2**24


def parse_measures(text: str | None) -> tuple[str, ...]:
    """``"alti,value-zeroing"`` (the command line's spelling) -> the measures, each once, in order (:data:`CONTRIBUTION_MEASURES`)."""
    names = tuple(dict.fromkeys(name.strip().replace("-", "_") for name in (text or "").split(",") if name.strip()))
    unknown = [name for name in names if name not in CONTRIBUTION_MEASURES]
    if unknown:
        raise BertologyError(f"unknown contribution measure {unknown[0].replace('_', '-')!r}: use alti, value-zeroing or both")
    return names


def in_statistics_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in :func:`~bertology.core.model.hooks.statistics_dtype` of the first one's dtype (the values'): float32 for
    half-precision weights, as they are otherwise."""
    dtype = statistics_dtype(tensors[0].dtype)
    return tuple(tensor.to(dtype) for tensor in tensors)


def head_vectors(value: torch.Tensor, block: AttentionBlock) -> torch.Tensor:
    """``v_j^h W_O^h`` of every head and key: ``value [batch, head, key, head_dim]`` -> ``[batch, head, key, hidden]``."""
    heads, head_dim = value.shape[1], value.shape[-1]
    return torch.einsum("bhjv,hvd->bhjd", value, block.output_weight.to(value.dtype).reshape(heads, head_dim, -1))


def _linear_part(block: AttentionBlock, dtype: torch.dtype):
    """``L(z) = gamma * (z - mean(z))``: the layer norm's linear part, without its scale."""
    gamma = block.layer_norm.weight.to(dtype)
    return lambda z: gamma * (z - z.mean(dim=-1, keepdim=True))


def _linearised_block(pattern: torch.Tensor, vectors: torch.Tensor, layer_input: torch.Tensor, block: AttentionBlock):
    """ALTI's decomposition of one layer's attention block as ``(weights, parts, own, resultant)``, with
    ``T_i(x_j) = sum_h weights[b, h, i, j] parts[b, h, j] + [i == j] own[b, i]`` and ``y_i = resultant[b, i]`` the block's real output:

    - post-norm: ``weights = a_h[i, j] / s_i``, ``parts = L(v_j^h W_O^h)`` (L is linear: applied to n vectors, not n^2),
      ``own = L(x_i) / s_i``, ``y_i = (L(sum_j sum_h a v W_O + x_i) + L(b_O)) / s_i + beta``, the layer norm's output;
    - pre-norm (a decoder's, docs/methods.md#decoders): ``v_j = LN(x_j) W_V + b_V`` travels with its token (its own norm),
      ``weights = a_h[i, j]``, ``parts = m v_j^h W_O^h``, ``own = x_i`` (the residual), ``y_i = x_i + m (sum_j sum_h a v W_O + b_O)``
      (``m`` Granite's multiplier, else 1), no norm after; in a parallel-residual layer (GPT-NeoX, Phi) the attention branch
      and the residual, without the feed-forward branch, which reads ``x_i`` alone;
    - pre-norm with an RMS norm on the attention output before the residual (Gemma 2, OLMo 2), ``N(z) = g z / r``: its linear
      part with the real scale ``r_i = sqrt(mean(z_i^2) + eps)`` of ``z_i = sum_j sum_h a v W_O + b_O``, ``weights = a_h[i, j] / r_i``,
      ``parts = g v_j^h W_O^h``, ``own = x_i``, ``y_i = x_i + g z_i / r_i`` (``g b_O / r_i`` belongs to no token).
    """
    bias = block.output_bias.to(vectors.dtype) if block.output_bias is not None else torch.zeros_like(layer_input[0, 0])
    if block.output_multiplier != 1:
        vectors, bias = vectors * block.output_multiplier, bias * block.output_multiplier
    mixed = torch.einsum("bhij,bhjd->bid", pattern, vectors)  # sum_j sum_h a v W_O
    if block.pre_norm and block.output_norm is not None:
        gain, eps = block.output_norm_parts()
        gain = gain.to(vectors.dtype)
        scale = torch.sqrt((mixed + bias).pow(2).mean(dim=-1, keepdim=True) + eps)  # r_i, the real RMS of the attention output
        return pattern / scale[:, None], gain * vectors, layer_input, layer_input + gain * (mixed + bias) / scale
    if block.pre_norm:
        return pattern, vectors, layer_input, mixed + layer_input + bias
    linear_part = _linear_part(block, vectors.dtype)
    scale = layer_norm_scale(mixed + bias + layer_input, block.layer_norm.eps)  # s_i, the real scale
    resultant = (linear_part(mixed + layer_input) + linear_part(bias)) / scale + block.layer_norm.bias.to(vectors.dtype)
    return pattern / scale[:, None], linear_part(vectors), linear_part(layer_input) / scale, resultant


def _distance_contributions(parts: torch.Tensor, resultant: torch.Tensor) -> torch.Tensor:
    """``max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1)`` of ``parts [batch, rows, n, hidden]`` against ``resultant [batch, rows, hidden]``."""
    distance = (resultant[:, :, None] - parts).abs().sum(dim=-1)
    return (resultant.abs().sum(dim=-1)[:, :, None] - distance).clamp(min=0)


def _chunk_rows(batch: int, n: int, hidden: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, batch * n * hidden))


def alti_contributions(pattern: torch.Tensor, value: torch.Tensor, layer_input: torch.Tensor, block: AttentionBlock,
                       chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """ALTI's contributions ``c[b, i, j]`` of one layer (see the module docstring), rows normalised; padding columns 0.

    ``pattern [batch, head, n, n]`` (padding rows zero), ``value [batch, head, n, head_dim]`` (``x W_V + b_V``; pre-norm
    ``LN(x) W_V + b_V``), ``layer_input [batch, n, hidden]`` (x, the residual). ``T_i(x_j)`` is built a chunk of queries at a
    time, at most ``chunk_elements`` of ``[batch, rows, n, hidden]``: the result does not depend on the chunk."""
    value, pattern, layer_input = in_statistics_dtype(value, pattern, layer_input)
    batch, n, hidden = layer_input.shape
    weights, parts_by_head, own, resultant = _linearised_block(pattern, head_vectors(value, block), layer_input, block)
    contributions = torch.zeros(batch, n, n, dtype=value.dtype, device=value.device)
    rows = _chunk_rows(batch, n, hidden, chunk_elements)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        # sum over heads one at a time, elementwise: each row's sum is the same whatever the chunk ([batch, rows, n, hidden])
        parts = weights[:, 0, start:stop, :, None] * parts_by_head[:, 0, None]
        for head in range(1, weights.shape[1]):
            parts.addcmul_(weights[:, head, start:stop, :, None], parts_by_head[:, head, None])
        rows_here = torch.arange(start, stop, device=value.device)
        parts[:, rows_here - start, rows_here] += own[:, start:stop]  # the residual: x_i is token i's own
        contributions[:, start:stop] = _distance_contributions(parts, resultant[:, start:stop])
    return rows_normalised(contributions)


def alti_per_head(pattern: torch.Tensor, value: torch.Tensor, layer_input: torch.Tensor, block: AttentionBlock,
                  chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Bertology's per-head variant of ALTI, for the ``alti`` view of every per-head analysis.

    ``[batch, head, n, n]``: head h's own output decomposed the same way, ``T^h_i(x_j) = weights[h, i, j] parts[h, j]`` (post-norm
    ``L(a_h[i, j] v_j^h W_O^h) / s_i`` with ``s_i`` the layer norm's real scale, pre-norm ``a_h[i, j] v_j^h W_O^h``) and
    ``y^h_i = sum_j T^h_i(x_j)`` (no residual, which belongs to no head),
    ``c_h[i, j] = max(0, ||y^h_i||_1 - ||y^h_i - T^h_i(x_j)||_1)``, rows normalised. Chunked over queries like
    :func:`alti_contributions`.
    """
    value, pattern, layer_input = in_statistics_dtype(value, pattern, layer_input)
    batch, heads, n, _ = value.shape
    hidden = layer_input.shape[-1]
    weights, parts_by_head, _, _ = _linearised_block(pattern, head_vectors(value, block), layer_input, block)
    resultants = torch.matmul(weights, parts_by_head)  # y^h_i = sum_j T^h_i(x_j): [batch, head, n, hidden]
    contributions = torch.zeros(batch, heads, n, n, dtype=value.dtype, device=value.device)
    rows = _chunk_rows(batch, n, hidden, chunk_elements)
    for head in range(heads):
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            parts = weights[:, head, start:stop, :, None] * parts_by_head[:, head, None]  # T^h_i(x_j): [batch, rows, n, hidden]
            contributions[:, head, start:stop] = _distance_contributions(parts, resultants[:, head, start:stop])
    return rows_normalised(contributions)


def value_zeroing(pattern: torch.Tensor, value: torch.Tensor, head_output: torch.Tensor, layer_input: torch.Tensor, block: AttentionBlock,
                  per_head: bool = False, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Value zeroing's scores of one layer (see the module docstring), rows normalised: ``[batch, n, n]`` (t's values zeroed in
    every head), or with ``per_head`` ``[batch, head, n, n]`` (in one head at a time). Padding rows and columns 0.

    The attention weights stay as they are, so zeroing t's values takes ``a_h[i, t] v_t^h W_O^h`` out of token i's
    attention output; the rest of the layer (residual, layer norm, feed-forward: ``block.rest_of_layer``) is run again on every
    such output, ``chunk_elements`` of ``[batch, zeroed, n, hidden]`` at a time."""
    layer_dtype = layer_input.dtype  # the reruns run the model's own modules, in its dtype
    value, pattern, head_output = in_statistics_dtype(value, pattern, head_output)
    batch, heads, n, _ = value.shape
    hidden = layer_input.shape[-1]
    vectors = head_vectors(value, block)  # [batch, head, n, hidden]
    bias = block.output_bias.to(value.dtype) if block.output_bias is not None else 0
    projected = torch.einsum("bhiv,hvd->bid", head_output, block.output_weight.to(value.dtype).reshape(heads, value.shape[-1], -1)) + bias
    original = block.rest_of_layer(projected.to(layer_dtype), layer_input).to(value.dtype)  # [batch, n, hidden]: the layer's output
    original_norm = torch.linalg.vector_norm(original, dim=-1)
    zeroed_count = heads * n if per_head else n  # per head: (h, t) pairs, head-major
    scores = torch.zeros(batch, zeroed_count, n, dtype=value.dtype, device=value.device)
    step = _chunk_rows(batch, n, hidden, chunk_elements)
    for start in range(0, zeroed_count, step):
        chosen = torch.arange(start, min(zeroed_count, start + step), device=value.device)
        if per_head:  # a_h[i, t] v_t^h W_O^h of one head: [batch, chunk, n, hidden]
            h, t = chosen // n, chosen % n
            removed = pattern[:, h, :, t].permute(1, 0, 2)[..., None] * vectors[:, h, t][:, :, None, :]
        else:  # summed over the heads
            removed = torch.einsum("bhit,bhtd->btid", pattern[..., chosen], vectors[:, :, chosen])
        outputs = block.rest_of_layer((projected[:, None] - removed).to(layer_dtype), layer_input[:, None]).to(value.dtype)  # [batch, chunk, n, hidden]
        norms = torch.linalg.vector_norm(outputs, dim=-1) * original_norm[:, None]
        cosine = (outputs * original[:, None]).sum(dim=-1) / torch.where(norms > 0, norms, 1)  # a zero vector: cosine 0, as sklearn's
        scores[:, chosen] = (1 - cosine).clamp(0, 2)
    # a key no head (per head: that head) gives weight removes nothing: exactly 0, not the rerun's rounding (padding, a decoder's future)
    heard = pattern > 0 if per_head else (pattern > 0).any(dim=1)  # [batch, (head,) i, t]
    scores = scores.unflatten(1, (heads, n)) if per_head else scores  # [batch, (head,) t, i]
    return rows_normalised(torch.where(heard, scores.transpose(-1, -2), 0))


def rolled_out(contributions: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """``R_l = c_l R_{l-1}`` (``R_0 = c_0``): the contributions of the input tokens to layer l's output (ALTI, value zeroing)."""
    return contributions if previous is None else torch.matmul(contributions, previous)
