"""Kobayashi et al.'s norm shares and mixing ratios: what a head mixes in (docs/methods.md#norms-and-mixing).

Kobayashi et al. (2020), "Attention is Not Only a Weight: Analyzing Transformers with Vector Norms": head h
of a layer adds ``a[i, j] f_h(x_j)`` to query i, with ``x_j`` the layer input and
``f_h(x) = (x W_V^h + b_V^h) W_O^h`` (the head's value projection, then its slice of the output
projection; the output bias left out). Its *norm shares* ``w[i, j] = ||a[i, j] f_h(x_j)|| / sum_k ||a[i, k] f_h(x_k)||``
are a distribution over keys like the weights, so every analysis runs on them unchanged.

Kobayashi et al. (2021), "Incorporating Residual and Normalization Layers into Analysis of Masked Language
Models": the context-mixing ratio of token i, with the residual and the layer norm taken into account as in
the authors' code (``norm-analysis-of-transformer``, ``emnlp2021``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from bertology.core.errors import BertologyError
from bertology.core.model.hooks import statistics_dtype
from bertology.core.model.layouts import AttentionBlock

#: The views of attention every analysis can run on (``--weighting``): the weights, Kobayashi's norm shares, and two
#: per-head contribution maps (:mod:`bertology.core.measures.contributions`): ALTI's per-head variant and value zeroing per head.
WEIGHTINGS = ("attention", "norm", "alti", "value-zeroing")
#: The views computed from a rerun or decomposition of the block (:mod:`bertology.core.measures.contributions`), not from the maps alone.
CONTRIBUTION_VIEWS = ("alti", "value-zeroing")
#: How the report names each view.
WEIGHTING_TITLES = {"attention": "attention weights", "norm": "norm shares (Kobayashi et al. 2020)",
                    "alti": "ALTI per head (Ferrando et al. 2022)", "value-zeroing": "value zeroing per head (Mohebbi et al. 2023)"}


def parse_weighting(weighting: str | Iterable[str]) -> list[str]:
    """``"attention"``, ``"norm"``, ``"attention,norm,alti,value-zeroing"`` (or a list of names) -> the views, in order, each once."""
    names = weighting.split(",") if isinstance(weighting, str) else list(weighting)
    views = list(dict.fromkeys(name.strip() for name in names))
    unknown = [name for name in views if name not in WEIGHTINGS]
    if unknown or not views:
        raise BertologyError(f"unknown weighting {','.join(unknown) or repr(weighting)}: use attention, norm, alti, value-zeroing or several, "
                             "comma-separated")
    return views


#: The context-mixing ratios of :func:`mixing_ratios`, in order (Kobayashi et al. 2021's names).
MIXING_RATIOS = ("attn", "attn_res", "attn_res_ln")


def transformed_norms(value: torch.Tensor, block: AttentionBlock) -> torch.Tensor:
    """``||f_h(x_j)|| = ||v_j^h W_O^h||`` of every head and key: ``value`` is ``[batch, head, key, head_dim]``
    (``x W_V + b_V``, as the attention function receives it: in a pre-norm block, ``LN(x) W_V + b_V`` with the real
    normalised input; with grouped-query attention, the shared key-value head's vectors repeated for each query head,
    docs/methods.md#decoders); returns ``[batch, head, key]``.

    Computed as ``sqrt(v^T G_h v)`` with ``G_h = W_O^h W_O^h^T`` (``head_dim x head_dim``), which costs
    ``head_dim / hidden`` of projecting every value vector. In float32 at least (:func:`~bertology.core.model.hooks.statistics_dtype`)
    whatever the weights' dtype.
    """
    value = value.to(statistics_dtype(value.dtype))
    num_heads, head_dim = value.shape[1], value.shape[-1]
    by_head = block.output_weight.reshape(num_heads, head_dim, -1).to(value.dtype)  # [head, head_dim, hidden]: f_h(x) = v_h @ W[h]
    gram = torch.matmul(by_head, by_head.transpose(1, 2))  # [head, head_dim, head_dim]
    squared = (torch.einsum("bhkd,hde->bhke", value, gram) * value).sum(dim=-1)
    return torch.sqrt(squared.clamp_min(0))


def norm_shares(attentions: torch.Tensor, key_norms: torch.Tensor) -> torch.Tensor:
    """Kobayashi et al.'s norm-based weights as shares of each query's row (docs/methods.md#norms-and-mixing):
    ``w[i, j] = a[i, j] ||f(x_j)|| / sum_k a[i, k] ||f(x_k)||``.

    ``attentions`` is ``[..., head, query, key]``, ``key_norms`` ``[..., head, key]``. Rows whose total is
    zero (padding queries) stay zero.
    """
    return rows_normalised(attentions * key_norms.unsqueeze(-2))


def layer_norm_scale(vectors: torch.Tensor, eps: float) -> torch.Tensor:
    """The scale a layer norm divides each vector of ``vectors [..., d]`` by, ``sqrt(var(v) + eps)`` (the variance over ``d``,
    biased), ``[..., 1]``; as the mean of the centred squares (torch's ``var`` took 13x as long on a CPU)."""
    centred = vectors - vectors.mean(dim=-1, keepdim=True)
    return torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + eps)


def rows_normalised(scores: torch.Tensor) -> torch.Tensor:
    """Each row of ``scores [..., n]`` divided by its sum; a row whose sum is zero (padding) stays zero."""
    total = scores.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, scores / torch.where(total > 0, total, 1), 0)


def mixing_ratios(pattern: torch.Tensor, value: torch.Tensor, head_output: torch.Tensor, layer_input: torch.Tensor,
                  block: AttentionBlock, projected: torch.Tensor | None = None) -> torch.Tensor:
    """The context-mixing ratios of every token, ``[batch, query, 3]`` in the order of :data:`MIXING_RATIOS`.

    With ``z[i <- j] = sum_h a_h[i, j] f_h(x_j)`` (the attention's part, output bias left out), the part a
    token keeps of itself ``P_i`` and the part it mixes in ``M_i = sum_{j != i} z[i <- j]``, each ratio is
    ``||M|| / (||M|| + ||P||)`` (Kobayashi et al. 2021, eq. for r_i):

    - ``attn`` (Attn-N): ``P_i = z[i <- i]``;
    - ``attn_res`` (AttnRes-N): ``P_i = z[i <- i] + x_i`` (the residual);
    - ``attn_res_ln`` (AttnResLn-N): both parts through the layer norm's linear part,
      ``g(z) = gamma * (z - mean(z)) / sqrt(var(s_i) + eps)``, with ``s_i = sum_j z[i <- j] + b_O + x_i``
      the vector the layer norm actually normalises.

    ``pattern`` is ``[batch, head, query, key]``, ``value`` ``[batch, head, key, head_dim]``, ``head_output`` each head's
    ``pattern @ value`` as the model computed it (``[batch, head, query, head_dim]``), ``layer_input`` ``[batch, query, hidden]``;
    all in float32 at least (:func:`~bertology.core.model.hooks.statistics_dtype`) whatever the weights' dtype.
    ``projected``: the model's own output projection of ``head_output``, ``sum_j z[i <- j] + b_O`` (``[batch, query, hidden]``),
    where it has run; in the statistics' dtype it is used as it is, not computed a second time (a sixth of a layer's work).
    """
    if block.pre_norm:
        raise BertologyError("the context-mixing ratios take the residual and the layer norm after attention (a post-norm block); "
                             "this model normalises before attention (pre-norm), where they have no such meaning")
    dtype = statistics_dtype(value.dtype)
    pattern, value, head_output, layer_input = (tensor.to(dtype) for tensor in (pattern, value, head_output, layer_input))
    weight = block.output_weight.to(dtype)  # [head * head_dim, hidden]

    def project(per_head: torch.Tensor) -> torch.Tensor:  # [batch, head, i, head_dim] -> sum_h per_head_h W_O^h: [batch, i, hidden]
        return torch.matmul(per_head.transpose(1, 2).flatten(2), weight)

    bias = block.output_bias.to(dtype) if block.output_bias is not None else None
    if projected is not None and projected.dtype == dtype:  # sum_j z[i <- j] + b_O as the model computed it
        with_bias = projected
        total = projected - bias if bias is not None else projected
    else:
        total = project(head_output)
        with_bias = total + bias if bias is not None else total
    own = project(pattern.diagonal(dim1=-2, dim2=-1)[..., None] * value)
    mixed = total - own
    kept = own + layer_input
    pre_norm = with_bias + layer_input
    scale = layer_norm_scale(pre_norm, block.layer_norm.eps)
    gamma = block.layer_norm.weight.to(value.dtype)

    def through_norm(vectors: torch.Tensor) -> torch.Tensor:
        return gamma * (vectors - vectors.mean(dim=-1, keepdim=True)) / scale

    def ratio(mix: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mix_norm, keep_norm = torch.linalg.vector_norm(mix, dim=-1), torch.linalg.vector_norm(keep, dim=-1)
        total_norm = mix_norm + keep_norm
        return torch.where(total_norm > 0, mix_norm / torch.where(total_norm > 0, total_norm, 1), 0)

    return torch.stack([ratio(mixed, own), ratio(mixed, kept), ratio(through_norm(mixed), through_norm(kept))], dim=-1)
