import numpy as np
import pytest

from bertology.families.syntax.probes import (
    PROBES,
    VARIANTS,
    ProbeSentence,
    baseline_uas,
    cross_validate,
    evaluate,
    offset_predictions,
    probe_uas,
    train_probe,
)


def synthetic(count=60, channels=6, dim=4, seed=0, planted=3):
    """Sentences whose channel ``planted`` puts most mass on the gold parent; the others, and the two uniform channels (each
    row spread evenly over the candidates), carry no signal."""
    rng = np.random.default_rng(seed)
    sentences = []
    for i in range(count):
        m = int(rng.integers(3, 9))
        heads = rng.integers(0, m + 1, size=m)
        heads[heads == np.arange(m) + 1] = 0  # no word heads itself
        features = rng.dirichlet(np.ones(m + 1), size=(channels, m))
        signal = np.full((m, m + 1), 0.2 / m)
        signal[np.arange(m), heads] = 0.8
        features[planted] = signal
        uniform = np.full((2, m, m + 1), 1.0 / (m + 1))
        sentences.append(ProbeSentence(f"s:{i}", f"s:{i}", features.astype(np.float16), uniform.astype(np.float16), heads,
                                       rng.normal(size=(m, dim)).astype(np.float16)))
    return sentences


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_probe_learns_a_planted_signal(variant):
    data = synthetic()
    probe = train_probe(data[:40], variant, epochs=300, batch_size=8)
    assert probe_uas(probe, data[40:]) > 0.95
    weights = probe.weights.detach().abs()
    assert int(weights.argmax()) == 3


def test_without_signal_the_probe_is_near_chance():
    data = synthetic()
    for sentence in data:
        sentence.features[3] = np.random.default_rng(1).dirichlet(np.ones(sentence.features.shape[2]), size=sentence.features.shape[1])
    probe = train_probe(data[:40], "attn", epochs=30)
    assert probe_uas(probe, data[40:]) < 0.5


def test_branching_baselines_by_hand():
    # words 1..3; heads (candidate index, 0 = root): word1 -> word2, word2 -> root, word3 -> word2
    sentence = ProbeSentence("s", "s", np.zeros((1, 3, 4), np.float16), np.zeros((1, 3, 4), np.float16), np.array([2, 0, 2]), np.zeros((3, 1), np.float16))
    assert offset_predictions(3, 1).tolist() == [2, 3, 0]  # right-branching
    assert offset_predictions(3, -1).tolist() == [0, 1, 2]  # left-branching
    assert baseline_uas([sentence], 1) == pytest.approx(1 / 3)
    assert baseline_uas([sentence], -1) == pytest.approx(1 / 3)


def test_evaluate_and_cross_validate_report_every_method():
    data = synthetic(count=30)
    result = evaluate(data[:20], data[20:], epochs=10)
    assert set(result["uas"]) == {"attn", "attn+emb", "uniform_attn", "uniform_attn+emb", "right_branching", "left_branching", "best_offset"}
    folds = cross_validate(data, folds=3, epochs=5)
    assert len(folds["folds"]) == 3 and sum(run["test_sentences"] for run in folds["folds"]) == 30
    assert folds["uas"]["attn"] > folds["uas"]["right_branching"]
    assert set(folds["verdict"]) == set(VARIANTS)


def test_a_planted_signal_beats_the_offset_baselines_and_the_uniform_probe():
    folds = cross_validate(synthetic(count=60), folds=3, epochs=60, bootstrap=200)
    for variant in VARIANTS:
        verdict = folds["verdict"][variant]
        assert verdict["beats_baselines"] and verdict["p_adj"] < 0.05 and verdict["margin"] > 0.2, verdict
        assert folds["uas"][variant] > folds["uas"][f"uniform_{variant}"] + 0.2


def test_a_probe_that_ties_its_uniform_probe_beats_nothing():
    """Features that are the uniform channels themselves (one copy per head): the heads' probe is the uniform probe (the
    same functions; trained to convergence, since Adam moves a channel's k copies k times as fast), and the verdict finds
    no win, however far above the offset baselines both sit."""
    data = synthetic(count=40)
    for sentence in data:
        sentence.uniform_features = sentence.features[[3, 3]]  # the planted signal is the uniform head's: no excess over it
        sentence.features = np.concatenate([sentence.uniform_features] * 3)
    folds = cross_validate(data, folds=2, epochs=300, bootstrap=200)
    for variant in VARIANTS:
        verdict = folds["verdict"][variant]
        assert not verdict["beats_baselines"], verdict
        assert verdict["reference"] == f"uniform_{variant}" and folds["uas"][f"uniform_{variant}"] > folds["uas"]["best_offset"]


def test_the_verdict_withholds_its_test_on_too_few_sentences():
    result = evaluate(synthetic(count=30)[:24], synthetic(count=30)[24:], epochs=5, bootstrap=100, min_sample=10)
    assert all(v["p_value"] is None and not v["beats_baselines"] for v in result["verdict"].values())


def test_the_parsing_probe_shows_its_progress_when_asked(capsys):
    sentences = synthetic(count=12)
    cross_validate(sentences, folds=3, epochs=1, seed=0, progress=True)
    err = capsys.readouterr().err
    assert "parsing probe" in err and f"/{3 * len(PROBES)}" in err  # one step per probe, uniform probes included
    cross_validate(sentences, folds=3, epochs=1, seed=0)
    assert "parsing probe" not in capsys.readouterr().err
