import numpy as np
import pytest
from scipy import stats

from bertology.core.statistics.stats import RunningMoments, t_test_greater


def test_moments_and_interval_match_numpy_and_scipy():
    rng = np.random.default_rng(1)
    data = rng.normal(size=(50, 3, 2))
    moments = RunningMoments((3, 2))
    for chunk in np.array_split(data, [7, 8, 30]):
        moments.push(chunk)
    np.testing.assert_allclose(moments.means(), data.mean(axis=0))
    np.testing.assert_allclose(moments.m2 / (moments.count - 1), data.var(axis=0, ddof=1))
    low, high = moments.interval()
    expected_low, expected_high = stats.t.interval(0.95, 49, loc=data.mean(axis=0), scale=stats.sem(data, axis=0))
    np.testing.assert_allclose(low, expected_low)
    np.testing.assert_allclose(high, expected_high)


def test_merge_of_parts_equals_the_whole():
    rng = np.random.default_rng(2)
    data = rng.exponential(size=(40, 4))
    whole = RunningMoments((4,))
    whole.push(data)
    first, second = RunningMoments((4,)), RunningMoments((4,))
    first.push(data[:13])
    second.push(data[13:])
    first.merge(second)
    np.testing.assert_allclose(first.means(), whole.means())
    np.testing.assert_allclose(first.m2, whole.m2)
    assert (first.count == 40).all()


def test_nan_observations_are_left_out_of_their_cell():
    moments = RunningMoments((2,))
    moments.push(np.array([[1.0, np.nan], [3.0, 5.0], [5.0, np.nan]]))
    assert moments.count.tolist() == [3, 1]
    np.testing.assert_allclose(moments.means(), [3.0, 5.0])
    low, high = moments.interval()
    assert np.isnan(low[1]) and np.isnan(high[1])  # one observation: no interval
    assert low[0] == pytest.approx(3.0 - stats.t.ppf(0.975, 2) * 2.0 / np.sqrt(3))


def moments_of(data):
    moments = RunningMoments(data.shape[1:])
    moments.push(data)
    return moments


def test_t_test_greater_matches_scipy():
    rng = np.random.default_rng(3)
    data = rng.normal([2.5, 3.0, 3.4, 4.0], 1.0, size=(25, 4))
    t, p = t_test_greater(moments_of(data), 3.0)
    expected = stats.ttest_1samp(data, 3.0, alternative="greater")
    np.testing.assert_allclose(t, expected.statistic, rtol=1e-10)
    np.testing.assert_allclose(p, expected.pvalue, rtol=1e-10)


def test_t_test_greater_a_mean_within_1e_6_of_tau_never_passes():
    tau = 3.0
    noise = np.random.default_rng(4).normal(0, 1e-9, size=(30, 1))
    data = np.concatenate([
        np.full((30, 1), tau),  # exactly tau, zero variance (0/0)
        np.full((30, 1), tau * (1 + 2e-7)),  # float noise above tau, zero variance (t = inf)
        tau * (1 + 9e-7) + noise,  # float noise above tau, tiny variance (t ~ 1e4, scipy p ~ 0)
        tau * (1 + 2e-6) + noise,  # just outside the band: the mean decides
        np.full((30, 1), 5.0),  # zero variance far above tau
        np.full((30, 1), 1.0),  # and far below
    ], axis=1)
    t, p = t_test_greater(moments_of(data), tau)
    np.testing.assert_array_equal(t[:3], 0.0)
    np.testing.assert_array_equal(p[:3], 1.0)
    assert p[3] < 1e-10 and t[3] > 0
    assert (t[4], p[4]) == (np.inf, 0.0) and (t[5], p[5]) == (-np.inf, 1.0)
    # relative to |tau|; at tau = 0 only an exact 0 is in the band
    t, p = t_test_greater(moments_of(np.array([[0.0, 1e-300], [0.0, 1e-300]])), 0.0, min_sample=2)
    assert (t[0], p[0]) == (0.0, 1.0) and p[1] == 0.0


def test_t_test_greater_needs_two_observations():
    moments = RunningMoments((3,))
    moments.push(np.array([[4.0, 4.0, np.nan], [5.0, np.nan, np.nan]]))
    t, p = t_test_greater(moments, 3.0, min_sample=2)
    assert np.isfinite(t[0]) and np.isnan(t[1:]).all() and np.isnan(p[1:]).all()


def test_confusion_metrics_match_scikit_learn():
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, matthews_corrcoef

    from bertology.core.statistics.stats import confusion_metric

    rng = np.random.default_rng(3)
    for classes in (2, 3):
        gold, predicted = rng.integers(0, classes, 60), rng.integers(0, classes, 60)
        confusion = confusion_matrix(gold, predicted, labels=range(classes))
        assert confusion_metric(confusion, "accuracy") == pytest.approx(accuracy_score(gold, predicted))
        assert confusion_metric(confusion, "macro_f1") == pytest.approx(f1_score(gold, predicted, average="macro"))
        assert confusion_metric(confusion, "matthews_correlation") == pytest.approx(matthews_corrcoef(gold, predicted))
        assert confusion_metric(confusion, "f1", positive=1) == pytest.approx(f1_score(gold, predicted, labels=[1], average="macro"))
    # undefined cases are 0, as in scikit-learn: one class only
    constant = confusion_matrix([1, 1, 1], [1, 1, 1], labels=[0, 1])
    assert confusion_metric(constant, "matthews_correlation") == 0.0
    assert confusion_metric(confusion_matrix([0, 0], [0, 0], labels=[0, 1]), "f1", positive=1) == 0.0
    # vectorised over leading axes
    stacked = np.stack([confusion, confusion])
    np.testing.assert_allclose(confusion_metric(stacked, "accuracy"), [accuracy_score(gold, predicted)] * 2)


def test_paired_bootstrap_by_hand():
    """The paired bootstrap's interval is the 2.5th-97.5th percentile of the resampled differences, and its
    p-value is two-sided, checked against a plain loop over the same resamples."""
    from bertology.core.statistics.stats import paired_bootstrap

    rng = np.random.default_rng(3)
    gold = rng.integers(0, 2, 60)
    baseline = np.where(rng.random(60) < 0.8, gold, 1 - gold)
    variant = np.where(rng.random(60) < 0.7, gold, 1 - gold)
    replicates, seed = 400, 11
    table = paired_bootstrap(gold, baseline, variant[None], classes=2, metric="accuracy", replicates=replicates, seed=seed)

    draws = np.random.default_rng(seed)
    deltas = []
    for _ in range(replicates):
        counts = draws.multinomial(60, np.full(60, 1 / 60))
        deltas.append((counts * (variant == gold)).sum() / 60 - (counts * (baseline == gold)).sum() / 60)
    deltas = np.sort(deltas)
    assert table.loc[0, "value"] == pytest.approx((variant == gold).mean())
    assert table.loc[0, "delta"] == pytest.approx((variant == gold).mean() - (baseline == gold).mean())
    # numpy's default percentile: linear interpolation between order statistics at (B - 1) q
    for column, q in (("ci_low", 0.025), ("ci_high", 0.975)):
        position = (replicates - 1) * q
        below = int(np.floor(position))
        expected = deltas[below] + (position - below) * (deltas[below + 1] - deltas[below])
        assert table.loc[0, column] == pytest.approx(expected, abs=1e-12)
    tail = min(1 + np.sum(deltas <= 0), 1 + np.sum(deltas >= 0))
    assert table.loc[0, "p"] == pytest.approx(min(1.0, 2 * tail / (1 + replicates)))
