"""Statistics shared by the analyzers: streaming, mergeable moments, their confidence intervals and one-sample t-tests."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pandas as pd
from scipy import stats

from bertology.core import options


class RunningMoments:
    """Count, mean and sum of squared deviations of observations, per cell of an array.

    Batches are folded in with Chan et al.'s (1979) parallel update, so any split of the data
    gives the same moments (up to float rounding) and two halves :meth:`merge` into the whole:
    ``mean = (n_a mean_a + n_b mean_b) / n``, ``M2 = M2_a + M2_b + delta^2 n_a n_b / n``.
    NaN observations are left out of their cell.
    """

    def __init__(self, shape: tuple[int, ...]):
        self.count = np.zeros(shape)
        self.mean = np.zeros(shape)
        self.m2 = np.zeros(shape)

    def check_state(self) -> None:
        """Refuse moments read back from a file unless they can be moments: one shape, counts whole and >= 0, M2 >= 0."""
        if not all(isinstance(getattr(self, part, None), np.ndarray) and getattr(self, part).dtype == np.float64 for part in ("count", "mean", "m2")):
            raise ValueError("count, mean and M2 must be float64 arrays")
        if not self.count.shape == self.mean.shape == self.m2.shape:
            raise ValueError(f"moments of shapes {self.count.shape}, {self.mean.shape}, {self.m2.shape}: count, mean and M2 must share one")
        if (self.count < 0).any() or (self.count != np.round(self.count)).any() or (self.m2 < 0).any():
            raise ValueError("moments with a negative or fractional count, or a negative sum of squares")

    def push(self, values: np.ndarray) -> None:
        """Add observations ``values[k, *shape]`` (k observations of every cell)."""
        values = np.asarray(values, dtype=np.float64)
        valid = ~np.isnan(values)
        count = valid.sum(axis=0).astype(np.float64)
        safe = np.where(valid, values, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(count > 0, safe.sum(axis=0) / count, 0.0)
        m2 = (np.where(valid, values - mean, 0.0) ** 2).sum(axis=0)
        self._combine(count, mean, m2)

    def merge(self, other: "RunningMoments") -> "RunningMoments":
        self._combine(other.count, other.mean, other.m2)
        return self

    def _combine(self, count: np.ndarray, mean: np.ndarray, m2: np.ndarray) -> None:
        total = self.count + count
        with np.errstate(invalid="ignore", divide="ignore"):
            delta = mean - self.mean
            self.mean = np.where(total > 0, self.mean + delta * count / total, 0.0)
            self.m2 = np.where(total > 0, self.m2 + m2 + delta**2 * self.count * count / total, 0.0)
        self.count = total

    def interval(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """Student-t interval for the mean: ``mean -/+ t_{(1+level)/2, n-1} * sd / sqrt(n)``.

        NaN where a cell has fewer than two observations.
        """
        with np.errstate(invalid="ignore", divide="ignore"):
            sem = np.sqrt(self.m2 / (self.count - 1)) / np.sqrt(self.count)
            half = stats.t.ppf((1 + level) / 2, self.count - 1) * sem
        half = np.where(self.count > 1, half, np.nan)
        return self.mean - half, self.mean + half

    def means(self) -> np.ndarray:
        return np.where(self.count > 0, self.mean, np.nan)


def merge_moments(mine: RunningMoments | None, theirs: RunningMoments | None) -> RunningMoments | None:
    """An analyzer's moments merged with another's, either of which may not have seen data yet (None)."""
    if theirs is None:
        return mine
    return theirs if mine is None else mine.merge(theirs)


#: The fewest observations a test needs (declared with its option, :data:`bertology.core.options.MIN_SAMPLE`).
MIN_SAMPLE = options.MIN_SAMPLE


def withheld(p, n, min_sample: int):
    """``p`` where its test saw at least ``min_sample`` observations (``n``), NaN elsewhere: no claim on too little data."""
    return np.where(np.asarray(n) >= min_sample, p, np.nan)


def t_test_greater(moments: RunningMoments, tau: float, rtol: float = 1e-6, min_sample: int = MIN_SAMPLE) -> tuple[np.ndarray, np.ndarray]:
    """One-sided one-sample t-test per cell, ``H0: mean <= tau``: ``t = (mean - tau) / (sd / sqrt(n))``,
    ``p = P(T_{n-1} >= t)`` (scipy's ``ttest_1samp(..., alternative="greater")``).

    A mean within a relative ``rtol`` of tau, ``|mean - tau| <= rtol * max(|tau|, tiny)``, gets ``t = 0``
    and ``p = 1`` whatever its variance: float noise over (numerically) zero variance would otherwise give
    ``t = +-inf`` (docs/methods.md#roles-and-the-sieve-score). Outside that band a zero variance gives ``t = +-inf``: the mean
    decides. ``t`` and ``p`` are NaN where a cell has fewer than ``max(2, min_sample)`` observations.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        sem = np.sqrt(moments.m2 / (moments.count - 1)) / np.sqrt(moments.count)
        t = (moments.mean - tau) / sem
    at_tau = np.abs(moments.mean - tau) <= rtol * max(abs(tau), np.finfo(np.float64).tiny)
    testable = moments.count >= max(2, min_sample)
    t = np.where(testable, np.where(at_tau, 0.0, t), np.nan)
    p = np.where(testable, np.where(at_tau, 1.0, stats.t.sf(t, moments.count - 1)), np.nan)
    return t, p


def corrected(p: pd.Series, method: str, alpha: float = 0.05) -> tuple[pd.Series, pd.Series]:
    """``(p_adj, reject)`` of statsmodels' ``multipletests`` over the p-values that exist: a NaN p (a cell that could not
    be tested) stays NaN and is never rejected, and takes no part in the correction of the others."""
    from statsmodels.stats.multitest import multipletests

    adjusted, reject = pd.Series(np.nan, index=p.index), pd.Series(False, index=p.index)
    testable = p.notna()
    if testable.any():
        rejected, values, _, _ = multipletests(p[testable], alpha=alpha, method=method)
        adjusted[testable], reject[testable] = values, rejected
    return adjusted, reject


def keyed_rng(seed: int, *key) -> np.random.Generator:
    """A random generator fixed by ``seed`` and ``key`` (for a sequence: :func:`sequence_key`).

    Draws made from it (bootstrap weights, samples, folds) follow the data item, not its position
    in a batch or shard, which keeps analyzers independent of batch order and mergeable.
    """
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "big"))


def sequence_key(example) -> tuple:
    """What keys a sequence's random draws: its line in the corpus file and its text(s).

    Never the file's name or path, so the same corpus under another name gives byte-identical
    tables; the line keeps a sentence that occurs twice in a file two independent draws.
    """
    return example.line, example.text, example.text_pair


def bootstrap_weights(seed: int, bootstrap: int, example) -> np.ndarray:
    """``[1 + bootstrap]`` weights of one sequence: 1 for the data itself (replicate 0), then Poisson(1) draws.

    The Poisson bootstrap (a sequence appears ``w ~ Poisson(1)`` times in a replicate) needs no
    pass over the whole corpus, so replicates are built while streaming and merge by addition.
    The draws are keyed by :func:`sequence_key`: every analyzer and every checkpoint that sees the
    same corpus with the same seed gets the same replicates (paired comparisons).
    """
    weights = np.ones(1 + bootstrap)
    weights[1:] = keyed_rng(seed, *sequence_key(example)).poisson(1.0, bootstrap)
    return weights


def interval_frame(moments: RunningMoments, index: pd.Index) -> pd.DataFrame:
    """Tidy table of moments: ``value`` (mean), ``ci_low``, ``ci_high`` (95% t interval), ``n``, one row per cell of ``index``."""
    low, high = moments.interval()
    return pd.DataFrame(
        {"value": moments.means().ravel(), "ci_low": low.ravel(), "ci_high": high.ravel(), "n": moments.count.ravel().astype(np.int64)},
        index=index,
    ).reset_index()


def confusion_metric(confusion: np.ndarray, metric: str, positive: int | None = None) -> np.ndarray:
    """A classification metric from confusion counts ``confusion[..., gold, predicted]`` (K x K), vectorised
    over leading axes so that a bootstrap's thousand resamples cost one array operation.

    accuracy = trace / total; F1 of class p = 2 TP / (2 TP + FP + FN); macro F1 = mean of per-class F1;
    Matthews correlation (Gorodkin 2004, multi-class) = (c s - sum_k p_k t_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2)),
    with c correct, s total, p_k predicted and t_k true counts. An undefined F1 or correlation is 0, as in scikit-learn.
    """
    confusion = np.asarray(confusion, dtype=np.float64)
    diagonal = np.diagonal(confusion, axis1=-2, axis2=-1)
    true, predicted = confusion.sum(-1), confusion.sum(-2)
    total = true.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        if metric == "accuracy":
            return diagonal.sum(-1) / total
        if metric in ("f1", "macro_f1"):
            per_class = np.nan_to_num(2 * diagonal / (true + predicted), nan=0.0)
            return per_class[..., positive] if metric == "f1" else per_class.mean(-1)
        if metric == "matthews_correlation":
            numerator = diagonal.sum(-1) * total - (predicted * true).sum(-1)
            denominator = np.sqrt((total**2 - (predicted**2).sum(-1)) * (total**2 - (true**2).sum(-1)))
            return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), 0.0)
    raise ValueError(f"unknown metric {metric!r}")


#: The share of a metric's scale (at least 1) below which a change is float rounding, not an effect: a head whose change is
#: within it is never said to matter, however small its p (the families' excess tolerance, for causal effects).
FLOAT_NOISE = 1e-6


def beyond_float_noise(change, scale) -> np.ndarray:
    """Where ``|change|`` exceeds :data:`FLOAT_NOISE` times ``max(1, |scale|)`` (the metric's typical size)."""
    return np.abs(np.asarray(change, dtype=np.float64)) > FLOAT_NOISE * np.maximum(1.0, np.abs(np.asarray(scale, dtype=np.float64)))


def varies(values: np.ndarray) -> np.ndarray:
    """Per column of ``values`` ``[n, K]``: whether the observations differ at all (a zero-variance test decides nothing)."""
    values = np.asarray(values)
    return (values != values[:1]).any(axis=0)


def resampled_counts(n: int, replicates: int, seed: int) -> Iterator[np.ndarray]:
    """The bootstrap's resamples of ``n`` observations as multinomial counts ``[b, n]`` (float64), ``replicates`` in all, in
    chunks of at most 1000 so that memory stays O(1000 n)."""
    rng = np.random.default_rng(seed)
    for start in range(0, replicates, 1000):
        yield rng.multinomial(n, np.full(n, 1.0 / n), size=min(1000, replicates - start)).astype(np.float64)


def bootstrap_interval(deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``deltas`` ``[V, B]`` (a change in each of ``B`` replicates): the 2.5 and 97.5 percentiles and the two-sided
    p ``min(1, 2 min(1 + #{d* <= 0}, 1 + #{d* >= 0}) / (1 + B))``."""
    low, high = np.percentile(deltas, [2.5, 97.5], axis=1)
    tail = np.minimum(1 + (deltas <= 0).sum(1), 1 + (deltas >= 0).sum(1))
    return low, high, np.minimum(1.0, 2 * tail / (1 + deltas.shape[1]))


def paired_bootstrap(gold: np.ndarray, baseline: np.ndarray, variants: np.ndarray, classes: int, metric: str,
                     positive: int | None = None, replicates: int = 1000, seed: int = 0, min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """Change of a metric when predictions ``variants[v]`` replace ``baseline``, with a paired bootstrap over examples.

    Every replicate resamples the examples once (multinomial counts) and scores the baseline and every
    variant on the same resample. Per variant: ``value``, ``delta = value - baseline value``, the 2.5 and
    97.5 percentiles of the resampled deltas, and a two-sided p = min(1, 2 min(1 + #{d* <= 0}, 1 + #{d* >= 0}) / (1 + B)),
    left empty (NaN) on fewer than ``min_sample`` examples. ``variants`` ``[V, draws, n]`` are several draws of each variant
    (resample ablation): an example's cell of the confusion matrix is then the mean over the draws, so the metric is that of
    the expected confusion matrix (for accuracy, the mean of the draws' accuracies).
    """
    gold, baseline, variants = np.asarray(gold), np.asarray(baseline), np.asarray(variants)
    n = len(gold)
    cells = np.arange(classes * classes)

    def cell(predictions: np.ndarray) -> np.ndarray:  # [..., n] -> one-hot cell of (gold, predicted) [..., n, K^2]
        return ((gold * classes) + predictions)[..., None] == cells

    drawn = variants.reshape(len(variants), -1, n)  # [V, draws, n]
    onehot = np.concatenate([cell(baseline)[None].astype(np.float64), cell(drawn).mean(1)])  # [1 + V, n, K^2], row 0: the baseline
    whole = confusion_metric(onehot.sum(1).reshape(-1, classes, classes), metric, positive)
    samples = []
    for counts in resampled_counts(n, replicates, seed):
        confusion = np.einsum("bn,vnc->vbc", counts, onehot).reshape(len(onehot), -1, classes, classes)
        samples.append(confusion_metric(confusion, metric, positive))
    samples = np.concatenate(samples, axis=1)
    low, high, p = bootstrap_interval(samples[1:] - samples[:1])  # [V, B] deltas
    return pd.DataFrame({"value": whole[1:], "delta": whole[1:] - whole[0], "ci_low": low, "ci_high": high, "p": withheld(p, n, min_sample)})
