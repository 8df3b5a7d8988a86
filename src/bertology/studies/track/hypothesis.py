"""The verdict on the learning-curve hypothesis from head behaviour tracked over checkpoints.

The hypothesis (docs/methods.md#track-and-the-learning-curve-verdict): heads pass through phases, over depth and over
pre-training. Broad and [CLS] attention come early, [SEP] and dependency relations in the middle,
punctuation deep. :func:`~bertology.studies.track.dynamics.track` runs the general profile (Clark et al. 2019), the role tests
(Pande et al. 2021) and, with trees, the syntactic heads over a series of checkpoints on one
corpus, and :func:`hypothesis_verdict` tests two claims:

1. **Depth** (final checkpoint): with ``m_l`` the mean over sequences of layer l's attention to a
   token set (a sequence's layer value is the mean of its heads), the layer ``argmax_l m_l`` of
   [CLS] is below that of [SEP], which is below that of punctuation. Uncertainty: the Poisson
   bootstrap over sequences (:class:`~bertology.studies.track.peaks.LayerPeaks`); the statistic is the
   share of replicates in which the whole order holds.
2. **Training** (two or more checkpoints): each pattern's strength at step s is
   ``max_l m_l(s)``. Its half-rise step is where it first covers half of its rise,
   ``first + (final - first) / 2`` (a random network already attends uniformly, so "half its final
   value" is measured above that starting point), interpolated linearly in ``ln(1 + step)``
   between checkpoints. A pattern **emerges** where its series changes by the rule every verdict over training shares
   (:func:`~bertology.studies.track.verdicts.series_change`): the 95% interval of its first-to-last change (paired
   replicates) excludes 0, it rises and ends beyond the uniform head on the same sequences
   (:mod:`~bertology.studies.track.verdicts`) and its half-rise step is located more narrowly than the run (:func:`emergence_verdict`);
   else there is "no evidence" that it does, and the order is not judged (verdict ``no evidence``). The order
   [CLS] before [SEP] before punctuation is tested on paired replicates (the same sequence weights at every
   checkpoint). With trees, the mean over relations of the best head's accuracy (Clark et al.'s syntactic heads) is
   tracked the same way.

On a decoder (docs/methods.md#decoders; e.g. ``bertology pretrain --causal``) [SEP] has no meaning and the first token,
the candidate attention sink, takes [CLS]'s place (:func:`~bertology.studies.track.peaks.peak_metrics`): the
claims become "first-token attention peaks below punctuation" and "it emerges before punctuation", and ``Sink_eps``
(Gu et al. 2025, "When Attention Sink Emerges in Language Models"), the share of heads whose mean attention to the first
token exceeds eps and the uniform head's on the same sequences (:mod:`~bertology.studies.track.sinks`), is followed per layer
and overall over the checkpoints.

Two patterns **tie** when they peak in the same layer (emerge at the same step) or their 95% intervals overlap. A claim
is **contradicted** when a pair is reversed in the data, with intervals apart, in at least 95% of the replicates; else a
**tie** when a pair ties; else **supported** when the order holds in the data and in at least 95% of the replicates;
else **inconclusive** (:func:`_order_verdict`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.model.kinds import Kind
from bertology.families.profile.analyzer import EXCESS_TOLERANCE
from bertology.studies.track.peaks import peak_layers, peak_metrics
from bertology.studies.track.verdicts import (
    crossing_steps,
    described,
    excess_claim,
    json_value,
    near_peak_span,
    not_beyond_words,
    rise_beyond_uniform,
    series_change,
)

LEVEL = 0.95
METRIC_NAMES = {"cls": "[CLS]", "sep": "[SEP]", "first": "the first token", "punct": "punctuation",
                "syntax": "dependency relations (best head per relation)"}
#: The two claims (depth, training) by the kind of model: on an encoder's token sets and on a decoder's (:func:`peak_metrics`).
CLAIMS = {
    "encoder": ("In the final model the layer where [CLS] attention peaks is below the layer where [SEP] peaks, "
                   "which is below the layer where punctuation peaks.",
                   "Over training, [CLS] attention emerges before [SEP] attention, which emerges before attention to punctuation."),
    "decoder": ("In the final decoder the layer where attention to the first token (the candidate attention sink) peaks is "
                           "below the layer where attention to punctuation peaks.",
                           "Over training, attention to the first token (the attention sink) emerges before attention to punctuation."),
}


def _order_verdict(data: np.ndarray, replicates: np.ndarray, intervals: list[tuple[float, float]]) -> tuple[str, list[dict]]:
    """The verdict on an order ``data[0] < data[1] < ...`` (peak layers or half-rise steps) with ``replicates [B, k]`` and each
    value's 95% interval ``intervals[k]``; and, per adjacent pair, what it rests on.

    A pair is a **tie** when its two values are equal in the data or their intervals overlap (the order cannot be told).
    The verdict is **contradicted** when some pair is reversed in the data, with intervals apart, and reversed in at least 95%
    of the replicates; else **tie** when some pair ties; else **supported** when the whole order holds in the data and in at
    least 95% of the replicates; else **inconclusive**.
    """
    pairs = []
    for i in range(len(data) - 1):
        (low_a, high_a), (low_b, high_b) = intervals[i], intervals[i + 1]
        overlap = bool(high_a >= low_b and high_b >= low_a)
        state = "tie" if data[i] == data[i + 1] or overlap else ("<" if data[i] < data[i + 1] else ">")
        reversed_share = float((replicates[:, i] > replicates[:, i + 1]).mean()) if len(replicates) else float("nan")
        pairs.append({"state": state, "reversed_share": reversed_share})
    holds = bool(_in_order(data))
    probability = float(_in_order(replicates).mean()) if len(replicates) else float("nan")
    if any(p["state"] == ">" and p["reversed_share"] >= LEVEL for p in pairs):
        return "contradicted", pairs
    if any(p["state"] == "tie" for p in pairs):
        return "tie", pairs
    if holds and probability >= LEVEL:
        return "supported", pairs
    return "inconclusive", pairs


def _in_order(values: np.ndarray) -> np.ndarray:
    """``values [..., k]`` -> True where ``values[..., 0] < values[..., 1] < ...`` (NaN never in order)."""
    return np.all(np.diff(values, axis=-1) > 0, axis=-1)


def _order(metrics: tuple[str, ...]) -> str:
    """``[CLS] < [SEP] < punctuation`` (a decoder's ``first token < punctuation``): the order a claim tests."""
    return " < ".join(METRIC_NAMES[metric].removeprefix("the ") for metric in metrics)


def depth_verdict(means: np.ndarray, kind: Kind, step: int | None = None, checkpoint: str | None = None, *, excess: np.ndarray) -> dict:
    """Claim 1 on a ``kind`` of model from ``means [1 + B, layer, metric]`` (the metrics :func:`peak_metrics` of ``kind``;
    row 0 is the data) and ``excess`` (the same shape: the layer means' excess over the uniform head on the same sequences,
    :meth:`~bertology.studies.track.peaks.LayerPeaks.replicate_excess`).

    The order is judged (:func:`_order_verdict`) only where every pattern is beyond the uniform head in its peak layer
    (:func:`~bertology.studies.track.verdicts.excess_claim`), else ``no evidence``; a layer within the families' tolerance of
    a peak ties with it (:func:`~bertology.studies.track.verdicts.near_peak_span`)."""
    metrics = peak_metrics(kind)
    peaks = peak_layers(means, metrics)
    rows = list(peaks.itertuples())
    replicate_peaks = means[1:].argmax(axis=1)
    holds = bool(_in_order(peaks.peak_layer.to_numpy()))
    probability = float(_in_order(replicate_peaks).mean())
    pairwise = {f"{a}<{b}": float((replicate_peaks[:, i] < replicate_peaks[:, i + 1]).mean())
                for i, (a, b) in enumerate(zip(metrics, metrics[1:]))}
    span_low, span_high = near_peak_span(means[0])
    intervals = [(min(r.ci_low, low), max(r.ci_high, high)) for r, low, high in zip(rows, span_low, span_high)]
    claims = [excess_claim(excess[:, r.peak_layer, k]) for k, r in enumerate(rows)]
    beyond = all(claim["beyond"] for claim in claims)
    verdict, pairs = _order_verdict(peaks.peak_layer.to_numpy(), replicate_peaks, intervals) if beyond else ("no evidence", [])
    where = ", ".join(
        f"{METRIC_NAMES[r.metric]} peaks in layer {r.peak_layer} (95% interval {low:.0f}-{high:.0f}, mean attention {means[0, r.peak_layer, k]:.3f}, "
        f"{described(claims[k])} over the uniform head)" for k, (r, (low, high)) in enumerate(zip(rows, intervals))
    )
    ties = [f"{METRIC_NAMES[a.metric]} and {METRIC_NAMES[b.metric]} tie ("
            + (f"both peak in layer {a.peak_layer}" if a.peak_layer == b.peak_layer
               else f"intervals {interval_a[0]:.0f}-{interval_a[1]:.0f} and {interval_b[0]:.0f}-{interval_b[1]:.0f} overlap")
            + ")" for a, b, interval_a, interval_b, pair in zip(rows, rows[1:], intervals, intervals[1:], pairs) if pair["state"] == "tie"]
    unclaimed = [f"{METRIC_NAMES[r.metric]} is no more than the uniform head's in layer {r.peak_layer} (tolerance {EXCESS_TOLERANCE:g})"
                 for r, claim in zip(rows, claims) if not claim["beyond"]]
    return {
        "claim": CLAIMS[kind.name][0],
        "step": step,
        "checkpoint": checkpoint,
        "peaks": {r.metric: {"layer": int(r.peak_layer), "ci_low": float(low), "ci_high": float(high), "agreement": float(r.agreement),
                             "value": float(means[0, r.peak_layer, k]), "excess": json_value(claims[k]["excess"]),
                             "excess_ci_low": json_value(claims[k]["low"]), "beyond_uniform": claims[k]["beyond"]}
                  for k, (r, (low, high)) in enumerate(zip(rows, intervals))},
        "layer_means": {metric: means[0, :, k].round(4).tolist() for k, metric in enumerate(metrics)},
        "order_holds": holds,
        "probability": probability,
        "pairwise_probability": pairwise,
        "pairs": {f"{a}<{b}": pair["state"] for (a, b), pair in zip(zip(metrics, metrics[1:]), pairs)},
        "replicates": int(len(means) - 1),
        "verdict": verdict,
        "statement": f"{where} (layers 0-based). The order {_order(metrics)} holds in {probability:.1%} of "
                     f"{len(means) - 1} bootstrap replicates over sequences" + "".join(f"; {words}" for words in ties + unclaimed)
                     + (": no evidence on the order." if unclaimed else f": {verdict}."),
    }


def emergence_verdict(steps: list[int], strength: np.ndarray, kind: Kind, syntax: bool = False, *, excess: np.ndarray) -> tuple[dict, pd.DataFrame]:
    """Claim 2 on a ``kind`` of model from ``strength [checkpoint, 1 + B, metric]``; the metrics are :func:`peak_metrics`
    of ``kind``, then, with ``syntax``, ``syntax``; ``excess [checkpoint, 1 + B, metric of peak_metrics]``: each pattern's
    strongest layer's excess over the uniform head on the same sequences.

    A pattern **emerges** only when its series changes (:func:`~bertology.studies.track.verdicts.series_change`): (a) the 95%
    interval of its first-to-last change (paired bootstrap replicates: ``strength[-1, b] - strength[0, b]``) lies above 0, (b)
    its excess over the uniform head rises, and ends, beyond the families' tolerance
    (:func:`~bertology.studies.track.verdicts.rise_beyond_uniform`; the syntax row, an accuracy the uniform head is not scored
    on here, needs its change beyond that tolerance) and (c) its half-rise step is located more narrowly than the run: the
    checkpoints that bracket the crossing in the replicates (a replicate that does not rise: the whole run), from the 2.5th
    percentile of the lower to the 97.5th of the upper, do not span from the first checkpoint to the last (with two
    checkpoints they always do). Otherwise the table says ``no evidence``. The order of the claim is judged
    (:func:`_order_verdict`, on the half-rise steps and their 95% intervals) only when every one of its patterns emerges;
    else the verdict is ``no evidence``.

    Returns the verdict and a table ``metric, first, final, change, change_low, change_high, emerges, half_step, ci_low,
    ci_high, bracket_low, bracket_high, located_low, located_high, excess_change_low, final_excess, final_excess_low,
    beyond_uniform``.
    """
    peak_metrics_ = peak_metrics(kind)
    metrics = (*peak_metrics_, *(("syntax",) if syntax else ()))
    steps_array = np.asarray(steps)
    table = pd.DataFrame([_emergence_row(metric, steps_array, strength[:, :, k], excess[:, :, k] if k < len(peak_metrics_) else None)
                          for k, metric in enumerate(metrics)])
    crossed = crossing_steps(steps_array, strength)  # [1 + B, metric]
    emerged = bool((table.emerges.iloc[: len(peak_metrics_)] == "yes").all())
    result = _emergence_order(table, crossed[:, : len(peak_metrics_)], kind, steps, emerged)
    if syntax:
        _syntax_between(result, table, crossed, peak_metrics_, emerged)
    return result, table


def _emergence_row(metric: str, steps: np.ndarray, strength: np.ndarray, excess: np.ndarray | None) -> dict:
    """One row of :func:`emergence_verdict`'s table from a pattern's ``strength [checkpoint, 1 + B]`` and its ``excess`` over the
    uniform head (the same shape; None for the syntax row, whose first-to-last change must clear the tolerance instead)."""
    beyond = (rise_beyond_uniform(excess) if excess is not None else
              {"excess_change_low": np.nan, "final_excess": np.nan, "final_excess_low": np.nan,
               "beyond_uniform": excess_claim(strength[-1] - strength[0])["beyond"]})
    series = series_change(steps, strength, beyond)
    point = series["half_step"]
    # the checkpoint at or after the crossing (rounded: exp(log(s)) may land a hair above a checkpoint's own step)
    after = int(np.searchsorted(steps, round(point, 6))) if np.isfinite(point) else None
    return {"metric": metric, **{key: series[key] for key in ("first", "final", "change", "change_low", "change_high")},
            "emerges": "yes" if series["changes"] else "no evidence", **{key: series[key] for key in ("half_step", "ci_low", "ci_high")},
            "bracket_low": int(steps[after - 1]) if after else None, "bracket_high": int(steps[after]) if after else None,
            **{key: series[key] for key in ("located_low", "located_high", *beyond)}}


def _emergence_order(table: pd.DataFrame, crossed: np.ndarray, kind: Kind, steps: list[int], emerged: bool) -> dict:
    """Claim 2's verdict on the order of the patterns of :func:`peak_metrics` from their half-rise steps ``crossed [1 + B,
    metric]`` and :func:`emergence_verdict`'s ``table``; judged only where every one of them ``emerged``."""
    peak_metrics_ = peak_metrics(kind)
    holds = bool(_in_order(crossed[0]))
    probability = float(_in_order(crossed[1:]).mean()) if crossed.shape[0] > 1 else float("nan")
    if emerged:
        verdict, pairs = _order_verdict(crossed[0], crossed[1:], [(r.ci_low, r.ci_high) for r in table.iloc[: len(peak_metrics_)].itertuples()])
    else:
        verdict, pairs = "no evidence", []
    ties = [f"{METRIC_NAMES[a]} and {METRIC_NAMES[b]} tie (half-rise intervals overlap)"
            for (a, b), pair in zip(zip(peak_metrics_, peak_metrics_[1:]), pairs) if pair["state"] == "tie"]
    if emerged:
        ending = (f". The order {_order(peak_metrics_)} holds in {probability:.1%} of {crossed.shape[0] - 1} paired bootstrap replicates"
                  + (f"; {'; '.join(ties)}" if ties else "") + f": {verdict}.")
    else:
        ending = f". Not every pattern of the order {_order(peak_metrics_)} emerges: no evidence on the order."
    return {
        "claim": CLAIMS[kind.name][1],
        "steps": [int(s) for s in steps],
        "strength": "max over layers of the layer mean; emerged = the step where it first covers half of its rise from the first checkpoint",
        "patterns": {row.metric: {k: json_value(v) for k, v in row._asdict().items() if k not in ("Index", "metric")} for row in table.itertuples()},
        "order_holds": holds,
        "probability": json_value(probability),
        "pairs": {f"{a}<{b}": pair["state"] for (a, b), pair in zip(zip(peak_metrics_, peak_metrics_[1:]), pairs)},
        "replicates": int(crossed.shape[0] - 1),
        "verdict": verdict,
        "statement": "; ".join(_described_emergence(row, steps) for row in table.itertuples()) + ending,
    }


def _syntax_between(result: dict, table: pd.DataFrame, crossed: np.ndarray, peak_metrics_: tuple[str, ...], emerged: bool) -> None:
    """Add to claim 2's ``result`` the share of the replicates in which the dependency heads' half-rise step ``crossed[:, -1]``
    falls between the first pattern's and punctuation's, and say so where they emerge too."""
    k = table.metric.tolist().index("syntax")
    last = len(peak_metrics_) - 1  # punctuation
    between = _in_order(np.stack([crossed[1:, 0], crossed[1:, k], crossed[1:, last]], axis=-1))
    result[f"syntax_between_{peak_metrics_[0]}_and_punct_probability"] = float(between.mean()) if between.size else None
    if emerged and table.emerges.iloc[k] == "yes":
        result["statement"] += (f" Dependency heads emerge between {METRIC_NAMES[peak_metrics_[0]]} and punctuation in "
                                f"{between.mean():.1%} of the replicates.")


def _described_emergence(row, steps: list[int]) -> str:
    """A row of :func:`emergence_verdict`'s table in words: its change, where it crosses half of it, and that it emerges or why not."""
    change = (f"{METRIC_NAMES[row.metric]} goes from {row.first:.3f} at step {steps[0]} to {row.final:.3f} at step {steps[-1]} "
              f"(change {row.change:+.3f}, 95% interval {row.change_low:+.3f} to {row.change_high:+.3f})")
    if np.isfinite(row.half_step):
        change += (f", crosses half of that rise at step {row.half_step:.0f} (95% interval {row.ci_low:.0f}-{row.ci_high:.0f}; "
                   f"between checkpoints {row.bracket_low:.0f} and {row.bracket_high:.0f}, in 95% of the replicates between "
                   f"{row.located_low:.0f} and {row.located_high:.0f})")
    if row.emerges == "yes":
        return change + ": it emerges"
    why = []
    if not row.change_low > 0:
        why.append("the change's interval does not exclude 0" if row.change_high >= 0 or np.isnan(row.change_high) else "it falls")
    if not row.beyond_uniform:
        why.append(not_beyond_words(row._asdict()) if np.isfinite(row.final_excess) else f"its change does not clear {EXCESS_TOLERANCE:g}")
    if not (np.isfinite(row.half_step) and not (row.located_low <= steps[0] and row.located_high >= steps[-1])):
        why.append("its half-rise step is not located more narrowly than the run")
    return change + f": no evidence that it emerges ({' and '.join(why)})"


def hypothesis_verdict(steps: list[int], checkpoints: list[str], means: np.ndarray, kind: Kind,
                       syntax: np.ndarray | None = None, *, excess: np.ndarray) -> tuple[dict, pd.DataFrame | None]:
    """Both claims on a ``kind`` of model from ``means [checkpoint, 1 + B, layer, metric]`` (the metrics :func:`peak_metrics`
    of ``kind``), their ``excess`` over the uniform head (the same shape) and optionally ``syntax [checkpoint, 1 + B]``."""
    verdict = {"depth": depth_verdict(means[-1], kind, step=steps[-1], checkpoint=checkpoints[-1], excess=excess[-1])}
    if len(steps) < 2:
        verdict["training"] = {"verdict": "not applicable", "statement": "One checkpoint: there is no training series to order (depth only)."}
        return verdict, None
    strength = means.max(axis=2)  # [checkpoint, 1 + B, metric]
    if syntax is not None:
        strength = np.concatenate([strength, syntax[..., None]], axis=-1)
    verdict["training"], table = emergence_verdict(steps, strength, kind, syntax=syntax is not None, excess=excess.max(axis=2))
    return verdict, table

