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
- **Verdict** (:func:`induction_verdict`): the strength of induction at a checkpoint is the strongest head's score (the max over
  heads, in the data and in each replicate, as ``track``'s strengths take the max over layers); the in-context learning drop is
  minus the score. Each series' half-rise step and its 95% interval come from
  :func:`~bertology.studies.track.verdicts.crossing_steps` on the paired replicates. A series **changes** only where the 95%
  interval of its first-to-last change lies above 0 and its half-rise step is located more narrowly than the run (the rule
  every verdict over training shares, :func:`~bertology.studies.track.verdicts.series_change`, as a pattern's emergence), and
  induction only where the strongest head's excess over the uniform head on the same sequences
  (:meth:`InductionReplicates.replicate_excess`) rises, and ends, beyond the families' tolerance
  (:func:`~bertology.studies.track.verdicts.rise_beyond_uniform`); else there is no evidence, and no claim. When
  both change, they fall **in the same window** (``supported``) where their half-rise intervals overlap, and **not**
  (``contradicted``) where the intervals are apart.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, Engine, LayerMaps, RunStats, moved_to, stack_layers
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import MIN_SAMPLE, bootstrap_weights
from bertology.families.headtypes.analyzer import INDUCTION, head_type_targets, second_copies, target_mass
from bertology.families.kinds import check_kind, check_same_kind
from bertology.families.roles.analyzer import excess_over_uniform
from bertology.studies.track.verdicts import json_value, not_beyond_words, rise_beyond_uniform, series_change

#: Olsson et al.'s late and early tokens (1-based positions in the context).
OLSSON_LATE, OLSSON_EARLY = 500, 50


class InductionReplicates(LayerwiseAnalyzer):
    """Every head's induction score (see the module docstring), averaged over the sequences that have a query with a target,
    with Poisson bootstrap replicates: :meth:`replicate_means` ``[1 + B, layer, head]`` (row 0 the data)."""

    name = "induction_replicates"

    def __init__(self, kind: Kind, bootstrap: int = 1000, seed: int = 0):
        self.kind, self.bootstrap, self.seed = kind, bootstrap, seed
        self._sums: np.ndarray | None = None  # [1 + B, layer, head]: weighted sums of sequence scores
        self._excess: np.ndarray | None = None  # [1 + B, layer, head]: weighted sums of their excess over the uniform head
        self._weights = np.zeros(1 + bootstrap)  # [1 + B]: summed weights of the sequences that have a score
        self._sequences = 0
        self._pending: list[torch.Tensor] = []  # one [batch, 2 head] per layer: the heads' scores, then the uniform head's
        self._targets: torch.Tensor | None = None

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            check_kind(self, batch)
            self._pending = []
            self._targets = head_type_targets(batch.input_ids, batch.mask, batch.segment_ids >= 0, self.kind,
                                              second_copy=second_copies(batch))[INDUCTION]
        visible = maps.visible(batch)  # on the layer's device: a device map may spread the layers over several
        targets = moved_to(self._targets, visible.device) & visible
        uniform = maps.uniform_scored(batch, self, lambda head: target_mass(head, targets))  # [batch, 1 or head]
        self._pending.append(torch.cat([target_mass(maps.attention, targets), uniform.expand(-1, maps.attention.shape[1])], dim=-1))

    def finish_batch(self, batch: Batch) -> None:
        both = stack_layers(self._pending, batch, dim=1).cpu().numpy()  # [batch, layer, 2 head], float64; NaN: no query with a target
        self._pending, self._targets = [], None
        scores, uniform = np.split(both, 2, axis=-1)
        seen = np.isfinite(scores).all(axis=(1, 2))
        weights = np.stack([bootstrap_weights(self.seed, self.bootstrap, example) for example in batch.examples]) * seen[:, None]
        sums = np.einsum("br,blh->rlh", weights, np.where(seen[:, None, None], scores, 0.0))
        excess = np.einsum("br,blh->rlh", weights, np.where(seen[:, None, None], excess_over_uniform(scores, uniform), 0.0))
        self._sums = sums if self._sums is None else self._sums + sums
        self._excess = excess if self._excess is None else self._excess + excess
        self._weights += weights.sum(axis=0)
        self._sequences += int(seen.sum())

    def merge(self, other: "InductionReplicates") -> "InductionReplicates":
        check_same_kind(self, other)
        if other.bootstrap != self.bootstrap or other.seed != self.seed:
            raise ValueError("cannot merge InductionReplicates with different bootstrap sizes or seeds")
        if other._sums is not None:
            self._sums = other._sums.copy() if self._sums is None else self._sums + other._sums
            self._excess = other._excess.copy() if self._excess is None else self._excess + other._excess
            self._weights = self._weights + other._weights
            self._sequences += other._sequences
        return self

    @property
    def sequences(self) -> int:
        return self._sequences

    def replicate_means(self, layers: int, heads: int) -> np.ndarray:
        """``[1 + B, layer, head]``; NaN throughout where no sequence has a query with a target (no repeated token)."""
        if self._sums is None:
            return np.full((1 + self.bootstrap, layers, heads), np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._sums / self._weights[:, None, None]

    def replicate_excess(self, layers: int, heads: int) -> np.ndarray:
        """``[1 + B, layer, head]``: each head's mean excess over the uniform head on the same sequences
        (:func:`~bertology.families.roles.analyzer.excess_over_uniform` per sequence: float noise is 0); NaN as in
        :meth:`replicate_means`."""
        if self._excess is None:
            return np.full((1 + self.bootstrap, layers, heads), np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._excess / self._weights[:, None, None]

    def result(self) -> pd.DataFrame:
        """``layer, head, value, ci_low, ci_high, n, excess``: each head's mean induction score and the 2.5th-97.5th percentiles of
        its replicates, over the ``n`` sequences that have a query with a target, and its mean excess over the uniform head."""
        columns = ["layer", "head", "value", "ci_low", "ci_high", "n", "excess"]
        if self._sums is None:
            return pd.DataFrame(columns=columns)
        means = self.replicate_means(*self._sums.shape[1:])
        low, high = np.nanpercentile(means[1:], [2.5, 97.5], axis=0) if self.bootstrap else (np.full(means.shape[1:], np.nan),) * 2
        layer, head = np.indices(means.shape[1:])
        return pd.DataFrame({"layer": layer.ravel(), "head": head.ravel(), "value": means[0].ravel(), "ci_low": low.ravel(),
                             "ci_high": high.ravel(), "n": self._sequences, "excess": self.replicate_excess(*self._sums.shape[1:])[0].ravel()})


def icl_positions(max_length: int) -> tuple[int, int]:
    """``(early, late)``: the 1-based positions of Olsson et al.'s 50th and 500th tokens scaled to a context of ``max_length``
    pieces (see the module docstring)."""
    late = min(OLSSON_LATE, max_length)
    return max(2, round(late * OLSSON_EARLY / OLSSON_LATE)), late


def in_context_scores(engine: Engine, examples: list, seed: int, bootstrap: int, progress: bool = False,
                      desc: str = "in-context") -> tuple[np.ndarray, int, int, int]:
    """The in-context learning score of ``engine``'s model (with its causal-LM head) over the sequences of the track pass
    (:meth:`~bertology.core.engine.Engine.encode`: the same truncation), on those of at least ``late`` pieces: ``(replicates
    [1 + B] (row 0 the data; NaN where no sequence is long enough), sequences, early, late)``, with the positions of
    :func:`icl_positions` and the replicates' Poisson weights keyed by the sequence (paired with :class:`InductionReplicates`')."""
    early, late = icl_positions(engine.settings.max_length)
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


def _why_not(series: dict, verb: str) -> str:
    """Why a series of :func:`~bertology.studies.track.verdicts.series_change` does not change, in words."""
    why = [] if series["change_low"] > 0 else ["the change's interval does not exclude 0"]
    if series["beyond_uniform"] is False:
        why.append(not_beyond_words(series))
    if not series["located"]:
        why.append("its half-rise step is not located more narrowly than the run")
    return f": no evidence that it {verb} ({' and '.join(why)})"


CLAIM = "Induction heads form in the same window of training as the in-context learning score drops (Olsson et al. 2022)."


def induction_verdict(steps: list[int], induction: np.ndarray, icl: np.ndarray, icl_sequences: int,
                      min_sample: int = MIN_SAMPLE, *, excess: np.ndarray) -> dict:
    """The verdict of the module's docstring from ``induction [checkpoint, 1 + B, layer, head]`` and ``excess`` (the same shape,
    each head's excess over the uniform head: :class:`InductionReplicates`), and ``icl [checkpoint, 1 + B]``
    (:func:`in_context_scores`; ``icl_sequences``: the fewest long-enough sequences of a checkpoint, below ``min_sample`` no claim)."""
    steps_array = np.asarray(steps)
    strongest = np.nanmax(induction.reshape(*induction.shape[:2], -1), axis=-1) if np.isfinite(induction).any() else None
    result = {"claim": CLAIM, "steps": [None if s is None else int(s) for s in steps], "verdict": "no evidence",  # None: one checkpoint of unknown step
              "strength": "induction: the strongest head's induction score (max over heads); in-context learning: its drop, minus the score"}
    if len(steps) < 2:
        return {**result, "verdict": "not applicable", "statement": "One checkpoint: there is no training series."}
    if strongest is None or not np.isfinite(strongest[:, 0]).all():
        return {**result, "statement": "No sequence of the corpus repeats a token: no induction score, no claim."}
    if icl_sequences < min_sample or not np.isfinite(icl[:, 0]).all():
        return {**result, "statement": f"{icl_sequences} sequences are long enough for the in-context learning score (at least "
                                       f"{min_sample} needed): no claim."}
    heads = series_change(steps_array, strongest, rise_beyond_uniform(np.nanmax(excess.reshape(*excess.shape[:2], -1), axis=-1)))  # the strongest head's excess
    drop = series_change(steps_array, -icl, {"beyond_uniform": None})  # a loss: no uniform head to clear
    result["induction"], result["icl_drop"] = heads, drop
    words = []
    for name, series, verb in (("the strongest head's induction score", heads, "forms"), ("the in-context learning drop", drop, "drops")):
        text = (f"{name} goes from {series['first']:.3f} to {series['final']:.3f} (change {series['change']:+.3f}, 95% interval "
                f"{series['change_low']:+.3f} to {series['change_high']:+.3f})")
        if np.isfinite(series["half_step"]):
            text += f", half of it by step {series['half_step']:.0f} (95% interval {series['ci_low']:.0f}-{series['ci_high']:.0f})"
        words.append(text + ("" if series["changes"] else _why_not(series, verb)))
    if heads["changes"] and drop["changes"]:
        overlap = heads["ci_low"] <= drop["ci_high"] and drop["ci_low"] <= heads["ci_high"]
        result["verdict"] = "supported" if overlap else "contradicted"
        ending = ("their half-rise intervals overlap: the same window" if overlap
                  else "their half-rise intervals are apart: not the same window")
    else:
        ending = "not both change beyond noise: no claim on the window"
    result["statement"] = "; ".join(words) + f"; {ending}: {result['verdict']}."
    for key in ("induction", "icl_drop"):  # verdict.json: NaN (a series that never rises) becomes null
        result[key] = {name: json_value(value) for name, value in result[key].items()}
    return result
