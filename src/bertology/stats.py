"""Statistics shared by the analyzers: streaming, mergeable moments and their confidence intervals."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
from scipy import stats


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


def keyed_rng(seed: int, *key) -> np.random.Generator:
    """A random generator fixed by ``seed`` and ``key`` (e.g. a sentence's source and text).

    Draws made from it (bootstrap weights, samples, folds) follow the data item, not its position
    in a batch or shard, which keeps analyzers independent of batch order and mergeable.
    """
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "big"))


def interval_frame(moments: RunningMoments, index: pd.Index) -> pd.DataFrame:
    """Tidy table of moments: ``value`` (mean), ``ci_low``, ``ci_high`` (95% t interval), ``n``, one row per cell of ``index``."""
    low, high = moments.interval()
    return pd.DataFrame(
        {"value": moments.means().ravel(), "ci_low": low.ravel(), "ci_high": high.ravel(), "n": moments.count.ravel().astype(np.int64)},
        index=index,
    ).reset_index()
