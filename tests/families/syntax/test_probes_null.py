"""The parsing probe under the null (issue 39): its uniform features are the word-level uniform head, checked against numpy
loops from the definition; on a null model (the tiny BERT in float64 with every query projection zeroed, so that every head
is exactly the uniform head) the heads' probe does no better than the uniform head's probe, and neither the probe's verdict
nor the family's claims say it beats its baselines."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import WORDS, float64_model

from bertology.core.engine import Engine, RunStats
from bertology.core.text.corpora import Example
from bertology.families.syntax.probes import VARIANTS, ProbeData, cross_validate

#: Whole words of the tiny vocabulary, and two that split into several pieces.
VOCABULARY = [word for word in WORDS if not word.startswith("##") and word not in ("un", "token")] + ["unbelievably", "tokenization"]


def random_tree_examples(count: int, seed: int = 0) -> list[Example]:
    """``count`` sentences of 3 to 9 random words with random trees: one root, every other word headed by its right
    neighbour with probability 0.6 (so the offset baselines and a probe of position have something to find), else by a
    random other word."""
    rng = np.random.default_rng(seed)
    examples = []
    for line in range(count):
        m = int(rng.integers(3, 10))
        words = [str(w) for w in rng.choice(VOCABULARY, size=m)]
        root = int(rng.integers(m))
        heads = []
        for i in range(m):
            others = [j for j in range(m) if j != i]
            heads.append(0 if i == root else (i + 2 if i + 1 < m and rng.random() < 0.6 else int(rng.choice(others)) + 1))
        text = " ".join(words)
        spans, begin = [], 0
        for word in words:
            begin = text.index(word, begin)
            spans.append((begin, begin + len(word)))
            begin += len(word)
        examples.append(Example(text=text, source=f"random:{line}", words=tuple(words), word_spans=tuple(spans), heads=tuple(heads),
                                relations=tuple("root" if h == 0 else "dep" for h in heads)))
    return examples


def uniform_features_by_hand(batch, b: int, layers: int) -> np.ndarray:
    """``[2 * layers, m, m + 1]``: on an encoder every real piece sees the sequence's n pieces, ``U[i, j] = 1 / n``; at word
    level (rows averaged over a word's pieces, columns summed, by loops over the alignment) read at (dependent, candidate)
    and (candidate, dependent), candidate 0 the [CLS] unit; the same in every layer."""
    alignment, n = batch.alignments[b], int(batch.host_lengths[b])
    assignment = np.asarray(alignment.assignment, dtype=np.float64)  # [unit, piece]
    units = assignment.shape[0]
    word = np.zeros((units, units))
    for u in range(units):
        for v in range(units):
            word[u, v] = sum(assignment[u, p] * assignment[v, q] / n for p in range(n) for q in range(n)) / assignment[u].sum()
    m = len(batch.examples[b].heads)
    dependents = [int(alignment.word_unit[i]) for i in range(m)]
    candidates = [int(alignment.unit_of_piece[0]), *dependents]
    dep_to_head = np.array([[word[i, j] for j in candidates] for i in dependents])
    head_to_dep = np.array([[word[j, i] for j in candidates] for i in dependents])
    return np.stack([dep_to_head] * layers + [head_to_dep] * layers)


def null_bert(tiny_bert_dir):
    """The tiny BERT in float64 with every query projection (weights and biases) zeroed: every head is exactly uniform."""
    loaded = float64_model(tiny_bert_dir)
    with torch.no_grad():
        for name, parameter in loaded.model.named_parameters():
            if ".query." in name:
                parameter.zero_()
    return loaded


def test_the_uniform_features_are_the_word_level_uniform_head(tiny_bert_dir):
    loaded = float64_model(tiny_bert_dir)
    examples = random_tree_examples(7)
    engine, data = Engine(loaded, batch_size=3, progress=False), ProbeData()  # batches of unequal lengths: padding
    engine.run(examples, [data])
    layers = loaded.model.config.num_hidden_layers
    checked = 0
    for items in engine.batches(engine.encode(enumerate(examples), RunStats())):
        batch = engine.run_batch(items)
        for b, example in enumerate(batch.examples):
            sentence = next(s for s in data.ordered() if s.source == example.source)
            expected = uniform_features_by_hand(batch, b, layers)
            assert sentence.uniform_features.dtype == np.float16 and sentence.uniform_features.shape == expected.shape
            np.testing.assert_allclose(sentence.uniform_features.astype(np.float64), expected, rtol=1e-3, atol=1e-4)
            checked += 1
    assert checked == len(examples)
    assert any(len(e.words) < len(loaded.tokenizer(e.text)["input_ids"]) - 2 for e in examples)  # a word of several pieces


@pytest.fixture(scope="module")
def null_probe_data(tiny_bert_dir):
    data = ProbeData()
    Engine(null_bert(tiny_bert_dir), batch_size=8, progress=False).run(random_tree_examples(60), [data])
    return data.ordered()


def test_on_a_null_model_every_head_feature_is_the_uniform_feature(null_probe_data):
    for sentence in null_probe_data:
        heads = sentence.features.shape[0] // sentence.uniform_features.shape[0]
        np.testing.assert_array_equal(sentence.features, np.repeat(sentence.uniform_features, heads, axis=0))


def test_on_a_null_model_the_probe_does_not_beat_the_uniform_probe(null_probe_data):
    result = cross_validate(null_probe_data, folds=5, epochs=20, bootstrap=500)
    for variant in VARIANTS:
        verdict = result["verdict"][variant]
        assert not verdict["beats_baselines"], verdict
        assert abs(result["uas"][variant] - result["uas"][f"uniform_{variant}"]) < 0.05  # the same features, duplicated per head


def test_on_a_null_model_the_family_claims_no_probe(tiny_bert_dir):
    from bertology.api import analyze
    from bertology.families import get_family

    result = analyze(null_bert(tiny_bert_dir), random_tree_examples(60), analyses=["syntax"], bootstrap=200, probe_folds=5, probe_epochs=10,
                     min_dependents=5, progress=False, view=False)
    syntax = result.results["syntax"]
    assert not any(v["beats_baselines"] for v in syntax.documents["probe"]["verdict"].values())
    assert get_family("syntax").claims(syntax) == []
    assert any("does not beat the offset baselines and the uniform probe" in line for line in get_family("syntax").summary(syntax))
