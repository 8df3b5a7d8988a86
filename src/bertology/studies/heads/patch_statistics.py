"""The statistics of ``bertology patch`` (docs/methods.md#which-heads-matter-causally): each head's normalised effect, a
ratio of means over pairs, with a bootstrap interval over pairs, a bootstrap p and a correction over heads; and the
agreement of attribution patching with exact patching.

``effect_h = mean_pairs[change_h] / mean_pairs[gap]``, where ``change_h = LD_patched - LD(target)`` and ``gap = LD(source)
- LD(target)`` (denoising: ``LD(x) - LD(x')``; 1 = head ``h`` alone restores the whole gap). Every replicate resamples the
pairs once (multinomial counts) and recomputes both means, so the interval is the ratio's, not a ratio of intervals.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.statistics.stats import MIN_SAMPLE, corrected, withheld
from bertology.studies.heads.patching import PairEffects

#: The level a corrected p must be below, with an interval that excludes 0, for a head to matter.
ALPHA = 0.05
COLUMNS = ["layer", "head", "method", "direction", "position", "logit_diff_change", "effect", "ci_low", "ci_high", "p", "p_adj", "matters", "n"]


def ratio_bootstrap(change: np.ndarray, gap: np.ndarray, replicates: int, seed: int) -> dict[str, np.ndarray]:
    """Per column of ``change`` ``[n, K]``: ``mean(change)``, ``effect = mean(change) / mean(gap)``, the 2.5 and 97.5 percentiles
    of the replicates' ratios and the two-sided p ``min(1, 2 min(1 + #{r* <= 0}, 1 + #{r* >= 0}) / (1 + B))`` (as
    :func:`~bertology.core.statistics.stats.paired_bootstrap`). A replicate whose gap mean is 0 has no ratio and is left
    out; a mean gap of 0 gives no effect, interval or p (NaN)."""
    change, gap = np.asarray(change, dtype=np.float64), np.asarray(gap, dtype=np.float64)
    n = len(gap)
    rng = np.random.default_rng(seed)
    ratios = []
    for start in range(0, replicates, 1000):  # counts in chunks: memory stays O(1000 n)
        counts = rng.multinomial(n, np.full(n, 1.0 / n), size=min(1000, replicates - start)).astype(np.float64)
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


def patching_table(effects: PairEffects, direction: str, *, replicates: int = 10000, seed: int = 0, correction: str = "fdr_bh",
                   min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """:data:`COLUMNS` for every head and method (activation, attribution). ``p_adj`` is corrected (statsmodels
    ``multipletests``, ``correction``) over the heads of one method; a head ``matters`` where its interval excludes 0 and its
    ``p_adj`` is below :data:`ALPHA`; on fewer than ``min_sample`` pairs no p is reported and nothing matters."""
    n, layers, heads = effects.activation.shape
    gap = effects.clean - effects.corrupt if direction == "denoise" else effects.corrupt - effects.clean
    grid = pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers)})
    tables = []
    for method, change in (("activation", effects.activation), ("attribution", effects.attribution)):
        scores = pd.DataFrame(ratio_bootstrap(change.reshape(n, -1), gap, replicates, seed))
        scores["p"] = withheld(scores.p, n, min_sample)
        scores["p_adj"] = corrected(scores.p, correction)[0]
        excludes_zero = (scores.ci_low > 0) | (scores.ci_high < 0)
        scores["matters"] = excludes_zero & (scores.p_adj < ALPHA)
        tables.append(pd.concat([grid, scores], axis=1).assign(method=method, direction=direction, position="all", n=n))
    return pd.concat(tables, ignore_index=True)[COLUMNS]


def pairs_table(effects: PairEffects, lines: list[int], direction: str) -> pd.DataFrame:
    """Per pair, head and method: ``pair`` (its line, or index in a built-in set), ``ld_clean``, ``ld_corrupt`` and the
    ``change`` of the target run's LD."""
    n, layers, heads = effects.activation.shape
    index = pd.MultiIndex.from_product([range(n), range(layers), range(heads)], names=["row", "layer", "head"]).to_frame(index=False)
    tables = [index.assign(method=method, change=change.reshape(-1)) for method, change in
              (("activation", effects.activation), ("attribution", effects.attribution))]
    table = pd.concat(tables, ignore_index=True)
    row = table.pop("row").to_numpy()
    table.insert(0, "pair", np.asarray(lines)[row])
    return table.assign(direction=direction, ld_clean=effects.clean[row], ld_corrupt=effects.corrupt[row])


def agreement(table: pd.DataFrame) -> dict:
    """How attribution patching ranks the heads against exact patching: the Spearman correlation of their changes and the
    top-k recall, the share of the ``k`` heads of largest exact ``|change|`` that are among attribution's ``k`` largest
    (``k``: the heads that matter by exact patching, at least 1)."""
    from scipy.stats import spearmanr

    exact = table[table.method == "activation"].reset_index(drop=True)
    estimate = table[table.method == "attribution"].reset_index(drop=True)
    k = max(1, int(exact.matters.sum()))
    top_exact = set(np.argsort(-exact.logit_diff_change.abs().to_numpy(), kind="stable")[:k])
    top_estimate = set(np.argsort(-estimate.logit_diff_change.abs().to_numpy(), kind="stable")[:k])
    varies = min(exact.logit_diff_change.nunique(), estimate.logit_diff_change.nunique()) > 1
    rho = spearmanr(exact.logit_diff_change, estimate.logit_diff_change).statistic if varies else float("nan")
    return {"spearman": float(rho), "top_k": k, "top_k_recall": len(top_exact & top_estimate) / k}
