"""ALBERT's layout: a post-norm encoder whose ``G`` groups of shared layers run as ``L`` layers.

Layer ``l`` is that of group ``floor(l / (L / G))`` (``encoder.albert_layer_groups[g].albert_layers``); each has
``attention``, ``attention.dense`` and ``attention.LayerNorm`` (transformers' ``AlbertTransformer``).
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import ENCODER
from bertology.core.model.layouts.base import Layout


class AlbertLayout(Layout):
    model_types = frozenset({"albert"})
    kind = ENCODER

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return [layer for group in base.encoder.albert_layer_groups for layer in group.albert_layers]

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        return [base.embeddings, base.encoder.embedding_hidden_mapping_in]

    def pooler(self, base: nn.Module) -> nn.Module | None:
        return getattr(base, "pooler", None)

    def layer_calls(self, base: nn.Module, config) -> list[nn.Module]:
        groups = base.encoder.albert_layer_groups
        per_group = config.num_hidden_layers / config.num_hidden_groups
        return [inner for layer in range(config.num_hidden_layers) for inner in groups[int(layer / per_group)].albert_layers]

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.attention.dense

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.attention.LayerNorm

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        return layer.attention.value.weight.T

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = attention.LayerNorm(projected + x)``, then ``full_layer_layer_norm(FFN(h) + h)`` (``AlbertLayer.ff_chunk``)."""
        hidden = layer.attention.LayerNorm(projected + x)
        return layer.full_layer_layer_norm(layer.ff_chunk(hidden) + hidden)
