"""What a pass hands its analyzers: the encoded examples, a batch, and one layer's maps in each view of attention."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np
import torch

from bertology.core.errors import BertologyError
from bertology.core.measures.norms import norm_shares
from bertology.core.model.kinds import ENCODER, Kind, uniform_rows
from bertology.core.text.alignment import WordAlignment, align, default_word_spans, to_word_level
from bertology.core.text.corpora import Example

#: The vector norms of ``LayerMaps.vector_norms``, in order: ``||k_j||``, ``||v_j||`` and ``||f_h(x_j)||`` (Kobayashi et al. 2020).
VECTOR_NORMS = ("key", "value", "transformed")


@dataclass
class Encoded:
    """One tokenized example: its ids, offsets and segment ids, and where it sits in the corpus."""

    index: int
    example: Example
    input_ids: list[int]
    token_type_ids: list[int] | None
    offsets: list[tuple[int, int]]
    sequence_ids: list[int | None]
    truncated: bool

    def __len__(self) -> int:
        return len(self.input_ids)


def is_pair(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[batch]``: True for sentence pairs (some piece belongs to sentence B)."""
    return (segment_ids == 1).any(dim=1)


@dataclass
class Batch:
    """What every analyzer receives for one batch (tensors on the model's device).

    ``attentions[l, b, h, i, j]`` is head ``h`` of layer ``l``'s attention from query ``i`` to key
    ``j`` of sequence ``b``; rows and columns of padding are zero. In the layer-by-layer pass it is None: the
    maps reach each :class:`~bertology.core.analyzer.LayerwiseAnalyzer` one layer at a time (:class:`LayerMaps`),
    and the batch carries the rest. Masks are ``[batch, n]`` booleans.
    ``segment_ids`` is 0 or 1 for the pieces of sentence A or B and -1 for special tokens and padding.

    ``kind`` (:mod:`bertology.core.model.kinds`) says which keys each query sees (``visible_counts``), which queries enter a
    mean over queries (``query_mask``: a decoder's leaves out row 0, which sees only itself), and which anchor tokens
    ``anchors`` marks: an encoder's ``cls`` and ``sep``, a decoder's ``first`` (the candidate sink, BOS where the tokenizer
    adds one; docs/methods.md#decoders).

    ``weighting`` says which view of attention ``attentions`` holds (:data:`~bertology.core.measures.norms.WEIGHTINGS`):
    the weights, or Kobayashi et al.'s norm shares (:meth:`weighted`); analyzers never need to know.
    ``key_norms[l, b, h, j]`` is ``||f_h(x_j)||`` where the run asked for norms; ``mixing[l, b, i, r]`` the
    context-mixing ratios (:func:`~bertology.core.measures.norms.mixing_ratios`) where an analyzer ``needs`` them;
    ``hidden_states[l, b, i, :]`` every layer's output (``l = 0``: the embeddings) where an analyzer ``needs`` them;
    ``vector_norms[l, b, h, k, j]`` where an analyzer ``needs`` ``"vectors"``: the norms of key j's key vector ``||k_j||``
    (``k = 0``), value vector ``||v_j||`` (1) and transformed vector ``||f_h(x_j)||`` (2) in head h (:data:`VECTOR_NORMS`);
    ``contributions[measure][l, b, i, j]`` where an analyzer ``needs`` ALTI or value zeroing (:mod:`bertology.core.measures.contributions`).
    """

    items: list[Encoded]
    input_ids: torch.Tensor
    mask: torch.Tensor
    anchors: dict[str, torch.Tensor]  # the kind's anchor tokens by name -> [batch, n]
    punct_mask: torch.Tensor
    segment_ids: torch.Tensor
    attentions: torch.Tensor | None
    embedding: torch.nn.Module | None = field(default=None, repr=False)
    weighting: str = "attention"
    key_norms: torch.Tensor | None = field(default=None, repr=False)
    mixing: torch.Tensor | None = field(default=None, repr=False)
    hidden_states: torch.Tensor | None = field(default=None, repr=False)
    vector_norms: torch.Tensor | None = field(default=None, repr=False)
    contributions: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # measure -> [layer, batch, n, n]
    view_maps: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # alti, value-zeroing -> [layer, batch, head, n, n]
    #: The stacked pass: each contribution view's maps of the layer's uniform head, per head, as ``view_maps``.
    uniform_view_maps: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    layer_visible_keys: list[torch.Tensor] = field(default_factory=list, repr=False)  # the stacked pass: LayerMaps.visible_keys per layer
    layer_count: int | None = None  # where there are no maps to count them from (the layer-by-layer pass)
    head_count: int | None = None
    kind: Kind = ENCODER
    _views: dict[str, "Batch"] = field(default_factory=dict, init=False, repr=False)
    _placed: dict[torch.device, "Batch"] = field(default_factory=dict, init=False, repr=False)

    @property
    def device(self) -> torch.device:
        """Where the batch's tensors are: the model's input device, or a layer's (:meth:`on`)."""
        return self.input_ids.device

    def on(self, device: torch.device) -> "Batch":
        """This batch with its masks and ids on ``device`` (made once per device and batch; the batch itself where they are
        there already): where a device map spreads the layers over several devices, each layer's maps are reduced on that
        layer's device with the batch's masks moved there once. Items, alignments and counts are shared."""
        if device == self.device:
            return self
        if device not in self._placed:
            moved = {name: moved_to(getattr(self, name), device) for name in ("input_ids", "mask", "punct_mask", "segment_ids")}
            placed = dataclasses.replace(self, anchors={name: moved_to(marks, device) for name, marks in self.anchors.items()}, **moved)
            for shared in ("alignments", "host_lengths", "any_pair"):
                if shared in self.__dict__:
                    placed.__dict__[shared] = self.__dict__[shared]
            self._placed[device] = placed
        return self._placed[device]

    def weighted(self, weighting: str) -> "Batch":
        """This batch under another view of attention (computed once per batch): ``attention``, the weights;
        ``norm``, each row's norm shares ``a[i, j] ||f(x_j)|| / sum_k a[i, k] ||f(x_k)||`` (docs/methods.md#norms-and-mixing);
        ``alti`` and ``value-zeroing``, the per-head contribution maps the pass computed (:mod:`bertology.core.measures.contributions`)."""
        if weighting == self.weighting:
            return self
        if weighting not in self._views:
            maps = attention_view(weighting, self.attentions, self.key_norms, self.view_maps)
            view = dataclasses.replace(self, attentions=maps, weighting=weighting)
            view.__dict__["alignments"] = self.alignments  # shared: the pieces and words are the same
            self._views[weighting] = view
        return self._views[weighting]

    @cached_property
    def input_embeddings(self) -> torch.Tensor:
        """The model's static input (token) embeddings of every piece, ``[batch, n, dim]``."""
        with torch.inference_mode():
            return self.embedding(self.input_ids)

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def num_layers(self) -> int:
        return self.layer_count if self.layer_count is not None else self.attentions.shape[0]

    @property
    def num_heads(self) -> int:
        return self.head_count if self.head_count is not None else self.attentions.shape[2]

    @cached_property
    def any_pair(self) -> bool:
        """Whether some sequence of the batch is a sentence pair (from the items: no copy from the device)."""
        return any(segment == 1 for item in self.items for segment in item.sequence_ids)

    @cached_property
    def host_lengths(self) -> np.ndarray:
        """Real tokens of each sequence, on the host (from the items: no copy from the device)."""
        return np.array([len(item.input_ids) for item in self.items], dtype=np.int64)

    def layer_maps(self, layer: int) -> "LayerMaps":
        """Layer ``layer``'s maps of this (whole) batch, as the layer-by-layer pass hands them out."""
        if self.weighting == "norm":
            uniform_view = partial(norm_shares, key_norms=self.key_norms[layer])
        elif self.weighting in self.uniform_view_maps:
            uniform_view = partial(_computed_view, self.uniform_view_maps[self.weighting][layer])
        else:
            uniform_view = None
        return LayerMaps(layer, self.attentions[layer], mixing=None if self.mixing is None else self.mixing[layer],
                         vector_norms=None if self.vector_norms is None else self.vector_norms[layer],
                         contributions={measure: maps[layer] for measure, maps in self.contributions.items()},
                         visible_keys=self.layer_visible_keys[layer] if self.layer_visible_keys else None, uniform_view=uniform_view)

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)

    @cached_property
    def query_mask(self) -> torch.Tensor:
        """``[batch, n]``: the queries that enter a mean over queries (:meth:`~bertology.core.model.kinds.Kind.query_mask`)."""
        return self.kind.query_mask(self.mask)

    @cached_property
    def visible_counts(self) -> torch.Tensor:
        """``[batch, n]`` int: the keys each query sees, ``|S_i|``, 0 for padding: per-row uniform attention is ``1 / |S_i|``
        (:meth:`~bertology.core.model.kinds.Kind.visible_counts`)."""
        return self.kind.visible_counts(self.mask)

    @cached_property
    def anchor_mask(self) -> torch.Tensor:
        """``[batch, n]``: every anchor token of the kind (an encoder's [CLS] and [SEP], a decoder's first token)."""
        return torch.stack(list(self.anchors.values())).any(dim=0)

    @property
    def examples(self) -> list[Example]:
        return [item.example for item in self.items]

    @property
    def indices(self) -> list[int]:
        """Position of each sequence in the corpus (stable across batch sizes and shards)."""
        return [item.index for item in self.items]

    @cached_property
    def alignments(self) -> list[WordAlignment]:
        """Piece-to-word alignment of each sequence (gold words where the corpus has them)."""
        result = []
        for item in self.items:
            example = item.example
            spans = [list(example.word_spans) if example.word_spans is not None else default_word_spans(example.text)]
            if example.text_pair is not None:
                spans.append(default_word_spans(example.text_pair))
            result.append(align(item.offsets, item.sequence_ids, spans))
        return result


def moved_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself where it is there already (no call at all, so nothing that could copy or wait), else
    a copy (a device map may spread the layers over several devices)."""
    return tensor if tensor.device == device else tensor.to(device)


def stack_layers(parts: Sequence[torch.Tensor], batch: Batch, dim: int = 0) -> torch.Tensor:
    """Stack a batch's per-layer results, each reduced on its layer's device, on the batch's device (:func:`moved_to`)."""
    return torch.stack([moved_to(part, batch.device) for part in parts], dim=dim)


@dataclass
class LayerMaps:
    """One layer's maps of a batch, handed to every :class:`~bertology.core.analyzer.LayerwiseAnalyzer` inside the
    forward pass and released before the next layer runs, so a pass holds one layer's maps, not all of them.

    ``attention[b, h, i, j]`` (``[batch, head, n, n]``, in the analyzer's view of attention, padding rows and columns
    zero, on the model's device and in its dtype; in a pass by blocks of queries, ``[batch, head, r, n]``, the query rows
    :attr:`rows` of the layer, each row whole: an analyzer that sets ``folds_row_blocks`` receives each layer as
    consecutive blocks, from :attr:`starts_layer` to :attr:`ends_layer`); ``mixing[b, i, r]`` the layer's context-mixing ratios where an
    analyzer ``needs`` them; ``vector_norms[b, h, k, j]`` the layer's key, value and transformed vector norms
    (:data:`VECTOR_NORMS`) where an analyzer ``needs`` ``"vectors"``. Analyzers of the same view share one object, so
    word-level maps are merged once.
    """

    layer: int
    attention: torch.Tensor
    mixing: torch.Tensor | None = None
    vector_norms: torch.Tensor | None = None
    #: The layer's contribution maps ``c[b, i, j]`` by measure (``alti``, ``value_zeroing``) where an analyzer ``needs`` them.
    contributions: dict[str, torch.Tensor] = field(default_factory=dict)
    #: ``[batch, n, n]`` bool: the keys each query saw in this layer, from the mask the model applied (padding, causality, a
    #: sliding window, a layer of local attention); None where the pass did not record it (:meth:`visible`).
    visible_keys: torch.Tensor | None = None
    #: How this view of attention sees a head's weights ``[batch, head, n, n]``, applied to the uniform head's
    #: (:meth:`uniform`): None for the weights themselves; the norm shares of each head's own vectors under ``norm``; each
    #: head's contribution maps under ``alti`` and ``value-zeroing``.
    uniform_view: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    #: The query rows ``attention`` holds (:func:`~bertology.core.model.hooks.bertology_attention` by blocks of queries);
    #: None for every row. ``visible_keys`` and :meth:`uniform` hold the same rows.
    rows: slice | None = None
    #: The uniform heads of the batch's layers so far, by their visible keys (``id(visible) -> (visible, uniform, scores)``,
    #: ``scores`` what each analyzer made of it, :meth:`uniform_scored`): a layer that saw the very keys an earlier one saw
    #: (the same tensor) is given the same uniform head (:meth:`uniform`). None: each layer makes its own.
    shared_uniforms: dict[int, tuple[torch.Tensor, torch.Tensor, dict]] | None = field(default=None, repr=False)
    _word_maps: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _uniform: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def row_start(self) -> int:
        """The first query row of ``attention`` in the layer (0 for every row)."""
        return 0 if self.rows is None else self.rows.start

    @property
    def starts_layer(self) -> bool:
        """Whether these maps hold the layer's first query row (every row, or its first block)."""
        return self.row_start == 0

    @property
    def ends_layer(self) -> bool:
        """Whether these maps hold the layer's last query row (every row, or its last block)."""
        return self.rows is None or self.rows.stop == self.attention.shape[-1]

    def visible(self, batch: Batch) -> torch.Tensor:
        """``[batch, n, n]`` bool (``[batch, r, n]`` for a block of rows): the keys each query of ``batch`` saw in this layer:
        the mask the model applied where the pass recorded it, else the kind's (:meth:`~bertology.core.model.kinds.Kind.visible_keys`)."""
        return self.visible_keys if self.visible_keys is not None else batch.kind.visible_keys(batch.mask, self.rows)

    def uniform(self, batch: Batch) -> torch.Tensor:
        """This layer's uniform head in this view of attention (docs/methods.md#the-null-model).

        ``[batch, 1, n, n]``, every row ``1 / |S_i|`` over the keys it saw (:meth:`visible`,
        :func:`~bertology.core.model.kinds.uniform_rows`); under a view that reads each head's own vectors (``norm``,
        ``alti``, ``value-zeroing``: :attr:`uniform_view`) those weights seen through it, one per head,
        ``[batch, head, n, n]``. In float64 (float32 on MPS, which has no float64); made once a layer and shared by the
        analyzers that score it beside the heads; in the weights' view, the very tensor of an earlier layer of the batch
        that saw the same keys (:attr:`shared_uniforms`).
        """
        if self._uniform is None:
            uniform = self._shared_uniform(batch)[1]
            self._uniform = uniform if self.uniform_view is None else self.uniform_view(uniform).to(uniform.dtype)
        return self._uniform

    def _shared_uniform(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(visible, uniform, scores)`` of the weights' uniform head over this layer's visible keys: an earlier layer's of
        the batch where it saw the very same keys (:attr:`shared_uniforms`), else made here (and kept there, where kept)."""
        visible = self.visible(batch)
        known = self.shared_uniforms.get(id(visible)) if self.shared_uniforms is not None else None
        if known is None or known[0] is not visible:
            known = (visible, uniform_rows(visible, torch.float32 if visible.device.type == "mps" else torch.float64)[:, None], {})
            if self.shared_uniforms is not None:
                self.shared_uniforms[id(visible)] = known
        return known

    def uniform_scored(self, batch: Batch, scorer: object, score: Callable[[torch.Tensor], Any]) -> Any:
        """``score(self.uniform(batch))``, computed once for every layer of the batch that shares this uniform head
        (:attr:`shared_uniforms`) and the same ``scorer`` (the analyzer, whose ``score`` reads nothing of the layer but the
        head and the batch); computed anew under a view of each head's own vectors, whose uniform head is the layer's own,
        and where the layer keeps its own (a block of rows, the stacked pass)."""
        if self.uniform_view is not None or self.shared_uniforms is None:
            return score(self.uniform(batch))
        _, uniform, scores = self._shared_uniform(batch)
        if id(scorer) not in scores:
            scores[id(scorer)] = score(uniform)
        return scores[id(scorer)]

    def word_attention(self, batch: Batch, b: int) -> torch.Tensor:
        """Word-level attention ``[head, u, u]`` of sequence ``b`` at this layer (docs/methods.md#notation-and-word-level-attention)."""
        if self.rows is not None:
            raise BertologyError("word-level maps need a layer's whole maps, not a block of its query rows")
        if b not in self._word_maps:
            n = int(batch.host_lengths[b])
            self._word_maps[b] = to_word_level(self.attention[b, :, :n, :n], batch.alignments[b])
        return self._word_maps[b]


def _computed_view(maps: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    """A :attr:`LayerMaps.uniform_view` whose maps the stacked pass computed already."""
    return maps


def attention_view(weighting: str, attention: torch.Tensor, key_norms: torch.Tensor | None,
                   per_head_views: dict[str, torch.Tensor]) -> torch.Tensor:
    """The maps of one view of attention (:data:`~bertology.core.measures.norms.WEIGHTINGS`), for a layer or a stack of
    layers: ``attention``, the weights; ``norm``, each row's norm shares ``a[i, j] ||f(x_j)|| / sum_k a[i, k] ||f(x_k)||``
    (docs/methods.md#norms-and-mixing) from ``key_norms``; ``alti`` and ``value-zeroing``, the per-head contribution maps
    the pass computed (:mod:`bertology.core.measures.contributions`)."""
    if weighting == "attention":
        return attention
    if weighting in per_head_views:
        return per_head_views[weighting]
    if weighting == "norm" and key_norms is not None:
        return norm_shares(attention, key_norms)
    raise ValueError(f"this pass has no {weighting!r} view (the engine computes the views its run asks for)")

