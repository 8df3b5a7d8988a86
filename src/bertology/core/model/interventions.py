"""Interventions on attention heads, through the named hook points of :mod:`bertology.core.model.hooks`.

Three interventions, which combine freely (docs/methods.md#importance-ablation-and-pruning):

* **mask** a head: its output ``a @ v`` is zeroed before the heads are concatenated and projected
  (Michel et al. 2019's ``xi_h = 0``);
* make a head's attention **uniform** over the real tokens, ``a[i, j] = 1/n`` (Kovaleva et al. 2019's
  "disabling");
* **disable a layer**'s attention: every head's output is zeroed, so the attention block adds only
  its output bias to the residual stream.

:func:`attach_variants` runs several interventions at once on copies of one batch stacked along
the batch axis, which is how leave-one-out evaluates every head of a layer in one pass.
:class:`HeadGates` are Michel's continuous gates, per example, whose gradient is a head's importance.
:class:`LayerReplay` replays cached layer outputs so that a pass starts at layer ``l`` (what lies below
an intervention does not change). :func:`prune_heads` removes heads physically.

transformers 5 has neither ``head_mask`` nor ``prune_heads``; everything here works through the
attention interface, forward overrides on layer modules and plain weight slicing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from bertology.core.errors import ModelError
from bertology.core.model.hooks import Hooks, active_hooks
from bertology.core.model.layouts import Layout, layout_of

INTERVENTIONS = ("mask", "uniform")


@dataclass(frozen=True)
class Intervention:
    """Heads to mask, heads to make uniform and layers to disable, as ``(layer, head)`` pairs and layer indices."""

    masked: frozenset[tuple[int, int]] = frozenset()
    uniform: frozenset[tuple[int, int]] = frozenset()
    disabled_layers: frozenset[int] = frozenset()

    @classmethod
    def of(cls, kind: str, layer: int, head: int = -1) -> "Intervention":
        """One head (``head >= 0``) or every head of a layer (``head == -1``), masked or made uniform.

        ``of("mask", l)`` zeroes every head of layer ``l``, the same as ``disable(l)``.
        """
        if kind not in INTERVENTIONS:
            raise ValueError(f"unknown intervention {kind!r}; known: {', '.join(INTERVENTIONS)}")
        return cls(**{"masked" if kind == "mask" else "uniform": frozenset({(layer, max(head, -1))})})

    @classmethod
    def disable(cls, layer: int) -> "Intervention":
        return cls(disabled_layers=frozenset({layer}))

    def __or__(self, other: "Intervention") -> "Intervention":
        return Intervention(self.masked | other.masked, self.uniform | other.uniform, self.disabled_layers | other.disabled_layers)

    @property
    def lowest_layer(self) -> int | None:
        """The lowest layer this touches (None for no intervention): everything below it is unchanged."""
        layers = [layer for layer, _ in self.masked | self.uniform] + list(self.disabled_layers)
        return min(layers) if layers else None

    def attach_to(self, hooks: Hooks, num_heads: int) -> Hooks:
        """Add this intervention's handlers to ``hooks``."""
        return attach_variants(hooks, [self], num_heads)


def _selection(pairs: Iterable[tuple[int, int]], layer: int, num_heads: int) -> np.ndarray:
    """Bool per head of ``layer``: the heads named in ``pairs`` (head -1: all of them)."""
    chosen = np.zeros(num_heads, dtype=bool)
    for pair_layer, head in pairs:
        if pair_layer == layer:
            chosen[slice(None) if head < 0 else head] = True
    return chosen


def attach_variants(hooks: Hooks, variants: Sequence[Intervention], num_heads: int) -> Hooks:
    """Apply ``variants[v]`` to the ``v``-th copy of a batch stacked copy-major (``[V * B, ...]``).

    Masking multiplies each head's output by a 0/1 gate; uniform attention replaces the pattern by
    ``key_mask / n_visible`` (rows of exactly ``1/n`` over the real tokens, Kovaleva et al. 2019; in a decoder
    ``1/(i + 1)`` over the keys query i sees).
    """
    count = len(variants)
    layers = {layer for v in variants for layer, _ in v.masked | v.uniform} | {layer for v in variants for layer in v.disabled_layers}
    gates, uniform = {}, {}
    for layer in layers:
        zeroed = np.stack([_selection(v.masked, layer, num_heads) | (layer in v.disabled_layers) for v in variants])
        flat = np.stack([_selection(v.uniform, layer, num_heads) for v in variants])
        if zeroed.any():
            gates[layer] = torch.from_numpy((~zeroed).astype(np.float64))
        if flat.any():
            uniform[layer] = torch.from_numpy(flat)

    def gate_heads(layer: int, output: torch.Tensor) -> torch.Tensor | None:
        if layer not in gates:
            return None
        gate = gates[layer].to(output.device, output.dtype)[:, None, :, None, None]  # [V, 1, H, 1, 1]
        return (output.view(count, -1, *output.shape[1:]) * gate).view_as(output)

    def flatten_heads(layer: int, pattern: torch.Tensor) -> torch.Tensor | None:
        if layer not in uniform:
            return None
        keys = pattern.shape[-1]
        real = hooks.key_mask if hooks.key_mask is not None else torch.ones(pattern.shape[0], 1, 1, keys, dtype=torch.bool, device=pattern.device)
        flat = real.to(pattern.dtype) / real.sum(-1, keepdim=True).clamp(min=1).to(pattern.dtype)  # [V*B, 1, q or 1, k]
        chosen = uniform[layer].to(pattern.device)[:, None, :, None, None]  # [V, 1, H, 1, 1]
        stacked = pattern.view(count, -1, *pattern.shape[1:])
        return torch.where(chosen, flat.view(count, -1, 1, flat.shape[-2], keys).expand_as(stacked), stacked).view_as(pattern)

    return hooks.add("pattern", flatten_heads).add("head_output", gate_heads)


class HeadGates:
    """Michel et al. (2019)'s gates: ``MHA(x) = sum_h xi_h Att_h(x)``, one ``xi`` per example, layer and head.

    ``values`` has shape ``[layers, batch, heads]``; make it ``requires_grad`` and the gradient of the
    summed loss with respect to it is ``dL(x)/d xi_h`` for each example ``x``.
    """

    def __init__(self, values: torch.Tensor):
        self.values = values

    def attach_to(self, hooks: Hooks) -> Hooks:
        def gate(layer: int, output: torch.Tensor) -> torch.Tensor:
            return output * self.values[layer].to(output.dtype)[:, :, None, None]

        return hooks.add("head_output", gate)


def known_layout(model: nn.Module) -> Layout:
    """The model's layout (:mod:`bertology.core.model.layouts`), refused in one line where bertology knows none."""
    layout = layout_of(model.config)
    if layout is None:
        raise ModelError(f"{type(model).__name__}: bertology does not know where this model keeps its layers")
    return layout


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The model's layer modules in call order (ALBERT's shared layers appear once; calls are counted), as its layout
    (:mod:`bertology.core.model.layouts`) lists them."""
    return known_layout(model).layers(model.base_model)


class LayerReplay:
    """Run a model from layer ``l`` on: layers below return a cached hidden state instead of computing.

    Layer calls are counted per forward pass, so shared layers (ALBERT) replay correctly. While a
    layer is replayed, the active :class:`~bertology.core.model.hooks.Hooks` count it, so hook handlers keep the
    true layer numbers. ``first_token_only`` computes the last layer for the first token only (the
    only one a first-token classifier reads; see :func:`reads_first_token_only`).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.layout = known_layout(model)
        self.modules = self.layout.layers(model.base_model)
        self._calls = 0
        self._start = 0
        self._input: torch.Tensor | None = None
        self._recorded: list[torch.Tensor] | None = None
        self._first_token_layer: int | None = None

    def _forward(self, module: nn.Module, original):
        def forward(hidden_states, *args, **kwargs):
            layer = self._calls
            self._calls += 1
            if layer < self._start:
                hooks = active_hooks()
                if hooks is not None:
                    hooks.skip_layer()
                return self._input
            if layer == self._first_token_layer:  # exact at position 0, the input passed through elsewhere
                first = self.layout.first_token_output(module, hidden_states, *args, **kwargs)
                output = torch.cat([first, hidden_states[:, 1:]], dim=1)
            else:
                output = original(hidden_states, *args, **kwargs)
            if self._recorded is not None:
                self._recorded.append(output)
            return output

        return forward

    @contextmanager
    def _installed(self) -> Iterator[None]:
        originals = {id(m): m.forward for m in self.modules}
        for module in {id(m): m for m in self.modules}.values():
            module.forward = self._forward(module, originals[id(module)])

        def reset(*_):
            self._calls = 0

        handle = self.model.register_forward_pre_hook(reset)
        try:
            yield
        finally:
            handle.remove()
            for module in {id(m): m for m in self.modules}.values():
                del module.forward

    @contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        """Run normally and collect each layer's output hidden state (the input of the next)."""
        self._recorded, self._start, self._first_token_layer = [], 0, None
        try:
            with self._installed():
                yield self._recorded
        finally:
            self._recorded = None

    @contextmanager
    def start_at(self, layer: int, hidden: torch.Tensor | None, first_token_only: bool = False) -> Iterator[None]:
        """Start at ``layer`` with ``hidden`` as its input (the recorded output of ``layer - 1``)."""
        self._start, self._input = layer, hidden
        self._first_token_layer = self.model.config.num_hidden_layers - 1 if first_token_only else None
        try:
            with self._installed():
                yield
        finally:
            self._start, self._input, self._first_token_layer = 0, None, None


def reads_first_token_only(model: nn.Module) -> bool:
    """True for the classifiers whose output depends on the last layer's first token alone: those its layout names
    (:attr:`~bertology.core.model.layouts.base.Layout.first_token_classifiers`), whose last layer it can compute for that
    token alone (:meth:`~bertology.core.model.layouts.base.Layout.first_token_output`)."""
    layout = layout_of(model.config)
    return layout is not None and type(model).__name__ in layout.first_token_classifiers


def _keep(linear: nn.Linear, index: torch.Tensor, dim: int) -> None:
    """Keep the output rows (dim 0) or input columns (dim 1) of ``linear`` at ``index``, in place."""
    weight = linear.weight.index_select(dim, index).detach().clone()
    linear.weight = nn.Parameter(weight)
    if dim == 0 and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.index_select(0, index).detach().clone())
    if dim == 0:
        linear.out_features = len(index)
    else:
        linear.in_features = len(index)


def prune_heads(model: nn.Module, heads: dict[int, Sequence[int]]) -> None:
    """Remove ``heads[layer]`` from each layer, in place: the query, key and value projections lose
    those heads' rows and the output projection their columns. Head indices refer to the current
    model. Every layer keeps at least one head. Records what was removed in
    ``config.bertology_pruned_heads`` (original indices), so :func:`shrink_to_config` can rebuild the shape.
    """
    layout = known_layout(model)
    modules = layout.layers(model.base_model)
    if len(modules) != model.config.num_hidden_layers:
        raise ModelError(f"{type(model).__name__}: layers share weights, so heads cannot be removed from one layer")
    record = {int(k): list(v) for k, v in (getattr(model.config, "bertology_pruned_heads", None) or {}).items()}
    for layer, remove in heads.items():
        remove = sorted({int(h) for h in remove})
        if not remove:
            continue
        parts = layout.head_parts(modules[layer])
        if parts is None:
            raise ModelError(f"{type(modules[layer]).__name__}: bertology cannot prune heads of this layer type (BERT, RoBERTa, ELECTRA, DistilBERT can)")
        owner, qkv, output, count_name = parts.owner, parts.qkv, parts.output, parts.count_attribute
        count = getattr(owner, count_name)
        size = qkv[0].out_features // count
        if len(remove) >= count:
            raise ModelError(f"layer {layer}: cannot remove all {count} heads (keep at least one)")
        kept = [h for h in range(count) if h not in remove]
        index = torch.tensor([h * size + i for h in kept for i in range(size)], device=output.weight.device)
        for linear in qkv:
            _keep(linear, index, 0)
        _keep(output, index, 1)
        setattr(owner, count_name, len(kept))
        if hasattr(owner, "all_head_size"):
            owner.all_head_size = len(kept) * size
        original = [h for h in range(count + len(record.get(layer, []))) if h not in record.get(layer, [])]
        record[layer] = sorted(record.get(layer, []) + [original[h] for h in remove])
    model.config.bertology_pruned_heads = {str(k): v for k, v in sorted(record.items())}


def shrink_to_config(model: nn.Module) -> None:
    """Give a freshly built full-size model the shape its config's ``bertology_pruned_heads`` records."""
    pruned = {int(k): v for k, v in (getattr(model.config, "bertology_pruned_heads", None) or {}).items()}
    model.config.bertology_pruned_heads = {}
    prune_heads(model, pruned)
