"""Clark's syntactic heads on decoders (docs/methods.md#decoders): each direction scored on the pairs whose target it can
see, with that count of pairs, beside the uniform head on the same pairs; against loops over transformers' own eager maps."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TEXTS, eager_reference

from bertology.core.engine import Engine
from bertology.core.text.alignment import align
from bertology.core.text.corpora import Example
from bertology.families.syntax.analyzer import OFFSETS, RelationHeads


def tree(text: str, heads: tuple[int, ...], relations: tuple[str, ...], line: int) -> Example:
    words, spans, begin = text.split(), [], 0
    for word in words:
        begin = text.index(word, begin)
        spans.append((begin, begin + len(word)))
        begin += len(word)
    return Example(text=text, source=f"gold:{line}", words=tuple(words), word_spans=tuple(spans), heads=heads, relations=relations)


EXAMPLES = [
    tree("the cat sat on the mat .", (2, 3, 0, 6, 6, 3, 3), ("det", "nsubj", "root", "case", "det", "obl", "punct"), 1),
    tree("we saw the big red house", (2, 0, 6, 6, 6, 2), ("nsubj", "root", "det", "amod", "amod", "obj"), 2),
    tree("the dog ran fast", (2, 3, 0, 3), ("det", "nsubj", "root", "advmod"), 3),
]


def word_level_by_loops(attention: np.ndarray, assignment: np.ndarray) -> np.ndarray:
    """``W[u, v]``: the mean over u's pieces (by share) of the attention summed over v's pieces (by share), by loops."""
    units, n = assignment.shape
    words = np.zeros((units, units))
    for u in range(units):
        for v in range(units):
            words[u, v] = sum(assignment[u, p] * assignment[v, q] * attention[p, q] for p in range(n) for q in range(n)) / assignment[u].sum()
    return words


def fractional_hit(values: np.ndarray, candidates: list[int], gold: int) -> float:
    """1/t when the gold unit is among the t candidates tied at the maximum, else 0."""
    scores = np.array([values[c] for c in candidates])
    tied = [c for c, s in zip(candidates, scores) if s >= scores.max() - 1e-12]
    return 1 / len(tied) if gold in tied else 0.0


def by_loops(loaded, examples, maps_of):
    """Per (relation, direction): the pairs seen; per (relation, direction, layer, head): the hits; per (relation, direction):
    the uniform head's hits and each offset's, with a causal decoder's visibility (query piece p sees key pieces q <= p)."""
    hits, pairs, uniform, offsets = {}, {}, {}, {}
    for example, maps in zip(examples, maps_of(loaded, examples)):
        encoding = loaded.tokenizer(example.text, return_offsets_mapping=True)
        alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [list(example.word_spans)])
        share, n = alignment.assignment, len(encoding["input_ids"])
        sees = np.array([[any(share[u, p] > 0 and share[v, q] > 0 and q <= p for p in range(n) for q in range(n))
                          for v in range(alignment.num_units)] for u in range(alignment.num_units)])
        flat = np.tril(np.ones((n, n)))
        even = word_level_by_loops(flat / flat.sum(1, keepdims=True), share)
        words = np.stack([[word_level_by_loops(maps[layer, head], share) for head in range(maps.shape[1])] for layer in range(maps.shape[0])])
        for dependent, (head_word, relation) in enumerate(zip(example.heads, example.relations)):
            if head_word == 0:
                continue
            dep_unit, gold_unit = alignment.word_unit[dependent], alignment.word_unit[head_word - 1]
            word_units = [u for u in range(alignment.num_units) if alignment.unit_is_word[u] and u != dep_unit]
            for direction in ("dep->head", "head->dep"):
                if not (sees[dep_unit, gold_unit] if direction == "dep->head" else sees[gold_unit, dep_unit]):
                    continue
                candidates = [u for u in word_units if (sees[dep_unit, u] if direction == "dep->head" else sees[u, dep_unit])]
                for key in (relation, "all"):
                    pairs[key, direction] = pairs.get((key, direction), 0) + 1
                    uniform[key, direction] = uniform.get((key, direction), 0) + fractional_hit(
                        even[dep_unit] if direction == "dep->head" else even[:, dep_unit], candidates, gold_unit)
                    for offset in OFFSETS:
                        offsets[key, direction, offset] = offsets.get((key, direction, offset), 0) + (dependent + offset == head_word - 1)
                for layer in range(words.shape[0]):
                    for head in range(words.shape[1]):
                        values = words[layer, head, dep_unit] if direction == "dep->head" else words[layer, head, :, dep_unit]
                        for key in (relation, "all"):
                            hits[key, direction, layer, head] = hits.get((key, direction, layer, head), 0) + fractional_hit(values, candidates, gold_unit)
    return hits, pairs, uniform, offsets


@pytest.mark.parametrize("model", ["gpt2_64", "llama64"])
@pytest.mark.parametrize("null", [None, "uniform"])
def test_each_direction_is_scored_on_the_pairs_it_sees_beside_the_uniform_head(model, null, request):
    loaded = request.getfixturevalue(model)
    analyzer = RelationHeads(loaded.kind, bootstrap=10, seed=0)
    Engine(loaded, batch_size=2, progress=False, null=null).run(EXAMPLES, [analyzer])
    table = analyzer.result().set_index(["relation", "direction", "layer", "head"])

    def reference_maps(loaded, examples):
        if null is None:
            return [reference["attentions"] for reference in eager_reference(loaded, examples)]
        maps = []
        for example in examples:
            n = len(loaded.tokenizer(example.text)["input_ids"])
            flat = np.tril(np.ones((n, n)))
            maps.append(np.broadcast_to(flat / flat.sum(1, keepdims=True), (loaded.num_layers, loaded.num_heads, n, n)))
        return maps

    hits, pairs, uniform, offsets = by_loops(loaded, EXAMPLES, reference_maps)
    for (relation, direction, layer, head), row in table.iterrows():
        count = pairs.get((relation, direction), 0)
        assert row.n == count, (relation, direction)
        if count:
            assert row.accuracy == pytest.approx(hits[relation, direction, layer, head] / count, abs=1e-12), (relation, direction, layer, head)
            assert row.uniform == pytest.approx(uniform[relation, direction] / count, abs=1e-12), (relation, direction)
        else:
            assert np.isnan(row.accuracy) and np.isnan(row.uniform)  # no pair this direction sees: no accuracy, never the best
    baselines = analyzer.baselines().set_index(["relation", "direction", "offset"])
    for (relation, direction, offset), row in baselines.iterrows():
        count = pairs.get((relation, direction), 0)
        assert row.n == count
        if count:  # the offsets are scored on the same pairs as the heads
            assert row.accuracy == pytest.approx(offsets[relation, direction, offset] / count, abs=1e-12)
    best = analyzer.best(min_dependents=1).set_index("relation")
    assert best.loc["all", "n"] == pairs["all", best.loc["all", "direction"]]
    assert (best.uniform == [uniform[r, d] / pairs[r, d] for r, d in zip(best.index, best.direction)]).all() or \
        np.allclose(best.uniform, [uniform[r, d] / pairs[r, d] for r, d in zip(best.index, best.direction)], atol=1e-12)


def test_a_relation_is_tested_in_the_direction_that_has_enough_pairs(gpt2_64):
    """``det`` dependents all precede their nouns: dep->head sees none of them, head->dep all; with ``min_dependents`` above
    what one direction has, the best head comes from the testable direction, never the untestable one."""
    analyzer = RelationHeads(gpt2_64.kind, bootstrap=20, seed=0)
    Engine(gpt2_64, batch_size=2, progress=False).run(EXAMPLES * 4, [analyzer])
    table = analyzer.result()
    pairs = table[(table.layer == 0) & (table["head"] == 0)].set_index(["relation", "direction"]).n
    assert pairs["det", "dep->head"] == 0 and pairs["det", "head->dep"] == 4 * 4
    best = analyzer.best(min_dependents=10).set_index("relation")
    assert best.loc["det", "direction"] == "head->dep" and not best.loc["det", "few"]
    # "all": both directions have enough pairs; the best among both
    scores = table[table.relation == "all"]
    assert best.loc["all", "accuracy"] == pytest.approx(scores.accuracy.max())


@pytest.mark.parametrize("model", ["gpt2_64", "llama64", "tiny_bert"])
def test_the_uniform_null_makes_no_syntactic_claim(model, request):
    """Every head of the null model is the uniform head: its accuracy is the uniform column's on the same pairs, and no
    relation is significant, however many heads tie."""
    from bertology.core.text.parsing import spacy_trees

    loaded = request.getfixturevalue(model)
    examples = list(spacy_trees([Example(t, source=f"t:{i}") for i, t in enumerate(TEXTS * 4)]))
    analyzer = RelationHeads(loaded.kind, bootstrap=200, seed=0)
    Engine(loaded, batch_size=4, progress=False, null="uniform").run(examples, [analyzer])
    table = analyzer.result().dropna(subset=["accuracy"])
    np.testing.assert_allclose(table.accuracy, table.uniform, rtol=0, atol=1e-6)  # float32 hits of 1/t on tiny_bert
    best = analyzer.best(min_dependents=5)
    assert not best.significant.any(), best
    assert (best.dropna(subset=["p_value"]).p_value > 0.5).all()
