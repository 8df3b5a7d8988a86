"""Activation patching and attribution patching of every head on prompt pairs (docs/methods.md#which-heads-matter-causally).

Per pair, ``LD = logit_a - logit_b`` at the pair's read position. Denoising (the default) runs the corrupted prompt ``x'``
with head ``h``'s output ``z_h`` (:mod:`bertology.core.model.head_outputs`) taken from the clean run ``x``, at every
position; noising runs ``x`` with ``z_h`` from ``x'``. The run patched into is the *target*, the run ``z`` comes from the
*source*.

Exact patching reuses the target run: the hidden state entering layer ``l`` does not depend on a patch at ``l``, so it
is recorded once (:class:`~bertology.core.model.interventions.LayerReplay`) and layer ``l``'s heads run from there as
``H`` stacked copies of the pair, copy ``h`` with head ``h`` patched (as leave-one-out does).

Attribution patching (Nanda 2023; Kramar et al. 2024's AtP) estimates the same change to first order,
``(z_h(source) - z_h(target)) . dLD/dz_h`` at the target run, summed over positions and the head's dimensions: every
head from one forward pair and one backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bertology.core.model.head_outputs import HeadOutputs
from bertology.core.model.interventions import LayerReplay
from bertology.studies.heads.pairs import EncodedPair

DIRECTIONS = ("denoise", "noise")


@dataclass
class PairEffects:
    """Per pair: ``LD`` of the clean and corrupted runs ``[n]``, and each method's change of the target run's ``LD``,
    ``[n, layers, heads]`` (``attribution``: its first-order estimate)."""

    clean: np.ndarray
    corrupt: np.ndarray
    activation: np.ndarray
    attribution: np.ndarray


def logit_difference(logits: torch.Tensor, pair: EncodedPair) -> torch.Tensor:
    """``logit_a - logit_b`` at the pair's read position, per row of ``logits`` ``[rows, positions, vocabulary]``."""
    at = logits[:, pair.position]
    return at[:, pair.answer] - at[:, pair.wrong]


class Patcher:
    """Patch every head of ``model`` (a causal LM, or an encoder with its masked-LM head) on pairs, in ``direction``."""

    def __init__(self, model: torch.nn.Module, direction: str = "denoise"):
        if direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {direction!r}; known: {', '.join(DIRECTIONS)}")
        self.model, self.direction = model, direction
        self.heads = HeadOutputs(model)
        self.replay = LayerReplay(model)

    def _ids(self, pieces: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor([pieces], device=self.model.device)

    def _runs(self, pair: EncodedPair) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, target) pieces of ``pair`` in this direction."""
        clean, corrupt = self._ids(pair.clean), self._ids(pair.corrupt)
        return (clean, corrupt) if self.direction == "denoise" else (corrupt, clean)

    def exact(self, pair: EncodedPair) -> tuple[float, float, np.ndarray]:
        """``LD`` of the source and target runs and the change of the target's ``LD`` with each head patched, ``[layers, heads]``.

        Each layer runs ``H + 1`` stacked copies, the last unpatched: a change is measured against that copy, computed the
        same way, so that batched arithmetic (float32's last bits) is never taken for an effect."""
        source, target = self._runs(pair)
        heads = self.heads
        with torch.inference_mode():
            with heads.recorded() as z_source:
                ld_source = logit_difference(self.model(input_ids=source).logits, pair)
            with self.replay.record() as hidden:
                ld_target = logit_difference(self.model(input_ids=target).logits, pair)
            changes = np.empty((heads.num_layers, heads.num_heads))
            copies = heads.num_heads + 1
            stacked = target.repeat(copies, 1)
            copy = torch.arange(heads.num_heads, device=target.device)
            for layer in range(heads.num_layers):
                def patch(at: int, z: torch.Tensor, layer=layer) -> torch.Tensor:
                    z = z.clone()
                    z[copy, :, copy] = z_source[layer][0].transpose(0, 1).to(z.dtype)  # copy h gets the source's head h
                    return z

                start = hidden[layer - 1].repeat(copies, 1, 1) if layer > 0 else None
                with self.replay.start_at(layer, start), heads.replaced(patch, layers=range(layer, layer + 1)):
                    patched = logit_difference(self.model(input_ids=stacked).logits, pair).double()
                changes[layer] = (patched[:-1] - patched[-1]).cpu().numpy()
        return float(ld_source), float(ld_target), changes

    def attribution(self, pair: EncodedPair) -> np.ndarray:
        """AtP's estimate of each head's change, ``[layers, heads]``: ``(z_source - z_target) . dLD/dz`` at the target run."""
        source, target = self._runs(pair)
        heads = self.heads
        with torch.inference_mode(), heads.recorded() as z_source:
            self.model(input_ids=source)
        shifts = [None] * heads.num_layers

        def shifted(layer: int, z: torch.Tensor) -> torch.Tensor:  # z + 0, the zero a leaf whose gradient is dLD/dz
            shifts[layer] = torch.zeros_like(z, requires_grad=True)
            return z + shifts[layer]

        with torch.enable_grad(), heads.recorded() as z_target, heads.replaced(shifted):
            ld = logit_difference(self.model(input_ids=target).logits, pair).sum()
            gradients = torch.autograd.grad(ld, shifts)
        return np.stack([((z_source[layer] - z_target[layer]).double() * gradients[layer].double()).sum(dim=(0, 1, 3)).cpu().numpy()
                         for layer in range(heads.num_layers)])

    def effects(self, pairs: list[EncodedPair], progress: bool = False) -> PairEffects:
        """Every method's per-pair changes on ``pairs``."""
        from tqdm.auto import tqdm

        runs = [self.exact(pair) + (self.attribution(pair),) for pair in tqdm(pairs, desc=f"patching ({self.direction})", disable=not progress)]
        source, target, activation, attribution = (np.array([run[i] for run in runs], dtype=np.float64) for i in range(4))
        clean, corrupt = (source, target) if self.direction == "denoise" else (target, source)
        return PairEffects(clean, corrupt, activation, attribution)
