"""Kovaleva et al.'s patterns under the null (issue 39): the uniform map of a sequence, encoder or causal, long or short, is
none of the classes; a uniform model's maps are all heterogeneous; the excess features are the column-by-column
differences from the uniform map, by loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PAIRS, TEXTS

from bertology.core.engine import Engine
from bertology.core.text.corpora import Example
from bertology.families.patterns.analyzer import PATTERNS, HeadPatterns, PatternThresholds, RuleClassifier, pattern_excess

EXAMPLES = [Example(text) for text in TEXTS] + [Example(a, b) for a, b in PAIRS] + [Example("go."), Example("we saw it.")]


def uniform_by_hand(n: int, causal: bool) -> np.ndarray:
    """U[i, j] = 1 / |V_i| on the keys query i sees (all n, or j <= i), by loops."""
    u = np.zeros((n, n))
    for i in range(n):
        seen = range(i + 1) if causal else range(n)
        for j in seen:
            u[i, j] = 1.0 / len(seen)
    return u


def masks(n, causal, pair_at=None):
    mask = torch.ones(1, n, dtype=torch.bool)
    special = torch.zeros(1, n, dtype=torch.bool)
    special[0, 0] = True
    segments = torch.zeros(1, n, dtype=torch.long)
    segments[0, 0] = -1
    if not causal:
        special[0, n - 1] = True
        segments[0, n - 1] = -1
    if pair_at is not None:
        special[0, pair_at] = True
        segments[0, pair_at] = -1
        segments[0, pair_at + 1 : n - (0 if causal else 1)] = 1
    visible = torch.tensor(uniform_by_hand(n, causal) > 0)[None]
    return mask, special, segments, visible


@pytest.mark.parametrize("causal", [True, False])
def test_the_uniform_map_is_no_class_at_any_length(causal):
    for n in range(2, 41):
        for pair_at in (None, *((n // 2,) if n >= 5 else ())):
            mask, special, segments, visible = masks(n, causal, pair_at)
            u = torch.tensor(uniform_by_hand(n, causal))[None, None]
            assert PATTERNS[int(RuleClassifier().classify(u, mask, special, segments, visible=visible)[0, 0])] == "heterogeneous", (n, pair_at)
            assert PATTERNS[int(RuleClassifier().classify(u.float(), mask, special, segments, visible=visible)[0, 0])] == "heterogeneous"
    # what the rules alone said: a uniform causal map of up to nine pieces is "vertical" on its first two columns
    u = uniform_by_hand(9, causal=True)
    assert (u[:, 0].sum() + u[:, 1].sum()) / 9 >= 0.5


def test_the_excess_features_are_column_by_column_differences_from_the_uniform_map():
    rng = np.random.default_rng(3)
    n = 12
    for causal in (True, False):
        mask, special, segments, visible = masks(n, causal, pair_at=5)
        a = rng.dirichlet(np.full(n, 0.3), size=n) * uniform_by_hand(n, causal) * n
        a /= a.sum(1, keepdims=True)
        u = uniform_by_hand(n, causal)
        excess = pattern_excess(torch.tensor(a)[None, None], mask, special, segments, visible)
        specials = [j for j in range(n) if special[0, j]]
        columns = [sum(a[i, j] - u[i, j] for i in range(n)) / n for j in range(n)]
        vertical = sum(columns[j] for j in specials) + max(columns[j] for j in range(n) if j not in specials)
        diagonal = sum(a[i, i - 1] - u[i, i - 1] for i in range(1, n)) / n + sum(a[i, i + 1] - u[i, i + 1] for i in range(n - 1)) / n
        sentence = {i: int(segments[0, i]) for i in range(n) if segments[0, i] >= 0}
        own = [sum(a[i, j] - u[i, j] for j in sentence if sentence[j] == sentence[i]) for i in sentence]
        assert excess["vertical"].item() == pytest.approx(vertical, rel=1e-12)
        assert excess["diagonal"].item() == pytest.approx(diagonal, rel=1e-12)
        assert excess["block"].item() == pytest.approx(np.mean(own), rel=1e-12)


def test_a_strong_vertical_map_on_a_short_causal_sequence_is_still_vertical():
    n = 6
    mask, special, segments, visible = masks(n, causal=True)
    a = np.zeros((n, n))
    a[:, 0] = 1.0  # everything on the first token
    classify = RuleClassifier().classify
    assert PATTERNS[int(classify(torch.tensor(a)[None, None], mask, special, segments, visible=visible)[0, 0])] == "vertical"
    assert PATTERNS[int(RuleClassifier(PatternThresholds(margin=0.7)).classify(torch.tensor(a)[None, None], mask, special, segments,
                                                                                 visible=visible)[0, 0])] == "heterogeneous"


@pytest.mark.parametrize("fixture", ["tiny_bert", "gpt2_64", "llama64"])
def test_a_uniform_model_has_only_heterogeneous_maps(fixture, request):
    loaded = request.getfixturevalue(fixture)
    analyzer = HeadPatterns()
    Engine(loaded, batch_size=3, progress=False, null="uniform").run(EXAMPLES, [analyzer])
    table = analyzer.result()
    assert (table[table.pattern != "heterogeneous"].share == 0).all(), table[table.share > 0]
    assert (table.majority == "heterogeneous").all()
