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
- A series over training, ``strength [checkpoint, 1 + B]`` with paired replicates, **changes** (:func:`series_change`: a pattern
  that emerges, induction heads that form, an in-context learning score that drops) only where the 95% interval of its
  first-to-last change lies above 0, it clears the uniform head where it has one (:func:`rise_beyond_uniform`) and its
  half-rise step (:func:`crossing_steps`: where it first covers half of its rise, ``first + (final - first) / 2``,
  interpolated linearly in ``ln(1 + step)``) is located more narrowly than the run.

So a series whose heads attend uniformly (to float noise) claims nothing: no verdict, no pattern that emerges.
:func:`json_value` gives the verdicts' numbers as ``verdict.json`` holds them.
"""

from __future__ import annotations

import numpy as np

from bertology.families.profile.analyzer import EXCESS_TOLERANCE


def json_value(value):
    """Plain Python values for verdict.json: NaN (a pattern that never rises) becomes null."""
    if isinstance(value, (float, np.floating)):
        return None if np.isnan(value) else float(value)
    return value.item() if isinstance(value, np.generic) else value


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


def _crossing_index(strength: np.ndarray, share: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``strength [checkpoint, ...]`` -> (the target ``first + share x (final - first)``, by default the half rise, whether
    the series rises (final > first), the index of the first checkpoint at or above the target; 1 where it does not rise)."""
    first, final = strength[0], strength[-1]
    target = first + share * (final - first)
    rises = final > first
    above = strength >= target[None]
    return target, rises, np.where(rises, above.argmax(axis=0), 1)  # never 0 when it rises


def crossing_steps(steps: np.ndarray, strength: np.ndarray, share: float = 0.5) -> np.ndarray:
    """Where each series first covers half of its rise (``share`` of it: 0.1 and 0.9 bound a rise's window,
    :mod:`~bertology.studies.track.phase`), interpolated in ``ln(1 + step)``.

    ``strength [checkpoint, ...]`` -> ``[...]`` steps; NaN where the series does not rise
    (final <= first).
    """
    target, rises, k = _crossing_index(strength, share)
    before = np.take_along_axis(strength, (k - 1)[None], axis=0)[0]
    after = np.take_along_axis(strength, k[None], axis=0)[0]
    x = np.log1p(steps.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.clip((target - before) / (after - before), 0.0, 1.0)
    crossed = np.expm1(x[k - 1] + share * (x[k] - x[k - 1]))
    return np.where(rises, crossed, np.nan)


def crossing_brackets(steps: np.ndarray, strength: np.ndarray, share: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoints' steps that bracket each series' half-rise crossing (of ``share`` of its rise): the one before it and
    the one at or after it; where a series does not rise (or is NaN), the whole run (the first and the last checkpoint)."""
    _, rises, k = _crossing_index(strength, share)
    rises = rises & np.isfinite(strength).all(axis=0)
    steps = np.asarray(steps)
    return np.where(rises, steps[k - 1], steps[0]), np.where(rises, steps[k], steps[-1])


def series_change(steps: np.ndarray, strength: np.ndarray, beyond: dict) -> dict:
    """Whether one series changes over training (the module's rule), from ``strength [checkpoint, 1 + B]`` (row 0 the data, then
    the paired replicates) at ``steps``, and what it rests on: ``first``, ``final``, ``change`` and its 95% interval
    ``change_low``-``change_high``; the half-rise step ``half_step`` (:func:`crossing_steps`; NaN where it does not rise) and
    its 95% interval ``ci_low``-``ci_high``; ``located_low``-``located_high``, the checkpoints that bracket the crossing in the
    replicates (:func:`crossing_brackets`), from the 2.5th percentile of the lower to the 97.5th of the upper (no replicate:
    the whole run), and ``located``, whether they span less than the run (with two checkpoints they never do); then the
    fields of ``beyond``, the series' comparison with the uniform head (:func:`rise_beyond_uniform`; ``beyond_uniform`` None
    where it has no uniform head, as a loss has not), and ``changes``: the change's interval lies above 0, the series is not
    short of the uniform head, and its half-rise step is located."""
    crossed = crossing_steps(steps, strength)  # [1 + B]
    point = float(crossed[0])
    low, high = interval(crossed[1:])
    change_low, change_high = interval(strength[-1, 1:] - strength[0, 1:])
    if strength.shape[1] > 1:
        lows, highs = crossing_brackets(steps, strength[:, 1:])
        located_low = float(np.percentile(lows, 2.5, method="lower"))
        located_high = float(np.percentile(highs, 97.5, method="higher"))
    else:
        located_low, located_high = float(steps[0]), float(steps[-1])
    located = bool(np.isfinite(point)) and not (located_low <= steps[0] and located_high >= steps[-1])
    return {"first": float(strength[0, 0]), "final": float(strength[-1, 0]), "change": float(strength[-1, 0] - strength[0, 0]),
            "change_low": change_low, "change_high": change_high, "half_step": point, "ci_low": low, "ci_high": high,
            "located_low": located_low, "located_high": located_high, **beyond, "located": located,
            "changes": bool(change_low > 0) and beyond["beyond_uniform"] is not False and located}


def why_no_change(series: dict, verb: str) -> str:
    """Why a series of :func:`series_change` does not change, in words."""
    why = [] if series["change_low"] > 0 else ["the change's interval does not exclude 0"]
    if series["beyond_uniform"] is False:
        why.append(not_beyond_words(series))
    if not series["located"]:
        why.append("its half-rise step is not located more narrowly than the run")
    return f": no evidence that it {verb} ({' and '.join(why)})"
