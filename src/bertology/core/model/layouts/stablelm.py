"""StableLM's layout (StableLM-2, StableLM-3B-4E1T): Llama's layer names with biased LayerNorms for RMS norms.

Transformers' ``StableLmDecoderLayer``: rotary embeddings on part of each head (``partial_rotary_factor``, applied
before bertology's ``key`` hook point), optional per-head norms of queries and keys (``qk_layernorm``), and, where
``use_parallel_residual``, GPT-NeoX's parallel residual: ``x + attention(LN(x)) + MLP(LN(x))`` with the one
``input_layernorm``, and no ``post_attention_layernorm``.
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.layouts.base import parallel_finish, sequential_finish
from bertology.core.model.layouts.llama import LlamaLayout


class StableLmLayout(LlamaLayout):
    model_types = frozenset({"stablelm"})

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if layer.use_parallel_residual:
            return parallel_finish(layer.mlp, layer.input_layernorm, projected, x)
        return sequential_finish(layer.mlp, layer.post_attention_layernorm, projected, x)
