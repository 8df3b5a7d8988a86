"""Clark's syntactic heads on decoders (docs/methods.md#decoders): each direction scored on the pairs whose target it can
see, with that count of pairs; against loops over transformers' own eager maps."""

from __future__ import annotations

import numpy as np
from conftest import eager_reference

from bertology.core.engine import Engine
from bertology.core.text.alignment import align, to_word_level
from bertology.core.text.corpora import Example
from bertology.families.syntax.analyzer import RelationHeads


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


def test_each_direction_is_scored_on_the_pairs_it_sees(gpt2_64):
    analyzer = RelationHeads(gpt2_64.kind, bootstrap=10, seed=0)
    engine = Engine(gpt2_64, batch_size=2, progress=False)
    engine.run(EXAMPLES, [analyzer])
    table = analyzer.result().set_index(["relation", "direction", "layer", "head"])
    hits, pairs = {}, {}
    for example, reference in zip(EXAMPLES, eager_reference(gpt2_64, EXAMPLES)):
        encoding = gpt2_64.tokenizer(example.text, return_offsets_mapping=True)
        alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [list(example.word_spans)])
        words = to_word_level(reference["attentions"], alignment)  # [layer, head, u, u]
        for dependent, (head_word, relation) in enumerate(zip(example.heads, example.relations)):
            if head_word == 0:
                continue
            dep_unit, gold_unit = alignment.word_unit[dependent], alignment.word_unit[head_word - 1]
            # dep->head sees the pair when the head comes first; head->dep when the dependent does
            direction = "dep->head" if gold_unit < dep_unit else "head->dep"
            for key in (relation, "all"):
                pairs[key, direction] = pairs.get((key, direction), 0) + 1
            candidates = [u for u in range(words.shape[-1]) if alignment.unit_is_word[u] and u != dep_unit]
            for layer in range(gpt2_64.num_layers):
                for head in range(gpt2_64.num_heads):
                    scores = words[layer, head, dep_unit] if direction == "dep->head" else words[layer, head, :, dep_unit]
                    predicted = candidates[int(np.argmax(scores[candidates]))]
                    for key in (relation, "all"):
                        hits[key, direction, layer, head] = hits.get((key, direction, layer, head), 0) + (predicted == gold_unit)
    for (relation, direction, layer, head), row in table.iterrows():
        count = pairs.get((relation, direction), 0)
        assert row.n == count, (relation, direction)
        if count:
            assert row.accuracy == hits[relation, direction, layer, head] / count, (relation, direction, layer, head)
        else:
            assert np.isnan(row.accuracy)  # no pair this direction sees: no accuracy, never the best
    best = analyzer.best(min_dependents=1).set_index("relation")
    assert best.loc["all", "n"] == pairs["all", best.loc["all", "direction"]]
