"""What zero, mean and resample ablation put in place of a head's output ``z_h``.

See docs/methods.md#importance-ablation-and-pruning.

``z_h`` is head ``h``'s slice of the input of the attention output projection (:mod:`bertology.core.model.head_outputs`).
Each replacement gives, for a batch of examples, one tensor per layer that :func:`~bertology.core.model.head_outputs.replace_chosen`
puts in place of the chosen heads' ``z``:

* **zero** (``mask`` is its old name): ``z_h = 0`` (Michel et al. 2019's gate at 0);
* **mean** (Wang et al. 2022; Heimersheim & Nanda 2024): ``z_h`` = its mean over the real pieces of a reference, over
  positions (one vector per head, every position gets it: the default) or per piece index ``i`` over the reference's
  examples that reach ``i`` (``mean_over="examples"``; an evaluated example longer than every reference example is refused);
* **resample** (Zhang & Nanda 2024; Heimersheim & Nanda 2024): ``z_h`` from another example's own run, a donor drawn for
  each example and draw, seeded. Pieces are aligned by their index among the real pieces (padding on either side takes
  no part); a donor is drawn among the reference examples with at least as many pieces as the example (other than
  itself where the reference is the evaluated set), so it covers every piece; an example longer than every other is given
  one of the longest, and its pieces past the donor's end get the mean over positions.
"""

from __future__ import annotations

import numpy as np
import torch

from bertology.core.errors import BertologyError
from bertology.core.model.head_outputs import HeadOutputs
from bertology.studies.heads.method import HeadMethod

#: ``bertology ablate``'s interventions: ``mask`` is the old name of ``zero`` (the same numbers); ``uniform`` changes the
#: attention pattern instead of ``z_h`` (:mod:`bertology.core.model.interventions`).
ABLATIONS = ("zero", "mask", "mean", "resample", "uniform")
#: What mean ablation averages ``z_h`` over: every position (one mean per head), or the examples at each piece index.
MEAN_OVER = ("positions", "examples")


def piece_index(mask: torch.Tensor) -> torch.Tensor:
    """``[batch, positions]``: each position's index among its row's real pieces (``mask`` True), 0 before the first."""
    return (mask.long().cumsum(1) - 1).clamp(min=0)


def pieces_first(z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``z`` ``[batch, positions, ...]`` with each row's real pieces moved to its front, in order (padding after them)."""
    order = torch.argsort((~mask).int(), dim=1, stable=True)
    return z.gather(1, order.view(*order.shape, *[1] * (z.dim() - 2)).expand_as(z))


def aligned(z_donor: torch.Tensor, mask_donor: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``[batch, positions, heads, d_head]``: at row ``b``'s ``j``-th real piece, donor row ``b``'s ``z`` at its ``j``-th real
    piece; ``fill`` ``[heads, d_head]`` past the donor's last piece."""
    ordered = pieces_first(z_donor, mask_donor)
    piece = piece_index(mask)
    taken = ordered.gather(1, piece.clamp(max=ordered.shape[1] - 1)[..., None, None].expand(-1, -1, *ordered.shape[2:]))
    inside = piece < mask_donor.sum(1, keepdim=True)
    return torch.where(inside[..., None, None], taken, fill.to(taken.dtype))


def draw_donors(lengths: np.ndarray, reference_lengths: np.ndarray, draws: int, seed: int, same: bool) -> np.ndarray:
    """``[draws, n]`` donor indices into the reference, one per example and draw: uniform among the reference examples at least
    as long as the example (others than itself where ``same``, the reference being the evaluated examples), or, where there
    are none, among the longest others."""
    rng = np.random.default_rng(seed)
    donors = np.empty((draws, len(lengths)), dtype=np.int64)
    for i, length in enumerate(lengths):
        others = np.ones(len(reference_lengths), dtype=bool)
        if same:
            others[i] = False
        long_enough = others & (reference_lengths >= length)
        pool = long_enough if long_enough.any() else others & (reference_lengths == reference_lengths[others].max())
        donors[:, i] = rng.choice(np.flatnonzero(pool), size=draws)
    return donors


class Replacement:
    """The value put in place of the chosen heads' ``z``, per layer, for a batch of examples; ``draws`` of them (resample)."""

    draws = 1

    def values(self, chunk: list[int], inputs: dict[str, torch.Tensor], draw: int) -> list[torch.Tensor]:
        raise NotImplementedError


class Constant(Replacement):
    """The same value at every position of every example: zero, or the mean over positions."""

    def __init__(self, per_layer: list[torch.Tensor]):
        self.per_layer = [value[None, None] for value in per_layer]  # [1, 1, heads, d_head]

    def values(self, chunk, inputs, draw):
        return self.per_layer


class ReferenceMeans:
    """``z``'s mean over the real pieces of ``rows`` (float64, per layer): over positions ``[heads, d_head]``, and, with
    ``per_piece``, at each piece index over the rows that reach it ``[pieces, heads, d_head]``."""

    def __init__(self, method: HeadMethod, heads: HeadOutputs, rows: list[dict], per_piece: bool):
        longest = max(len(row["input_ids"]) for row in rows)
        device = method.task_model.device
        total = torch.zeros(heads.num_layers, heads.num_heads, heads.head_dim, dtype=torch.float64, device=device)
        by_piece = torch.zeros(heads.num_layers, longest if per_piece else 0, heads.num_heads, heads.head_dim, dtype=torch.float64, device=device)
        counts = torch.zeros(longest, dtype=torch.float64, device=device)
        with torch.inference_mode():
            for chunk in method.batches(rows, "reference means"):
                inputs = method.model_inputs([rows[i] for i in chunk])
                mask = inputs["attention_mask"].bool()
                with heads.recorded() as z:
                    method.task_model.model(**inputs)
                piece = piece_index(mask)[mask]
                for layer, z_layer in enumerate(z):
                    real = z_layer[mask].double()  # [real pieces, heads, d_head]
                    total[layer] += real.sum(0)
                    if per_piece:
                        by_piece[layer].index_add_(0, piece, real)
                counts += torch.bincount(piece, minlength=longest).double()
        self.over_positions = total / counts.sum()
        self.per_piece = by_piece / counts[:, None, None] if per_piece else None


class PerPieceMean(Replacement):
    """At each real piece of an example, the mean of ``z`` at that piece index over the reference's examples."""

    def __init__(self, per_piece: torch.Tensor):
        self.per_piece = per_piece  # [layers, pieces, heads, d_head]

    def values(self, chunk, inputs, draw):
        piece = piece_index(inputs["attention_mask"].bool())
        return [means[piece] for means in self.per_piece]


class Resample(Replacement):
    """``z`` of a donor's own run (:func:`draw_donors`, :func:`aligned`), ``draws`` donors per example."""

    def __init__(self, method: HeadMethod, heads: HeadOutputs, rows: list[dict], reference: list[dict] | None, draws: int, seed: int,
                 fill: torch.Tensor):
        self.method, self.heads, self.draws, self.fill = method, heads, draws, fill
        self.reference = reference if reference is not None else rows
        lengths = np.array([len(row["input_ids"]) for row in rows])
        self.donors = draw_donors(lengths, np.array([len(row["input_ids"]) for row in self.reference]), draws, seed, reference is None)

    def values(self, chunk, inputs, draw):
        donor_inputs = self.method.model_inputs([self.reference[i] for i in self.donors[draw, chunk]])
        with self.heads.recorded() as z:
            self.method.task_model.model(**donor_inputs)
        mask_donor, mask = donor_inputs["attention_mask"].bool(), inputs["attention_mask"].bool()
        return [aligned(z[layer], mask_donor, mask, self.fill[layer]) for layer in range(self.heads.num_layers)]


def replacement(method: HeadMethod, heads: HeadOutputs, intervention: str, rows: list[dict], reference: list[dict] | None,
                mean_over: str, resamples: int, seed: int) -> Replacement:
    """The :class:`Replacement` of ``intervention`` (zero, mask, mean or resample) for evaluating ``rows``; the mean and the
    donors come from ``reference`` (None: ``rows`` themselves)."""
    if intervention in ("zero", "mask"):
        dtype = next(method.task_model.model.parameters()).dtype
        zero = torch.zeros(heads.num_heads, heads.head_dim, dtype=dtype, device=method.task_model.device)
        return Constant([zero] * heads.num_layers)
    if intervention == "resample" and reference is None and len(rows) < 2:
        raise BertologyError("resample ablation takes z_h from other examples: give two examples or more, or a --reference")
    source = reference if reference is not None else rows
    per_piece = intervention == "mean" and mean_over == "examples"
    if per_piece and max(len(row["input_ids"]) for row in rows) > max(len(row["input_ids"]) for row in source):
        raise BertologyError(f"--mean-over examples: an evaluated example has {max(len(row['input_ids']) for row in rows)} pieces, more than any "
                             f"reference example ({max(len(row['input_ids']) for row in source)}); give a longer --reference or --mean-over positions")
    means = ReferenceMeans(method, heads, source, per_piece)
    if intervention == "mean":
        return PerPieceMean(means.per_piece) if per_piece else Constant(list(means.over_positions))
    return Resample(method, heads, rows, reference, resamples, seed, means.over_positions)
