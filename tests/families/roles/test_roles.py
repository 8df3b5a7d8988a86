from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats
from statsmodels.stats.multitest import multipletests

from bertology.core.engine import Batch
from bertology.core.model.kinds import ENCODER
from bertology.core.text.corpora import Example
from bertology.families.roles.analyzer import HeadRoles, role_colocation, role_shares, sieve_mean
from bertology.families.roles.analyzer import role_scores as scores_of_kind
from bertology.families.roles.analyzer import syntactic_scores as syntactic_of_kind


def role_scores(attention, mask, cls, sep, segments, **options):
    """An encoder's sieve scores from its [CLS] and [SEP] masks."""
    return scores_of_kind(attention, mask, {"cls": cls, "sep": sep}, segments, ENCODER, **options)


def syntactic_scores(attention, assignment, word_unit, heads, relations):
    """An encoder's syntactic scores."""
    return syntactic_of_kind(attention, assignment, word_unit, heads, relations, ENCODER)


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


def local_by_hand(a, w=2):
    """The local sieve score read literally off METHODS.md section 5, one query at a time."""
    n = len(a)
    return np.mean([np.mean([a[i, j] for j in range(n) if abs(i - j) <= w]) for i in range(n)]) / (1 / n)


def block_by_hand(a, special, first_sep):
    """The block score as Pande et al.'s code computes it: every token i, specials included, is in A before
    the first [SEP] and in B from it on; (mean of a[i] over the non-special tokens of i's segment) / (1/n)
    times the entropy in nats of the whole row; mean over i."""
    n = len(a)
    segment = [0 if i < first_sep else 1 for i in range(n)]
    total = 0.0
    for i in range(n):
        sieve = [j for j in range(n) if segment[j] == segment[i] and j not in special]
        entropy = -sum(a[i, j] * np.log(a[i, j]) for j in range(n) if a[i, j] > 0)
        total += np.mean(a[i, sieve]) / (1 / n) * entropy
    return total / n


def batch_of(maps, masks):
    """One padded batch ``[batch, head, width, width]`` and its masks from per-sequence maps and masks."""
    width = max(m[0].shape[1] for m in masks)
    attention = torch.zeros(len(maps), maps[0].shape[0], width, width, dtype=maps[0].dtype)
    padded = [torch.zeros(len(maps), width, dtype=torch.bool) for _ in range(3)] + [torch.full((len(maps), width), -1)]
    for b, (a, sequence) in enumerate(zip(maps, masks)):
        n = a.shape[-1]
        attention[b, :, :n, :n] = a
        for target, source in zip(padded, sequence):
            target[b, :n] = source[0]
    return attention, padded


def test_uniform_attention_scores_one_for_every_sieve_role_and_ln_n_for_block():
    for masks, is_pair in ((single(12), False), (pair(4, 5), True)):
        n = masks[0].shape[1]
        scores = role_scores(torch.full((1, 2, n, n), 1.0 / n, dtype=torch.float64), *masks)
        for role, value in scores.items():
            if role == "block" and not is_pair:
                assert torch.isnan(value).all()  # block is for pairs only
            elif role == "block":
                torch.testing.assert_close(value, torch.full_like(value, np.log(n)))  # (1/n)/(1/n) * H(uniform) = ln n
            else:
                torch.testing.assert_close(value, torch.ones_like(value), msg=role)
    # syntactic: pieces [CLS] the cat sat [SEP], words the/cat/sat, heads the->cat, cat->sat
    assignment = np.eye(5)
    scores = syntactic_scores(torch.full((1, 2, 5, 5), 0.2, dtype=torch.float64), assignment, np.array([1, 2, 3]), (2, 3, 0), ("det", "nsubj", "root"))
    assert set(scores) == {"syntactic", "syntactic:det", "syntactic:nsubj"}
    for value in scores.values():
        torch.testing.assert_close(value, torch.ones(1, 2, dtype=torch.float64))


def test_local_window_counts_keys_at_distance_two():
    n = 9
    a = np.zeros((n, n))
    for i in range(n):  # all the mass at distance exactly 2
        far = [j for j in (i - 2, i + 2) if 0 <= j < n]
        a[i, far] = 1 / len(far)
    mask, cls, sep, segments = single(n)
    score = role_scores(torch.tensor(a)[None, None], mask, cls, sep, segments)["local"].item()
    # n * mean_i 1/|S_i| with |S_i| = 3, 4, 5, ..., 5, 4, 3: a window |i - j| < 2 would give 0
    assert score == pytest.approx(9 * (2 / 3 + 2 / 4 + 5 / 5) / 9, rel=1e-12)
    assert score == pytest.approx(local_by_hand(a), rel=1e-12)
    b = np.random.default_rng(0).dirichlet(np.ones(n), size=n)
    assert role_scores(torch.tensor(b)[None, None], mask, cls, sep, segments)["local"].item() == pytest.approx(local_by_hand(b), rel=1e-12)
    interior = torch.zeros(1, n, dtype=torch.bool)
    interior[0, 2 : n - 2] = True
    positions = torch.arange(n)
    window = ((positions[:, None] - positions[None, :]).abs() <= 2)[None]
    inside = (torch.tensor(a)[None, None] * window).sum(-1)  # the sieve sums sum_{j in S_i} a[i, j]
    assert sieve_mean(inside, window.sum(-1), interior, torch.tensor([[n]])).item() == pytest.approx(n / 5)


def test_delimiter_counts_cls_and_sep_exactly():
    # a hand-made map with a heavy [CLS] column: the delimiter score (both kinds) is far from the [SEP]-only one
    rng = np.random.default_rng(3)
    for masks, specials in ((single(8), [0, 7]), (pair(3, 4), [0, 4, 9])):
        n = masks[0].shape[1]
        a = 0.5 * rng.dirichlet(np.ones(n), size=n)
        a[:, 0] += 0.4  # [CLS]
        a[:, specials[-1]] += 0.1  # the last [SEP]
        scores = role_scores(torch.tensor(a)[None, None], *masks)
        expected = {"delimiter": n * a[:, specials].mean(1).mean(), "cls": n * a[:, 0].mean(), "sep": n * a[:, specials[1:]].mean(1).mean()}
        assert {role: scores[role].item() for role in expected} == pytest.approx(expected, rel=1e-12)
        assert abs(expected["delimiter"] - expected["sep"]) > 0.5


def test_block_score_matches_the_authors_definition_by_hand():
    rng = np.random.default_rng(1)
    layouts = []
    mask, cls, sep, segments = pair(3, 4)  # [CLS] a a a [SEP] b b b b [SEP]
    layouts.append(((mask, cls, sep, segments), {0, 4, 9}, 4))
    # RoBERTa: <s> a a </s> </s> b b b </s>; the second </s> belongs to B
    segments = torch.tensor([[-1, 0, 0, -1, -1, 1, 1, 1, -1]])
    sep = torch.tensor([[False, False, False, True, True, False, False, False, True]])
    cls = torch.zeros(1, 9, dtype=torch.bool)
    cls[0, 0] = True
    layouts.append(((torch.ones(1, 9, dtype=torch.bool), cls, sep, segments), {0, 3, 4, 8}, 3))
    maps = []
    for masks, _, _ in layouts:
        n = masks[0].shape[1]
        a = rng.dirichlet(np.full(n, 0.5), size=(2, n))
        a[1, :, ::3] = 0  # zeros in the rows: 0 ln 0 = 0
        maps.append(torch.tensor(a / a.sum(-1, keepdims=True)))
    attention, masks = batch_of(maps, [layout[0] for layout in layouts])  # padded in one batch
    scores = role_scores(attention, *masks)["block"]
    for b, (a, (_, special, first_sep)) in enumerate(zip(maps, layouts)):
        for head in range(2):
            assert scores[b, head].item() == pytest.approx(block_by_hand(a[head].numpy(), special, first_sep), rel=1e-12)


def test_block_head_on_its_own_segment_scores_n_over_m_ln_m_and_passes_tau_3():
    roles = HeadRoles(ENCODER, tau=3.0)
    roles._shape = (1, 2)
    for m in range(6, 13):
        masks = pair(m, m)
        n = 2 * m + 3
        segment = [0] * (m + 1) + [1] * (m + 2)  # [CLS] + A, then the first [SEP] + B + [SEP]
        a = np.zeros((2, n, n))
        for i in range(n):
            own = [j for j in range(n) if segment[j] == segment[i] and j not in (0, m + 1, n - 1)]
            a[0, i, own] = 1 / m  # spread evenly over its own segment
            a[1, i, own[0]] = 1.0  # on one token of its block: entropy 0
        scores = role_scores(torch.tensor(a)[None], *masks)["block"]
        assert scores[0, 0].item() == pytest.approx(n / m * np.log(m), rel=1e-12)  # (1/m)/(1/n) * ln m for every token
        assert scores[0, 0].item() == pytest.approx(block_by_hand(a[0], {0, m + 1, n - 1}, m + 1), rel=1e-12)
        assert scores[0, 1].item() == 0.0
        roles._push("block", scores.numpy()[:, None])
    table = roles.test(min_sample=2).set_index("head")
    assert table.loc[0, "mean"] > 4.4 and table.loc[0, "has_role"]  # 2.5 ln 6 = 4.48 ... (27/12) ln 12 = 5.59
    assert not table.loc[1, "has_role"]


def test_scores_are_float64_from_sums_in_the_maps_dtype():
    # The sieve sums are one sweep over the float32 maps; only those sums are float64: equal to float64 by hand to
    # float32's rounding of a sum of n terms (issue 28: metrics at the cost of a sweep, in the maps' dtype).
    rng = np.random.default_rng(2)
    a = torch.tensor(rng.dirichlet(np.ones(10), size=(1, 1, 10)), dtype=torch.float32)
    exact = a[0, 0].double().numpy()  # the float32 values, scored in float64
    scores = role_scores(a, *pair(3, 4))
    assert all(value.dtype == torch.float64 for value in scores.values())
    assert scores["local"].item() == pytest.approx(local_by_hand(exact), rel=1e-6)
    assert scores["block"].item() == pytest.approx(block_by_hand(exact, {0, 4, 9}, 4), rel=1e-6)
    syntactic = syntactic_scores(a, np.eye(10), np.arange(1, 9), (2, 0, 2, 3, 4, 5, 6, 7), ("a",) * 8)["syntactic"]
    assert syntactic.dtype == torch.float64
    assert syntactic.item() == pytest.approx(10 * np.mean([exact[w + 1, h] for w, h in zip(range(8), (2, 0, 2, 3, 4, 5, 6, 7)) if h]), rel=1e-13)


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
    roles = HeadRoles(ENCODER, tau=2.0, correction="fdr_bh")
    roles._shape = (2, 3)
    samples = {"local": rng.normal(2.3, 1.0, size=(40, 2, 3)), "cls": rng.normal(5.0, 3.0, size=(40, 2, 3))}
    samples["cls"][5, 1, 2] = np.nan  # a missing score shortens that head's sample
    for role, values in samples.items():
        for chunk in np.array_split(values, 3):
            roles._push(role, chunk)
    table = roles.test()
    for role in ("local", "cls"):
        expected_p = []
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
        reject, adjusted, _, _ = multipletests(expected_p, alpha=0.05, method="fdr_bh")  # one family per role
        ordered = table.set_index(["role", "layer", "head"]).loc[role]
        np.testing.assert_allclose(ordered.p_adj, adjusted)
        assert ordered.has_role.tolist() == reject.tolist()
        bonferroni = roles.test(correction="bonferroni").set_index(["role", "layer", "head"]).loc[role]
        np.testing.assert_allclose(bonferroni.p_adj, np.minimum(np.array(expected_p) * 6, 1))


def test_a_role_labels_do_not_depend_on_other_roles_in_the_run():
    rng = np.random.default_rng(5)
    local = rng.normal(3.0, 1.0, size=(30, 2, 4)) + np.linspace(0, 0.8, 8).reshape(2, 4)
    roles = HeadRoles(ENCODER, tau=3.0)
    roles._shape = (2, 4)
    roles._push("local", local)
    alone = roles.test().set_index(["layer", "head"])
    p = [stats.ttest_1samp(local[:, layer, h], 3.0, alternative="greater").pvalue for layer in range(2) for h in range(4)]
    reject, adjusted, _, _ = multipletests(p, alpha=0.05, method="fdr_bh")
    np.testing.assert_allclose(alone.p_adj, adjusted)
    assert alone.has_role.tolist() == reject.tolist()
    roles._push("block", rng.normal(6.0, 1.0, size=(30, 2, 4)))  # eight more heads, all far above tau
    roles._push("syntactic", rng.normal(2.0, 1.0, size=(30, 2, 4)))  # eight more, all far below
    with_others = roles.test().query("role == 'local'").set_index(["layer", "head"])
    pd.testing.assert_frame_equal(with_others, alone)


def test_uniform_float32_head_holds_no_role_at_tau_1():
    # n * float32(1/n) > 1 for each n: float noise above 1, over zero variance (one length) or a tiny one
    for lengths in ([10] * 8, [5, 6, 7, 9, 10, 11, 12, 13]):
        maps, masks = [], []
        for n in lengths:
            a = torch.full((2, n, n), 1.0 / n, dtype=torch.float32)  # head 0: uniform
            a[1] = 0  # head 1: a true local head (all on the window)
            for i in range(n):
                a[1, i, max(0, i - 2) : i + 3] = 1.0 / len(range(max(0, i - 2), min(n, i + 3)))
            maps.append(a)
            masks.append(single(n))
        attention, (mask, cls, sep, segments) = batch_of(maps, masks)
        items = [SimpleNamespace(example=Example("x"), input_ids=[0] * n, sequence_ids=[0] * n) for n in lengths]
        batch = Batch(items=items, input_ids=torch.zeros_like(segments), mask=mask, anchors={"cls": cls, "sep": sep},
                      punct_mask=torch.zeros_like(mask), segment_ids=segments, attentions=attention[None], kind=ENCODER)
        roles = HeadRoles(ENCODER, tau=1.0)
        roles.update(batch)
        table = roles.test(min_sample=2).set_index(["head", "role"])
        for role in ("local", "delimiter", "cls", "sep"):
            assert table.loc[(0, role), "mean"] == pytest.approx(1.0, rel=1e-6)
            assert not table.loc[(0, role), "has_role"] and table.loc[(0, role), "p"] == 1.0, (lengths, role)
        assert table.loc[(1, "local"), "has_role"]


def test_constant_scores_at_tau_are_tested_and_never_pass():
    roles = HeadRoles(ENCODER, tau=3.0)
    roles._shape = (1, 3)
    scores = np.tile([3.0, 3.0 * (1 + 1e-7), 5.0], (20, 1, 1))  # exactly tau; tau plus float noise; far above
    scores[::2, 0, 1] += 3e-9  # with a little variance
    roles._push("local", scores)
    table = roles.test().set_index("head")
    assert table.p.tolist()[:2] == [1.0, 1.0] and table.t.tolist()[:2] == [0.0, 0.0]
    assert table.p_adj.tolist()[:2] == [1.0, 1.0]  # in the family, not left out as untestable
    assert table.has_role.tolist() == [False, False, True]


def test_shares_and_colocation():
    table = pd.DataFrame({
        "layer": [0, 0, 0, 0, 1, 1, 1, 1], "head": [0, 0, 1, 1, 0, 0, 1, 1],
        "role": ["local", "cls", "local", "cls", "local", "cls", "local", "cls"],
        "has_role": [True, True, False, True, True, False, False, False],
        "p": [0.01, 0.01, 0.5, 0.01, 0.01, np.nan, 0.5, np.nan],  # layer 1's cls cells were not tested (too few sequences)
    })
    shares = role_shares(table).set_index("role")
    assert shares.share.to_dict() == {"local": 0.5, "cls": 1.0} and shares.tested.to_dict() == {"local": 4, "cls": 2}
    by_layer = role_shares(table, by_layer=True).set_index(["layer", "role"]).share
    assert by_layer[(0, "cls")] == 1.0 and np.isnan(by_layer[(1, "cls")]) and by_layer[(1, "local")] == 0.5
    colocation = role_colocation(table)
    assert colocation.loc["local", "local"] == 2 and colocation.loc["local", "cls"] == 1 and colocation.loc["cls", "cls"] == 2


def test_block_score_on_real_rte_pairs_matches_a_plain_loop(minilm, shared_data):
    """The default model on RTE dev pairs: the block role's mean per head equals METHODS.md section 5 computed
    by a plain loop over tokens on transformers' own attention maps (and reaches well above tau = 3)."""
    import csv

    from transformers import AutoModel

    from bertology.api import analyze
    from bertology.core.model.models import default_model_path

    with (shared_data / "glue" / "RTE" / "dev.tsv").open() as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))[:8]
    reference = AutoModel.from_pretrained(default_model_path(), attn_implementation="eager").eval()
    tokenizer, scores = minilm.tokenizer, []
    for row in rows:
        encoded = tokenizer(row["sentence1"], row["sentence2"], return_tensors="pt")
        with torch.no_grad():
            attention = torch.stack(reference(**encoded, output_attentions=True).attentions)[:, 0].double().numpy()
        ids = encoded["input_ids"][0].tolist()
        n, first_sep = len(ids), ids.index(tokenizer.sep_token_id)
        special = [i in (tokenizer.cls_token_id, tokenizer.sep_token_id) for i in ids]
        segment = [0 if i < first_sep else 1 for i in range(n)]
        total = np.zeros(attention.shape[:2])
        for i in range(n):
            keys = [j for j in range(n) if segment[j] == segment[i] and not special[j]]
            row_i = attention[:, :, i, :]
            entropy = -np.sum(np.where(row_i > 0, row_i * np.log(np.where(row_i > 0, row_i, 1.0)), 0.0), axis=-1)
            total += row_i[:, :, keys].mean(-1) * n * entropy
        scores.append(total / n)
    result = analyze(minilm, [Example(r["sentence1"], r["sentence2"]) for r in rows], analyses=["roles"], progress=False, view=False)
    block = result.table("roles")[result.table("roles").role == "block"].sort_values(["layer", "head"])["mean"].to_numpy().reshape(6, 12)
    np.testing.assert_allclose(block, np.mean(scores, axis=0), rtol=1e-6)
    assert block.max() > 3


def test_the_roles_grid_draws_each_roles_mean_score_per_head_with_its_holders_marked():
    """Issue 26: one panel per role with a score, the layer x head mean sieve score (white at tau), a dot on each head that
    holds the role, and the strongest head named; a role with no score (block on single sentences) gets no panel."""
    from bertology.families.roles.analyzer import SUMMARY_ROLES
    from bertology.families.roles.report import role_grid, role_strength

    rng = np.random.default_rng(0)
    rows = []
    for role in ("local", "cls", "block"):
        for layer in range(3):
            for head in range(4):
                mean = np.nan if role == "block" else rng.uniform(0, 12 if role == "cls" else 4)
                rows.append((layer, head, role, mean, bool(mean > 3.5) if role != "block" else False))
    roles = pd.DataFrame(rows, columns=["layer", "head", "role", "mean", "has_role"])
    grids = role_strength(roles, SUMMARY_ROLES)
    assert list(grids) == ["local", "cls"]
    figure = role_grid(roles, SUMMARY_ROLES, tau=3.0)
    panels = [axis for axis in figure.axes if axis.images]
    assert len(panels) == 2
    for axis, role in zip(panels, ("local", "cls")):
        rows = roles[roles.role == role]
        score = rows.pivot(index="layer", columns="head", values="mean").to_numpy()
        image = axis.images[0]
        np.testing.assert_array_equal(image.get_array(), score)
        assert image.norm.vcenter == 3.0 and image.norm.vmax >= score.max()
        held = {(int(head), int(layer)) for head, layer in axis.collections[0].get_offsets()}
        assert held == {(head, layer) for layer, head in zip(rows.layer[rows.has_role], rows["head"][rows.has_role])}
        best = rows.loc[rows["mean"].idxmax()]
        assert axis.get_title().startswith(f"{role}: {int(rows.has_role.sum())} of 12 heads hold it; strongest {best.layer}-{best['head']}")


def roles_table():
    """A small ``roles`` table: local has three tested heads (two hold the role) and one untested head with the largest
    mean (seen in 5 sequences: no p-value, it must not be named); cls has no tested head; block has nothing to score."""
    nan = float("nan")
    return pd.DataFrame({
        "layer": [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0],
        "head": [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0],
        "role": ["local"] * 4 + ["cls"] * 4 + ["block"] * 4 + ["syntactic:nsubj"],
        "mean": [4.5, 3.2, 6.25, 9.0, 2.0, 2.5, 1.0, 1.5, nan, nan, nan, nan, 8.0],
        "ci_low": [4.0, 2.9, 5.5, 1.0, 1.0, 1.0, 1.0, 1.0, nan, nan, nan, nan, 7.0],
        "ci_high": [5.0, 3.5, 7.0, 17.0, 3.0, 4.0, 1.0, 2.0, nan, nan, nan, nan, 9.0],
        "t": [6.0, 1.1, 8.0, nan, nan, nan, nan, nan, nan, nan, nan, nan, 5.0],
        "p": [0.001, 0.15, 0.0004, nan, nan, nan, nan, nan, nan, nan, nan, nan, 0.001],
        "p_adj": [0.0015, 0.15, 0.0012, nan, nan, nan, nan, nan, nan, nan, nan, nan, 0.001],
        "has_role": [True, False, True, False, False, False, False, False, False, False, False, False, True],
        "n": [12, 12, 12, 5, 6, 6, 4, 6, 0, 0, 0, 0, 12],
    })


def test_the_summary_counts_tested_heads_only_and_names_the_strongest_tested_head():
    from bertology.families import FamilyResult, get_family

    lines = get_family("roles").summary(FamilyResult(tables={"roles": roles_table()}, extras={"role_tau": 3.0}))
    assert lines == [
        "role local at tau 3: 2 of 3 tested heads (67%), 1 not tested; strongest 1-0 (mean score 6.25, 95% CI 5.50-7.00, p_adj 0.0012, holds it)",
        "role cls at tau 3: not tested (every head seen in at most 6 sequences, fewer than --min-sample)",
    ]  # block (nothing scored) and the per-relation syntactic role are left out; 1-1's mean of 9.0 is untested


def test_the_summary_of_two_views_says_which_view_each_line_is_of():
    from bertology.families import FamilyResult, get_family
    from bertology.studies.analyze.weightings import combine_views

    second = roles_table().assign(has_role=False)
    combined = combine_views({"attention": FamilyResult(tables={"roles": roles_table()}, extras={"role_tau": 2.0}),
                              "norm": FamilyResult(tables={"roles": second}, extras={"role_tau": 2.0})})
    lines = get_family("roles").summary(combined)
    assert [line.split(":")[0] for line in lines] == ["[attention weights] role local at tau 2", "[attention weights] role cls at tau 2",
                                                      "[norm shares] role local at tau 2", "[norm shares] role cls at tau 2"]
    assert "0 of 3 tested heads (0%)" in lines[2] and lines[2].endswith("does not pass the test)")


def test_the_summary_of_a_run_matches_its_table(tiny_bert):
    """A real run at the run's own tau: the printed count and the strongest head are the table's."""
    from conftest import tiny_examples

    from bertology.api import analyze
    from bertology.families import get_family

    result = analyze(tiny_bert, tiny_examples(), analyses=["roles"], tau=1.0, progress=False, view=False)
    lines = {line.split(":")[0]: line for line in get_family("roles").summary(result.results["roles"])}
    table = result.table("roles")
    local = table[(table.role == "local") & table.p.notna()]
    top = local.loc[local["mean"].idxmax()]
    assert lines["role local at tau 1"].startswith(f"role local at tau 1: {int(local.has_role.sum())} of {len(local)} tested heads")
    assert f"strongest {int(top.layer)}-{int(top['head'])} (mean score {top['mean']:.2f}," in lines["role local at tau 1"]
    assert lines["role block at tau 1"] == "role block at tau 1: not tested (every head seen in at most 2 sequences, fewer than --min-sample)"


def test_with_no_head_holding_a_role_the_section_says_so_in_words_in_place_of_empty_frames(tmp_path):
    """Issue 39: where every share is 0 the bars per layer and the colocation counts would be empty frames: the section says
    so in one note and draws the score grid alone; where a head holds a role, both figures are drawn."""
    from bertology.core.storage.runfolder import RunFolder
    from bertology.families.roles.report import roles_section

    shares_by_tau = pd.DataFrame({"role": ["local", "cls"], "tau": [3.0, 3.0], "share": [0.0, 0.0]})
    unheld = roles_table().assign(has_role=False)
    assert not (role_shares(unheld, by_layer=True).share > 0).any()
    with RunFolder(tmp_path / "unheld") as folder:
        section = roles_section(folder, unheld, shares_by_tau, tau=3.0, correction="fdr_bh", min_sample=10)
    assert [figure.path.stem for figure in section.figures] == ["roles_grid"]
    assert any(note.startswith("Share of heads holding each role per layer, and heads holding two roles at once: nothing to show: "
                               "every value is 0") for note in section.notes)
    with RunFolder(tmp_path / "held") as folder:
        section = roles_section(folder, roles_table(), shares_by_tau, tau=3.0, correction="fdr_bh", min_sample=10)
    assert [figure.path.stem for figure in section.figures] == ["roles_by_layer", "roles_grid", "roles_colocation"]
    assert not any("nothing to show" in note for note in section.notes)
