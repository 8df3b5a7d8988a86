"""Roles under the null (issue 39): every head replaced by the uniform head over the keys it saw (``Engine(null="uniform")``)
holds no role, whatever tau, and the ``uniform`` column is the uniform head's score, checked against loops from the
definition; a sliding window's local role is measured against the window's keys."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import PAIRS, TEXTS, gold_example

from bertology.core.engine import Engine, RunStats
from bertology.core.text.corpora import Example
from bertology.families.roles.analyzer import HeadRoles

EXAMPLES = ([Example(text) for text in TEXTS] + [Example(a, b) for a, b in PAIRS] + [Example("the cat sat.", "the dog ran fast.")]
            + [gold_example(k, text) for k, text in enumerate(TEXTS[:4])])


def run_roles(loaded, examples=EXAMPLES, null="uniform", tau=0.5, batch_size=3) -> HeadRoles:
    roles = HeadRoles(loaded.kind, tau=tau)
    Engine(loaded, batch_size=batch_size, progress=False, null=null).run(examples, [roles])
    return roles


def uniform_block_by_hand(n: int, segments: list[int], by_position: list[int], sees_later: bool) -> float:
    """Pande et al.'s block score of the uniform head on one pair of ``n`` pieces, from the definition: per query i (row 0 out
    on a decoder), the mean of U over the non-special pieces of i's segment it sees, over ``1/|V_i|``, times the entropy of
    U's row, ``ln |V_i|``; ``segments[j]`` 0, 1, or -1 for a special piece, whose own segment is ``by_position``."""
    terms = []
    for i in range(0 if sees_later else 1, n):
        seen = list(range(n)) if sees_later else list(range(i + 1))
        own = segments[i] if segments[i] >= 0 else by_position[i]
        keys = [j for j in seen if segments[j] == own]
        if not keys:
            continue
        row = 1.0 / len(seen)
        entropy = -sum(row * math.log(row) for _ in seen)
        terms.append(sum(row for _ in keys) / len(keys) * len(seen) * entropy)
    return float(np.mean(terms))


@pytest.mark.parametrize("fixture", ["tiny_bert", "gpt2_64", "llama64"])
def test_a_uniform_model_holds_no_role_and_its_heads_score_the_uniform_value(fixture, request):
    loaded = request.getfixturevalue(fixture)
    table = run_roles(loaded).test(min_sample=2)
    assert not table.has_role.any(), table[table.has_role]
    assert {"local", "delimiter", "block", "syntactic"} <= set(table.role)
    tested = table[table.p.notna()]
    assert len(tested) and (tested.p_excess == 1.0).all()  # a uniform head's excess is 0: its test decides nothing
    np.testing.assert_allclose(tested["mean"], tested.uniform, rtol=1e-5)
    for role in ("local", "delimiter", "syntactic", *(("cls", "sep") if loaded.kind.sees_later_keys else ())):
        np.testing.assert_allclose(table[table.role == role].uniform, 1.0, rtol=1e-12)  # every sieve role of U: 1
    # block: Pande et al.'s entropy-weighted score, ln n-like for the uniform head, from loops over each pair (the segments
    # and [SEP]s are the batch's: what is under test is the score)
    engine, expected = Engine(loaded, progress=False), []
    for item in engine.encode(enumerate(e for e in EXAMPLES if e.text_pair is not None), RunStats()):
        batch = engine.run_batch([item])
        segments, n = batch.segment_ids[0].tolist(), len(item)
        seps = batch.anchors["sep"][0].tolist() if "sep" in batch.anchors else [False] * n
        by_position = [int(any(seps[: i + 1])) for i in range(n)]  # specials: B from the first [SEP] on
        expected.append(uniform_block_by_hand(n, segments, by_position, loaded.kind.sees_later_keys))
    block = table[table.role == "block"]
    np.testing.assert_allclose(block.uniform, np.mean(expected), rtol=1e-9)
    assert (block.uniform > 1.5).all()  # far above the sieve roles' 1: the excess, not the raw score, is what is tested


def test_a_random_model_with_block_scores_above_tau_needs_an_excess_over_the_uniform_head(llama64):
    """The random Llama's block scores sit at the uniform head's (ln n-like) on pairs: above a low tau, yet held by no head
    that does not beat the uniform head on the same sequences."""
    pairs = [Example(a, b) for a, b in PAIRS] * 3 + [Example("the cat sat.", "the dog ran fast.")] * 3
    table = run_roles(llama64, pairs, null=None, tau=1.0).test(min_sample=2)
    block = table[table.role == "block"]
    assert (block["mean"] > 1.0).all()  # every head passes tau on its raw score
    held = block[block.has_role]
    assert (held.p_excess <= 0.05).all() and (held.excess > 0).all()
    assert set(held.index) <= set(block[block.p_excess < 0.05].index)


def test_a_sliding_window_uniform_head_scores_one_on_local_and_holds_no_role(tiny_llama_dir):
    from core.test_null_and_visible_keys import windowed

    loaded = windowed(tiny_llama_dir, "mistral", window=4)
    examples = [Example(text) for text in TEXTS] * 2
    assert max(len(loaded.tokenizer(text)["input_ids"]) for text in TEXTS) > 8  # longer than the window
    table = run_roles(loaded, examples).test(min_sample=2)
    local = table[table.role == "local"]
    np.testing.assert_allclose(local["mean"], 1.0, rtol=1e-6)  # the window's keys, not i + 1, are the reference
    np.testing.assert_allclose(local.uniform, 1.0, rtol=1e-12)
    assert not table.has_role.any()
