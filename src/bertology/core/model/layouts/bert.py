"""BERT's layout and its copies' (MiniLM, ELECTRA, RoBERTa, XLM-R, CamemBERT): post-norm encoders.

Layers are ``encoder.layer[l]``, with ``attention.self``, ``attention.output.dense`` and ``attention.output.LayerNorm``
(transformers' ``BertLayer``).
"""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import ENCODER
from bertology.core.model.layouts.base import HeadParts, Layout


class BertLayout(Layout):
    model_types = frozenset({"bert", "electra"})
    kind = ENCODER
    first_token_classifiers = frozenset({"BertForSequenceClassification", "ElectraForSequenceClassification"})

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.encoder.layer)

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        return [base.embeddings, *([base.embeddings_project] if hasattr(base, "embeddings_project") else [])]  # ELECTRA's projection

    def pooler(self, base: nn.Module) -> nn.Module | None:
        return getattr(base, "pooler", None)

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention.self

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.attention.output.dense

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.attention.output.LayerNorm

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        return layer.attention.self.value.weight.T

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = LN1(projected + x)``, then ``LN2(FFN(h) + h)`` (``BertLayer.feed_forward_chunk``)."""
        return layer.feed_forward_chunk(layer.attention.output.LayerNorm(projected + x))

    def first_token_output(self, layer: nn.Module, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs) -> torch.Tensor:
        context, _ = layer.attention.self(hidden_states, attention_mask=attention_mask)
        return layer.feed_forward_chunk(layer.attention.output(context[:, :1], hidden_states[:, :1]))

    def head_parts(self, layer: nn.Module) -> HeadParts:
        own = layer.attention.self
        return HeadParts(own, "num_attention_heads", (own.query, own.key, own.value), layer.attention.output.dense)


class RobertaLayout(BertLayout):
    """BERT's layers; positions count from ``padding_idx + 1``, so two of the table's are never a piece's (514 -> 512)."""

    model_types = frozenset({"roberta", "xlm-roberta", "camembert"})
    reserved_positions = 2
    first_token_classifiers = frozenset({"RobertaForSequenceClassification", "XLMRobertaForSequenceClassification", "CamembertForSequenceClassification"})
