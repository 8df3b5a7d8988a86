"""The layout contract: where an architecture keeps each layer's attention parts, and what the rest of its layer does.

See docs/methods.md#decoders; every layout passes the contract test, tests/core/model/test_layouts.py.

A :class:`Layout` subclass names the ``config.model_type`` values it serves and is registered by that (:data:`LAYOUTS`);
every module of :mod:`bertology.core.model.layouts` is imported with the package, so a new layout is one file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from bertology.core.model.kinds import Kind


@dataclass(frozen=True)
class AttentionBlock:
    """Where one layer's attention parts live, whatever the architecture names them.

    ``attention``: the module that calls the attention function (its first argument is the attention's input, in a
    post-norm block the layer input ``x``, which is also the residual); ``output``: the output projection ``W_O``
    (``nn.Linear``, or GPT-2's ``Conv1D``, input ``heads * head_dim``); ``layer_norm``: the layer norm applied to
    ``attention output + x`` (post-norm blocks: BERT's), or, where ``pre_norm``, the one applied to ``x`` before attention
    (GPT-2, Llama: docs/methods.md#decoders); ``layer``: the whole layer, whose first input is ``x`` (ALBERT's shared one
    runs as several layers; needed where ``pre_norm``: the attention there reads ``LN(x)``, not the residual).
    """

    attention: torch.nn.Module
    output: torch.nn.Module
    layer_norm: torch.nn.Module
    pre_norm: bool = False
    layer: torch.nn.Module | None = field(default=None, compare=False)
    #: The rest of the layer after its attention, ``rest_of_layer(W_O-projected attention output + b_O, x) -> layer output`` (residual,
    #: layer norms, feed-forward), for value zeroing's reruns (:meth:`Layout.rest_of_layer`).
    rest_of_layer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(compare=False, kw_only=True)
    #: ``m``, the scalar the attention output is multiplied by before it joins the residual (Granite's ``residual_multiplier``).
    output_multiplier: float = 1.0
    #: The RMS norm the attention output passes through before it joins the residual (Gemma 2's and OLMo 2's
    #: ``post_attention_layernorm``), ``N(z) = g * z / sqrt(mean(z^2) + eps)``, and what its weight lacks of ``g`` (Gemma
    #: stores ``g - 1``).
    output_norm: torch.nn.Module | None = field(default=None, compare=False)
    output_norm_gain_offset: float = 0.0

    def output_norm_parts(self) -> tuple[torch.Tensor, float]:
        """``(g, eps)`` of :attr:`output_norm`."""
        norm = self.output_norm
        return norm.weight + self.output_norm_gain_offset, getattr(norm, "eps", getattr(norm, "variance_epsilon", None))

    @property
    def input_module(self) -> torch.nn.Module:
        """The module whose first input is the layer input ``x`` (the residual): the attention in a post-norm block, the
        whole layer in a pre-norm one."""
        return self.layer if self.pre_norm else self.attention

    @property
    def output_weight(self) -> torch.Tensor:
        """``W_O`` as ``[heads * head_dim, hidden]`` (``x W_O``): a Linear's weight transposed, a Conv1D's as it is."""
        from transformers.pytorch_utils import Conv1D

        return self.output.weight if isinstance(self.output, Conv1D) else self.output.weight.T

    @property
    def output_bias(self) -> torch.Tensor | None:
        return self.output.bias


@dataclass(frozen=True)
class HeadParts:
    """What removing a head slices in one layer (:func:`~bertology.core.model.interventions.prune_heads`): the query, key and
    value projections (``nn.Linear``, ``heads * head_dim`` output rows, head-major), the output projection (as many input
    columns), and the module that holds the head count under ``count_attribute`` (and ``all_head_size``, where it keeps one)."""

    owner: nn.Module
    count_attribute: str
    qkv: tuple[nn.Linear, nn.Linear, nn.Linear]
    output: nn.Linear


#: Every registered layout by the ``config.model_type`` it serves (filled as :mod:`bertology.core.model.layouts` imports its modules).
LAYOUTS: dict[str, "Layout"] = {}


class Layout:
    """One family of architectures: the model types it serves, its kind, pre- or post-norm, where each layer keeps its
    attention, output projection and norm, the list of its layers, the rest of a layer after the attention, and its
    length rules.

    A subclass that sets ``model_types`` in its own body is registered for them; a derived family (Gemma 2 from Llama)
    subclasses its parent's layout and overrides what differs. Methods take the bare model (``model.base_model``) or one
    layer module; layouts hold no state.
    """

    #: The ``config.model_type`` values this layout serves.
    model_types: ClassVar[frozenset[str]] = frozenset()
    #: :data:`ENCODER` or :data:`DECODER`.
    kind: ClassVar[Kind]
    #: The norm comes before the attention (``LN(x)`` is its input: GPT-2, Llama), not after ``attention + x`` (BERT's post-norm).
    pre_norm: ClassVar[bool] = False
    #: Positions of the position table that no piece can take (RoBERTa's ``padding_idx + 1``).
    reserved_positions: ClassVar[int] = 0
    #: The sequence classifiers of this family (class names) whose head reads the last layer's first token alone (BERT's
    #: pooler, RoBERTa's and ELECTRA's classification heads, DistilBERT's pre-classifier): ablation's layer replay then
    #: computes the last layer for that token only (:meth:`first_token_output`). A decoder's classifier reads the last token.
    first_token_classifiers: ClassVar[frozenset[str]] = frozenset()
    #: What a norm's weight lacks of its gain ``g`` (Gemma's RMS norms store ``g - 1``): :meth:`norm_gain`.
    norm_gain_offset: ClassVar[float] = 0.0

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        model_types = sorted(cls.__dict__.get("model_types", ()))
        taken = [model_type for model_type in model_types if model_type in LAYOUTS]
        if taken:
            raise TypeError(f"{cls.__name__} and {type(LAYOUTS[taken[0]]).__name__} both serve {taken[0]!r} models")
        LAYOUTS.update((model_type, cls()) for model_type in model_types)

    # ---- what each layout says ----

    def layers(self, base: nn.Module) -> list[nn.Module]:
        """The layer modules in call order, a shared one once (ablation's :class:`~bertology.core.model.interventions.LayerReplay`)."""
        raise NotImplementedError

    def attention(self, layer: nn.Module) -> nn.Module:
        """The module of ``layer`` that calls the attention function."""
        raise NotImplementedError

    def output_projection(self, layer: nn.Module) -> nn.Module:
        """``W_O``: the projection of the concatenated heads."""
        raise NotImplementedError

    def norm(self, layer: nn.Module) -> nn.Module:
        """The layer norm before the attention (pre-norm), or the one after ``attention + x`` (post-norm)."""
        raise NotImplementedError

    def rest_of_layer(self, layer: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output from its ``W_O``-projected attention output (``+ b_O``) and its input ``x``, as the layer's own
        forward computes it after the attention (value zeroing's reruns)."""
        raise NotImplementedError

    def embeddings(self, base: nn.Module) -> list[nn.Module]:
        """The modules that make the first layer's input from the pieces (token and position embeddings, their norm and
        projection): what ``bertology restore`` puts back as its unit 0."""
        raise NotImplementedError

    def value_projection(self, layer: nn.Module) -> torch.Tensor:
        """``W_V`` of ``layer`` as ``[hidden, kv_heads * head_dim]``: ``x W_V`` is every key-value head's value side by side,
        head-major, before the bias (the copying score's OV circuit, :mod:`bertology.families.headtypes.copying`)."""
        raise NotImplementedError

    # ---- what a layout may change ----

    def pooler(self, base: nn.Module) -> nn.Module | None:
        """The module that pools the last layer for a sequence classifier (BERT's ``pooler``), which belongs with the
        classifier's head; None where the family has none."""
        return None

    def first_token_output(self, layer: nn.Module, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs) -> torch.Tensor:
        """``layer``'s output at position 0 alone, ``[batch, 1, hidden]``, exact: the attention reads every key, but what
        follows it acts on each position alone. Layouts with :attr:`first_token_classifiers` give it."""
        raise NotImplementedError

    def head_parts(self, layer: nn.Module) -> HeadParts | None:
        """What removing one of ``layer``'s heads slices (:class:`HeadParts`); None where bertology cannot remove heads
        from this family's layers."""
        return None

    def final_norm(self, base: nn.Module) -> nn.Module | None:
        """The norm between the last layer and the unembedding (a pre-norm decoder's); None where there is none."""
        return None

    def norm_gain(self, norm: nn.Module) -> torch.Tensor | None:
        """``g``, what ``norm`` multiplies each normalised coordinate by: its weight plus :attr:`norm_gain_offset`; None where it has
        no weight (OLMo's norms, OLMo 2's missing one: ``g = 1``)."""
        weight = getattr(norm, "weight", None)
        return None if weight is None else weight + self.norm_gain_offset

    def layer_calls(self, base: nn.Module, config) -> list[nn.Module]:
        """The layer module each attention layer runs, in order: :meth:`layers`, unless layers are shared (ALBERT)."""
        return self.layers(base)

    def is_pre_norm(self, config) -> bool:
        """Whether ``config``'s layers are pre-norm: :attr:`pre_norm`, unless the config chooses (OPT)."""
        return self.pre_norm

    def before_residual(self, layer: nn.Module, config) -> dict:
        """What the attention output passes through before it joins the residual, as :class:`AttentionBlock`'s
        ``output_multiplier``, ``output_norm`` and ``output_norm_gain_offset``: nothing, by default."""
        return {}

    # ---- built from the above ----

    def block(self, layer: nn.Module, config) -> AttentionBlock:
        """``layer``'s :class:`AttentionBlock`."""
        return AttentionBlock(self.attention(layer), self.output_projection(layer), self.norm(layer), pre_norm=self.is_pre_norm(config),
                              layer=layer, rest_of_layer=partial(self.rest_of_layer, layer), **self.before_residual(layer, config))

    def blocks(self, base: nn.Module, config) -> list[AttentionBlock]:
        """One :class:`AttentionBlock` per attention layer, in the order the forward pass runs them."""
        return [self.block(layer, config) for layer in self.layer_calls(base, config)]


def sequential_finish(feed_forward: nn.Module, norm: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A sequential pre-norm layer after its attention: ``h = x + projected``, then ``h + feed_forward(norm(h))`` (GPT-2's
    ``mlp`` and ``ln_2``; Llama's, Mistral's, Qwen's, Gemma's, OLMo's, Phi-3's and StableLM's ``mlp`` and
    ``post_attention_layernorm``; GPT-NeoX's without a parallel residual)."""
    hidden = x + projected
    return hidden + feed_forward(norm(hidden))


def parallel_finish(feed_forward: nn.Module, norm: nn.Module, projected: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A parallel-residual layer after its attention: ``x + projected + feed_forward(norm(x))`` (GPT-NeoX's with
    ``use_parallel_residual`` and ``post_attention_layernorm``; Phi's and StableLM's, whose one ``input_layernorm`` feeds
    both branches)."""
    return x + projected + feed_forward(norm(x))
