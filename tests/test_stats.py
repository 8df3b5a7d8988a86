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
