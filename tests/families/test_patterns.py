import numpy as np
import pytest
import torch

from bertology.families.patterns.analyzer import PATTERNS, PatternThresholds, RuleClassifier, pattern_features


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


def features_by_hand(a: np.ndarray, pair_at: int) -> dict:
    """The rule features of one pair's map, written as plain loops: [CLS] = 0, sentence A 1..pair_at-1,
    [SEP] = pair_at, sentence B pair_at+1..n-2, [SEP] = n-1."""
    n = a.shape[0]
    specials = {0, pair_at, n - 1}
    sentence = {i: 0 if i < pair_at else 1 for i in range(n) if i not in specials}
    column = [sum(a[i, j] for i in range(n)) / n for j in range(n)]
    block = [sum(a[i, j] for j in sentence if sentence[j] == sentence[i]) for i in sentence]  # non-special queries only
    return {
        "vertical": sum(column[j] for j in specials) + max(column[j] for j in sentence),
        "diagonal": sum(a[i, i - 1] for i in range(1, n)) / n + sum(a[i, i + 1] for i in range(n - 1)) / n,
        "block": sum(block) / len(block),
    }


def test_block_feature_averages_over_the_non_special_queries_only():
    # a pure block map: every sentence token attends within its own sentence only (the specials spread evenly);
    # averaging over the 3 special queries too (their own-sentence mass is 0) would give 17 / 20 = 0.85
    features = pattern_features(torch.tensor(block())[None, None], *masks(N, pair_at=9))
    assert features["block"].item() == pytest.approx(1.0, abs=1e-12)
    assert classify(block(), pair_at=9) == "block"
    rng = np.random.default_rng(5)
    for pair_at in (4, 9, 15):
        a = rng.dirichlet(np.full(N, 0.3), size=N)
        features = pattern_features(torch.tensor(a)[None, None], *masks(N, pair_at=pair_at))
        expected = features_by_hand(a, pair_at)
        assert {name: value.item() for name, value in features.items()} == pytest.approx(expected, rel=1e-12)


def test_pattern_examples_do_not_depend_on_the_file_name(tiny_bert):
    from bertology.families.patterns.analyzer import HeadPatterns
    from bertology.core.corpora import Example
    from bertology.core.engine import Engine
    from conftest import TEXTS

    def kept(folder):
        analyzer = HeadPatterns(examples_per_class=2, seed=3)
        Engine(tiny_bert, progress=False).run([Example(text, source=f"{folder}:{line}") for line, text in enumerate(TEXTS, 1)], [analyzer])
        return {p: [(e.key, e.layer, e.head, e.text) for e in items] for p, items in analyzer.examples().items()}

    first = kept("corpus.txt")
    assert first == kept("elsewhere/copy-of-corpus.txt") and sum(map(len, first.values())) > 0


def test_the_mixed_rule_needs_the_total_as_well_as_each_part():
    # vertical 0.288 and diagonal 0.271 are each >= mixed_min 0.25, but their sum 0.559 is < mixed_total 0.6
    a = np.zeros((N, N))
    for i in range(N):
        a[i, 0] += 0.22  # [CLS]
        a[i, 1 if i == 0 else i - 1] += 0.26  # the previous token (the first: the next one)
        far = [j for j in range(1, N - 1) if abs(i - j) >= 2]
        a[i, far] += 0.52 / len(far)
    column = a.sum(0) / N
    vertical = column[[0, N - 1]].sum() + column[1 : N - 1].max()
    diagonal = (np.trace(a, offset=-1) + np.trace(a, offset=1)) / N
    features = pattern_features(torch.tensor(a)[None, None], *masks(N))
    assert features["vertical"].item() == pytest.approx(vertical, rel=1e-12) and features["diagonal"].item() == pytest.approx(diagonal, rel=1e-12)
    assert vertical >= 0.25 and diagonal >= 0.25 and vertical + diagonal < 0.6
    assert classify(a) == "heterogeneous"  # not vertical+diagonal
    assert classify(a, thresholds=PatternThresholds(mixed_total=0.55)) == "vertical+diagonal"
    assert classify(a, thresholds=PatternThresholds(mixed_min=0.28, mixed_total=0.55)) == "heterogeneous"
