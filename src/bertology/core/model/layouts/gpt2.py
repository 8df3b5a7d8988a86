"""GPT-2's layout: a pre-norm decoder whose layers are ``h[l]``.

Each has ``attn``, ``attn.c_proj`` (a ``Conv1D``) and ``ln_1`` before the attention, ``ln_2`` and ``mlp`` after it.
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import DECODER
from bertology.core.model.layouts.base import Layout, sequential_finish


class Gpt2Layout(Layout):
    model_types = frozenset({"gpt2"})
    kind, pre_norm = DECODER, True

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.h)

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        return [base.wte, base.wpe]

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attn

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.attn.c_proj

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.ln_1

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        weight = layer.attn.c_attn.weight  # Conv1D [hidden, 3 * hidden]: queries | keys | values
        return weight[:, 2 * weight.shape[1] // 3 :]

    def final_norm(self, base: nn.Module) -> nn.Module:
        return base.ln_f

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return sequential_finish(layer.mlp, layer.ln_2, projected, x)
