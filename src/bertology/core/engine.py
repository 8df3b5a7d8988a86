"""The engine: tokenize, batch by length, run the model once per batch, feed every analyzer.

Memory stays bounded whatever the corpus size: examples are read lazily, sorted by length only
within a window of ``batch_size * sort_window`` examples (to cut padding), and each batch's
attention ``[layer, batch, head, query, key]`` is dropped once the analyzers have seen it. A
batch is also capped so that its attention tensor holds at most ``max_attention_elements``. Past an ``attention_budget``
(one sequence can exceed any cap; by default ``auto``, :mod:`bertology.core.model.memory`), each layer's maps are computed by blocks of query rows
(:func:`~bertology.core.model.hooks.bertology_attention`) and folded block by block by the analyzers that can
(:func:`folds_row_blocks`), so a pass holds one block of one layer's maps, not ``heads x n x n``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import BatchEncoding

from bertology.core.errors import BertologyError, one_line_error
from bertology.core.measures.contributions import CONTRIBUTION_MEASURES, alti_contributions, alti_per_head, value_zeroing
from bertology.core.measures.norms import CONTRIBUTION_VIEWS, WEIGHTINGS, mixing_ratios, norm_shares, transformed_norms
from bertology.core.model.finite import FiniteWatch
from bertology.core.model.hooks import Hooks, uniform_attention
from bertology.core.model.kinds import DECODER, ENCODER, Kind, uniform_rows
from bertology.core.model.memory import resolved_attention_budget
from bertology.core.model.models import PUNCT_SETS, LoadedModel, attention_blocks, punctuation_table
from bertology.core.text.alignment import WordAlignment, align, default_word_spans, to_word_level
from bertology.core.text.corpora import Example

OVERFLOW_POLICIES = ("truncate", "skip")
#: The null models a pass can run in place of the model's attention (``Engine(null=...)``): None, the model itself.
NULL_MODELS = (None, "uniform")
#: The vector norms of ``LayerMaps.vector_norms``, in order: ``||k_j||``, ``||v_j||`` and ``||f_h(x_j)||`` (Kobayashi et al. 2020).
VECTOR_NORMS = ("key", "value", "transformed")
MAX_SKIPPED_SOURCES = 100  # the manifest lists the first skipped sequences; the count is exact
#: The default cap on a batch's padded attention size, ``layers * heads * batch * n^2``: at 512 pieces, three sequences of a
#: 6 x 12-head model (one layer's maps, all the layer-by-layer pass holds, about 40 MB in float32), whatever the batch size.
MAX_ATTENTION_ELEMENTS = 2**26
#: The fewest pieces a sequence needs to be analysed: with 0 or 1 there is no attention between tokens (one weight of 1, and a
#: decoder's only row is left out of every mean over queries). Shorter sequences are skipped and counted (``RunStats.degenerate``).
MIN_PIECES = 2
#: Bounded reading (:meth:`Engine.read`): a sentence is tokenized from its first ``CUT_MARGIN + CHARS_PER_PIECE * max_length``
#: characters, twice as many while that part cannot decide; the pieces in a part's last ``CUT_MARGIN`` characters (or a
#: WordPiece model's longest word, where longer) may differ from the whole sentence's (a word cut short) and decide nothing.
CHARS_PER_PIECE = 8
CUT_MARGIN = 1000


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
        layer's device with the batch's masks moved there once (issue 40). Items, alignments and counts are shared."""
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
    a copy (a device map may spread the layers over several devices: issue 40)."""
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
        """This layer's uniform head in this view of attention (docs/methods.md#the-null-model): ``[batch, 1, n, n]``, every
        row ``1 / |S_i|`` over the keys it saw (:meth:`visible`, :func:`~bertology.core.model.kinds.uniform_rows`); under a
        view that reads each head's own vectors (``norm``, ``alti``, ``value-zeroing``: :attr:`uniform_view`) those weights
        seen through it, one per head, ``[batch, head, n, n]``. In float64 (float32 on MPS, which has no float64); made once
        a layer and shared by the analyzers that score it beside the heads; in the weights' view, the very tensor of an earlier
        layer of the batch that saw the same keys (:attr:`shared_uniforms`)."""
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


#: What an analyzer's ``needs`` may name: the mixing ratios, every layer's output, the key/value/transformed vector norms
#: and the contribution measures (:data:`~bertology.core.measures.contributions.CONTRIBUTION_MEASURES`).
KNOWN_NEEDS = frozenset({"mixing", "hidden_states", "vectors", *CONTRIBUTION_MEASURES})


@dataclass(frozen=True)
class PassNeeds:
    """What one pass computes beyond the attention weights, decoded once from its analyzers' ``needs`` and the views they
    receive (:meth:`of`): ``norms``, every head's ``||f_h(x_j)||`` (the ``norm`` view); ``mixing``, every token's
    context-mixing ratios; ``hidden_states``, every layer's output; ``vectors``, every head's key, value and transformed
    vector norms; ``contributions``, each named measure's maps (``alti``, ``value_zeroing``); ``views``, the per-head
    contribution maps of those views (``alti``, ``value-zeroing``) for :meth:`Batch.weighted`."""

    norms: bool = False
    mixing: bool = False
    hidden_states: bool = False
    vectors: bool = False
    contributions: tuple[str, ...] = ()
    views: tuple[str, ...] = ()

    @classmethod
    def of(cls, analyzers: Sequence, weightings: Sequence[str]) -> "PassNeeds":
        """The needs of ``analyzers``, analyzer k receiving the view ``weightings[k]``; an unknown need is refused."""
        named = set().union(*(getattr(analyzer, "needs", frozenset()) for analyzer in analyzers))
        if named - KNOWN_NEEDS:
            raise BertologyError(f"unknown analyzer needs {sorted(named - KNOWN_NEEDS)}: an analyzer may need {', '.join(sorted(KNOWN_NEEDS))}")
        return cls(norms="norm" in weightings, mixing="mixing" in named, hidden_states="hidden_states" in named,
                   vectors="vectors" in named, contributions=tuple(measure for measure in CONTRIBUTION_MEASURES if measure in named),
                   views=tuple(view for view in CONTRIBUTION_VIEWS if view in weightings))

    @property
    def anything(self) -> bool:
        """Whether the pass computes more than the weights (a pass that does needs the engine's own forward pass)."""
        return self != NO_NEEDS

    @property
    def values(self) -> bool:
        """Whether the pass captures each layer's value vectors."""
        return self.norms or self.mixing or self.vectors or bool(self.contributions or self.views)

    @property
    def layer_inputs(self) -> bool:
        """Whether the pass keeps each layer's input ``x`` (the residual): for the mixing ratios and the contributions."""
        return self.mixing or bool(self.contributions or self.views)


NO_NEEDS = PassNeeds()


def is_layerwise(analyzer) -> bool:
    """True for an analyzer that folds a batch one layer at a time (:class:`~bertology.core.analyzer.LayerwiseAnalyzer`)."""
    return callable(getattr(analyzer, "update_layer", None)) and callable(getattr(analyzer, "finish_batch", None))


#: The views of attention a pass by blocks of queries gives: the weights and the norm shares (row by row); the contribution
#: views rerun or decompose the whole block.
BLOCKED_VIEWS = ("attention", "norm")
#: What an analyzer may need and still fold blocks of queries: the mixing ratios and contribution maps read whole maps.
BLOCKED_NEEDS = frozenset({"hidden_states", "vectors"})


def folds_row_blocks(analyzer, weighting: str = "attention") -> bool:
    """Whether ``analyzer`` receiving the view ``weighting`` takes each layer's maps as blocks of query rows
    (:attr:`LayerMaps.rows`): a layerwise analyzer that says so (``folds_row_blocks``), in a view made row by row
    (:data:`BLOCKED_VIEWS`), needing nothing that reads whole maps (:data:`BLOCKED_NEEDS`)."""
    return (is_layerwise(analyzer) and bool(getattr(analyzer, "folds_row_blocks", False)) and weighting in BLOCKED_VIEWS
            and getattr(analyzer, "needs", frozenset()) <= BLOCKED_NEEDS)


@dataclass
class RunStats:
    """What a run saw: sequence and token counts, truncations and skips, and its wall time."""

    sequences: int = 0
    tokens: int = 0
    truncated: int = 0
    skipped: int = 0  # longer than max_length, with overflow="skip"
    degenerate: int = 0  # fewer than MIN_PIECES pieces
    batches: int = 0
    seconds: float = 0.0
    skipped_sources: list[str] = field(default_factory=list)
    #: Analyzers whose ``update`` raised (``isolate=True``): position in the run's analyzers -> the error, one line.
    failed: dict[int, str] = field(default_factory=dict)
    #: Analyzers left out of the pass past the attention budget (they read whole maps, or hold more than it; ``isolate=True``):
    #: position -> the one line that says why. Not a failure: the budget is a setting of the run.
    left_out: dict[int, str] = field(default_factory=dict)

    def add(self, other: "RunStats") -> "RunStats":
        """Fold in the counts of another part of the corpus (a shard); ``seconds`` is left to the caller (wall time)."""
        self.sequences += other.sequences
        self.tokens += other.tokens
        self.truncated += other.truncated
        self.skipped += other.skipped
        self.degenerate += other.degenerate
        self.batches += other.batches
        self.skipped_sources = (self.skipped_sources + other.skipped_sources)[:MAX_SKIPPED_SOURCES]
        for position, message in other.failed.items():
            self.failed.setdefault(position, message)
        for position, message in other.left_out.items():
            self.left_out.setdefault(position, message)
        return self

    @property
    def dropped(self) -> set[int]:
        """The analyzers out of the pass: failed or left out."""
        return set(self.failed) | set(self.left_out)

    @property
    def seen(self) -> int:
        """The examples read so far: analysed, or skipped as too long or degenerate."""
        return self.sequences + self.skipped + self.degenerate

    def leave_out(self, index: int, example: Example) -> None:
        """Note a skipped example among the first :data:`MAX_SKIPPED_SOURCES` (its source, or its place in the corpus from 1)."""
        if len(self.skipped_sources) < MAX_SKIPPED_SOURCES:
            self.skipped_sources.append(example.source or f"example {index + 1}")

    def check_counted(self, max_length: int) -> None:
        """Refuse, in one line that names the first example skipped, a pass that analysed no sequence."""
        if self.sequences:
            return
        reasons = [f"{count} {why}" for count, why in ((self.skipped, f"longer than {max_length} pieces"),
                                                      (self.degenerate, f"of fewer than {MIN_PIECES} pieces")) if count]
        if not reasons:
            raise BertologyError("no sequence to analyse: the input has none")
        first = f" (the first: {self.skipped_sources[0]})" if self.skipped_sources else ""
        advice = "; raise --max-length or truncate" if self.skipped else ""
        raise BertologyError(f"no sequence to analyse: every one was skipped, {' and '.join(reasons)}{first}{advice}")

    def as_dict(self) -> dict:
        return {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "truncated": self.truncated,
            "skipped": self.skipped,
            "degenerate": self.degenerate,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
            "sequences_per_second": round(self.sequences / self.seconds, 2) if self.seconds else None,
        }


class Engine:
    """Runs one model over a corpus once and hands each batch to every analyzer.

    Parameters
    ----------
    model : LoadedModel
    batch_size : int
        Most sequences per forward pass (and, with ``batch_tokens``, the sort window's unit).
    batch_tokens : int, optional
        Pack batches by tokens instead: as many length-sorted sequences as fit in ``batch_tokens`` padded pieces (``count x
        longest``; at least one sequence), so that a batch of short sentences is wide and one of long passages narrow.
    max_length : int, optional
        Most pieces per sequence (default and upper bound: the model's limit).
    overflow : {"truncate", "skip"}
        What to do with longer sequences; either way the run counts them.
    sort_window : int
        Sort by length within windows of ``batch_size * sort_window`` examples.
    max_attention_elements : int
        Cap on the padded attention size ``layers * batch * heads * n * n`` of one batch, so that memory depends on the
        longest sequences, not on where they fall (:data:`MAX_ATTENTION_ELEMENTS`).
    progress : bool
        Show a progress bar with sequences per second.
    layerwise : bool
        Where every analyzer of a run is a :class:`~bertology.core.analyzer.LayerwiseAnalyzer`, hand them each layer's maps
        inside the forward pass and keep none (peak memory: one layer's maps); otherwise, or with False, every layer's maps
        of a batch are stacked and each analyzer's ``update`` gets them all.
    null : {None, "uniform"}
        ``"uniform"``: run the null model instead of the model's own attention: every head attends uniformly over the keys the
        model's mask lets each query see (:func:`~bertology.core.model.hooks.uniform_attention`, docs/methods.md#the-null-model),
        so that a run can count the claims it makes where there is nothing to find.
    attention_budget : int, "auto" or None
        Most bytes of one layer's maps (``batch * heads * n * n`` in the statistics dtype, float32 at least) a batch may
        hold at once: past it, each layer's maps are computed by blocks of query rows that fit it (at least one row), handed
        to the analyzers that fold blocks (``folds_row_blocks``, :func:`folds_row_blocks`); the others are left out of the
        rest of the pass with one line naming the budget (``RunStats.left_out`` with ``isolate``, else an error). ``"auto"``
        (the default): the smaller of 64 MiB and a sixteenth of the free memory of the devices that hold the layers
        (:func:`~bertology.core.model.memory.auto_attention_budget`), resolved here into :attr:`attention_budget`. None: no
        budget, whole maps.
    query_block : int, optional
        Compute every layer's maps this many query rows at a time, whatever the budget (a test of the blocks, a fixed size).
    punct : {"upos", "clark"}
        The punctuation set of ``Batch.punct_mask`` (:data:`~bertology.core.model.models.PUNCT_SETS`,
        docs/methods.md#head-profile), so every analyzer of a run measures attention to the same punctuation.
    """

    def __init__(
        self,
        model: LoadedModel,
        *,
        batch_size: int = 32,
        batch_tokens: int | None = None,
        max_length: int | None = None,
        overflow: str = "truncate",
        sort_window: int = 32,
        max_attention_elements: int = MAX_ATTENTION_ELEMENTS,
        progress: bool = True,
        punct: str = "upos",
        layerwise: bool = True,
        null: str | None = None,
        attention_budget: int | str | None = "auto",
        query_block: int | None = None,
    ):
        if punct not in PUNCT_SETS:
            raise BertologyError(f"unknown punctuation set {punct!r}: use {' or '.join(PUNCT_SETS)}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, not {overflow!r}")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if batch_tokens is not None and batch_tokens < 1:
            raise ValueError("batch_tokens must be at least 1")
        if null not in NULL_MODELS:
            raise BertologyError(f"unknown null model {null!r}: use {' or '.join(repr(name) for name in NULL_MODELS)}")
        if query_block is not None and query_block < 1:
            raise BertologyError("a block of queries must hold at least 1 row")
        self.null = null
        self.attention_budget, self.query_block = resolved_attention_budget(attention_budget, model.model), query_block
        self.model = model
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.max_length = min(max_length or model.max_length, model.max_length)
        self.overflow = overflow
        self.sort_window = sort_window
        self.max_attention_elements = max_attention_elements
        self.progress = progress
        self.punct = punct
        self.layerwise = layerwise
        # The engine counts and truncates (or skips) sequences over max_length itself: transformers' one-time warning that they
        # "will result in indexing errors" is marked as given.
        model.tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
        table = model.punct_by_id if punct == "upos" else punctuation_table(model.tokenizer, punct)
        self._punct_by_id = torch.as_tensor(table, device=model.device)

    def with_null(self, null: str) -> "Engine":
        """This engine's twin, the same model, batches, cuts and punctuation, that runs the null model ``null`` (:data:`NULL_MODELS`)
        instead of the model's own attention."""
        if null not in NULL_MODELS:
            raise BertologyError(f"unknown null model {null!r}: use {' or '.join(repr(name) for name in NULL_MODELS)}")
        twin = copy.copy(self)
        twin.null = null
        return twin

    def punctuation(self, input_ids: torch.Tensor) -> torch.Tensor:
        """True for the pieces of the run's punctuation set (``punct``)."""
        return self._punct_by_id[input_ids]

    # -- tokenization and batching ---------------------------------------------------------
    def _encode(self, sentences: list[str], truncate: bool) -> BatchEncoding:
        """The encoding of a sentence or a pair, with offsets and segment ids; with ``truncate``, cut to ``max_length``."""
        return self.model.tokenizer(
            *sentences,
            truncation="longest_first" if truncate else False,
            max_length=self.max_length if truncate else None,
            return_offsets_mapping=True,
            return_token_type_ids=True,
        )

    def read(self, example: Example) -> tuple[list[str], BatchEncoding]:
        """``(parts, encoding)``: the example's sentence (or two) cut to parts that decide what ``max_length`` does to it, and
        their encoding untruncated, so that neither memory nor time grows with a sentence's length.

        A sentence over the limit (:data:`CHARS_PER_PIECE`) is cut, and the cut stands once more than ``budget`` pieces
        (``max_length`` less the special tokens) lie before the part's margin (:data:`CUT_MARGIN`): those are the whole
        sentence's first pieces, so the whole is over ``max_length`` as well and truncation keeps only pieces among them.
        Otherwise the limit doubles, up to the whole sentence; a sentence that fits is never cut. In a pair, a cut sentence
        also needs more such pieces than the other sentence, where that one is whole, so that truncation (longest first)
        shares ``max_length`` between the two as it would between the whole ones; where both are cut, the one piece an odd
        budget leaves goes to the part with more pieces. A tokenizer that truncates on the left reads the whole sentences."""
        tokenizer = self.model.tokenizer
        sentences = [text for text in (example.text, example.text_pair) if text is not None]
        if tokenizer.truncation_side != "right" or all(len(sentence) <= CUT_MARGIN + CHARS_PER_PIECE * self.max_length for sentence in sentences):
            return sentences, self._encode(sentences, truncate=False)
        margin = max(CUT_MARGIN, getattr(tokenizer.backend_tokenizer.model, "max_input_chars_per_word", 0))
        budget = self.max_length - tokenizer.num_special_tokens_to_add(pair=len(sentences) == 2)
        limits = [margin + CHARS_PER_PIECE * self.max_length] * len(sentences)
        while True:
            parts = [sentence[:limit] for sentence, limit in zip(sentences, limits)]
            encoding = self._encode(parts, truncate=False)
            cut = [len(part) < len(sentence) for part, sentence in zip(parts, sentences)]
            sides = encoding.sequence_ids()
            pieces = [sides.count(k) for k in range(len(parts))]
            decided = [sum(1 for (_, end), side in zip(encoding["offset_mapping"], sides) if side == k and end <= len(part) - margin)
                       for k, part in enumerate(parts)]
            undecided = [k for k in range(len(parts)) if cut[k] and not (
                decided[k] > budget and all(cut[other] or decided[k] > pieces[other] for other in range(len(parts)) if other != k))]
            if not undecided:
                return parts, encoding
            for k in undecided:
                limits[k] *= 2

    def encode(self, indexed: Iterable[tuple[int, Example]], stats: RunStats) -> Iterator[Encoded]:
        """Tokenize examples (a bounded part of each: :meth:`read`), truncating or skipping those over ``max_length``, and
        skipping those of fewer than :data:`MIN_PIECES` pieces (degenerate); ``stats`` counts each."""
        for index, example in indexed:
            parts, encoding = self.read(example)
            truncated = len(encoding["input_ids"]) > self.max_length
            if truncated and self.overflow == "skip":
                stats.skipped += 1
                stats.leave_out(index, example)
                continue
            if truncated:
                encoding = self._encode(parts, truncate=True)
            if len(encoding["input_ids"]) < MIN_PIECES:
                stats.degenerate += 1
                stats.leave_out(index, example)
                continue
            stats.truncated += int(truncated)
            yield Encoded(
                index=index,
                example=example,
                input_ids=encoding["input_ids"],
                token_type_ids=encoding.get("token_type_ids"),
                offsets=[tuple(o) for o in encoding["offset_mapping"]],
                sequence_ids=encoding.sequence_ids(),
                truncated=truncated,
            )

    def windows(self, encoded: Iterable[Encoded]) -> Iterator[list[list[Encoded]]]:
        """Consecutive windows of ``batch_size * sort_window`` encoded examples, each as its length-sorted batches:
        sorting within a window cuts padding while memory stays bounded."""
        iterator = iter(encoded)
        while window := list(itertools.islice(iterator, self.batch_size * self.sort_window)):
            window.sort(key=lambda item: (len(item), item.index))
            batches, start = [], 0
            while start < len(window):
                stop = start + 1
                while stop < len(window) and self.fits(stop - start + 1, len(window[stop])):
                    stop += 1
                batches.append(window[start:stop])
                start = stop
            yield batches

    def fits(self, count: int, longest: int) -> bool:
        """Whether ``count`` sequences padded to ``longest`` pieces make one batch: at most ``batch_size`` sequences, or
        with ``batch_tokens`` at most that many padded pieces; and at most ``max_attention_elements`` of attention."""
        within = count <= self.batch_size if self.batch_tokens is None else count * longest <= self.batch_tokens
        return within and count * self.model.num_layers * self.model.num_heads * longest * longest <= self.max_attention_elements

    def layer_bytes(self, items: list[Encoded]) -> int:
        """Bytes of one layer's maps of a batch: ``batch * heads * n * n`` in the statistics dtype (float32 at least)."""
        width = max(len(item) for item in items)
        itemsize = torch.promote_types(self.model.model.dtype, torch.float32).itemsize
        return len(items) * self.model.num_heads * width * width * itemsize

    def query_rows(self, items: list[Encoded]) -> int | None:
        """The query rows per block of a batch's maps (:attr:`query_block`, or as many as fit :attr:`attention_budget`, at
        least one), or None where its whole maps fit (computed at once)."""
        width = max(len(item) for item in items)
        if self.query_block is not None:
            return self.query_block if self.query_block < width else None
        if self.attention_budget is None or self.layer_bytes(items) <= self.attention_budget:
            return None
        return max(1, self.attention_budget * width // self.layer_bytes(items))

    def held_past_budget(self, analyzer, items: list[Encoded]) -> int | None:
        """The bytes an analyzer that folds blocks holds beside them for a batch (its ``held_bytes(count, width)``, where it
        has one: rollout's running products), where they exceed :attr:`attention_budget`; else None."""
        held = getattr(analyzer, "held_bytes", None)
        if self.attention_budget is None or held is None:
            return None
        size = held(len(items), max(len(item) for item in items))
        return size if size > self.attention_budget else None

    def refusal(self, analyzer, items: list[Encoded], rows: int) -> str:
        """The one line that leaves ``analyzer`` out of a batch whose maps go by blocks of ``rows`` query rows."""
        name, held = getattr(analyzer, "name", type(analyzer).__name__), self.held_past_budget(analyzer, items)
        if held is not None:
            return f"{name} left out: it holds {held:,} bytes for this batch, past the attention budget of {self.attention_budget:,} bytes"
        why = (f"a layer's maps of this batch ({self.layer_bytes(items):,} bytes) exceed the attention budget of {self.attention_budget:,} bytes"
               if self.query_block is None else f"the pass computes maps by blocks of {rows} query rows (query_block)")
        return f"{name} left out: {why}, and it reads whole maps"

    def batches(self, encoded: Iterable[Encoded]) -> Iterator[list[Encoded]]:
        """Length-sorted batches, sorted within windows so that memory stays bounded."""
        for window in self.windows(encoded):
            yield from window

    def collate(self, items: list[Encoded]) -> dict[str, torch.Tensor]:
        """Pad a batch into tensors on the model's device."""
        pad_id = self.model.tokenizer.pad_token_id or 0
        width = max(len(item) for item in items)
        input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.bool)
        token_types = torch.zeros((len(items), width), dtype=torch.long)
        segments = torch.full((len(items), width), -1, dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item)
            input_ids[row, :n] = torch.tensor(item.input_ids)
            mask[row, :n] = True
            if item.token_type_ids is not None:
                token_types[row, :n] = torch.tensor(item.token_type_ids)
            segments[row, :n] = torch.tensor([-1 if s is None else s for s in item.sequence_ids])
        device = self.model.device
        return {
            "input_ids": input_ids.to(device),
            "mask": mask.to(device),
            "token_type_ids": token_types.to(device),
            "segment_ids": segments.to(device),
        }

    # -- running -----------------------------------------------------------------------------
    def model_inputs(self, tensors: dict[str, torch.Tensor], input_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for collated tensors (``input_ids``: others in their place, masked pieces say)."""
        inputs = {"input_ids": tensors["input_ids"] if input_ids is None else input_ids, "attention_mask": tensors["mask"].long()}
        if "token_type_ids" in self.model.tokenizer.model_input_names:
            inputs["token_type_ids"] = tensors["token_type_ids"]
        return inputs

    def forward(self, tensors: dict[str, torch.Tensor], hooks: Hooks | None = None, hidden_states: bool = False):
        """One forward pass of the model on collated tensors, with optional hooks (and every layer's output)."""
        inputs = self.model_inputs(tensors)
        if hidden_states:
            inputs["output_hidden_states"] = True
        if self.model.kind is DECODER and getattr(self.model.model.config, "use_cache", False):
            inputs["use_cache"] = False  # a decoder's cache keeps every layer's keys and values for generation; nothing here generates
        hooks = hooks or Hooks()
        with torch.inference_mode(), hooks.attach(self.model.model):
            return self.model.model(**inputs)

    def new_batch(self, items: list[Encoded], tensors: dict[str, torch.Tensor]) -> Batch:
        """The batch every analyzer receives, before its maps: its masks, the kind's anchor tokens and its counts."""
        mask, input_ids = tensors["mask"], tensors["input_ids"]
        model = self.model
        return Batch(
            items=items,
            input_ids=input_ids,
            mask=mask,
            anchors=model.kind.anchor_masks(input_ids, mask, model.cls_token_id, model.sep_token_id),
            punct_mask=self.punctuation(input_ids) & mask,
            segment_ids=tensors["segment_ids"],
            attentions=None,
            layer_count=model.num_layers,
            head_count=model.num_heads,
            embedding=model.model.get_input_embeddings(),
            kind=model.kind,
        )

    def run_batch(self, items: list[Encoded], needs: PassNeeds = NO_NEEDS,
                  on_layer: Callable[[Batch, int, Callable[[str], LayerMaps]], object] | None = None,
                  query_rows: int | None = None, last_layer: int | None = None) -> Batch:
        """Run the model on one batch and capture every layer's attention, and what ``needs`` asks for beyond it
        (:class:`PassNeeds`).

        With ``on_layer``, the layer-by-layer pass: the maps are not kept. ``on_layer(batch, layer, maps)`` is called inside
        the forward pass as soon as a layer's attention has run, with the batch (its masks and items, no maps) and
        ``maps(weighting)`` giving that layer's :class:`LayerMaps` in a view (made once per layer and view); the layer's
        tensors are released when it returns, and the batch comes back with ``attentions`` None. With ``query_rows`` (the
        layer-by-layer pass only), each layer's maps are computed and handed over that many query rows at a time
        (:attr:`LayerMaps.rows`). With ``last_layer`` (the layer-by-layer pass, no hidden states), the forward pass stops
        once that layer's maps are handed over: no later layer runs (the viewer of a long input's first layers)."""
        if query_rows is not None and (on_layer is None or needs.mixing or needs.contributions or needs.views):
            raise BertologyError("maps by blocks of queries go to the layer-by-layer pass, without mixing ratios or contribution maps")
        if last_layer is not None and (on_layer is None or needs.hidden_states):
            raise BertologyError("a pass that stops after a layer is a layer-by-layer pass without hidden states")
        tensors = self.collate(items)
        batch = self.new_batch(items, tensors)
        capture = BatchCapture(self, batch, needs, on_layer, query_rows, last_layer)
        capture.stack_into_batch(capture.forward(tensors))
        capture.require_finite()
        return batch

    @property
    def knows_blocks(self) -> bool:
        """Whether :func:`~bertology.core.model.models.attention_blocks` knows where this model keeps ``W_O`` and its layer norms."""
        return self.model.layout is not None

    @cached_property
    def blocks(self):
        """The model's attention blocks (:func:`~bertology.core.model.models.attention_blocks`), found when norms or mixing are first asked for."""
        return attention_blocks(self.model.model)

    def run(self, examples: Iterable[Example], analyzers: Sequence, *, total: int | None = None,
            step: Callable[[list[Encoded]], object] | None = None, desc: str = "analyzing", isolate: bool = False,
            weightings: Sequence[str] | None = None, start: int = 0, stats: RunStats | None = None, skip_batches: int = 0,
            on_batch: Callable[[RunStats, dict], object] | None = None) -> RunStats:
        """Stream ``examples`` through the model once and update every analyzer with every batch.

        ``step`` turns a batch's items into what the analyzers receive (default :meth:`run_batch`;
        a :class:`~bertology.studies.compare.comparison.CompareEngine` runs two models there). ``weightings[k]`` is the
        view of attention analyzer k receives (default: the weights for every analyzer); the norms are computed
        once per batch where any analyzer asks for them, and so are the mixing ratios where an analyzer's
        ``needs`` names ``"mixing"``, and the layers' outputs where it names ``"hidden_states"``. With ``isolate``, an
        analyzer whose ``update`` raises is left out of the rest of the pass and its error recorded in
        ``RunStats.failed``, so the others lose nothing; the error is raised only when every analyzer failed.

        ``start``: the corpus position of the first example (a shard's, or a resumed run's, offset). ``stats``: the
        counts so far to go on from (a resumed run); ``skip_batches``: batches of the first window already counted.
        ``on_batch(stats, position)`` is called after every batch with where the run stands: ``window_start`` (the
        examples before the current window of ``batch_size * sort_window``), ``batches_done`` in it, and the
        truncated, skipped (too long) and degenerate counts before it. A run given ``start=window_start``, ``skip_batches=batches_done``
        and those counts forms the same windows and batches as the uninterrupted one, so it ends with the same numbers.
        """
        weightings = list(weightings) if weightings is not None else ["attention"] * len(analyzers)
        if len(weightings) != len(analyzers):
            raise ValueError("give one weighting per analyzer")
        for weighting in weightings:
            if weighting not in WEIGHTINGS:
                raise BertologyError(f"unknown weighting {weighting!r}: use {' or '.join(WEIGHTINGS)}")
        needs = PassNeeds.of(analyzers, weightings)
        layerwise = step is None and self.layerwise and all(is_layerwise(analyzer) for analyzer in analyzers)
        folding = [step is None and folds_row_blocks(analyzer, weighting) for analyzer, weighting in zip(analyzers, weightings)]
        blocked_needs = PassNeeds.of([a for a, folds in zip(analyzers, folding) if folds], [w for w, folds in zip(weightings, folding) if folds])
        if step is None:
            step = partial(self.run_batch, needs=needs)
        elif needs.anything:
            raise BertologyError("norm, ALTI and value-zeroing views, mixing ratios, vector norms and hidden states need the engine's own forward pass")
        stats = stats or RunStats()
        feeder = Feeder(analyzers, weightings, stats, isolate)
        started = time.perf_counter() - stats.seconds
        encoded = self.encode(enumerate(examples, start), stats)
        window_start, before = start, (stats.truncated, stats.skipped, len(stats.skipped_sources), stats.degenerate)
        with tqdm(total=total, initial=stats.seen, unit="seq", desc=desc, disable=not self.progress, smoothing=0.1) as bar:
            for window in self.windows(encoded):
                for done, items in enumerate(window[skip_batches:], start=skip_batches + 1):
                    rows = self.query_rows(items)
                    if rows is not None:  # by blocks of queries: those that fold them; the others left out, in one line
                        for position, analyzer in enumerate(analyzers):
                            if not folding[position] or self.held_past_budget(analyzer, items) is not None:
                                feeder.refuse(position, self.refusal(analyzer, items, rows))
                        feeder.finish_batch(self.run_batch(items, blocked_needs, on_layer=feeder.on_layer, query_rows=rows))
                    elif layerwise:
                        feeder.finish_batch(step(items, on_layer=feeder.on_layer))
                    else:
                        feeder.update(step(items))
                    stats.sequences += len(items)
                    stats.tokens += sum(len(item) for item in items)
                    stats.batches += 1
                    bar.update(stats.seen - bar.n)
                    if on_batch is not None:
                        stats.seconds = time.perf_counter() - started
                        on_batch(stats, {"window_start": window_start, "batches_done": done, "truncated_before": before[0],
                                         "skipped_before": before[1], "sources_before": before[2], "degenerate_before": before[3]})
                skip_batches = 0
                # its sequences and its skips
                window_start += sum(len(items) for items in window) + stats.skipped - before[1] + stats.degenerate - before[3]
                before = (stats.truncated, stats.skipped, len(stats.skipped_sources), stats.degenerate)
        stats.seconds = time.perf_counter() - started
        return stats


class Feeder:
    """Hands each batch (or each layer's maps) to every analyzer of a pass in the view of attention it receives; with
    ``isolate``, an analyzer whose update raises is left out of the rest of the pass and its error recorded in
    ``stats.failed``, so the others lose nothing; the error is raised only when every analyzer failed."""

    def __init__(self, analyzers: Sequence, weightings: Sequence[str], stats: RunStats, isolate: bool):
        self.analyzers, self.weightings, self.stats, self.isolate = analyzers, weightings, stats, isolate

    def refuse(self, position: int, message: str) -> None:
        """Leave analyzer ``position`` out of the rest of the pass with the one line ``message`` (``stats.left_out``); without
        ``isolate``, or where no other analyzer is left, raised."""
        if position in self.stats.dropped:
            return
        if not self.isolate or len(self.stats.dropped) == len(self.analyzers) - 1:
            raise BertologyError(message)
        self.stats.left_out[position] = message

    def feed(self, position: int, call: Callable[[], object]) -> None:
        if position in self.stats.dropped:
            return
        try:
            call()
        except Exception as exc:
            if not self.isolate or len(self.stats.dropped) == len(self.analyzers) - 1:
                raise
            self.stats.failed[position] = one_line_error(exc)

    def on_layer(self, batch: Batch, layer: int, maps: Callable[[str], LayerMaps]) -> None:
        for position, analyzer in enumerate(self.analyzers):
            self.feed(position, lambda: analyzer.update_layer(batch, maps(self.weightings[position])))

    def finish_batch(self, batch: Batch) -> None:
        for position, analyzer in enumerate(self.analyzers):
            self.feed(position, lambda: analyzer.finish_batch(batch))

    def update(self, batch: Batch) -> None:
        for position, analyzer in enumerate(self.analyzers):
            weighting = self.weightings[position]  # a paired step's batches have the weights alone
            self.feed(position, lambda: analyzer.update(batch if weighting == "attention" else batch.weighted(weighting)))


class _ForwardStopped(Exception):
    """Raised inside the forward pass, past the last layer a pass asks for (:meth:`Engine.run_batch`'s ``last_layer``), and
    caught where that pass began."""


class BatchCapture:
    """One batch's forward pass (:meth:`Engine.run_batch`): named hook points capture each layer's pattern and, as ``needs``
    asks, its values, keys and input ``x``; at the layer's last hook point (``head_output``) :meth:`end_of_layer` computes what
    the analyzers receive from that layer and either keeps it (the stacked pass) or hands it to ``on_layer`` and lets it go
    (the layer-by-layer pass)."""

    def __init__(self, engine: Engine, batch: Batch, needs: PassNeeds, on_layer: Callable | None, query_rows: int | None = None,
                 last_layer: int | None = None):
        self.engine, self.batch, self.needs, self.on_layer, self.query_rows = engine, batch, needs, on_layer, query_rows
        self.last_layer = last_layer  # the forward pass stops once this layer is handed over (None: every layer runs)
        self.attached: Hooks | None = None  # the hooks of the forward pass (their key_mask: the mask of the layer being run)
        # Rows of padding queries are zeroed: they are no query of the sequence (docs/methods.md#head-profile); known on the
        # host, so a batch of one length has none to zero.
        self.padded = len({len(item) for item in batch.items}) > 1
        self.captured: dict[int, dict[str, torch.Tensor]] = {}  # layer -> what its hook points gave so far
        self.layer_inputs: list[torch.Tensor] = []
        self.kept: list[LayerCapture] = []
        # Layer l reads layer l's input x, the output of layer l - 1 (l = 0: the embeddings), so with the last layer's output
        # these are the hidden states, taken without transformers' output recorder (it leaves hooks in the model that no
        # pickle, and so no Ray actor, can carry), each copied into one [layer + 1, batch, n, dim] tensor as it comes: never
        # a tuple of them beside its stacked copy. A model of unknown layout asks transformers for them.
        self.own_states = needs.hidden_states and engine.model.layout is not None
        self.states: torch.Tensor | None = None
        self.states_kept = 0
        # The mixing ratios read the attention's output through W_O, which the model's own output projection computes next:
        # a layer whose ratios are asked for waits there (:meth:`end_of_projection`) instead of projecting it a second time.
        self.awaiting_projection: tuple[int, dict[str, torch.Tensor], torch.Tensor] | None = None
        # A layer whose every query saw the keys the layer before saw (the model's one mask, no window of its own) shares
        # that layer's visible keys, and through them its uniform head (LayerMaps.uniform): made once a batch, and scored
        # once by the analyzers that keep what they made of it (whole maps only: a block's rows are its own).
        self.last_visible: tuple[tuple, torch.Tensor | None, torch.Tensor] | None = None  # (source, its mask, the visible keys)
        self.uniforms: dict[int, tuple[torch.Tensor, torch.Tensor, dict]] = {}  # id(visible keys) -> (them, the uniform head, its scores)
        self.finite = FiniteWatch()  # whether each layer's maps and hidden states are finite, read once a batch (require_finite)

    def hooks(self) -> Hooks:
        """The hook points this pass reads (:mod:`bertology.core.model.hooks`); under the uniform null model, the pattern is
        replaced first."""
        keep = self.keep
        hooks = self.attached = Hooks()
        hooks.query_rows = self.query_rows
        if self.engine.null == "uniform":
            hooks.add("pattern", uniform_attention(hooks))
        hooks.add("pattern", self.keep_pattern)
        if self.needs.values:
            hooks.add("value", partial(keep, "value"))
        if self.needs.vectors:
            hooks.add("key", partial(keep, "key"))
        return hooks.add("head_output", self.end_of_layer)

    def keep(self, name: str, layer: int, tensor: torch.Tensor) -> None:
        self.captured.setdefault(layer, {})[name] = tensor

    def keep_pattern(self, layer: int, pattern: torch.Tensor) -> None:
        """The pattern, and the keys the model's mask let each real query see in this layer (``[batch, n, n]``); a block of
        query rows (:attr:`~bertology.core.model.hooks.Hooks.rows`) goes to the analyzers at once (:meth:`hand_block`)."""
        batch = self.batch.on(pattern.device)  # the layer's device
        mask, seen, rows = batch.mask, self.attached.key_mask, self.attached.rows
        queries = mask if rows is None else mask[:, rows]

        def visible() -> torch.Tensor:
            return batch.kind.visible_keys(mask, rows) if seen is None else seen[:, 0] & mask[:, None, :] & queries[:, :, None]

        if rows is not None:
            self.hand_block(layer, rows, pattern, visible())
            return
        # the same source as the layer before: the kind's rule, or the same memory of the model's mask read the same way
        source = (pattern.device,) if seen is None else (pattern.device, seen.data_ptr(), seen.dtype, tuple(seen.shape), seen.stride())
        if self.last_visible is None or self.last_visible[0] != source:
            self.last_visible = (source, seen, visible())  # the mask held: its memory is no other tensor's while this stands
        self.captured.setdefault(layer, {}).update(pattern=pattern, visible=self.last_visible[2])

    def hand_block(self, layer: int, rows: slice, pattern: torch.Tensor, visible: torch.Tensor) -> None:
        """One block of a layer's query rows (padding rows zeroed in place) to ``on_layer``; at the layer's first block, the
        norms the blocks share are computed from its value (and key) vectors."""
        captured, batch = self.captured.setdefault(layer, {}), self.batch.on(pattern.device)
        if rows.start == 0:
            captured["shared"] = self.measure(layer, None, captured.get("value"), captured.get("key"), None)
        if self.padded:
            pattern.masked_fill_(~batch.mask[:, None, rows, None], 0)
        self.finite.maps(layer, pattern)
        shared = captured["shared"]
        block = dataclasses.replace(shared, pattern=pattern, visible_keys=visible, rows=rows)
        self.on_layer(batch, layer, block.maps)

    def forward(self, tensors: dict[str, torch.Tensor]):
        """The model's forward pass with this capture's hooks, and, where needed, each layer's input ``x``: a post-norm
        block's attention reads it, a pre-norm (decoder) block's layer (its attention reads ``LN(x)``)."""
        needs = self.needs
        blocks = self.engine.blocks if needs.layer_inputs or self.own_states else []
        shared = {id(block.input_module): block.input_module for block in blocks}  # ALBERT shares one

        def keep_layer_input(module, args, kwargs):  # x, the layer's input and the residual
            x = args[0] if args else kwargs["hidden_states"]
            if needs.layer_inputs:
                self.layer_inputs.append(x)
            if self.own_states:
                self.keep_state(x)

        handles = [module.register_forward_pre_hook(keep_layer_input, with_kwargs=True) for module in shared.values()]
        if needs.mixing:
            projections = {id(block.output): block.output for block in self.engine.blocks}  # ALBERT shares one
            handles += [module.register_forward_hook(self.end_of_projection) for module in projections.values()]
        try:
            outputs = self.engine.forward(tensors, self.hooks(), hidden_states=needs.hidden_states and not self.own_states)
            self.require_projected()
            return outputs
        except _ForwardStopped:  # at last_layer: the later layers' work is never done
            return None
        except Exception:  # an analyzer that failed on a layer's NaN maps (the layer-by-layer pass): that layer's line comes first
            self.require_finite()
            raise
        finally:
            for handle in handles:
                handle.remove()
            # The hooks' handlers are this capture's methods: a cycle that only the garbage collector would free, and with it
            # the batch, its hidden states and every layer's last maps (a 32-layer model at 1,024 tokens grew 140 MB a batch)
            if self.attached is not None:
                self.attached.clear()
                self.attached = None

    def require_finite(self) -> None:
        """Refuse the batch in one line where a layer's maps or hidden states hold NaN or infinities (:class:`FiniteWatch`):
        tables are never made of them, so a model that overflows its dtype fails the whole pass."""
        self.finite.require(self.batch.items, self.engine.model.model.dtype, self.batch.device)

    def keep_state(self, x: torch.Tensor) -> None:
        """Copy the next hidden state ``x`` into :attr:`states` (made at the first, on the batch's device; the last comes after
        the forward pass, so inference mode is entered here too)."""
        with torch.inference_mode():
            if self.states is None:
                self.states = torch.empty((self.engine.model.num_layers + 1, *x.shape), dtype=x.dtype, device=self.batch.device)
            self.states[self.states_kept].copy_(x)
        self.states_kept += 1

    def end_of_layer(self, layer: int, head_output: torch.Tensor) -> None:
        """The attention's last hook point: its pattern has been used, so its padding rows are zeroed in place (a layer by
        blocks of queries has handed them over already); past :attr:`last_layer`, the forward pass stops. A layer whose
        mixing ratios are asked for is handed over after its output projection (:meth:`end_of_projection`)."""
        captured = self.captured.pop(layer)
        if self.needs.mixing:
            self.require_projected()
            self.awaiting_projection = (layer, captured, head_output)
            return
        if "shared" not in captured:  # whole maps (by blocks of queries, "shared" holds what the blocks had in common)
            self.hand_layer(layer, captured, head_output)
        if layer == self.last_layer:
            raise _ForwardStopped

    def require_projected(self) -> None:
        """Refuse, in one line, a layer whose output projection never ran after its attention: its maps would be lost."""
        if self.awaiting_projection is not None:
            raise BertologyError(f"layer {self.awaiting_projection[0]}'s output projection did not run after its attention, so its "
                                 "mixing ratios and maps were never handed over; this model's layout does not fit the mixing ratios")

    def end_of_projection(self, module: torch.nn.Module, args, projected: torch.Tensor) -> None:
        """The forward hook of a layer's output projection, which runs right after its attention: ``projected``, the
        attention's output through ``W_O`` plus ``b_O``, completes the layer awaiting it (:meth:`end_of_layer`)."""
        if self.awaiting_projection is None:
            return
        (layer, captured, head_output), self.awaiting_projection = self.awaiting_projection, None
        self.hand_layer(layer, captured, head_output, projected)
        if layer == self.last_layer:
            raise _ForwardStopped

    def hand_layer(self, layer: int, captured: dict[str, torch.Tensor], head_output: torch.Tensor,
                   projected: torch.Tensor | None = None) -> None:
        """A layer's whole maps (padding rows zeroed in place) and what ``needs`` asks of them: kept (the stacked pass) or
        handed to ``on_layer``. ``projected``: the model's output projection of ``head_output``, where it has run."""
        pattern, batch = captured["pattern"], self.batch.on(captured["pattern"].device)
        if self.padded:
            pattern.masked_fill_(~batch.mask[:, None, :, None], 0)
        self.finite.maps(layer, pattern)
        result = self.measure(layer, pattern, captured.get("value"), captured.get("key"), head_output, projected)
        result.visible_keys, result.uniforms = captured["visible"], self.uniforms
        if self.on_layer is None:
            self.kept.append(result)
        else:
            self.on_layer(batch, layer, result.maps)

    def measure(self, layer: int, pattern: torch.Tensor, value: torch.Tensor | None, key: torch.Tensor | None,
                head_output: torch.Tensor, projected: torch.Tensor | None = None) -> "LayerCapture":
        """What the analyzers receive from one layer: its pattern and what ``needs`` asks for (padding rows zero), on the
        layer's device; ``projected``, the model's own ``head_output W_O + b_O``, where it has run."""
        placed = pattern if pattern is not None else value if value is not None else key
        needs, mask = self.needs, self.batch.mask if placed is None else self.batch.on(placed.device).mask
        wants_block = needs.norms or needs.layer_inputs or (needs.vectors and self.engine.knows_blocks)
        block = self.engine.blocks[layer] if wants_block else None
        # the layer's input, moved to the layer's device (a forward pre-hook sees it before accelerate's hook moves it there)
        x = moved_to(self.layer_inputs[layer], mask.device) if needs.layer_inputs else None
        norm = transformed_norms(value, block) if needs.norms or (needs.vectors and block is not None) else None
        ratio = mixing_ratios(pattern, value, head_output, x, block, projected) * mask[:, :, None] if needs.mixing else None
        contributions = {}
        for measure in needs.contributions:  # padding rows zero (their columns are: padding keys get no weight)
            computed = (alti_contributions(pattern, value, x, block) if measure == "alti"
                        else value_zeroing(pattern, value, head_output, x, block))
            contributions[measure] = computed * mask[:, :, None] if self.padded else computed
        views, uniform_views = {}, {}
        for view in needs.views:  # per head, padding rows zero
            views[view] = self.per_head_view(view, pattern, value, head_output, x, block)
            uniform_views[view] = partial(self.uniform_view, view, value, x, block)
        if norm is not None:
            uniform_views["norm"] = partial(norm_shares, key_norms=norm)
        vectors = None
        if needs.vectors:
            key_norm, value_norm = torch.linalg.vector_norm(key, dim=-1), torch.linalg.vector_norm(value, dim=-1)
            vectors = torch.stack([key_norm, value_norm, norm if norm is not None else torch.full_like(key_norm, torch.nan)], dim=2)
        return LayerCapture(layer, pattern, norm, ratio, vectors, contributions, views, uniform_views)

    def per_head_view(self, view: str, pattern: torch.Tensor, value: torch.Tensor, head_output: torch.Tensor, x: torch.Tensor,
                      block) -> torch.Tensor:
        """One contribution view's per-head maps of a layer (:mod:`bertology.core.measures.contributions`), padding rows zero."""
        computed = (alti_per_head(pattern, value, x, block) if view == "alti"
                    else value_zeroing(pattern, value, head_output, x, block, per_head=True))
        return computed * self.batch.on(computed.device).mask[:, None, :, None] if self.padded else computed

    def uniform_view(self, view: str, value: torch.Tensor, x: torch.Tensor, block, uniform: torch.Tensor) -> torch.Tensor:
        """The contribution view's maps of the layer's uniform head (``uniform [batch, 1, n, n]``), per head: the same measure
        with every head's weights uniform over the keys it saw, its output ``U v`` (docs/methods.md#the-null-model)."""
        with torch.inference_mode():  # as the pass: the stacked pass asks for it after the forward
            weights = uniform.to(value.dtype).expand(-1, value.shape[1], -1, -1)
            return self.per_head_view(view, weights, value, torch.matmul(weights, value), x, block)

    def stack_into_batch(self, outputs) -> None:
        """Stack what the layers gave into the batch (the stacked pass), and the hidden states where needed, on the batch's
        device (:func:`stack_layers`)."""
        batch, needs = self.batch, self.needs
        if self.on_layer is None:
            kept = self.kept
            batch.attentions = stack_layers([layer.pattern for layer in kept], batch)
            batch.layer_visible_keys = [moved_to(layer.visible_keys, batch.device) for layer in kept]
            batch.key_norms = stack_layers([layer.key_norms for layer in kept], batch) if needs.norms else None
            batch.mixing = stack_layers([layer.mixing for layer in kept], batch) if needs.mixing else None
            batch.vector_norms = stack_layers([layer.vector_norms for layer in kept], batch) if needs.vectors else None
            batch.contributions = {measure: stack_layers([layer.contributions[measure] for layer in kept], batch) for measure in needs.contributions}
            batch.view_maps = {view: stack_layers([layer.views[view] for layer in kept], batch) for view in needs.views}
            batch.uniform_view_maps = {view: stack_layers([layer.maps(view).uniform(batch.on(layer.pattern.device)) for layer in kept], batch)
                                       for view in needs.views}
        if needs.hidden_states and self.own_states:
            self.keep_state(outputs.last_hidden_state)
            batch.hidden_states = self.states
        elif needs.hidden_states:
            batch.hidden_states = stack_layers(outputs.hidden_states, batch)
        if needs.hidden_states:
            self.finite.states(batch.hidden_states, batch.mask)


@dataclass
class LayerCapture:
    """What one layer of a batch gave: its ``pattern`` (padding rows zero), ``key_norms`` ``||f_h(x_j)||``, ``mixing``
    ratios, ``vector_norms``, contribution maps by measure and per-head contribution ``views``, each where the pass needs it."""

    layer: int
    pattern: torch.Tensor
    key_norms: torch.Tensor | None
    mixing: torch.Tensor | None
    vector_norms: torch.Tensor | None
    contributions: dict[str, torch.Tensor]
    views: dict[str, torch.Tensor]
    #: How each view other than the weights sees the uniform head (:attr:`LayerMaps.uniform_view`).
    uniform_views: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    visible_keys: torch.Tensor | None = None
    rows: slice | None = None  # the query rows of pattern (a block of them), None for every row
    uniforms: dict[int, tuple[torch.Tensor, torch.Tensor, dict]] | None = None  # the batch's uniform heads (LayerMaps.shared_uniforms)
    _made: dict[str, LayerMaps] = field(default_factory=dict, init=False, repr=False)

    def maps(self, weighting: str) -> LayerMaps:
        """The layer's :class:`LayerMaps` in one view of attention (:func:`attention_view`), made once per view."""
        if weighting not in self._made:
            self._made[weighting] = LayerMaps(self.layer, attention_view(weighting, self.pattern, self.key_norms, self.views),
                                              mixing=self.mixing, vector_norms=self.vector_norms, contributions=self.contributions,
                                              visible_keys=self.visible_keys, uniform_view=self.uniform_views.get(weighting), rows=self.rows,
                                              shared_uniforms=self.uniforms)
        return self._made[weighting]
