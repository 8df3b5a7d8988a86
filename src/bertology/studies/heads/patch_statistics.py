"""The statistics of ``bertology patch``: each head's normalised effect with an interval, a p and a correction.

The effect is a ratio of means over pairs, with a bootstrap interval over pairs, a bootstrap p and a correction over
heads; and the agreement of attribution patching with exact patching (docs/methods.md#which-heads-matter-causally).

``effect_h = mean_pairs[change_h] / mean_pairs[gap]``, where ``change_h = LD_patched - LD(target)`` and ``gap = LD(source)
- LD(target)`` (denoising: ``LD(x) - LD(x')``; 1 = head ``h`` alone restores the whole gap). Every replicate resamples the
pairs once (multinomial counts) and recomputes both means, so the interval is the ratio's, not a ratio of intervals.

``attribution*`` (AtP* with GradDrop, Kramar et al. 2024) is a magnitude for ranking, ``1/(L-1) sum_l |mean_pairs AtP_l|``
with ``AtP_l`` the estimate whose gradient skips layer ``l``: it gets an interval (the same resampled pairs) and no p, for
a magnitude tested against 0 would always be called something.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.statistics.stats import MIN_SAMPLE, beyond_float_noise, corrected, resampled_counts, varies, withheld
from bertology.studies.heads.patching import PairEffects

#: The level a corrected p must be below, with an interval that excludes 0, for a head to matter.
ALPHA = 0.05
COLUMNS = ["layer", "head", "method", "direction", "position", "logit_diff_change", "effect", "ci_low", "ci_high", "p", "p_adj", "matters", "n"]


def ld_scale(clean: np.ndarray, corrupt: np.ndarray) -> float:
    """The typical size of the pairs' logit differences, ``mean(|LD|)`` over both prompts: what float rounding is relative to."""
    return float(np.mean(np.abs(np.concatenate([clean, corrupt]))))


def ratio_bootstrap(change: np.ndarray, gap: np.ndarray, replicates: int, seed: int) -> dict[str, np.ndarray]:
    """Per column of ``change`` ``[n, K]``: ``mean(change)``, ``effect = mean(change) / mean(gap)``, the 2.5 and 97.5 percentiles
    of the replicates' ratios and the two-sided p ``min(1, 2 min(1 + #{r* <= 0}, 1 + #{r* >= 0}) / (1 + B))`` (as
    :func:`~bertology.core.statistics.stats.paired_bootstrap`). A replicate whose gap mean is 0 has no ratio and is left
    out; a mean gap of 0 gives no effect, interval or p (NaN)."""
    change, gap = np.asarray(change, dtype=np.float64), np.asarray(gap, dtype=np.float64)
    n = len(gap)
    ratios = []
    for counts in resampled_counts(n, replicates, seed):
        gaps = counts @ gap / n
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios.append(np.where(gaps[:, None] != 0, (counts @ change / n) / gaps[:, None], np.nan))
    ratios = np.concatenate(ratios)  # [B, K]
    mean_change, mean_gap = change.mean(0), gap.mean()
    nothing = np.full(change.shape[1], np.nan)
    if mean_gap == 0 or not np.isfinite(ratios).any():
        return {"logit_diff_change": mean_change, "effect": nothing, "ci_low": nothing, "ci_high": nothing, "p": nothing}
    drawn = np.isfinite(ratios).sum(0)
    low, high = np.nanpercentile(ratios, [2.5, 97.5], axis=0)
    tail = np.minimum(1 + (ratios <= 0).sum(0), 1 + (ratios >= 0).sum(0))
    return {"logit_diff_change": mean_change, "effect": mean_change / mean_gap, "ci_low": low, "ci_high": high,
            "p": np.minimum(1.0, 2 * tail / (1 + drawn))}


def graddrop_bootstrap(dropped: np.ndarray, gap: np.ndarray, replicates: int, seed: int) -> dict[str, np.ndarray]:
    """attribution* per head from ``dropped`` ``[n, L, heads...]``: ``1/(L-1) sum_l |mean_pairs dropped[:, l]|``, that over
    ``|mean(gap)|`` as its effect, and the 2.5 and 97.5 percentiles of the replicates' effects; no p."""
    n, depth = dropped.shape[:2]
    flat = np.asarray(dropped, dtype=np.float64).reshape(n, depth, -1)
    magnitude = np.abs(flat.mean(0)).sum(0) / (depth - 1)
    mean_gap = abs(float(np.mean(gap)))
    nothing = np.full(magnitude.shape, np.nan)
    if mean_gap == 0:
        return {"logit_diff_change": magnitude, "effect": nothing, "ci_low": nothing, "ci_high": nothing, "p": nothing}
    effects = []
    for counts in resampled_counts(n, replicates, seed):
        means = np.einsum("bn,nlk->blk", counts, flat) / n
        gaps = np.abs(counts @ gap / n)
        with np.errstate(invalid="ignore", divide="ignore"):
            effects.append(np.where(gaps[:, None] != 0, np.abs(means).sum(1) / (depth - 1) / gaps[:, None], np.nan))
    low, high = np.nanpercentile(np.concatenate(effects), [2.5, 97.5], axis=0)
    return {"logit_diff_change": magnitude, "effect": magnitude / mean_gap, "ci_low": low, "ci_high": high, "p": nothing}


def _tested(scores: dict, change: np.ndarray, scale: float, correction: str, min_sample: int) -> pd.DataFrame:
    """``scores`` with ``p`` withheld below ``min_sample`` pairs and where the per-pair changes ``[n, K]`` do not vary (a
    zero-variance test decides nothing: a pair repeated, a position both prompts share), ``p_adj`` corrected over the
    family's rows, and ``matters``: an interval that excludes 0, ``p_adj`` below :data:`ALPHA` and a mean change beyond float
    rounding of LDs of size ``scale`` (:func:`~bertology.core.statistics.stats.beyond_float_noise`)."""
    scores = pd.DataFrame(scores)
    scores["p"] = np.where(varies(change), withheld(scores.p, len(change), min_sample), np.nan)
    scores["p_adj"] = corrected(scores.p, correction)[0]
    excludes_zero = (scores.ci_low > 0) | (scores.ci_high < 0)
    scores["matters"] = excludes_zero & (scores.p_adj < ALPHA) & beyond_float_noise(scores.logit_diff_change, scale)
    return scores


def _grid(layers: int, heads: int, positions: int | None = None) -> pd.DataFrame:
    """``layer, head, position`` in the order of a ``[layers, heads(, positions)]`` array's cells (position "all" without)."""
    if positions is None:
        return pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers), "position": "all"})
    index = pd.MultiIndex.from_product([range(layers), range(heads), range(positions)], names=["layer", "head", "position"]).to_frame(index=False)
    return index.assign(position=index.position.astype(str))


def patching_table(effects: PairEffects, direction: str, *, replicates: int = 10000, seed: int = 0, correction: str = "fdr_bh",
                   min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """:data:`COLUMNS` for every head and method (activation, attribution, attribution* where there are two layers or more),
    at all positions, and per position where the effects have them. ``p_adj`` is corrected (statsmodels ``multipletests``,
    ``correction``) within a family: one method's heads at all positions, or its heads and positions; on fewer than
    ``min_sample`` pairs no p is reported and nothing matters."""
    n, layers, heads = effects.changes["activation"].shape
    gap = effects.clean - effects.corrupt if direction == "denoise" else effects.corrupt - effects.clean
    scale = ld_scale(effects.clean, effects.corrupt)
    families = [(method, change, None) for method, change in effects.changes.items()]
    families += [(method, change, change.shape[-1]) for method, change in effects.by_position.items()]
    tables = [pd.concat([_grid(layers, heads, positions), _tested(ratio_bootstrap(change.reshape(n, -1), gap, replicates, seed), change.reshape(n, -1),
                                                                  scale, correction, min_sample)], axis=1).assign(method=method)
              for method, change, positions in families]
    if layers > 1:
        scores = graddrop_bootstrap(effects.dropped, gap, replicates, seed)
        tables.append(pd.concat([_grid(layers, heads), pd.DataFrame(scores)], axis=1).assign(method="attribution*", p_adj=np.nan, matters=False))
    return pd.concat(tables, ignore_index=True).assign(direction=direction, n=n)[COLUMNS]


def ablation_table(ablations: dict[str, np.ndarray], clean: np.ndarray, corrupt: np.ndarray, *, replicates: int = 10000, seed: int = 0,
                   correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """:data:`COLUMNS` for zero and mean ablation and gradient importance on the clean prompts (``direction`` "ablation"):
    the mean change of the clean run's LD, over the mean gap ``LD(x) - LD(x')`` as its effect, tested as patching's are;
    gradient importance, a magnitude, gets an interval and no p."""
    n, layers, heads = next(iter(ablations.values())).shape
    tables = []
    for method, change in ablations.items():
        scores = ratio_bootstrap(change.reshape(n, -1), clean - corrupt, replicates, seed)
        scored = (pd.DataFrame(scores).assign(p=np.nan, p_adj=np.nan, matters=False) if method == "gradient importance"
                  else _tested(scores, change.reshape(n, -1), ld_scale(clean, corrupt), correction, min_sample))
        tables.append(pd.concat([_grid(layers, heads), scored], axis=1).assign(method=method))
    return pd.concat(tables, ignore_index=True).assign(direction="ablation", n=n)[COLUMNS]


def pairs_table(effects: PairEffects, lines: list[int], direction: str, ablations: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    """Per pair, head, method and position (all, or each where patched so): ``pair`` (its line, or index in a built-in set),
    ``ld_clean``, ``ld_corrupt`` and the ``change`` of the target run's LD (attribution*, a magnitude over pairs, has none),
    and of the clean run's under each of ``ablations`` (direction "ablation")."""
    n, layers, heads = effects.changes["activation"].shape
    methods = [(method, change, direction) for method, change in [*effects.changes.items(), *effects.by_position.items()]]
    methods += [(method, change, "ablation") for method, change in (ablations or {}).items()]
    tables = []
    for method, change, way in methods:
        positions = change.shape[3] if change.ndim == 4 else None
        grid = _grid(layers, heads, positions)
        tables.append(pd.concat([grid] * n, ignore_index=True).assign(row=np.repeat(np.arange(n), len(grid)), method=method, direction=way,
                                                                      change=change.reshape(-1)))
    table = pd.concat(tables, ignore_index=True)
    row = table.pop("row").to_numpy()
    table.insert(0, "pair", np.asarray(lines)[row])
    return table.assign(ld_clean=effects.clean[row], ld_corrupt=effects.corrupt[row])


def agreement(table: pd.DataFrame) -> dict:
    """How each attribution method ranks the heads against exact patching, at all positions: the Spearman correlation of
    their changes (attribution*, a magnitude: against exact patching's ``|change|``) and the top-k recall, the share of the
    ``k`` heads of largest exact ``|change|`` that are among the method's ``k`` largest (``k``: the heads that matter by
    exact patching, at least 1); nothing where exact patching tested no head."""
    from scipy.stats import spearmanr

    every = table[table.position == "all"]
    exact = every[every.method == "activation"].reset_index(drop=True)
    if exact.p.isna().all():  # nothing was tested (too few pairs, no variation, no gap): nothing to agree on
        return {}
    k = max(1, int(exact.matters.sum()))
    top_exact = set(np.argsort(-exact.logit_diff_change.abs().to_numpy(), kind="stable")[:k])
    found = {}
    for method in ("attribution", "attribution*"):
        estimate = every[every.method == method].reset_index(drop=True)
        if estimate.empty:
            continue
        reference = exact.logit_diff_change.abs() if method == "attribution*" else exact.logit_diff_change
        top_estimate = set(np.argsort(-estimate.logit_diff_change.abs().to_numpy(), kind="stable")[:k])
        varies = min(reference.nunique(), estimate.logit_diff_change.nunique()) > 1
        rho = spearmanr(reference, estimate.logit_diff_change).statistic if varies else float("nan")
        found[method] = {"spearman": float(rho), "top_k": k, "top_k_recall": len(top_exact & top_estimate) / k}
    return found
