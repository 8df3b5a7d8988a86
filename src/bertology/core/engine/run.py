"""The pass: :class:`Engine` runs one model over a corpus once and hands each batch to every analyzer.

:class:`Feeder` hands over each batch (or each layer's maps), and :class:`~bertology.core.engine.capture.BatchCapture`
captures each batch's forward pass.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import cached_property, partial

import torch
from tqdm.auto import tqdm

from bertology.core.engine.batch import Batch, Encoded, LayerMaps
from bertology.core.engine.budget import AttentionBudgeting
from bertology.core.engine.capture import BatchCapture, model_inputs
from bertology.core.engine.needs import NO_NEEDS, PassNeeds, checked_weightings, folds_row_blocks, is_layerwise
from bertology.core.engine.reading import LengthCappedReading
from bertology.core.engine.settings import PassSettings
from bertology.core.engine.stats import RunStats
from bertology.core.errors import BertologyError, one_line_error
from bertology.core.model.models import LoadedModel, attention_blocks, punctuation_table
from bertology.core.text.corpora import Example


class Engine(LengthCappedReading, AttentionBudgeting):
    """Runs one model over a corpus once and hands each batch to every analyzer.

    Parameters
    ----------
    model : LoadedModel
    settings : PassSettings, optional
        How the pass reads the corpus into batches and computes each batch's maps (:class:`PassSettings`; default: its
        defaults), fixed on this model (:meth:`PassSettings.resolved`) into :attr:`settings`: ``max_length`` at most the
        model's, the attention budget in bytes.
    progress : bool
        Show a progress bar with sequences per second.
    **options
        Fields of :class:`PassSettings` by name, in place of those of ``settings`` (``Engine(model, batch_size=8)``).
    """

    def __init__(self, model: LoadedModel, settings: PassSettings | None = None, *, progress: bool = True, **options):
        self.model = model
        self.settings = replace(settings or PassSettings(), **options).resolved(model)
        self.progress = progress
        # The engine counts and truncates (or skips) sequences over max_length itself: transformers' one-time warning that they
        # "will result in indexing errors" is marked as given.
        model.tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
        punct = self.settings.punct
        table = model.punct_by_id if punct == "upos" else punctuation_table(model.tokenizer, punct)
        self._punct_by_id = torch.as_tensor(table, device=model.device)

    def with_null(self, null: str) -> "Engine":
        """This engine's twin, the same model, batches, cuts and punctuation, that runs the null model ``null``
        (:data:`~bertology.core.engine.settings.NULL_MODELS`) instead of the model's own attention."""
        twin = copy.copy(self)
        twin.settings = replace(self.settings, null=null)
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
        capture = BatchCapture(self.model, blocks, self.settings.null, batch, needs, on_layer, query_rows, last_layer)
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
        layerwise = own_pass and self.settings.layerwise and all(is_layerwise(analyzer) for analyzer in analyzers)
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
    """Hands each batch (or each layer's maps) to every analyzer of a pass in the view of attention it receives.

    With ``isolate``, an analyzer whose update raises is left out of the rest of the pass and its error recorded in
    ``stats.failed``, so the others lose nothing; the error is raised only when every analyzer failed. With ``blocks``
    (the engine's own pass), :attr:`folding` says which analyzers take a layer's maps by blocks of query rows
    (:func:`~bertology.core.engine.needs.folds_row_blocks`) and :attr:`blocked_needs` what they need.
    """

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
