"""The kind of a model, encoder or decoder: the keys each query sees, the uniform reference and the anchor tokens.

What differs between a bidirectional encoder and a causal decoder (docs/methods.md#decoders), in one object that the
engine, every family and every report ask instead of branching on a flag.

A :class:`Kind` says which keys each query sees and how many (``|S_i|``: an encoder's n; a decoder's ``i + 1``, keys
``j <= i``), which queries enter a mean over queries (an encoder's every real token; a decoder's ``i >= 1``: row 0 sees
only itself, so its weight 1 says nothing of the head), the uniform reference of a row (``1 / |S_i|``, whose entropy is
``ln |S_i|``), and the anchor tokens a head may park its attention on (Clark et al. 2019: an encoder's [CLS] and [SEP];
a decoder's first token, the candidate attention sink of Xiao et al. 2024, BOS where the tokenizer adds one).

A run folder's manifest names the kind (``model.kind``) so that reports read it back with :func:`kind_named`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch


class Kind:
    """What one kind of model sees (see the module docstring). Two instances serve every model: :data:`ENCODER` and
    :data:`DECODER`; compare kinds with ``is`` or ``==``, and name them with :attr:`name` (``encoder``, ``decoder``)."""

    #: ``encoder`` or ``decoder``, as ``info``, manifests and reports say.
    name: ClassVar[str]
    #: The anchor tokens by name, in report order: the keys of :attr:`~bertology.core.engine.Batch.anchors`.
    anchors: ClassVar[tuple[str, ...]]
    #: Whether a query sees the keys after it: an encoder's does, so ``next`` (``a[i, i + 1]``) and a row of its own at an
    #: anchor ([CLS]'s entropy) have a meaning there; a decoder's never does.
    sees_later_keys: ClassVar[bool]
    #: How a report names the anchors in a sentence.
    anchor_words: ClassVar[str]
    #: The position of a sequence's first query in a mean over queries (:meth:`query_mask`, for a sequence that starts at
    #: position 0): 0, or 1 where a query sees no later key (a decoder's row 0 sees only itself). A mean over queries that
    #: slices the rows from here sums exactly the terms it averages.
    first_query: ClassVar[int]
    #: The one instance of the kind (:mod:`bertology.core.storage.states` gives it back for a stored kind).
    shared_instance: ClassVar["Kind"]

    def __repr__(self) -> str:
        return f"<{self.name} kind>"

    def __reduce__(self):  # one instance per kind, also through pickles (Ray actors, resumed states)
        return kind_named, (self.name,)

    def anchor_masks(self, input_ids: torch.Tensor, mask: torch.Tensor, cls_token_id: int | None,
                     sep_token_id: int | None) -> dict[str, torch.Tensor]:
        """``{anchor: [batch, n] bool}`` for the :attr:`anchors`, padding False."""
        raise NotImplementedError

    def query_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``[batch, n]`` bool: the queries that enter a mean over queries, the real tokens from :attr:`first_query` on."""
        positions = torch.arange(mask.shape[1], device=mask.device)
        return mask & (positions >= self.first_query)[None]

    def visible_keys(self, mask: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """``[batch, n, n]`` bool: key ``j`` is seen by query ``i`` (both real tokens); with ``rows``, only those query rows,
        ``[batch, r, n]`` (a block of a pass by blocks of queries)."""
        raise NotImplementedError

    def visible_counts(self, mask: torch.Tensor) -> torch.Tensor:
        """``[batch, n]`` int: the keys each query sees, ``|S_i|``, 0 for padding; the uniform row is ``1 / |S_i|``."""
        raise NotImplementedError

    def uniform_entropy(self, length: int) -> float:
        """The mean over a sequence's queries (:meth:`query_mask`) of the uniform row's entropy ``ln |S_i|`` (nats), for a
        sequence of ``length`` tokens; NaN where it has no query."""
        raise NotImplementedError

    def uniform_entropies(self, lengths: np.ndarray) -> np.ndarray:
        """:meth:`uniform_entropy` of each length, float64."""
        return np.array([self.uniform_entropy(int(n)) for n in lengths], dtype=np.float64)


def uniform_rows(visible: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[..., n, n]``: the uniform head over ``visible [..., n, n]`` keys, ``U = V / V.sum(-1)``: each query's row ``1 /
    |S_i|`` on the keys it sees, zero where it sees none (padding); the null of docs/methods.md#the-null-model."""
    weights = visible.to(dtype)
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=1)


def first_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[batch, n]``: each sequence's first token, position 0 (a decoder's anchor, docs/methods.md#decoders)."""
    first = torch.zeros_like(mask)
    first[:, 0] = mask[:, 0]
    return first


class EncoderKind(Kind):
    """Bidirectional attention: every real token sees every real token, ``|S_i| = n``."""

    name = "encoder"
    anchors = ("cls", "sep")
    sees_later_keys = True
    first_query = 0
    anchor_words = "[CLS], [SEP]"

    def anchor_masks(self, input_ids, mask, cls_token_id, sep_token_id):
        return {"cls": (input_ids == cls_token_id) & mask, "sep": (input_ids == sep_token_id) & mask}

    def visible_keys(self, mask, rows=None):
        return mask[:, None, :] & mask[:, slice(None) if rows is None else rows, None]

    def visible_counts(self, mask):
        return mask.sum(dim=1, keepdim=True) * mask

    def uniform_entropy(self, length):
        return math.log(length) if length > 0 else float("nan")


class DecoderKind(Kind):
    """Causal attention: query i sees keys ``j <= i``, ``|S_i| = i + 1``; row 0 is no query of a mean (it sees only itself)."""

    name = "decoder"
    anchors = ("first",)
    sees_later_keys = False
    first_query = 1
    anchor_words = "the first token (the candidate attention sink)"

    def anchor_masks(self, input_ids, mask, cls_token_id, sep_token_id):
        return {"first": first_token_mask(mask)}

    def visible_keys(self, mask, rows=None):
        rows = slice(0, mask.shape[1]) if rows is None else rows
        positions = torch.arange(mask.shape[1], device=mask.device)
        earlier = positions[None, :] <= positions[rows, None]  # [r, n]: j <= i
        return earlier[None] & mask[:, None, :] & mask[:, rows, None]

    def visible_counts(self, mask):
        n = mask.sum(dim=1, keepdim=True)
        return torch.minimum(torch.arange(1, mask.shape[1] + 1, device=mask.device)[None], n) * mask

    def uniform_entropy(self, length):
        # mean_{i=1..n-1} ln(i + 1) = ln(n!) / (n - 1)
        return math.lgamma(length + 1) / (length - 1) if length > 1 else float("nan")


ENCODER: Kind = EncoderKind()
DECODER: Kind = DecoderKind()
EncoderKind.shared_instance, DecoderKind.shared_instance = ENCODER, DECODER  # one instance per kind, also in resumed states
#: Every kind by name.
KINDS: dict[str, Kind] = {kind.name: kind for kind in (ENCODER, DECODER)}


def kind_named(name: str) -> Kind:
    """The kind a manifest or a table names (``encoder``, ``decoder``)."""
    if name not in KINDS:
        raise ValueError(f"unknown kind of model {name!r}: {' or '.join(KINDS)}")
    return KINDS[name]


def kind_of(config) -> Kind:
    """A configuration's kind: a decoder's where its self-attention is causal (``is_decoder``) or its model type is one that
    transformers builds only as a causal language model (GPT-2, Llama, Qwen, ...; BERT and RoBERTa can be either and are
    encoders unless ``is_decoder``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    causal_only = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return DECODER if bool(getattr(config, "is_decoder", False)) or causal_only else ENCODER
