import numpy as np
import pytest
from scipy import stats

from bertology.stats import RunningMoments


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


def test_confusion_metrics_match_scikit_learn():
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, matthews_corrcoef

    from bertology.stats import confusion_metric

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
