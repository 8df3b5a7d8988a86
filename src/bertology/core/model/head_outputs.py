"""A head's output as the unit of causal interventions (docs/methods.md#which-heads-matter-causally).

``z_h``, head ``h``'s slice of the input of the attention output projection ``W_O``, at every position: the input of
``W_O`` is the heads' outputs side by side, head-major, so ``z_h`` is its columns ``h * d_head : (h + 1) * d_head`` and
``o = sum_h z_h W_O^h``. It is read and replaced by a forward pre-hook on the projection the layout names
(:meth:`~bertology.core.model.layouts.base.Layout.output_projection`: GPT-2's ``Conv1D``, GPT-NeoX's ``dense``, Llama's
``o_proj``, BERT's ``attention.output.dense``), never by model type. A grouped-query model's ``z`` has
``num_attention_heads`` heads, however few key-value heads there are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from bertology.core.errors import ModelError
from bertology.core.model.interventions import known_layout

#: ``replace(layer, z) -> z'``: what a pre-hook puts in place of layer ``layer``'s ``z`` ``[batch, positions, heads, d_head]``.
Replacement = Callable[[int, torch.Tensor], torch.Tensor]


class HeadOutputs:
    """The output projections of one model's layers, through its layout: read every layer's ``z`` or replace it."""

    def __init__(self, model: nn.Module):
        layout = known_layout(model)
        base = model.base_model
        calls = layout.layer_calls(base, model.config)
        if len({id(layer) for layer in calls}) != len(calls):
            raise ModelError(f"{type(model).__name__}: layers share weights, so a head's output is not one layer's")
        self.model = model
        self.layout = layout
        self.projections = [layout.output_projection(layer) for layer in calls]
        self.num_heads = model.config.num_attention_heads
        width = layout.block(calls[0], model.config).output_weight.shape[0]
        if width % self.num_heads:
            raise ModelError(f"{type(model).__name__}: the output projection's {width} inputs are not {self.num_heads} heads")
        self.head_dim = width // self.num_heads

    @property
    def num_layers(self) -> int:
        return len(self.projections)

    def split(self, flat: torch.Tensor) -> torch.Tensor:
        """``[batch, positions, heads * d_head] -> [batch, positions, heads, d_head]``."""
        return flat.reshape(*flat.shape[:-1], self.num_heads, self.head_dim)

    @contextmanager
    def replaced(self, replace: Replacement, layers: range | None = None) -> Iterator[None]:
        """While inside, layer ``l``'s ``W_O`` reads ``replace(l, z)`` instead of ``z`` (for ``l`` in ``layers``, every layer by default)."""
        with ExitStack() as stack:
            for layer in layers if layers is not None else range(self.num_layers):
                def hook(module, args, layer=layer):
                    z = self.split(args[0])
                    return (replace(layer, z).reshape(args[0].shape), *args[1:])

                stack.callback(self.projections[layer].register_forward_pre_hook(hook).remove)
            yield

    @contextmanager
    def recorded(self, detach: bool = True) -> Iterator[list[torch.Tensor]]:
        """While inside, every forward pass appends each layer's ``z`` ``[batch, positions, heads, d_head]`` to the yielded list,
        in layer order (a copy, detached unless ``detach`` is False)."""
        seen: list[torch.Tensor] = []

        def keep(layer: int, z: torch.Tensor) -> torch.Tensor:
            seen.append(z.detach().clone() if detach else z)
            return z

        with self.replaced(keep):
            yield seen


def replace_chosen(z: torch.Tensor, chosen: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``z`` of ``C`` stacked copies of a batch, ``[C * batch, positions, heads, d_head]`` copy-major, with copy ``c``'s heads where
    ``chosen[c]`` (bool ``[C, heads]``) replaced by ``value`` (``[batch or 1, positions or more or 1, heads, d_head]``, its first
    positions taken: a layer computed for the first token alone sees one); the other heads kept."""
    copies = z.view(len(chosen), -1, *z.shape[1:])
    value = value[:, : z.shape[1]].to(z.dtype)
    return torch.where(chosen.to(z.device)[:, None, None, :, None], value.unsqueeze(0), copies).view_as(z)
