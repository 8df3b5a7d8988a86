import numpy as np
import pytest

from bertology.families.syntax.probes import VARIANTS, ProbeSentence, baseline_uas, cross_validate, evaluate, offset_predictions, probe_uas, train_probe


def synthetic(count=60, channels=6, dim=4, seed=0, planted=3):
    """Sentences whose channel ``planted`` puts most mass on the gold parent; the others are noise."""
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
        sentences.append(ProbeSentence(f"s:{i}", f"s:{i}", features.astype(np.float16), heads, rng.normal(size=(m, dim)).astype(np.float16)))
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
    sentence = ProbeSentence("s", "s", np.zeros((1, 3, 4), np.float16), np.array([2, 0, 2]), np.zeros((3, 1), np.float16))
    assert offset_predictions(3, 1).tolist() == [2, 3, 0]  # right-branching
    assert offset_predictions(3, -1).tolist() == [0, 1, 2]  # left-branching
    assert baseline_uas([sentence], 1) == pytest.approx(1 / 3)
    assert baseline_uas([sentence], -1) == pytest.approx(1 / 3)


def test_evaluate_and_cross_validate_report_every_method():
    data = synthetic(count=30)
    result = evaluate(data[:20], data[20:], epochs=10)
    assert set(result["uas"]) == {"attn", "attn+emb", "right_branching", "left_branching", "best_offset"}
    folds = cross_validate(data, folds=3, epochs=5)
    assert len(folds["folds"]) == 3 and sum(run["test_sentences"] for run in folds["folds"]) == 30
    assert folds["uas"]["attn"] > folds["uas"]["right_branching"]


def test_the_parsing_probe_shows_its_progress_when_asked(capsys):
    sentences = synthetic(count=12)
    cross_validate(sentences, folds=3, epochs=1, seed=0, progress=True)
    assert "parsing probe" in capsys.readouterr().err
    cross_validate(sentences, folds=3, epochs=1, seed=0)
    assert "parsing probe" not in capsys.readouterr().err
