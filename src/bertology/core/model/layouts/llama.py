"""Llama's layout and its kin's: pre-norm decoders (Mistral, Qwen2, Qwen3, OLMo, Gemma, Phi-3, Granite, OLMo 2).

Layers are ``layers[l]``, with ``self_attn``, ``self_attn.o_proj`` and ``input_layernorm`` before the attention,
``post_attention_layernorm`` and ``mlp`` after it, and the final ``norm``. Gemma's norms store ``g - 1``; Phi-3 fuses
its projections; Gemma 2, Granite and OLMo 2 change what happens to the attention output before the residual.
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import DECODER
from bertology.core.model.layouts.base import Layout, sequential_finish


class LlamaLayout(Layout):
    model_types = frozenset({"llama", "mistral", "qwen2", "qwen3", "olmo"})
    kind, pre_norm = DECODER, True

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.layers)

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        return [base.embed_tokens]

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn.o_proj

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.input_layernorm

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        return layer.self_attn.v_proj.weight.T

    def final_norm(self, base: nn.Module) -> nn.Module:
        return base.norm

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return sequential_finish(layer.mlp, layer.post_attention_layernorm, projected, x)


class GemmaLayout(LlamaLayout):
    """Gemma: Llama's layer, whose RMS norms store ``g - 1``."""

    model_types = frozenset({"gemma"})
    norm_gain_offset = 1.0


class Phi3Layout(LlamaLayout):
    """Phi-3: Llama's layer with the queries, keys and values of one fused projection, ``qkv_proj`` (queries, then keys, then values)."""

    model_types = frozenset({"phi3"})

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        attention = layer.self_attn
        return attention.qkv_proj.weight[-attention.num_key_value_heads * attention.head_dim :].T


class Gemma2Layout(LlamaLayout):
    """Gemma 2: an RMS norm after each branch, before the residual (``post_attention_layernorm``, whose weight is ``g - 1``,
    as every norm's here, and ``post_feedforward_layernorm``), the feed-forward's own before it (``pre_feedforward_layernorm``)."""

    model_types = frozenset({"gemma2"})
    norm_gain_offset = 1.0

    def before_residual(self, layer: nn.Module, config) -> dict:
        return {"output_norm": layer.post_attention_layernorm, "output_norm_gain_offset": self.norm_gain_offset}

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = x + post_attention_layernorm(projected)``, then ``h + post_feedforward_layernorm(MLP(pre_feedforward_layernorm(h)))``."""
        hidden = x + layer.post_attention_layernorm(projected)
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))


class GraniteLayout(LlamaLayout):
    """Granite: Llama's layer with both branches scaled by ``m`` (``residual_multiplier``) before the residual."""

    model_types = frozenset({"granite"})

    def before_residual(self, layer: nn.Module, config) -> dict:
        return {"output_multiplier": float(getattr(config, "residual_multiplier", 1.0))}

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = x + m projected``, ``h + m MLP(post_attention_layernorm(h))``."""
        hidden = x + projected * layer.residual_multiplier
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden)) * layer.residual_multiplier


class Olmo2Layout(LlamaLayout):
    """OLMo 2: no norm before the attention; an RMS norm after each branch, before the residual (``post_attention_layernorm``,
    ``post_feedforward_layernorm``)."""

    model_types = frozenset({"olmo2"})

    def norm(self, layer: nn.Module) -> nn.Module:
        return nn.Identity()

    def before_residual(self, layer: nn.Module, config) -> dict:
        return {"output_norm": layer.post_attention_layernorm}

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = x + post_attention_layernorm(projected)``, then ``h + post_feedforward_layernorm(MLP(h))``."""
        hidden = x + layer.post_attention_layernorm(projected)
        return hidden + layer.post_feedforward_layernorm(layer.mlp(hidden))
