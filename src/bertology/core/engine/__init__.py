"""The engine: tokenize, batch by length, run the model once per batch, feed every analyzer.

Memory stays bounded whatever the corpus size: examples are read lazily, sorted by length only
within a window of ``batch_size * sort_window`` examples (to cut padding), and each batch's
attention ``[layer, batch, head, query, key]`` is dropped once the analyzers have seen it. A
batch is also capped so that its attention tensor holds at most ``max_attention_elements``. Past an ``attention_budget``
(one sequence can exceed any cap; by default ``auto``, :mod:`bertology.core.model.memory`), each layer's maps are computed by blocks of query rows
(:func:`~bertology.core.model.hooks.bertology_attention`) and folded block by block by the analyzers that can
(:func:`folds_row_blocks`), so a pass holds one block of one layer's maps, not ``heads x n x n``.

The package's face: :mod:`.batch` (the batch and a layer's maps), :mod:`.needs` (what a pass computes), :mod:`.stats` (what a
run saw), :mod:`.settings` (every setting of a pass, :class:`PassSettings`), :mod:`.reading` (the length-capped reading of
examples into batches), :mod:`.budget` (the attention budget's arithmetic), :mod:`.capture` (one batch's forward pass through
named hook points) and :mod:`.run` (the engine and its feeder).
"""

from bertology.core.engine.batch import VECTOR_NORMS, Batch, Encoded, LayerMaps, attention_view, is_pair, moved_to, stack_layers
from bertology.core.engine.budget import AttentionBudgeting
from bertology.core.engine.capture import BatchCapture, LayerCapture, model_forward, model_inputs
from bertology.core.engine.needs import BLOCKED_NEEDS, BLOCKED_VIEWS, KNOWN_NEEDS, NO_NEEDS, PassNeeds, folds_row_blocks, is_layerwise
from bertology.core.engine.reading import CHARS_PER_PIECE, CUT_MARGIN, LengthCappedReading
from bertology.core.engine.run import Engine, Feeder
from bertology.core.engine.settings import MAX_ATTENTION_ELEMENTS, NULL_MODELS, OVERFLOW_POLICIES, PassSettings
from bertology.core.engine.stats import MAX_SKIPPED_SOURCES, MIN_PIECES, RunStats

__all__ = [
    "BLOCKED_NEEDS", "BLOCKED_VIEWS", "CHARS_PER_PIECE", "CUT_MARGIN", "KNOWN_NEEDS", "MAX_ATTENTION_ELEMENTS", "MAX_SKIPPED_SOURCES",
    "MIN_PIECES", "NO_NEEDS", "NULL_MODELS", "OVERFLOW_POLICIES", "VECTOR_NORMS", "AttentionBudgeting", "Batch", "BatchCapture",
    "Encoded", "Engine", "Feeder", "LayerCapture", "LayerMaps", "LengthCappedReading", "PassNeeds", "PassSettings", "RunStats", "attention_view",
    "folds_row_blocks", "is_layerwise", "is_pair", "model_forward", "model_inputs", "moved_to", "stack_layers",
]
