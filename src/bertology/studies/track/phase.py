"""The phase change of induction heads (Olsson et al. 2022; METHODS.md section 15): whether a decoder's induction heads form
abruptly, in the window in which the in-context learning score drops and the loss shows a bump, from the induction probe's
scores at every checkpoint (:mod:`~bertology.studies.track.probe`: repeats at random periods and offsets, so that only content
predicts them) and the loss measured on the track corpus.

- **Heads** (:func:`probe_heads`, at each checkpoint): an **induction head** is a head of layer 1 or deeper (a layer-0 head has
  no head below it to compose with, so it is never one) whose induction score on the probe is at least the head-types
  family's mass (``--head-type-mass``), beyond the uniform head's on the same sequences (its excess and the excess's 2.5th
  percentile above the families' tolerance, :func:`~bertology.studies.track.verdicts.excess_claim`), at most periods (the median
  over the probe's periods of its mean score at each, at least that mass). A head that is none, whose score reaches that
  mass at some period, beyond the uniform head there, but not at most periods is **positional**: it copies by position, as
  a head trained on a fixed period does. A **previous-token head** puts that mass on the key before each query, beyond the
  uniform head. The previous-token head below an induction head is the strongest one in a layer under it: the pair that
  composes (Elhage et al. 2021).
- **Rise window** (:func:`rise_window`) of a series: from where it first covers 10% of its rise to where it first covers 90%
  (:func:`~bertology.studies.track.verdicts.crossing_steps`), bounded by the checkpoints that bracket those crossings (the one
  before the 10% crossing, the one at or after the 90%), in the data and in each paired bootstrap replicate; its interval is
  the 2.5th percentile of the replicates' lower brackets to the 97.5th of their upper (no replicate: the data's). A rise is
  **abrupt** where the 97.5th percentile of the replicates' bracketed spans is at most :data:`ABRUPT_SHARE` of the training
  steps between the first checkpoint and the last, **smooth** otherwise.
- **Loss bump** (:func:`loss_bump`): a falling loss without a phase change is convex (each stretch falls no faster than the one
  before); a bump is a plateau above its lower convex hull before a drop back to it. Its size is the largest height of the
  loss above the hull, as a share of the loss's whole fall (first checkpoint less the lowest); a bump is claimed where that
  share is at least :data:`BUMP_SHARE` in the data and in the 2.5th percentile of the replicates, and it lies from the
  checkpoint of that height to the next hull vertex (the drop), its interval over the replicates as the rise window's.
- **Verdict** (:func:`phase_verdict`): ``no evidence`` unless the strongest head of layer 1 or deeper at the last checkpoint
  is an induction head there and its score changes by the rule every verdict over training shares
  (:func:`~bertology.studies.track.verdicts.series_change`, beyond the uniform head); then ``smooth`` or ``abrupt`` by its
  rise window, and ``supported`` where it is abrupt and both the in-context learning score's drop (which must change too)
  and the loss bump lie in intervals that overlap the head's window.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.families.profile.analyzer import EXCESS_TOLERANCE
from bertology.studies.track.verdicts import (
    crossing_brackets,
    crossing_steps,
    excess_claim,
    interval,
    json_value,
    rise_beyond_uniform,
    series_change,
    why_no_change,
)

#: A rise is abrupt where its 10%-90% window spans at most this share of training (the checkpoints' first to last step).
ABRUPT_SHARE = 0.25
#: A loss bump is claimed where the loss rises above its lower convex hull by at least this share of its whole fall.
BUMP_SHARE = 0.1


def _bounds(lows: np.ndarray, highs: np.ndarray) -> tuple[float, float]:
    """A window's interval from its bounds in the data and the replicates (``[1 + B]`` each): the 2.5th percentile of the
    replicates' lower bounds to the 97.5th of their upper (no replicate: the data's)."""
    if len(lows) == 1:
        return float(lows[0]), float(highs[0])
    return float(np.percentile(lows[1:], 2.5, method="lower")), float(np.percentile(highs[1:], 97.5, method="higher"))


def rise_window(steps: np.ndarray, strength: np.ndarray) -> dict:
    """The 10%-90% rise window of ``strength [checkpoint, 1 + B]`` at ``steps`` (the module's rule): ``start`` and ``end``
    (interpolated, the data's; NaN where it does not rise), ``bracket_low``-``bracket_high`` (the data's checkpoints around
    them), ``low``-``high`` (the replicates' interval), ``span_high`` (the 97.5th percentile of the replicates' bracketed
    spans), ``span_share`` (that over the training steps) and ``abrupt``; a series' verdict holds them as ``window_*``."""
    start, end = (crossing_steps(steps, strength[:, 0], share) for share in (0.1, 0.9))
    low, _ = crossing_brackets(steps, strength, 0.1)
    _, high = crossing_brackets(steps, strength, 0.9)
    training = float(steps[-1] - steps[0])
    spans = (high - low)[1:]
    span_high = float(np.percentile(spans, 97.5, method="higher")) if spans.size else float(high[0] - low[0])
    window_low, window_high = _bounds(low, high)
    share = span_high / training if training > 0 else np.nan
    return {"start": float(start), "end": float(end), "bracket_low": float(low[0]), "bracket_high": float(high[0]),
            "low": window_low, "high": window_high, "span_high": span_high, "span_share": float(share),
            "abrupt": bool(np.isfinite(start) and share <= ABRUPT_SHARE)}


def _hull_heights(steps: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``loss [checkpoint]``'s height above its lower convex hull at each checkpoint, and the hull's vertices (indices)."""
    hull: list[int] = []
    for k in range(len(steps)):
        while len(hull) >= 2:
            (a, b), c = hull[-2:], k  # drop b where it lies on or above the chord from a to c
            if (loss[b] - loss[a]) * (steps[c] - steps[a]) >= (loss[c] - loss[a]) * (steps[b] - steps[a]):
                hull.pop()
            else:
                break
        hull.append(k)
    return loss - np.interp(steps, steps[hull], loss[hull]), np.array(hull)


def _bump_of(steps: np.ndarray, loss: np.ndarray) -> tuple[float, float, float]:
    """One loss series' bump: (its height above the hull over the whole fall, the step of that height, the next hull vertex's)."""
    heights, vertices = _hull_heights(steps, loss)
    fall = loss[0] - loss.min()
    k = int(heights.argmax())
    after = vertices[vertices >= k]
    return (float(heights[k] / fall) if fall > 0 else 0.0), float(steps[k]), float(steps[after[0]])


def loss_bump(steps: np.ndarray, loss: np.ndarray) -> dict:
    """The loss bump of ``loss [checkpoint, 1 + B]`` (the module's rule): ``share`` (the data's height over the fall) and its
    2.5th percentile ``share_low``, ``peak_step`` and ``end_step`` (the data's drop), ``window_low``-``window_high``, and
    ``bump``; no bump where a replicate is NaN throughout or there are fewer than three checkpoints."""
    finite = np.isfinite(loss).all(axis=0)
    if len(steps) < 3 or not finite[0]:
        return {"share": np.nan, "share_low": np.nan, "peak_step": np.nan, "end_step": np.nan, "window_low": np.nan, "window_high": np.nan,
                "bump": False}
    bumps = np.array([_bump_of(steps, loss[:, b]) for b in range(loss.shape[1]) if finite[b]])  # [1 + B', 3]
    share_low = float(np.percentile(bumps[1:, 0], 2.5)) if len(bumps) > 1 else float(bumps[0, 0])
    window_low, window_high = _bounds(bumps[:, 1], bumps[:, 2])
    return {"share": float(bumps[0, 0]), "share_low": share_low, "peak_step": float(bumps[0, 1]), "end_step": float(bumps[0, 2]),
            "window_low": window_low, "window_high": window_high, "bump": bool(min(bumps[0, 0], share_low) >= BUMP_SHARE)}


def probe_heads(step: int | None, probe, mass: float) -> pd.DataFrame:
    """One checkpoint's heads on the induction probe (a :class:`~bertology.studies.track.probe.ProbeResult`), named by the
    module's rules at ``mass``: ``step, layer, head, induction, induction_low, induction_high, previous, previous_low,
    previous_high, best_period, best_period_score, median_period_score, role`` (``induction``, ``previous-token``,
    ``positional`` or empty, in that precedence)."""
    layers, heads = probe.induction.shape[1:]
    rows = []
    for layer in range(layers):
        for head in range(heads):
            induction, previous = probe.induction[:, layer, head], probe.previous[:, layer, head]
            by_period = probe.period_scores[:, layer, head]
            best = int(by_period.argmax()) if by_period.size else None
            median = float(np.median(by_period)) if by_period.size else np.nan
            induction_head = (layer >= 1 and induction[0] >= mass and median >= mass
                              and excess_claim(probe.induction_excess[:, layer, head])["beyond"])
            previous_head = previous[0] >= mass and excess_claim(probe.previous_excess[:, layer, head])["beyond"]
            positional = (best is not None and by_period[best] >= mass and probe.period_excess[best, layer, head] > EXCESS_TOLERANCE
                          and not median >= mass)
            role = "induction" if induction_head else "previous-token" if previous_head else "positional" if positional else ""
            rows.append((step, layer, head, induction[0], *interval(induction[1:]), previous[0], *interval(previous[1:]),
                         None if best is None else int(probe.periods[best]), np.nan if best is None else float(by_period[best]), median, role))
    return pd.DataFrame(rows, columns=["step", "layer", "head", "induction", "induction_low", "induction_high", "previous", "previous_low",
                                       "previous_high", "best_period", "best_period_score", "median_period_score", "role"])


CLAIM = ("Induction heads form abruptly, in layer 1 or deeper, in the window of training in which the in-context learning score "
         "drops and the loss shows a bump (Olsson et al. 2022's phase change).")


def _plain(values: dict) -> dict:
    """``values`` as verdict.json holds them (NaN as null)."""
    return {key: json_value(value) for key, value in values.items()}


def _series(probes: list, member: str, layer: int, head: int) -> np.ndarray:
    """``[checkpoint, 1 + B]``: one head's ``member`` (``induction``, ``previous`` or their ``_excess``) over the probes."""
    return np.stack([getattr(probe, member)[:, layer, head] for probe in probes])


def _followed_head(steps: np.ndarray, probes: list, heads: pd.DataFrame, role: str, layer: int, head: int) -> dict:
    """One head's series of ``role`` (``induction`` or ``previous``) over training: its change
    (:func:`~bertology.studies.track.verdicts.series_change`, beyond the uniform head) and rise window."""
    series = _series(probes, role, layer, head)
    change = series_change(steps, series, rise_beyond_uniform(_series(probes, f"{role}_excess", layer, head)))
    named = heads[(heads.layer == layer) & (heads["head"] == head)].role.iloc[0]
    return _windowed({"layer": layer, "head": head, "role_at_last": named, **change}, rise_window(steps, series))


def _windowed(series: dict, window: dict) -> dict:
    """A series' verdict with its rise window (:func:`rise_window`) as ``window_*``, in verdict.json's values."""
    return _plain({**series, **{f"window_{key}": value for key, value in window.items()}})


def _overlap(a: dict, b: dict) -> bool:
    """Whether two windows' intervals (``window_low``-``window_high``) overlap."""
    low_a, high_a, low_b, high_b = a["window_low"], a["window_high"], b["window_low"], b["window_high"]
    return None not in (low_a, high_a, low_b, high_b) and low_a <= high_b and low_b <= high_a


def phase_verdict(steps: list[int], probes: list, loss: np.ndarray | None, mass: float) -> dict:
    """The verdict of the module's docstring from each checkpoint's :class:`~bertology.studies.track.probe.ProbeResult`
    (``probes``, in training order), the loss on the track corpus ``loss [checkpoint, 1 + B]`` (None: not measured) and the
    head-types family's ``mass``."""
    result = {"claim": CLAIM, "steps": [None if s is None else int(s) for s in steps], "verdict": "no evidence", "mass": mass,
              "abrupt_share": ABRUPT_SHARE, "bump_share": BUMP_SHARE}
    if len(steps) < 2:
        return {**result, "verdict": "not applicable", "statement": "One checkpoint: there is no training series."}
    steps_array = np.asarray(steps)
    heads = probe_heads(steps[-1], probes[-1], mass)
    result["named_heads"] = [_plain(row._asdict()) for row in heads[heads.role != ""].drop(columns="step").itertuples(index=False)]
    if heads.layer.max() < 1:
        return {**result, "statement": "One layer: no head has a head below it to compose with, so none is an induction head; no claim."}
    deep = heads[heads.layer >= 1]
    chosen = deep.loc[deep.induction.idxmax()]
    result["induction_head"] = head = _followed_head(steps_array, probes, heads, "induction", int(chosen.layer), int(chosen["head"]))
    below = heads[heads.layer < head["layer"]]
    partner = below.loc[below.previous.idxmax()]
    result["previous_token_head"] = previous = _followed_head(steps_array, probes, heads, "previous", int(partner.layer), int(partner["head"]))
    previous["rises"] = ("does not rise" if not previous["changes"] or previous["ci_low"] is None or head["ci_high"] is None
                         else "before or with it" if previous["ci_low"] <= head["ci_high"] else "after it")
    if all(probe.icl is not None for probe in probes):
        drop = -np.stack([probe.icl for probe in probes])
        result["icl_drop"] = _windowed(series_change(steps_array, drop, {"beyond_uniform": None}), rise_window(steps_array, drop))
    if loss is not None:
        result["loss_bump"] = _plain(loss_bump(steps_array, loss))
    result["verdict"] = _phase_word(result)
    result["statement"] = _phase_statement(result, heads)
    return result


def _phase_word(result: dict) -> str:
    """``no evidence``, ``smooth``, ``abrupt`` or ``supported`` (the module's rule) from :func:`phase_verdict`'s parts."""
    head = result["induction_head"]
    if not (head["changes"] and head["role_at_last"] == "induction"):
        return "no evidence"
    if not head["window_abrupt"]:
        return "smooth"
    drop, bump = result.get("icl_drop"), result.get("loss_bump")
    together = (drop is not None and drop["changes"] and _overlap(head, drop) and bump is not None and bump["bump"] and _overlap(head, bump))
    return "supported" if together else "abrupt"


def _window_words(series: dict) -> str:
    """A series' rise window (``window_*``) in words."""
    w = {key.removeprefix("window_"): value for key, value in series.items() if key.startswith("window_")}
    if w["start"] is None:
        return "no rise window (it does not rise)"
    return (f"its 10%-90% rise runs from step {w['start']:.0f} to {w['end']:.0f} (between checkpoints {w['bracket_low']:.0f} and "
            f"{w['bracket_high']:.0f}; in 95% of the replicates within {w['low']:.0f}-{w['high']:.0f}, spanning at most "
            f"{w['span_high']:.0f} steps, {w['span_share']:.0%} of training)")


def _change_words(name: str, series: dict, verb: str) -> str:
    """A followed series' change (and why it is not one) in words."""
    text = (f"{name} goes from {series['first']:.3f} to {series['final']:.3f} (change {series['change']:+.3f}, 95% interval "
            f"{series['change_low']:+.3f} to {series['change_high']:+.3f})")
    if series["half_step"] is not None:
        text += f", half of it by step {series['half_step']:.0f} (95% interval {series['ci_low']:.0f}-{series['ci_high']:.0f})"
    return text + ("" if series["changes"] else why_no_change({key: np.nan if value is None else value for key, value in series.items()}, verb))


def _phase_statement(result: dict, heads: pd.DataFrame) -> str:
    """:func:`phase_verdict`'s parts in words, ending on its verdict."""
    head, previous = result["induction_head"], result["previous_token_head"]
    words = [_change_words(f"on the induction probe, head {head['layer']}-{head['head']} (the strongest of layer 1 or deeper at the last "
                           "checkpoint)", head, "forms")]
    if head["role_at_last"] != "induction":
        words.append(f"it is no induction head at the last checkpoint (named {head['role_at_last'] or 'nothing'}: an induction head scores at "
                     f"least {result['mass']:g} at most periods, beyond the uniform head)")
    words.append(_window_words(head) + (f": abrupt (at most {ABRUPT_SHARE:.0%})" if head["window_abrupt"] else
                                        f": not abrupt (more than {ABRUPT_SHARE:.0%})"))
    words.append(_change_words(f"the previous-token head below it, {previous['layer']}-{previous['head']},", previous, "rises")
                 + f"; it rises {previous['rises']}" if previous["changes"] else
                 _change_words(f"the previous-token head below it, {previous['layer']}-{previous['head']},", previous, "rises"))
    drop = result.get("icl_drop")
    if drop is not None:
        words.append(_change_words("the in-context learning score's drop on the probe", drop, "drops") + "; " + _window_words(drop)
                     + ("; it overlaps the head's" if _overlap(head, drop) else "; it does not overlap the head's"))
    bump = result.get("loss_bump")
    if bump is None:
        words.append("no loss is measured on the track corpus: no loss bump to place")
    elif bump["share"] is None:
        words.append("too few checkpoints to place a loss bump")
    else:
        words.append(f"the loss on the track corpus rises above its convex hull by {bump['share']:.0%} of its fall (2.5th percentile "
                     f"{bump['share_low']:.0%}) at step {bump['peak_step']:.0f}, back on it by step {bump['end_step']:.0f} (95% within "
                     f"{bump['window_low']:.0f}-{bump['window_high']:.0f}): " + (("a bump" + ("" if _overlap(head, bump) else
                                                                                          ", not in the head's window"))
                                                                                         if bump["bump"] else f"no bump (at least {BUMP_SHARE:.0%})"))
    shallow = heads[(heads.layer == 0) & (heads.role == "positional")]
    words += [f"head 0-{row.head} is positional ({row.best_period_score:.2f} at period {row.best_period}, median {row.median_period_score:.2f} "
              "over periods), never an induction head" for row in shallow.itertuples()]
    return "; ".join(words) + f": {result['verdict']}."
