"""The pass: :class:`Engine` runs one model over a corpus once and hands each batch (or each layer's maps) to every
analyzer (:class:`Feeder`); :class:`BatchCapture` captures one batch's forward pass through named hook points."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property, partial

import torch
from tqdm.auto import tqdm

from bertology.core.engine.batch import Batch, Encoded, LayerMaps
from bertology.core.engine.budget import AttentionBudgeting
from bertology.core.engine.capture import BatchCapture, model_inputs
from bertology.core.engine.needs import NO_NEEDS, PassNeeds, checked_weightings, folds_row_blocks, is_layerwise
from bertology.core.engine.reading import MAX_ATTENTION_ELEMENTS, OVERFLOW_POLICIES, LengthCappedReading
from bertology.core.engine.stats import RunStats
from bertology.core.errors import BertologyError, one_line_error
from bertology.core.model.memory import resolved_attention_budget
from bertology.core.model.models import PUNCT_SETS, LoadedModel, attention_blocks, punctuation_table
from bertology.core.text.corpora import Example

#: The null models a pass can run in place of the model's attention (``Engine(null=...)``): None, the model itself.
NULL_MODELS = (None, "uniform")


class Engine(LengthCappedReading, AttentionBudgeting):
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

    # -- running -----------------------------------------------------------------------------
    def model_inputs(self, tensors: dict[str, torch.Tensor], input_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for collated tensors (:func:`~bertology.core.engine.capture.model_inputs`)."""
        return model_inputs(self.model, tensors, input_ids)

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
        blocks = self.blocks if needs.reads_blocks(self.knows_blocks) else None  # an unknown layout's are refused here, in one line
        capture = BatchCapture(self.model, blocks, self.null, batch, needs, on_layer, query_rows, last_layer)
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

    def feed_batch(self, items: list[Encoded], feeder: "Feeder", step: Callable, layerwise: bool) -> None:
        """Run one batch and hand it to the feeder's analyzers: past the attention budget, by blocks of queries to those that
        fold them (the others left out, in one line: :meth:`refusal`); else layer by layer where every analyzer takes the maps
        so (``layerwise``), or stacked; ``step``, the pass's own :meth:`run_batch` or another (a paired one)."""
        rows = self.query_rows(items)
        if rows is not None:
            for position, analyzer in enumerate(feeder.analyzers):
                if not feeder.folding[position] or self.held_past_budget(analyzer, items) is not None:
                    feeder.refuse(position, self.refusal(analyzer, items, rows))
            feeder.finish_batch(self.run_batch(items, feeder.blocked_needs, on_layer=feeder.on_layer, query_rows=rows))
        elif layerwise:
            feeder.finish_batch(step(items, on_layer=feeder.on_layer))
        else:
            feeder.update(step(items))

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
        weightings, own_pass = checked_weightings(analyzers, weightings), step is None
        needs = PassNeeds.of(analyzers, weightings)
        layerwise = own_pass and self.layerwise and all(is_layerwise(analyzer) for analyzer in analyzers)
        if own_pass:
            step = partial(self.run_batch, needs=needs)
        elif needs.anything:
            raise BertologyError("norm, ALTI and value-zeroing views, mixing ratios, vector norms and hidden states need the engine's own forward pass")
        stats = stats or RunStats()
        feeder = Feeder(analyzers, weightings, stats, isolate, blocks=own_pass)
        started = time.perf_counter() - stats.seconds
        encoded = self.encode(enumerate(examples, start), stats)
        window_start, before = start, (stats.truncated, stats.skipped, len(stats.skipped_sources), stats.degenerate)
        with tqdm(total=total, initial=stats.seen, unit="seq", desc=desc, disable=not self.progress, smoothing=0.1) as bar:
            for window in self.windows(encoded):
                for done, items in enumerate(window[skip_batches:], start=skip_batches + 1):
                    self.feed_batch(items, feeder, step, layerwise)
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
    ``stats.failed``, so the others lose nothing; the error is raised only when every analyzer failed. With ``blocks`` (the
    engine's own pass), :attr:`folding` says which analyzers take a layer's maps by blocks of query rows
    (:func:`~bertology.core.engine.needs.folds_row_blocks`) and :attr:`blocked_needs` what they need."""

    def __init__(self, analyzers: Sequence, weightings: Sequence[str], stats: RunStats, isolate: bool, blocks: bool = True):
        self.analyzers, self.weightings, self.stats, self.isolate = analyzers, weightings, stats, isolate
        self.folding = [blocks and folds_row_blocks(analyzer, weighting) for analyzer, weighting in zip(analyzers, weightings)]
        self.blocked_needs = PassNeeds.of([analyzer for analyzer, folds in zip(analyzers, self.folding) if folds],
                                          [weighting for weighting, folds in zip(weightings, self.folding) if folds])

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
