import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats
from statsmodels.stats.multitest import multipletests

from bertology.analyzers.roles import HeadRoles, role_colocation, role_scores, role_shares, sieve_mean, syntactic_scores


def single(n):
    """Masks of one sequence [CLS] w ... w [SEP] of n tokens."""
    mask = torch.ones(1, n, dtype=torch.bool)
    cls = torch.zeros(1, n, dtype=torch.bool)
    cls[0, 0] = True
    sep = torch.zeros(1, n, dtype=torch.bool)
    sep[0, -1] = True
    segments = torch.zeros(1, n, dtype=torch.long)
    segments[0, [0, -1]] = -1
    return mask, cls, sep, segments


def pair(n_a, n_b):
    """[CLS] A.. [SEP] B.. [SEP]"""
    n = n_a + n_b + 3
    mask = torch.ones(1, n, dtype=torch.bool)
    cls = torch.zeros(1, n, dtype=torch.bool)
    cls[0, 0] = True
    sep = torch.zeros(1, n, dtype=torch.bool)
    sep[0, [n_a + 1, n - 1]] = True
    segments = torch.tensor([[-1] + [0] * n_a + [-1] + [1] * n_b + [-1]])
    return mask, cls, sep, segments


def test_uniform_attention_scores_exactly_one_for_every_role():
    for masks, is_pair in ((single(12), False), (pair(4, 5), True)):
        n = masks[0].shape[1]
        scores = role_scores(torch.full((1, 2, n, n), 1.0 / n, dtype=torch.float64), *masks)
        for role, value in scores.items():
            if role == "block" and not is_pair:
                assert torch.isnan(value).all()  # block is for pairs only
            else:
                torch.testing.assert_close(value, torch.ones_like(value), msg=role)
    # syntactic: pieces [CLS] the cat sat [SEP], words the/cat/sat, heads the->cat, cat->sat
    assignment = np.eye(5)
    scores = syntactic_scores(torch.full((1, 2, 5, 5), 0.2, dtype=torch.float64), assignment, np.array([1, 2, 3]), (2, 3, 0), ("det", "nsubj", "root"))
    assert set(scores) == {"syntactic", "syntactic:det", "syntactic:nsubj"}
    for value in scores.values():
        torch.testing.assert_close(value, torch.ones(1, 2, dtype=torch.float64))


def test_mass_on_the_window_gives_n_over_5_away_from_the_edges():
    n, w = 15, 2
    a = np.zeros((n, n))
    for i in range(n):
        window = [j for j in range(i - w, i + w + 1) if 0 <= j < n]
        a[i, window] = 1 / len(window)
    attention = torch.tensor(a)[None, None]
    mask, cls, sep, segments = single(n)
    by_hand = sum(1 / len([j for j in range(i - w, i + w + 1) if 0 <= j < n]) for i in range(n))  # n * mean_i (1/|S_i|) sum_{S_i} a
    assert role_scores(attention, mask, cls, sep, segments)["local"].item() == pytest.approx(by_hand)
    interior = torch.zeros(1, n, dtype=torch.bool)
    interior[0, w : n - w] = True
    positions = torch.arange(n)
    window = ((positions[:, None] - positions[None, :]).abs() <= w)[None]
    assert sieve_mean(attention, window, interior, torch.tensor([[float(n)]])).item() == pytest.approx(n / 5)


def test_split_word_syntactic_score_by_hand():
    # pieces: [CLS] un ##believ ##able cat [SEP]; words "unbelievable" (pieces 1-3) -> head "cat" (piece 4)
    rng = np.random.default_rng(0)
    a = rng.dirichlet(np.ones(6), size=6)
    assignment = np.zeros((4, 6))
    assignment[[0, 1, 1, 1, 2, 3], range(6)] = 1
    scores = syntactic_scores(torch.tensor(a)[None, None], assignment, np.array([1, 2]), (2, 0), ("amod", "root"))
    by_hand = 6 * np.mean([a[i, 4] for i in (1, 2, 3)])
    assert scores["syntactic:amod"].item() == pytest.approx(by_hand)


def test_t_test_and_correction_agree_with_scipy_and_statsmodels():
    rng = np.random.default_rng(4)
    roles = HeadRoles(tau=2.0, correction="fdr_bh")
    roles._shape = (2, 3)
    samples = {"local": rng.normal(2.3, 1.0, size=(40, 2, 3)), "cls": rng.normal(5.0, 3.0, size=(40, 2, 3))}
    samples["cls"][5, 1, 2] = np.nan  # a missing score shortens that head's sample
    for role, values in samples.items():
        for chunk in np.array_split(values, 3):
            roles._push(role, chunk)
    table = roles.test()
    expected_p = []
    for role in ("local", "cls"):
        for layer in range(2):
            for head in range(3):
                x = samples[role][:, layer, head]
                x = x[~np.isnan(x)]
                test = stats.ttest_1samp(x, 2.0, alternative="greater")
                row = table.query("role == @role and layer == @layer and head == @head").iloc[0]
                assert row.t == pytest.approx(test.statistic)
                assert row.p == pytest.approx(test.pvalue)
                assert row.n == len(x)
                low, high = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
                assert (row.ci_low, row.ci_high) == (pytest.approx(low), pytest.approx(high))
                expected_p.append(test.pvalue)
    reject, adjusted, _, _ = multipletests(expected_p, alpha=0.05, method="fdr_bh")
    ordered = table.set_index(["role", "layer", "head"]).loc[[(r, l, h) for r in ("local", "cls") for l in range(2) for h in range(3)]]
    np.testing.assert_allclose(ordered.p_adj, adjusted)
    assert ordered.has_role.tolist() == reject.tolist()
    bonferroni = roles.test(correction="bonferroni").set_index(["role", "layer", "head"]).loc[ordered.index]
    np.testing.assert_allclose(bonferroni.p_adj, np.minimum(np.array(expected_p) * 12, 1))


def test_shares_and_colocation():
    table = pd.DataFrame({
        "layer": [0, 0, 0, 0, 1, 1, 1, 1], "head": [0, 0, 1, 1, 0, 0, 1, 1],
        "role": ["local", "cls", "local", "cls", "local", "cls", "local", "cls"],
        "has_role": [True, True, False, True, True, False, False, False],
    })
    shares = role_shares(table).set_index("role").share
    assert shares.to_dict() == {"local": 0.5, "cls": 0.5}
    by_layer = role_shares(table, by_layer=True).set_index(["layer", "role"]).share
    assert by_layer[(0, "cls")] == 1.0 and by_layer[(1, "cls")] == 0.0
    colocation = role_colocation(table)
    assert colocation.loc["local", "local"] == 2 and colocation.loc["local", "cls"] == 1 and colocation.loc["cls", "cls"] == 2
