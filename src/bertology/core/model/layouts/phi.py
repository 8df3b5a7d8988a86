"""Phi's (Phi-1, Phi-2) layout: Llama's places, with a parallel residual fed by one ``input_layernorm``.

Layers are ``layers[l]`` with ``self_attn`` and ``input_layernorm``, but the output projection is ``self_attn.dense``
and the final norm ``final_layernorm``; the one ``input_layernorm`` feeds both the attention and the feed-forward beside
it.
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.layouts.base import parallel_finish
from bertology.core.model.layouts.llama import LlamaLayout


class PhiLayout(LlamaLayout):
    model_types = frozenset({"phi"})

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn.dense

    def final_norm(self, base: nn.Module) -> nn.Module:
        return base.final_layernorm

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return parallel_finish(layer.mlp, layer.input_layernorm, projected, x)
