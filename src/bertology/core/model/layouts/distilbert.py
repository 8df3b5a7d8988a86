"""DistilBERT's layout: a post-norm encoder whose layers are ``transformer.layer[l]`` (``TransformerBlock``).

Each has ``attention``, ``attention.out_lin`` and ``sa_layer_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import ENCODER
from bertology.core.model.layouts.base import HeadParts, Layout


class DistilBertLayout(Layout):
    model_types = frozenset({"distilbert"})
    kind = ENCODER
    first_token_classifiers = frozenset({"DistilBertForSequenceClassification"})

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.transformer.layer)

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        return [base.embeddings]

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.attention.out_lin

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.sa_layer_norm

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        return layer.attention.v_lin.weight.T

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = LN1(projected + x)``, then ``LN2(FFN(h) + h)``."""
        hidden = layer.sa_layer_norm(projected + x)
        return layer.output_layer_norm(layer.ffn(hidden) + hidden)

    def first_token_output(self, layer: nn.Module, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs) -> torch.Tensor:
        attended, _ = layer.attention(hidden_states, attention_mask=attention_mask)
        first = layer.sa_layer_norm(attended[:, :1] + hidden_states[:, :1])
        return layer.output_layer_norm(layer.ffn(first) + first)

    def head_parts(self, layer: nn.Module) -> HeadParts:
        attention = layer.attention
        return HeadParts(attention, "n_heads", (attention.q_lin, attention.k_lin, attention.v_lin), attention.out_lin)
