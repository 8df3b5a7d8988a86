"""OPT's layout: a decoder, pre-norm where ``do_layer_norm_before`` (every size but OPT-350m), post-norm otherwise.

Layers are ``decoder.layers[l]``, with ``self_attn``, ``self_attn.out_proj`` and ``self_attn_layer_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import DECODER
from bertology.core.model.layouts.base import Layout


class OptLayout(Layout):
    model_types = frozenset({"opt"})
    kind, pre_norm = DECODER, True

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.decoder.layers)

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        decoder = base.decoder
        return [decoder.embed_tokens, decoder.embed_positions, *([decoder.project_in] if decoder.project_in is not None else [])]

    def is_pre_norm(self, config) -> bool:
        return bool(config.do_layer_norm_before)

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn.out_proj

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn_layer_norm

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        return layer.self_attn.v_proj.weight.T

    def final_norm(self, base: nn.Module) -> nn.Module | None:
        return base.decoder.final_layer_norm  # None where post-norm (OPT-350m)

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Pre-norm ``h = x + projected``, ``h + FC2(act(FC1(final_layer_norm(h))))``; post-norm (OPT-350m)
        ``h = self_attn_layer_norm(x + projected)``, ``final_layer_norm(h + FC2(act(FC1(h))))``."""
        hidden = x + projected
        if not layer.do_layer_norm_before:
            hidden = layer.self_attn_layer_norm(hidden)
        feed_forward = layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(hidden) if layer.do_layer_norm_before else hidden)))
        return hidden + feed_forward if layer.do_layer_norm_before else layer.final_layer_norm(hidden + feed_forward)
