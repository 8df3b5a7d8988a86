"""Induction heads over training (Olsson et al. 2022, "In-context Learning and Induction Heads"): each head's induction score and
the in-context learning score at every checkpoint of a decoder's series, and the verdict whether the heads form in the same
window as the in-context learning score drops (docs/methods.md#induction-heads-over-training).

- **Induction score** of a head on a sequence: the head-types family's (:mod:`bertology.families.headtypes.analyzer`), the mean
  over the queries ``i`` that follow an earlier occurrence of their token of the attention mass on the keys after those
  occurrences, ``{j + 1 : j < i, t_j = t_i}``. :class:`InductionReplicates` averages it over sequences with Poisson bootstrap
  replicates keyed by the sequence (:func:`~bertology.core.statistics.stats.bootstrap_weights`), so that the replicates of
  every checkpoint on one corpus are paired, as :class:`~bertology.studies.track.peaks.LayerPeaks`' are.
- **In-context learning score** (Olsson et al.): the loss of a late token in the context minus the loss of an early one,
  averaged over sequences; theirs is the 500th token's less the 50th's. Scaled to the context available (:func:`icl_positions`):
  the late token is the ``L = min(500, max_length)``-th, the early one the ``max(2, round(L / 10))``-th (Olsson's ratio), both
  1-based positions in the sequence as the model reads it, on the sequences of at least ``L`` pieces. The loss of the k-th token
  is ``-ln p(x_k | x_<k)``, in float64 (:func:`in_context_scores`). Negative: later tokens are predicted better, the context helps.
- The verdict on the series (:mod:`~bertology.studies.track.phase`) reads these scores on the induction probe, whose repeats
  come at random periods and offsets (:mod:`~bertology.studies.track.probe`); on the corpus they are tables (``induction.csv``,
  ``in_context.csv``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, Engine, LayerMaps, RunStats, moved_to, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import bootstrap_weights
from bertology.families.headtypes.analyzer import INDUCTION, head_type_targets, second_copies, target_mass
from bertology.families.kinds import check_kind, check_same_kind
from bertology.families.roles.analyzer import excess_over_uniform

#: Olsson et al.'s late and early tokens (1-based positions in the context).
OLSSON_LATE, OLSSON_EARLY = 500, 50


class InductionReplicates(LayerwiseAnalyzer):
    """Every head's induction score (see the module docstring), and with ``roles`` the head-types family's other scores too
    (the previous-token score: the mass on the key before the query), averaged over the sequences that have a query with a
    target, with Poisson bootstrap replicates: :meth:`replicate_means` ``[1 + B, layer, head]`` of a role (row 0 the data).
    On sequences that tell their repeat's period (``Example.period``, the induction probe's) it also keeps each period's mean
    induction score and excess over the uniform head (:meth:`period_means`, the data alone): a head that copies by position
    scores at one period alone."""

    name = "induction_replicates"

    def __init__(self, kind: Kind, bootstrap: int = 1000, seed: int = 0, roles: tuple[str, ...] = (INDUCTION,)):
        self.kind, self.bootstrap, self.seed, self.roles = kind, bootstrap, seed, roles
        self._sums: np.ndarray | None = None  # [1 + B, layer, head, role]: weighted sums of sequence scores
        self._excess: np.ndarray | None = None  # [1 + B, layer, head, role]: weighted sums of their excess over the uniform head
        self._weights = np.zeros((1 + bootstrap, len(roles)))  # [1 + B, role]: summed weights of the sequences that have a score
        self._sequences = np.zeros(len(roles), dtype=np.int64)
        self._periods: dict[int, list] = {}  # period -> [summed induction scores [layer, head], summed excess, sequences]
        self._pending: list[torch.Tensor] = []  # one [batch, 2, role, head] per layer: the heads' scores, then the uniform head's
        self._targets: list[torch.Tensor] | None = None

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            check_kind(self, batch)
            self._pending = []
            made = head_type_targets(batch.input_ids, batch.mask, batch.segment_ids >= 0, self.kind, second_copy=second_copies(batch))
            self._targets = [made[role] for role in self.roles]
        visible = maps.visible(batch)  # on the layer's device: a device map may spread the layers over several
        targets = [moved_to(role_targets, visible.device) & visible for role_targets in self._targets]

        def scored(head: torch.Tensor) -> torch.Tensor:  # [batch, role, head (or 1)]
            return torch.stack([target_mass(head, role_targets) for role_targets in targets], dim=1)

        heads = scored(maps.attention)
        self._pending.append(torch.stack([heads, maps.uniform_scored(batch, self, scored).expand_as(heads)], dim=1))

    def finish_batch(self, batch: Batch) -> None:
        both = stack_layers(self._pending, batch, dim=1).cpu().numpy()  # [batch, layer, 2, role, head], float64; NaN: no query with a target
        self._pending, self._targets = [], None
        scores, uniform = both[:, :, 0].transpose(0, 1, 3, 2), both[:, :, 1].transpose(0, 1, 3, 2)  # [batch, layer, head, role]
        seen = np.isfinite(scores).all(axis=(1, 2))  # [batch, role]
        weights = np.stack([bootstrap_weights(self.seed, self.bootstrap, example) for example in batch.examples])[:, :, None] * seen[:, None, :]
        excess = np.where(seen[:, None, None, :], excess_over_uniform(scores, uniform), 0.0)
        sums = np.einsum("brk,blhk->rlhk", weights, np.where(seen[:, None, None, :], scores, 0.0))
        excess_sums = np.einsum("brk,blhk->rlhk", weights, excess)
        self._sums = sums if self._sums is None else self._sums + sums
        self._excess = excess_sums if self._excess is None else self._excess + excess_sums
        self._weights += weights.sum(axis=0)
        self._sequences += seen.sum(axis=0)
        if INDUCTION in self.roles:
            k = self.roles.index(INDUCTION)
            for b, example in enumerate(batch.examples):
                if example.period is not None and seen[b, k]:
                    kept = self._periods.setdefault(example.period, [0.0, 0.0, 0])
                    kept[0], kept[1], kept[2] = kept[0] + scores[b, ..., k], kept[1] + excess[b, ..., k], kept[2] + 1

    def merge(self, other: "InductionReplicates") -> "InductionReplicates":
        check_same_kind(self, other)
        if other.bootstrap != self.bootstrap or other.seed != self.seed or other.roles != self.roles:
            raise ValueError("cannot merge InductionReplicates with different bootstrap sizes, seeds or roles")
        if other._sums is not None:
            self._sums = other._sums.copy() if self._sums is None else self._sums + other._sums
            self._excess = other._excess.copy() if self._excess is None else self._excess + other._excess
            self._weights = self._weights + other._weights
            self._sequences = self._sequences + other._sequences
        for period, (scores, excess, count) in other._periods.items():
            kept = self._periods.setdefault(period, [0.0, 0.0, 0])
            kept[0], kept[1], kept[2] = kept[0] + scores, kept[1] + excess, kept[2] + count
        return self

    @property
    def sequences(self) -> int:
        """The sequences that have a query with an induction target (of the first role)."""
        return int(self._sequences[0])

    def _mean(self, sums: np.ndarray | None, layers: int, heads: int, role: str | None) -> np.ndarray:
        if sums is None:
            return np.full((1 + self.bootstrap, layers, heads), np.nan)
        k = self.roles.index(role or self.roles[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            return sums[..., k] / self._weights[:, None, None, k]

    def replicate_means(self, layers: int, heads: int, role: str | None = None) -> np.ndarray:
        """``[1 + B, layer, head]`` of ``role`` (default: the first, induction); NaN throughout where no sequence has a query
        with a target (no repeated token)."""
        return self._mean(self._sums, layers, heads, role)

    def replicate_excess(self, layers: int, heads: int, role: str | None = None) -> np.ndarray:
        """``[1 + B, layer, head]``: each head's mean excess over the uniform head on the same sequences
        (:func:`~bertology.families.roles.analyzer.excess_over_uniform` per sequence: float noise is 0); NaN as in
        :meth:`replicate_means`."""
        return self._mean(self._excess, layers, heads, role)

    def period_means(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(periods [P], induction scores [P, layer, head], excess [P, layer, head], sequences [P])``: each period's mean over
        the sequences of that period (the data), periods in order; empty where no sequence tells its period."""
        periods = sorted(self._periods)
        if not periods:
            return np.zeros(0, dtype=np.int64), np.zeros((0, 0, 0)), np.zeros((0, 0, 0)), np.zeros(0, dtype=np.int64)
        counts = np.array([self._periods[p][2] for p in periods])
        return (np.array(periods), np.stack([self._periods[p][0] for p in periods]) / counts[:, None, None],
                np.stack([self._periods[p][1] for p in periods]) / counts[:, None, None], counts)

    def result(self) -> pd.DataFrame:
        """``layer, head, value, ci_low, ci_high, n, excess``: each head's mean induction score (the first role's) and the
        2.5th-97.5th percentiles of its replicates, over the ``n`` sequences that have a query with a target, and its mean excess
        over the uniform head."""
        columns = ["layer", "head", "value", "ci_low", "ci_high", "n", "excess"]
        if self._sums is None:
            return pd.DataFrame(columns=columns)
        shape = self._sums.shape[1:3]
        means = self.replicate_means(*shape)
        low, high = np.nanpercentile(means[1:], [2.5, 97.5], axis=0) if self.bootstrap else (np.full(means.shape[1:], np.nan),) * 2
        layer, head = np.indices(means.shape[1:])
        return pd.DataFrame({"layer": layer.ravel(), "head": head.ravel(), "value": means[0].ravel(), "ci_low": low.ravel(),
                             "ci_high": high.ravel(), "n": self.sequences, "excess": self.replicate_excess(*shape)[0].ravel()})


def icl_positions(max_length: int) -> tuple[int, int]:
    """``(early, late)``: the 1-based positions of Olsson et al.'s 50th and 500th tokens scaled to a context of ``max_length``
    pieces (see the module docstring)."""
    late = min(OLSSON_LATE, max_length)
    return max(2, round(late * OLSSON_EARLY / OLSSON_LATE)), late


def in_context_scores(engine: Engine, examples: list, seed: int, bootstrap: int, progress: bool = False,
                      desc: str = "in-context", length: int | None = None) -> tuple[np.ndarray, int, int, int]:
    """The in-context learning score of ``engine``'s model (with its causal-LM head) over the sequences of the track pass
    (:meth:`~bertology.core.engine.Engine.encode`: the same truncation), on those of at least ``late`` pieces: ``(replicates
    [1 + B] (row 0 the data; NaN where no sequence is long enough), sequences, early, late)``, with the positions of
    :func:`icl_positions` of the pass's ``max_length`` (of ``length`` where given: the induction probe's, whose last token is
    in its repeat) and the replicates' Poisson weights keyed by the sequence (paired with :class:`InductionReplicates`')."""
    early, late = icl_positions(length or engine.settings.max_length)
    sums, weights, count = np.zeros(1 + bootstrap), np.zeros(1 + bootstrap), 0
    with torch.inference_mode(), tqdm(total=len(examples), unit="seq", desc=desc, disable=not progress) as bar:
        for items in engine.batches(engine.encode(enumerate(examples), RunStats())):
            tensors = engine.collate(items)
            long_enough = tensors["mask"].sum(dim=1) >= late
            if bool(long_enough.any()):
                logits = engine.model.model(**engine.model_inputs(tensors)).logits
                # the k-th token (1-based) is input_ids[:, k - 1], predicted from position k - 2
                chosen = torch.tensor([early, late], device=logits.device)
                scores = torch.log_softmax(logits[:, chosen - 2].double(), dim=-1)
                losses = -scores.gather(-1, tensors["input_ids"][:, chosen - 1, None]).squeeze(-1)  # [batch, 2]
                differences = (losses[:, 1] - losses[:, 0]).cpu().numpy()
                for item, difference, keep in zip(items, differences, long_enough.tolist()):
                    if keep:
                        w = bootstrap_weights(seed, bootstrap, item.example)
                        sums += w * difference
                        weights += w
                        count += 1
            bar.update(len(items))
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / weights, count, early, late
