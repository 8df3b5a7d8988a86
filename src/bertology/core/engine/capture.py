"""One batch's forward pass (:class:`BatchCapture`), each layer's attention captured through named hook points.

What the pass needs of each layer's pattern (:mod:`bertology.core.model.hooks`) is captured with it; the analyzers
receive it layer by layer or stacked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from bertology.core.engine.batch import Batch, LayerMaps, attention_view, moved_to, stack_layers
from bertology.core.engine.needs import PassNeeds
from bertology.core.errors import BertologyError
from bertology.core.measures.contributions import alti_contributions, alti_per_head, value_zeroing
from bertology.core.measures.norms import mixing_ratios, norm_shares, transformed_norms
from bertology.core.model.finite import FiniteWatch
from bertology.core.model.hooks import Hooks, uniform_attention
from bertology.core.model.kinds import DECODER
from bertology.core.model.layouts import AttentionBlock
from bertology.core.model.models import LoadedModel


def model_inputs(model: LoadedModel, tensors: dict[str, torch.Tensor], input_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for collated tensors (``input_ids``: others in their place, masked pieces say)."""
    inputs = {"input_ids": tensors["input_ids"] if input_ids is None else input_ids, "attention_mask": tensors["mask"].long()}
    if "token_type_ids" in model.tokenizer.model_input_names:
        inputs["token_type_ids"] = tensors["token_type_ids"]
    return inputs


def model_forward(model: LoadedModel, tensors: dict[str, torch.Tensor], hooks: Hooks | None = None, hidden_states: bool = False,
                  blocks: Sequence[AttentionBlock] | None = None):
    """One forward pass of the model on collated tensors, with optional hooks (``blocks``: the model's attention blocks, where
    a hook reads a point of their modules, :meth:`~bertology.core.model.hooks.Hooks.attach`) and every layer's output."""
    inputs = model_inputs(model, tensors)
    if hidden_states:
        inputs["output_hidden_states"] = True
    if model.kind is DECODER and getattr(model.model.config, "use_cache", False):
        inputs["use_cache"] = False  # a decoder's cache keeps every layer's keys and values for generation; nothing here generates
    hooks = hooks or Hooks()
    with torch.inference_mode(), hooks.attach(model.model, blocks):
        return model.model(**inputs)


class _ForwardStopped(Exception):
    """Raised inside the forward pass, past the last layer a pass asks for (:meth:`Engine.run_batch`'s ``last_layer``), and
    caught where that pass began."""


class BatchCapture:
    """One batch's forward pass (:meth:`Engine.run_batch`): named hook points capture each layer's pattern and, as ``needs``
    asks, its values, keys and input ``x``; at the layer's last hook point (``head_output``) :meth:`end_of_layer` computes what
    the analyzers receive from that layer and either keeps it (the stacked pass) or hands it to ``on_layer`` and lets it go
    (the layer-by-layer pass)."""

    def __init__(self, model: LoadedModel, blocks: Sequence[AttentionBlock] | None, null: str | None, batch: Batch, needs: PassNeeds,
                 on_layer: Callable | None, query_rows: int | None = None, last_layer: int | None = None):
        self.batch, self.needs, self.on_layer, self.query_rows = batch, needs, on_layer, query_rows
        # the model, its attention blocks where the pass reads them (PassNeeds.reads_blocks; else None) and the null model run
        # in place of its attention (None: its own)
        self.model, self.blocks, self.null = model, blocks, null
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
        self.own_states = needs.hidden_states and model.layout is not None
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
        self.finite = FiniteWatch(model.num_layers)  # whether each layer's maps and hidden states are finite, read once a batch (require_finite)

    def hooks(self) -> Hooks:
        """The hook points this pass reads (:mod:`bertology.core.model.hooks`); under the uniform null model, the pattern is
        replaced first."""
        keep = self.keep
        hooks = self.attached = Hooks()
        hooks.query_rows = self.query_rows
        if self.null == "uniform":
            hooks.add("pattern", uniform_attention(hooks))
        hooks.add("pattern", self.keep_pattern)
        if self.needs.values:
            hooks.add("value", partial(keep, "value"))
        if self.needs.vectors:
            hooks.add("key", partial(keep, "key"))
        if self.needs.layer_inputs or self.own_states:
            hooks.add("layer_input", self.keep_layer_input)
        if self.needs.mixing:
            hooks.add("attn_out", self.end_of_projection)
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
        """The model's forward pass with this capture's hooks (:meth:`hooks`)."""
        try:
            outputs = model_forward(self.model, tensors, self.hooks(), self.needs.hidden_states and not self.own_states, self.blocks)
            self.require_projected()
            return outputs
        except _ForwardStopped:  # at last_layer: the later layers' work is never done
            return None
        except Exception:  # an analyzer that failed on a layer's NaN maps (the layer-by-layer pass): that layer's line comes first
            self.require_finite()
            raise
        finally:
            # The hooks' handlers are this capture's methods: a cycle that only the garbage collector would free, and with it
            # the batch, its hidden states and every layer's last maps (a 32-layer model at 1,024 tokens grew 140 MB a batch)
            if self.attached is not None:
                self.attached.clear()
                self.attached = None

    def keep_layer_input(self, layer: int, x: torch.Tensor) -> None:
        """Where needed, each layer's input ``x``, the residual (the ``layer_input`` hook point: a post-norm block's attention
        reads it, a pre-norm (decoder) block's layer, whose attention reads ``LN(x)``), and the hidden states from it."""
        if self.needs.layer_inputs:
            self.layer_inputs.append(x)
        if self.own_states:
            self.keep_state(x)

    def require_finite(self) -> None:
        """Refuse the batch in one line where a layer's maps or hidden states hold NaN or infinities (:class:`FiniteWatch`):
        tables are never made of them, so a model that overflows its dtype fails the whole pass."""
        self.finite.require(self.batch.items, self.model.model.dtype, self.batch.device)

    def keep_state(self, x: torch.Tensor) -> None:
        """Copy the next hidden state ``x`` into :attr:`states` (made at the first, on the batch's device; the last comes after
        the forward pass, so inference mode is entered here too)."""
        with torch.inference_mode():
            if self.states is None:
                self.states = torch.empty((self.model.num_layers + 1, *x.shape), dtype=x.dtype, device=self.batch.device)
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

    def end_of_projection(self, layer: int, projected: torch.Tensor) -> None:
        """The ``attn_out`` hook point, the layer's output projection, which runs right after its attention: ``projected``, the
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
        wants_block = needs.norms or needs.layer_inputs or (needs.vectors and self.model.layout is not None)
        block = self.blocks[layer] if wants_block else None
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
