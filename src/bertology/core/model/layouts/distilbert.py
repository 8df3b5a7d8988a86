"""DistilBERT's layout: a post-norm encoder whose layers are ``transformer.layer[l]`` (``TransformerBlock``), with
``attention``, ``attention.out_lin`` and ``sa_layer_norm``."""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import ENCODER
from bertology.core.model.layouts.base import Layout


class DistilBertLayout(Layout):
    model_types = frozenset({"distilbert"})
    kind = ENCODER

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.transformer.layer)

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.attention.out_lin

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.sa_layer_norm

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = LN1(projected + x)``, then ``LN2(FFN(h) + h)``."""
        hidden = layer.sa_layer_norm(projected + x)
        return layer.output_layer_norm(layer.ffn(hidden) + hidden)
