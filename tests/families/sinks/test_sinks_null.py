"""Attention sinks under the null (issue 39): the uniform head's share of the first token beside each head's, from loops
over the definition; a uniform model has no sink head even where uniform attention itself passes eps (short lines); the
rule is strictly ``> eps``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from conftest import TEXTS

from bertology.core.engine import Engine
from bertology.core.text.corpora import Example
from bertology.families.sinks.analyzer import AttentionSinks, sink_mask, sink_rates

SHORT = ["we saw it.", "go.", "yes!", "it is."]
EXAMPLES = [Example(text) for text in TEXTS + SHORT] + [Example("the cat sat.", "the dog ran.")]


def run_sinks(loaded, examples=EXAMPLES, null="uniform") -> AttentionSinks:
    analyzer = AttentionSinks(loaded.kind)
    Engine(loaded, batch_size=3, progress=False, null=null).run(examples, [analyzer])
    return analyzer


def uniform_alpha_0(n: int) -> float:
    """alpha_0 of the uniform causal head: the mean over queries i = 1 .. n-1 of 1 / (i + 1), by a loop."""
    return float(np.mean([1.0 / (i + 1) for i in range(1, n)]))


@pytest.mark.parametrize("fixture", ["gpt2_64", "llama64"])
def test_a_uniform_decoder_has_no_sink_head_though_uniform_attention_passes_eps_on_short_lines(fixture, request):
    loaded = request.getfixturevalue(fixture)
    table = run_sinks(loaded).result(min_sample=2)
    lengths = [len(loaded.tokenizer(e.text, e.text_pair)["input_ids"]) for e in EXAMPLES]
    assert min(lengths) <= 5 and uniform_alpha_0(min(lengths)) > 0.3  # uniform attention alone passes eps = 0.3 there
    attention = table[table.quantity == "attention"]
    expected = np.mean([uniform_alpha_0(n) for n in lengths])
    np.testing.assert_allclose(attention.uniform, expected, rtol=1e-12)  # beside every head: the uniform head's share
    np.testing.assert_allclose(attention.value, expected, rtol=1e-6)  # the null model's heads are that head
    assert (attention.p_excess == 1.0).all()
    assert table[table.quantity.isin(["key_norm_ratio", "value_norm_ratio"])].uniform.isna().all()
    for eps in (0.3, 0.1, expected - 0.01):  # eps below the heads' own mean: still no sink head
        rates = sink_rates(table, eps=eps, min_sample=2)
        assert (rates.sink_heads == 0).all(), (eps, rates)
    analyzer = run_sinks(loaded)
    assert analyzer.secondary(loaded.tokenizer, eps=0.1).empty  # a uniform head's last pieces of a short line are no sink


def test_the_uniform_share_on_short_lines_alone_exceeds_eps():
    for n, value in ((2, 0.5), (3, (1 / 2 + 1 / 3) / 2), (5, (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4)):
        assert uniform_alpha_0(n) == pytest.approx(value)
        assert value > 0.3  # five pieces or fewer: Gu et al.'s eps = 0.3 reached by uniform attention


def sink_table(values, p_excess, n=10) -> pd.DataFrame:
    return pd.DataFrame({"layer": 0, "head": range(len(values)), "quantity": "attention", "value": values, "n": n,
                         "uniform": 0.1, "excess": np.asarray(values) - 0.1, "p_excess": p_excess})


def test_a_head_exactly_at_eps_is_no_sink_head_and_one_above_is():
    eps = 0.3
    table = sink_table([eps, np.nextafter(eps, 1.0), 0.9, 0.9], [0.0, 0.0, 0.0, 0.9])
    assert sink_mask(table, eps, min_sample=2).tolist() == [False, True, True, False]  # strictly above; and beyond uniform
    rates = sink_rates(table, eps, min_sample=2).set_index("layer")
    assert rates.loc["0", "sink_heads"] == 2 and rates.loc["all", "rate"] == 0.5


def test_the_excess_tests_are_corrected_over_the_heads():
    from statsmodels.stats.multitest import multipletests

    p = [0.01, 0.02, 0.03, 0.04, 0.2]
    table = sink_table([0.9] * 5, p)
    for method in ("fdr_bh", "bonferroni"):
        reject = multipletests(p, alpha=0.05, method=method)[0]
        assert sink_mask(table, 0.3, min_sample=2, correction=method).tolist() == reject.tolist()
    few = sink_table([0.9] * 5, p, n=1)
    assert not sink_mask(few, 0.3, min_sample=2).any()  # undecided: too few sequences
