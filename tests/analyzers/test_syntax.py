import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from bertology.analyzers.syntax import OFFSETS, RelationHeads
from bertology.corpora import Example
from bertology.engine import Engine, RunStats

# "the cat sat on the mat ." with UD-style heads (1-based, 0 = root)
WORDS = ("the", "cat", "sat", "on", "the", "mat", ".")
HEADS = (2, 3, 0, 6, 6, 3, 3)
RELATIONS = ("det", "nsubj", "root", "case", "det", "obl", "punct")


def tree_example(text="the cat sat on the mat.", source="toy:1"):
    spans, position = [], 0
    for word in WORDS:
        position = text.index(word, position)
        spans.append((position, position + len(word)))
        position += len(word)
    return Example(text=text, source=source, words=WORDS, word_spans=tuple(spans), heads=HEADS, relations=RELATIONS)


def batch_with(model, examples, attention_for):
    """A real batch of ``examples`` whose attention is replaced by ``attention_for(batch, b)`` maps."""
    engine = Engine(model, progress=False)
    (items,) = list(engine.batches(engine.encode(enumerate(examples), RunStats())))
    batch = engine.run_batch(items)
    attentions = torch.zeros_like(batch.attentions)
    for b in range(batch.size):
        n = int(batch.lengths[b])
        attentions[:, b, :, :n, :n] = attention_for(batch, b)[None, None]
    return dataclasses.replace(batch, attentions=attentions)


def pieces_of(batch, b, word):
    alignment = batch.alignments[b]
    return np.flatnonzero(alignment.unit_of_piece == alignment.word_unit[word])


def gold_pointer(batch, b):
    """Every piece of a dependent attends to the first piece of its gold head (root and specials to [CLS])."""
    n = int(batch.lengths[b])
    matrix = torch.zeros(n, n)
    matrix[:, 0] = 1.0
    for word, head in enumerate(batch.examples[b].heads):
        if head > 0:
            for piece in pieces_of(batch, b, word):
                matrix[piece] = 0
                matrix[piece, pieces_of(batch, b, head - 1)[0]] = 1.0
    return matrix


def wrong_pointer(batch, b):
    """Every piece attends to the final "." (word 6): wrong for every dependent but the ones of "."."""
    n = int(batch.lengths[b])
    matrix = torch.zeros(n, n)
    matrix[:, pieces_of(batch, b, 6)[0]] = 1.0
    return matrix


def test_attention_at_the_gold_head_scores_100_percent_dep_to_head(tiny_bert):
    batch = batch_with(tiny_bert, [tree_example()], gold_pointer)
    analyzer = RelationHeads(bootstrap=100)
    analyzer.update(batch)
    table = analyzer.result()
    dep_to_head = table[table.direction == "dep->head"]
    assert (dep_to_head.accuracy == 1.0).all()
    assert dict(zip(dep_to_head.relation, dep_to_head.n)) == {"all": 6, "det": 2, "nsubj": 1, "case": 1, "obl": 1, "punct": 1}


def test_head_attending_to_its_dependent_scores_in_the_head_to_dep_direction(tiny_bert):
    # "mat" attends to its dependent "on"; everything else attends to [CLS]
    def pointer(batch, b):
        n = int(batch.lengths[b])
        matrix = torch.zeros(n, n)
        matrix[:, 0] = 1.0
        for piece in pieces_of(batch, b, 5):
            matrix[piece] = 0
            matrix[piece, pieces_of(batch, b, 3)[0]] = 1.0
        return matrix

    analyzer = RelationHeads(bootstrap=100)
    analyzer.update(batch_with(tiny_bert, [tree_example()], pointer))
    case = analyzer.result().query("relation == 'case'").set_index("direction").accuracy
    assert (case["head->dep"] == 1.0).all()
    assert (case["dep->head"] == 0.0).all()  # "on" attends to no word: the first candidate, "the", is predicted


def test_offset_baselines_by_hand(tiny_bert):
    analyzer = RelationHeads(bootstrap=100)
    analyzer.update(batch_with(tiny_bert, [tree_example()], gold_pointer))
    baselines = analyzer.baselines()
    # dependents (0-based word, head): the->cat (+1), cat->sat (+1), on->mat (+2), the->mat (+1), mat->sat (-3), .->sat (-4)
    expected_all = {-3: 1 / 6, -2: 0, -1: 0, 1: 3 / 6, 2: 1 / 6, 3: 0}
    got = baselines[baselines.relation == "all"].set_index("offset").accuracy.to_dict()
    assert got == pytest.approx(expected_all)
    assert baselines.query("relation == 'det' and offset == 1").accuracy.item() == 1.0
    assert baselines.query("relation == 'punct'").accuracy.max() == 0.0  # offset -4 is outside -3..+3
    assert set(baselines.offset) == set(OFFSETS)


def test_best_row_interval_and_paired_test(tiny_bert):
    examples = [tree_example(source=f"toy:{i}") for i in range(30)]
    analyzer = RelationHeads(bootstrap=400, seed=1)
    analyzer.update(batch_with(tiny_bert, examples, gold_pointer))
    best = analyzer.best(min_dependents=40).set_index("relation")
    assert best.loc["all", "accuracy"] == 1.0 and best.loc["all", "ci_low"] == 1.0
    assert best.loc["all", "baseline_offset"] == 1 and best.loc["all", "baseline_accuracy"] == pytest.approx(0.5)
    # the head is right on every replicate and the baseline never is better: p = 1 / (1 + B)
    assert best.loc["all", "p_value"] == pytest.approx(1 / 401)
    assert bool(best.loc["all", "significant"]) and not bool(best.loc["all", "few"])
    assert bool(best.loc["det", "few"]) is False and bool(best.loc["punct", "few"]) is True  # 60 vs 30 dependents


def test_bootstrap_interval_matches_a_direct_bootstrap_of_sentences(tiny_bert):
    """Replicates are Poisson-weighted sentence totals: the percentile interval agrees with one
    computed directly from the same weights on per-sentence hit counts."""
    rng = np.random.default_rng(0)
    examples = [tree_example(source=f"toy:{i}") for i in range(25)]
    hits = rng.random(25) < 0.6  # sentence i's "det" dependents are right (pointer) or wrong (uniform)

    def mixed(batch, b):
        pointer = gold_pointer if hits[int(batch.examples[b].source.split(":")[1])] else wrong_pointer
        matrix = pointer(batch, b)
        # a background growing with the query breaks argmax ties: in head->dep the last word wins, wrongly
        return matrix + 1e-3 * torch.arange(1, len(matrix) + 1)[:, None]

    analyzer = RelationHeads(bootstrap=300, seed=2)
    analyzer.update(batch_with(tiny_bert, examples, mixed))
    from bertology.stats import keyed_rng

    weights = np.stack([keyed_rng(2, e.source, e.text, e.text_pair).poisson(1.0, 300) for e in examples])  # [sentence, B]
    correct = hits.astype(float) * 2  # two det dependents per sentence
    replicate = (weights * correct[:, None]).sum(0) / (weights * 2).sum(0)
    row = analyzer.result().query("relation == 'det' and direction == 'dep->head' and layer == 0 and head == 0")
    assert row.accuracy.item() == pytest.approx(hits.mean())
    best = analyzer.best().set_index("relation").loc["det"]
    assert best.ci_low == pytest.approx(np.percentile(replicate, 2.5))
    assert best.ci_high == pytest.approx(np.percentile(replicate, 97.5))
    # and the interval is close to a normal-theory one for a proportion over sentences
    sem = scipy_stats.sem(hits.astype(float))
    assert best.ci_high - best.ci_low == pytest.approx(2 * 1.96 * sem, rel=0.35)


def test_best_accuracy_replicates_average_the_best_head_of_each_relation(tiny_bert):
    rng = np.random.default_rng(3)
    examples = [tree_example(source=f"toy:{i}") for i in range(12)]
    hits = rng.random(12) < 0.5

    def mixed(batch, b):
        pointer = gold_pointer if hits[int(batch.examples[b].source.split(":")[1])] else wrong_pointer
        return pointer(batch, b) + 1e-3 * torch.arange(1, int(batch.lengths[b]) + 1)[:, None]

    analyzer = RelationHeads(bootstrap=50, seed=4)
    analyzer.update(batch_with(tiny_bert, examples, mixed))
    best = analyzer.best(min_dependents=20)
    eligible = best[(best.relation != "all") & (best.n >= 20)]
    assert set(eligible.relation) == {"det"}  # 24 det dependents; the other relations have 12
    replicates = analyzer.best_accuracy_replicates(min_dependents=20)
    assert replicates.shape == (51,)
    assert replicates[0] == pytest.approx(eligible.accuracy.mean())
    # every head of every layer sees the same maps here, so the best head's replicate is the det interval's source
    assert np.percentile(replicates[1:], 2.5) == pytest.approx(eligible.ci_low.item())
    assert np.isnan(analyzer.best_accuracy_replicates(min_dependents=1000)).all()
