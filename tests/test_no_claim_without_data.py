"""No claim without the data for it (issue 26): a test on fewer observations than its minimum reports no p-value and no
verdict (syntax relations under --min-dependents, roles, frames, classes, restore and ablation under --min-sample), and
the report folds such rows away and says why."""

import numpy as np
import pandas as pd
import pytest

import bertology
from bertology.core.statistics.stats import MIN_SAMPLE, RunningMoments, corrected, paired_bootstrap, t_test_greater


def _conllu(sentences: int, rare: int) -> str:
    """``sentences`` trees "the cat sat ." (det, nsubj, root, punct) and ``rare`` trees with one ``csubj:pass`` word."""
    blocks = ["1\tthe\t_\tDET\t_\t_\t2\tdet\t_\t_\n2\tcat\t_\tNOUN\t_\t_\t3\tnsubj\t_\t_\n3\tsat\t_\tVERB\t_\t_\t0\troot\t_\t_\n"
              "4\t.\t_\tPUNCT\t_\t_\t3\tpunct\t_\t_\n"] * sentences
    blocks += ["1\twhat\t_\tPRON\t_\t_\t2\tcsubj:pass\t_\t_\n2\tsaid\t_\tVERB\t_\t_\t0\troot\t_\t_\n"] * rare
    return "\n".join(blocks) + "\n"


def test_a_relation_with_fewer_dependents_than_the_minimum_gets_no_p_and_no_significance(tiny_bert_dir, tmp_path):
    corpus = tmp_path / "gold.conllu"
    corpus.write_text(_conllu(30, 1))
    result = bertology.analyze(tiny_bert_dir, corpus, analyses=["syntax"], probe=False, bootstrap=200, out=tmp_path / "run", progress=False,
                               view=False)
    best = result.results["syntax"].tables["syntax_best"].set_index("relation")
    rare = best.loc["csubj:pass"]
    assert rare.n == 1 and rare.few
    assert np.isnan(rare.p_value) and np.isnan(rare.p_adj) and not rare.significant and np.isnan(rare.ci_low)
    assert best.loc["det"].n == 30 and not best.loc["det"].few and np.isfinite(best.loc["det"].p_value)
    # the correction runs over the tested relations only: by hand over their p-values
    tested = best[~best.few]
    expected, _ = corrected(tested.p_value, "fdr_bh")
    np.testing.assert_allclose(tested.p_adj.to_numpy(), expected.to_numpy())
    report = (tmp_path / "run" / "report.html").read_text()
    assert "Relations with fewer than 25 dependents: not tested" in report and "<details" in report


def test_a_t_test_on_fewer_sequences_than_the_minimum_reports_no_p():
    moments = RunningMoments((2,))
    data = np.column_stack([np.full(MIN_SAMPLE, 5.0) + np.arange(MIN_SAMPLE) * 0.01, np.r_[np.full(MIN_SAMPLE - 1, 5.0), np.nan]])
    moments.push(data)
    t, p = t_test_greater(moments, 3.0)
    assert np.isfinite(p[0]) and p[0] < 1e-6  # MIN_SAMPLE observations: tested
    assert np.isnan(t[1]) and np.isnan(p[1])  # one fewer: not tested, however clear its mean
    p_adj, reject = corrected(pd.Series(p), "bonferroni")
    assert reject.tolist() == [True, False] and np.isnan(p_adj[1]) and p_adj[0] == pytest.approx(p[0])  # one test in the family


def test_roles_on_too_few_sequences_claim_no_role(tiny_bert_dir, tmp_path):
    texts = ["the cat sat on the mat.", "where is the dog?", "we saw it.", "they ran home."]
    result = bertology.analyze(tiny_bert_dir, texts, analyses=["roles"], out=tmp_path / "run", progress=False, view=False)
    roles = result.results["roles"].tables["roles"]
    assert (roles.n <= 4).all() and roles.p.isna().all() and not roles.has_role.any()
    assert "Not tested, on fewer than --min-sample 10 sequences" in (tmp_path / "run" / "report.html").read_text()
    lenient = bertology.analyze(tiny_bert_dir, texts, analyses=["roles"], min_sample=2, progress=False, view=False)
    assert lenient.results["roles"].tables["roles"].p.notna().any()


def test_a_class_in_fewer_sequences_than_the_minimum_has_no_interval_and_no_named_head(tiny_bert_dir):
    texts = ["the cat did not sit.", "the dog sat.", "a bird flew.", "we saw it."]
    result = bertology.analyze(tiny_bert_dir, texts, analyses=["classes"], classes=["neg=words:negation"], progress=False, view=False)
    table = result.results["classes"].tables["classes"]
    assert (table.n == 1).all() and table.ci_low.isna().all() and table.value.notna().any()
    assert any("fewer than --min-sample 10" in warning for warning in result.warnings)
    assert not any(line.startswith("most attention to neg") for line in bertology.families.get_family("classes").summary(result.results["classes"]))


@pytest.mark.parametrize("n, tested", [(MIN_SAMPLE - 1, False), (MIN_SAMPLE, True)])
def test_restore_and_ablation_report_no_p_on_fewer_dev_examples_than_the_minimum(n, tested):
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 2, n)
    baseline = gold.copy()
    variants = np.stack([1 - gold, gold])  # every prediction wrong; unchanged
    scores = paired_bootstrap(gold, baseline, variants, 2, "accuracy", replicates=500)
    assert scores.p.notna().all() == tested and scores.p.isna().all() == (not tested)
    assert scores.delta[0] == -1.0  # the change itself is always reported
    if tested:
        assert scores.p[0] < 0.01
