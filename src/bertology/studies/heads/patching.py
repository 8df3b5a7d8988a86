"""Activation and attribution patching of every head on prompt pairs (docs/methods.md#which-heads-matter-causally).

Per pair, ``LD = logit_a - logit_b`` at the pair's read position (a classifier: its two labels' logits). Denoising (the
default) runs the corrupted prompt ``x'`` with head ``h``'s output ``z_h`` (:mod:`bertology.core.model.head_outputs`) taken
from the clean run ``x``, at every position or (``positions="each"``) at one position at a time; noising runs ``x`` with
``z_h`` from ``x'``. The run patched into is the *target*, the run ``z`` comes from the *source*.

A pair costs one source run (recorded), one target run with its backward pass(es) and the exact patches:

- exact patching reuses the target run: the hidden state entering layer ``l`` does not depend on a patch at ``l``, so it is
  recorded once (:class:`~bertology.core.model.interventions.LayerReplay`) and layer ``l``'s variants run from there as
  stacked copies of the target prompt, copy ``v`` with variant ``v`` patched (as leave-one-out does);
- attribution patching (Nanda 2023; Kramar et al. 2024's AtP) estimates the same change to first order,
  ``(z_h(source) - z_h(target)) . dLD/dz_h`` at the target run: every head from the shared source run and one forward and
  backward pass of the target;
- ``attribution*`` adds AtP*'s GradDrop (Kramar et al. 2024, section 3.1.2): the backward pass again once per layer ``l``
  with the gradient through layer ``l``'s contribution dropped (the residual stream passes it on), and the estimate
  ``1/(L-1) sum_l |mean_pairs AtP_l|`` (see :mod:`~bertology.studies.heads.patch_statistics`), which catches heads whose
  direct and indirect effects cancel. AtP*'s QK fix is not applied: it concerns queries and keys as nodes, and a head's
  ``z_h`` is read from both real runs, so nothing inside the head is linearised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from bertology.core.model.head_outputs import HeadOutputs
from bertology.core.model.interventions import LayerReplay
from bertology.studies.heads.pairs import EncodedPair

DIRECTIONS = ("denoise", "noise")
POSITIONS = ("all", "each")
#: The most copies of the target prompt one stacked forward pass of exact patching runs (a layer's variants in chunks).
MAX_COPIES = 64


@dataclass
class PairEffects:
    """Per pair: ``LD`` of the clean and corrupted runs ``[n]``; each method's change of the target run's ``LD`` with every
    head patched at all positions, ``[n, layers, heads]`` (``attribution``: its first-order estimate); with
    ``positions="each"``, ``by_position`` the same per position ``[n, layers, heads, positions]``; and ``dropped``, AtP with
    layer ``l``'s gradient dropped, ``[n, l, layers, heads]`` (attribution*)."""

    clean: np.ndarray
    corrupt: np.ndarray
    changes: dict[str, np.ndarray]
    dropped: np.ndarray
    by_position: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def joined(cls, parts: list[PairEffects]) -> PairEffects:
        """The effects of consecutive runs of pairs (the shards of a Ray run, in order) as one."""
        def stacked(name: str) -> dict[str, np.ndarray]:
            return {method: np.concatenate([getattr(part, name)[method] for part in parts]) for method in getattr(parts[0], name)}

        return cls(np.concatenate([part.clean for part in parts]), np.concatenate([part.corrupt for part in parts]), stacked("changes"),
                   np.concatenate([part.dropped for part in parts]), stacked("by_position"))


@dataclass
class TargetRun:
    """What the target run gives one pair: its ``LD``, each layer's output hidden state, and attribution's estimates (summed
    over positions ``[layers, heads]``, per position ``[layers, heads, positions]``, with each layer's gradient dropped
    ``[layers, layers, heads]``)."""

    ld: float
    hidden: list[torch.Tensor]
    attribution: np.ndarray
    attribution_by_position: np.ndarray
    dropped: np.ndarray


def logit_difference(logits: torch.Tensor, pair: EncodedPair) -> torch.Tensor:
    """``logit_a - logit_b`` per row of ``logits``: at the pair's read position of ``[rows, positions, vocabulary]``, or of a
    classifier's ``[rows, labels]`` (position None)."""
    at = logits if pair.position is None else logits[:, pair.position]
    return at[:, pair.answer] - at[:, pair.wrong]


class _DroppableGradient(torch.autograd.Function):
    """``layer_output`` unchanged forward; backward, the gradient goes on through the layer, or (while ``gates.dropped`` is
    this layer) straight to the layer's input, as if the layer added nothing (AtP*'s GradDrop)."""

    @staticmethod
    def forward(ctx, layer_input, layer_output, gates, layer):
        ctx.gates, ctx.layer = gates, layer
        return layer_output.view_as(layer_output)

    @staticmethod
    def backward(ctx, gradient):
        if ctx.gates.dropped == ctx.layer:
            return gradient, torch.zeros_like(gradient), None, None
        return None, gradient, None, None


class _Gates:
    """The layer whose gradient is dropped in the next backward pass (None: none)."""

    dropped: int | None = None


class Patcher:
    """Patch every head of ``model`` (a causal LM, an encoder with its masked-LM head, or a sequence classifier) on pairs,
    in ``direction``, at all positions together and (``positions="each"``) at each position alone."""

    def __init__(self, model: torch.nn.Module, direction: str = "denoise", positions: str = "all"):
        if direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {direction!r}; known: {', '.join(DIRECTIONS)}")
        if positions not in POSITIONS:
            raise ValueError(f"unknown positions {positions!r}; known: {', '.join(POSITIONS)}")
        self.model, self.direction, self.positions = model, direction, positions
        self.heads = HeadOutputs(model)
        self.replay = LayerReplay(model)

    def _ids(self, pieces: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor([pieces], device=self.model.device)

    def _runs(self, pair: EncodedPair) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, target) pieces of ``pair`` in this direction."""
        clean, corrupt = self._ids(pair.clean), self._ids(pair.corrupt)
        return (clean, corrupt) if self.direction == "denoise" else (corrupt, clean)

    def source_run(self, pair: EncodedPair) -> tuple[float, list[torch.Tensor]]:
        """The source run's ``LD`` and every layer's ``z`` ``[1, positions, heads, d_head]``."""
        source, _ = self._runs(pair)
        with torch.inference_mode(), self.heads.recorded() as z_source:
            ld = logit_difference(self.model(input_ids=source).logits, pair)
        return float(ld), z_source

    @contextmanager
    def _droppable(self, gates: _Gates) -> Iterator[None]:
        """While inside, each layer's output passes through :class:`_DroppableGradient` (forward values unchanged)."""
        with ExitStack() as stack:
            for layer, module in enumerate(self.replay.modules):
                def hook(module, args, kwargs, output, layer=layer):
                    layer_input = args[0] if args else kwargs["hidden_states"]
                    hidden = output[0] if isinstance(output, tuple) else output
                    hidden = _DroppableGradient.apply(layer_input, hidden, gates, layer)
                    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

                stack.callback(module.register_forward_hook(hook, with_kwargs=True).remove)
            yield

    def target_run(self, pair: EncodedPair, z_source: list[torch.Tensor], drop_gradients: bool = True) -> TargetRun:
        """The target run, recorded for exact patching, and attribution's estimates from its backward pass (and, with
        ``drop_gradients``, one more backward pass per layer with that layer's gradient dropped)."""
        _, target = self._runs(pair)
        heads, gates = self.heads, _Gates()
        shifts = [None] * heads.num_layers

        def shifted(layer: int, z: torch.Tensor) -> torch.Tensor:  # z + 0, the zero a leaf whose gradient is dLD/dz
            shifts[layer] = torch.zeros_like(z, requires_grad=True)
            return z + shifts[layer]

        with torch.enable_grad(), self.replay.record() as hidden, heads.recorded() as z_target, heads.replaced(shifted), self._droppable(gates):
            ld = logit_difference(self.model(input_ids=target).logits, pair).sum()
            differences = [(z_source[layer] - z_target[layer]).double() for layer in range(heads.num_layers)]

            def estimate(dropped: int | None) -> np.ndarray:  # [layers, heads, positions]
                gates.dropped = dropped
                gradients = torch.autograd.grad(ld, shifts, retain_graph=True)
                return np.stack([(differences[layer] * gradients[layer].double()).sum(dim=(0, 3)).T.cpu().numpy()
                                 for layer in range(heads.num_layers)])

            by_position = estimate(None)
            dropped = np.stack([estimate(layer).sum(-1) for layer in range(heads.num_layers)]) if drop_gradients else np.empty(0)
        return TargetRun(float(ld.detach()), [state.detach() for state in hidden], by_position.sum(-1), by_position, dropped)

    def _variants(self, length: int) -> list[tuple[int, int | None]]:
        """(head, position or None: every position) of each variant of a layer."""
        heads = range(self.heads.num_heads)
        every = [(head, None) for head in heads]
        return every + ([(head, position) for head in heads for position in range(length)] if self.positions == "each" else [])

    def exact(self, pair: EncodedPair, z_source: list[torch.Tensor], hidden: list[torch.Tensor]) -> np.ndarray:
        """The change of the target's ``LD`` with each variant of each layer patched, ``[layers, variants]``
        (:meth:`_variants`' order).

        Each chunk of a layer's variants runs with one unpatched copy last: a change is measured against that copy, computed
        the same way, so that batched arithmetic (float32's last bits) is never taken for an effect."""
        _, target = self._runs(pair)
        variants = self._variants(target.shape[1])
        changes = np.empty((self.heads.num_layers, len(variants)))
        with torch.inference_mode():
            for layer in range(self.heads.num_layers):
                for start in range(0, len(variants), MAX_COPIES - 1):
                    chunk = variants[start:start + MAX_COPIES - 1]
                    changes[layer, start:start + len(chunk)] = self._exact_chunk(pair, target, layer, chunk, z_source[layer], hidden)
        return changes

    def _exact_chunk(self, pair: EncodedPair, target: torch.Tensor, layer: int, chunk: list[tuple[int, int | None]],
                     z_layer: torch.Tensor, hidden: list[torch.Tensor]) -> np.ndarray:
        """One stacked forward pass from ``layer`` on: copy ``v`` with ``chunk[v]`` patched, then one unpatched copy."""
        copies = len(chunk) + 1
        source = z_layer[0]  # [positions, heads, d_head]

        def patch(at: int, z: torch.Tensor) -> torch.Tensor:
            z = z.clone()
            for copy, (head, position) in enumerate(chunk):
                rows = slice(None) if position is None else slice(position, position + 1)
                z[copy, rows, head] = source[rows, head].to(z.dtype)
            return z

        start = hidden[layer - 1].repeat(copies, 1, 1) if layer > 0 else None
        with self.replay.start_at(layer, start), self.heads.replaced(patch, layers=range(layer, layer + 1)):
            patched = logit_difference(self.model(input_ids=target.repeat(copies, 1)).logits, pair).double()
        return (patched[:-1] - patched[-1]).cpu().numpy()

    def effects(self, pairs: list[EncodedPair], progress: bool = False) -> PairEffects:
        """Every method's per-pair changes on ``pairs``."""
        from tqdm.auto import tqdm

        layers, heads = self.heads.num_layers, self.heads.num_heads
        lds, exact, attribution, by_position, dropped = [], [], [], [], []
        for pair in tqdm(pairs, desc=f"patching ({self.direction})", disable=not progress):
            ld_source, z_source = self.source_run(pair)
            run = self.target_run(pair, z_source)
            changes = self.exact(pair, z_source, run.hidden)
            lds.append((ld_source, run.ld))
            exact.append(changes[:, :heads])
            attribution.append(run.attribution)
            dropped.append(run.dropped)
            if self.positions == "each":
                by_position.append((changes[:, heads:].reshape(layers, heads, -1), run.attribution_by_position))
        source, target = np.array(lds, dtype=np.float64).T
        clean, corrupt = (source, target) if self.direction == "denoise" else (target, source)
        each = {} if not by_position else {method: np.stack([item[i] for item in by_position]) for i, method in enumerate(("activation", "attribution"))}
        return PairEffects(clean, corrupt, {"activation": np.stack(exact), "attribution": np.stack(attribution)}, np.stack(dropped), each)
