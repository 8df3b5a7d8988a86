"""What every ``track`` verdict stands on (docs/methods.md#track-and-the-learning-curve-verdict): a pattern counts only beyond the
uniform head on the same sequences, and a difference only beyond the families' excess tolerance.

- A sequence's **excess** is its value less the uniform head's on the same sequence (each row spread evenly over the keys it
  saw, :meth:`~bertology.core.engine.LayerMaps.uniform`), with float noise counted as 0
  (:func:`~bertology.families.roles.analyzer.excess_over_uniform`, as the role and head-type families take it); the analyzers of
  ``track`` average it over sequences with the same Poisson replicates as the values.
- A pattern (a layer's attention to a token set at its peak, a series' final strength, a first-to-last change) is **beyond the
  uniform head** only where its excess in the data and the 2.5th percentile of its replicates both exceed
  :data:`~bertology.families.profile.analyzer.EXCESS_TOLERANCE`, the profile's own test for a label (:func:`excess_claim`).
- Layers whose values lie within that tolerance of the peak's tie with it (:func:`near_peak_span`): a peak decided by rounding
  is no peak.

So a series whose heads attend uniformly (to float noise) claims nothing: no verdict, no pattern that emerges.
"""

from __future__ import annotations

import numpy as np

from bertology.families.profile.analyzer import EXCESS_TOLERANCE


def interval(values: np.ndarray) -> tuple[float, float]:
    """The 2.5th-97.5th percentile of ``values`` (NaN ignored); NaN, NaN when none is a number."""
    values = values[np.isfinite(values)]
    return tuple(float(v) for v in np.percentile(values, [2.5, 97.5])) if values.size else (np.nan, np.nan)


def excess_claim(excess: np.ndarray) -> dict:
    """``excess [1 + B]`` (row 0 the data, then the replicates) -> ``{"excess", "low", "high", "beyond"}``: the data's excess,
    its 95% percentile interval and whether both the data and the interval's lower end exceed :data:`EXCESS_TOLERANCE` (no
    replicate, no interval: never beyond)."""
    low, high = interval(excess[1:])
    data = float(excess[0])
    return {"excess": data, "low": low, "high": high, "beyond": bool(data > EXCESS_TOLERANCE and low > EXCESS_TOLERANCE)}


def near_peak_span(layer_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``layer_values [layer, metric]`` (the data) -> the first and last layer, per metric, whose value lies within
    :data:`EXCESS_TOLERANCE` of the metric's largest: the layers its peak cannot be told from."""
    near = layer_values >= layer_values.max(axis=0) - EXCESS_TOLERANCE
    layers = np.arange(layer_values.shape[0])[:, None]
    return np.where(near, layers, layers.max()).min(axis=0), np.where(near, layers, 0).max(axis=0)


def described(claim: dict) -> str:
    """An :func:`excess_claim` in words: ``excess +0.123 (95% interval +0.100 to +0.150)``."""
    return f"excess {claim['excess']:+.3g} (95% interval {claim['low']:+.3g} to {claim['high']:+.3g})"


def rise_beyond_uniform(excess: np.ndarray) -> dict:
    """``excess [checkpoint, 1 + B]``, a series' excess over the uniform head at each checkpoint (paired replicates) ->
    ``excess_change_low`` (the lower end of its first-to-last rise's interval), ``final_excess`` and ``final_excess_low`` (its
    value at the last checkpoint), and ``beyond_uniform``: whether both the rise and the final value are beyond the uniform head
    (:func:`excess_claim`), as a pattern that emerges must be."""
    rise, final = excess_claim(excess[-1] - excess[0]), excess_claim(excess[-1])
    return {"excess_change_low": rise["low"], "final_excess": final["excess"], "final_excess_low": final["low"],
            "beyond_uniform": rise["beyond"] and final["beyond"]}


def not_beyond_words(series: dict) -> str:
    """Why a series of :func:`rise_beyond_uniform` is not beyond the uniform head, in words."""
    return (f"its rise and final value do not clear the uniform head's by {EXCESS_TOLERANCE:g} (final excess {series['final_excess']:+.3g}, "
            f"95% interval from {series['final_excess_low']:+.3g}; rise's interval from {series['excess_change_low']:+.3g})")
