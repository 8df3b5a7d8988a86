import numpy as np
import pytest
import torch

from bertology.analyzers.patterns import PATTERNS, PatternThresholds, RuleClassifier, pattern_features


def masks(n, pair_at=None):
    mask = torch.ones(1, n, dtype=torch.bool)
    special = torch.zeros(1, n, dtype=torch.bool)
    special[0, [0, n - 1]] = True
    segments = torch.zeros(1, n, dtype=torch.long)
    segments[0, [0, n - 1]] = -1
    if pair_at is not None:
        special[0, pair_at] = True
        segments[0, pair_at] = -1
        segments[0, pair_at + 1 : n - 1] = 1
    return mask, special, segments


def classify(matrix, pair_at=None, thresholds=PatternThresholds()):
    n = matrix.shape[0]
    return PATTERNS[int(RuleClassifier(thresholds).classify(torch.tensor(matrix)[None, None], *masks(n, pair_at))[0, 0])]


N = 20


def vertical():
    a = np.zeros((N, N))
    a[:, 0] = 0.9
    a[:, 5] = 0.1
    return a


def diagonal():
    a = np.zeros((N, N))
    a[0, 0] = 1
    for i in range(1, N):
        a[i, i - 1] = 1
    return a


def vertical_and_diagonal():
    return 0.5 * vertical() + 0.5 * diagonal()


def block(pair_at=9):
    a = np.zeros((N, N))
    for i in range(N):
        if 0 < i < pair_at:
            a[i, 1:pair_at] = 1 / (pair_at - 1)
        elif pair_at < i < N - 1:
            a[i, pair_at + 1 : N - 1] = 1 / (N - 2 - pair_at)
        else:
            a[i] = 1 / N
    return a


@pytest.mark.parametrize("make, expected, pair_at", [
    (vertical, "vertical", None), (diagonal, "diagonal", None), (vertical_and_diagonal, "vertical+diagonal", None), (block, "block", 9),
])
def test_each_rule_recognises_its_class(make, expected, pair_at):
    assert classify(make(), pair_at) == expected


def test_random_dirichlet_maps_are_heterogeneous():
    rng = np.random.default_rng(0)
    for seed in range(20):
        assert classify(rng.dirichlet(np.ones(30), size=30)) == "heterogeneous"
        assert classify(rng.dirichlet(np.ones(30), size=30), pair_at=14) == "heterogeneous"


def test_block_needs_a_pair_and_thresholds_are_configurable():
    assert classify(block(), pair_at=None) == "heterogeneous"  # one sentence: no block
    weak = np.zeros((N, N))
    weak[:, 0] = 0.7
    weak[:, 1 : N - 1] = 0.3 / (N - 2)  # vertical mass 0.7 + 0.3 / 18
    assert classify(weak) == "vertical"
    assert classify(weak, thresholds=PatternThresholds(vertical=0.8)) == "heterogeneous"
    features = pattern_features(torch.tensor(vertical())[None, None], *masks(N))
    assert features["vertical"].item() == pytest.approx(1.0)  # [CLS] column 0.9 + heaviest other column 0.1
    assert features["diagonal"].item() == pytest.approx((0.9 + 0.1 + 0.1) / N)  # a[1,0], a[4,5], a[6,5]
    assert torch.isnan(features["block"]).all()
