"""The pass: :class:`Engine` runs one model over a corpus once and hands each batch (or each layer's maps) to every
analyzer (:class:`Feeder`); :class:`BatchCapture` captures one batch's forward pass through named hook points."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial

import torch
from tqdm.auto import tqdm

from bertology.core.engine.batch import Batch, Encoded, LayerMaps, attention_view, moved_to, stack_layers
from bertology.core.engine.budget import AttentionBudgeting
from bertology.core.engine.needs import NO_NEEDS, PassNeeds, folds_row_blocks, is_layerwise
from bertology.core.engine.reading import MAX_ATTENTION_ELEMENTS, OVERFLOW_POLICIES, LengthCappedReading
from bertology.core.engine.stats import RunStats
from bertology.core.errors import BertologyError, one_line_error
from bertology.core.measures.contributions import alti_contributions, alti_per_head, value_zeroing
from bertology.core.measures.norms import WEIGHTINGS, mixing_ratios, norm_shares, transformed_norms
from bertology.core.model.finite import FiniteWatch
from bertology.core.model.hooks import Hooks, uniform_attention
from bertology.core.model.kinds import DECODER
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
