"""A decoder's attention sinks over training: ``Sink_eps`` (Gu et al. 2025, "When Attention Sink Emerges in Language Models"),
the share of heads whose mean attention to the first token exceeds eps and the uniform head's on the same sequences, per layer at
each checkpoint (:func:`layer_sink_rates`) and overall over the series (:func:`sink_series`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.model.kinds import Kind
from bertology.families.profile.analyzer import EXCESS_TOLERANCE
from bertology.families.roles.analyzer import excess_over_uniform
from bertology.families.sinks.analyzer import sink_rates
from bertology.studies.track.result import CheckpointResult


def follows_sinks(kind: Kind) -> bool:
    """Whether :func:`~bertology.studies.track.dynamics.track` follows ``Sink_eps`` (Gu et al. 2025) on a ``kind`` of model:
    where the first token is an anchor (a decoder's, the candidate attention sink), whose attention per head the profile
    measures (``first``)."""
    return "first" in kind.anchors


def layer_sink_rates(heads: pd.DataFrame, eps: float) -> pd.DataFrame:
    """A decoder's ``Sink_eps`` per layer (Gu et al. 2025; the sinks family's :func:`~bertology.families.sinks.analyzer.sink_rates`):
    ``layer, metric = "sink_eps", value, ci_low, ci_high`` (no interval: NaN), from the profile's per-head ``first``, the mean
    over sequences of ``(1/(n-1)) sum_{i>=1} a[i, 0]``, which is the sinks family's ``alpha_0``.

    As in the sinks family, a head is a sink head only when it does more than the uniform head on the same sequences (the
    profile's ``uniform``; docs/methods.md#the-null-model), whose ``alpha_0`` is ``mean_{i>=1} 1/(i+1)``, above 0.3 on sequences
    of five pieces or fewer: its mean ``alpha_0 > eps`` (strictly), its mean excess over the uniform head beyond float noise
    (:func:`~bertology.families.roles.analyzer.excess_over_uniform` > 0) and the 95% interval of that excess above 0
    (``excess_ci_low`` > :data:`~bertology.families.profile.analyzer.EXCESS_TOLERANCE`, the profile's own test for a label;
    it stands in for the sinks family's ``p_excess``, which the profile does not compute)."""
    first = heads[heads.metric == "first"]
    beyond_uniform = (excess_over_uniform(first.value, first.uniform) > 0) & (first.excess_ci_low > EXCESS_TOLERANCE)
    # a head no more than the uniform one enters sink_rates without a mean (NaN > eps is false): it is no sink head
    rates = sink_rates(first.assign(quantity="attention", value=first.value.where(beyond_uniform)), eps)
    rates = rates[rates.layer != "all"]
    return pd.DataFrame({"layer": rates.layer.astype(int), "metric": "sink_eps", "value": rates.rate, "ci_low": np.nan, "ci_high": np.nan})


def sink_series(results: list[CheckpointResult], eps: float) -> dict:
    """A decoder's ``Sink_eps`` over its checkpoints (in training order): per layer, and overall (the mean over layers: every
    layer has the same heads), with the sentence that says when sinks appear."""
    steps = [r.step for r in results]
    grid = [r.layers[r.layers.metric == "sink_eps"].sort_values("layer").value.tolist() for r in results]
    overall = [float(np.mean(rates)) for rates in grid]
    where = ", ".join(f"{rate:.0%} at {'step unknown' if step is None else f'step {step}'}" for step, rate in zip(steps, overall))
    statement = (f"Sink_{eps:g} (the share of heads whose mean attention to the first token exceeds {eps:g}, and exceeds the uniform "
                 f"head's on the same sequences with its 95% interval, Gu et al. 2025): {where}.")
    if not any(overall):
        statement += " No head is a sink head at any checkpoint: no attention sink appears."
    return {"eps": eps, "steps": steps, "by_layer": grid, "overall": overall, "statement": statement}

