"""BERT's layout and its copies: BERT (and MiniLM, a BERT), ELECTRA, RoBERTa, XLM-R, CamemBERT: post-norm encoders whose
layers are ``encoder.layer[l]``, with ``attention.self``, ``attention.output.dense`` and ``attention.output.LayerNorm``
(transformers' ``BertLayer``)."""

from __future__ import annotations

import torch
from torch import nn

from bertology.core.model.kinds import ENCODER
from bertology.core.model.layouts.base import Layout


class BertLayout(Layout):
    model_types = frozenset({"bert", "electra"})
    kind = ENCODER

    def layers(self, base: nn.Module) -> list[nn.Module]:
        return list(base.encoder.layer)

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.attention.self

    def output_projection(self, layer: nn.Module) -> nn.Module:
        return layer.attention.output.dense

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.attention.output.LayerNorm

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h = LN1(projected + x)``, then ``LN2(FFN(h) + h)`` (``BertLayer.feed_forward_chunk``)."""
        return layer.feed_forward_chunk(layer.attention.output.LayerNorm(projected + x))


class RobertaLayout(BertLayout):
    """BERT's layers; positions count from ``padding_idx + 1``, so two of the table's are never a piece's (514 -> 512)."""

    model_types = frozenset({"roberta", "xlm-roberta", "camembert"})
    reserved_positions = 2
