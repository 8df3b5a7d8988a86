"""GPT-NeoX's (Pythia's) layout: a pre-norm decoder, its feed-forward beside the attention or after it.

Layers are ``layers[l]``, with ``attention``, ``attention.dense`` and ``input_layernorm``; the feed-forward reads
``post_attention_layernorm`` of ``x`` beside the attention (a parallel residual, ``use_parallel_residual``) or of
``x + attention`` after it.
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import DECODER
from bertology.core.model.layouts.base import Layout, parallel_finish, sequential_finish


class GptNeoXLayout(Layout):
    model_types = frozenset({"gpt_neox"})
    kind, pre_norm = DECODER, True

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.layers)

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        return [base.embed_in]

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.attention.dense

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.input_layernorm

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        """The fused ``query_key_value`` holds each head's query, key and value side by side (``[heads, 3, head_dim]`` rows)."""
        attention = layer.attention
        weight = attention.query_key_value.weight  # [heads * 3 * head_dim, hidden]
        return weight.view(-1, 3, attention.head_size, weight.shape[1])[:, 2].flatten(0, 1).T

    def final_norm(self, base: nn.Module) -> nn.Module:
        return base.final_layer_norm

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rest = parallel_finish if layer.use_parallel_residual else sequential_finish
        return rest(layer.mlp, layer.post_attention_layernorm, projected, x)
