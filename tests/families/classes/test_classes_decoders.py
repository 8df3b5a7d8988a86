"""Token classes on decoders (docs/methods.md#decoders): queries after the first word, per-row baselines over the words
each row sees, the last row; against numpy from transformers' own eager maps."""

from __future__ import annotations

import numpy as np
from conftest import TEXTS, eager_reference

from bertology.core.engine import Engine
from bertology.core.model.kinds import DECODER
from bertology.core.text.alignment import align, default_word_spans, to_word_level
from bertology.core.text.corpora import Example
from bertology.families.classes.analyzer import ClassAttention, TokenClass, class_rows

EXAMPLES = [Example(text) for text in TEXTS]
THE = TokenClass("the", "words", "the", frozenset({"the"}))


def test_decoder_class_attention_equals_numpy(gpt2_64):
    analyzer = ClassAttention(gpt2_64.kind, (THE,))
    Engine(gpt2_64, batch_size=3, progress=False).run(EXAMPLES, [analyzer])
    table = analyzer.result().set_index(["layer", "head", "row"])
    assert set(table.index.unique("row")) == set(class_rows(DECODER)) == {"all", "last_row"}
    values, baselines = {}, []
    for example, reference in zip(EXAMPLES, eager_reference(gpt2_64, EXAMPLES)):
        encoding = gpt2_64.tokenizer(example.text, return_offsets_mapping=True)
        spans = default_word_spans(example.text)
        alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [spans])
        member_units = {alignment.word_unit[k] for k, (a, b) in enumerate(spans) if example.text[a:b].casefold() == "the"}
        if not member_units:
            continue
        units = alignment.num_units
        member = np.array([u in member_units for u in range(units)], dtype=float)
        is_word = alignment.unit_is_word.astype(float)
        shares = [member[: i + 1].sum() / is_word[: i + 1].sum() for i in range(1, units) if is_word[: i + 1].sum() > 0]
        baselines.append(np.mean(shares))
        words = to_word_level(reference["attentions"], alignment)  # [layer, head, u, u]
        for layer in range(gpt2_64.num_layers):
            for head in range(gpt2_64.num_heads):
                to_class = words[layer, head] @ member
                values.setdefault((layer, head, "all"), []).append(to_class[1:].mean())
                values.setdefault((layer, head, "last_row"), []).append(to_class[-1])
    assert len(baselines) > 3
    for key, expected in values.items():
        row = table.loc[key]
        np.testing.assert_allclose(row.value, np.mean(expected), rtol=1e-10, err_msg=str(key))
        np.testing.assert_allclose(row.baseline, np.mean(baselines), rtol=1e-12)
        assert row.n == len(expected)


def uniform_class_values(loaded, example, member_units, causal: bool):
    """The uniform head's attention to a class by loops from the definition: piece p spreads 1 / |S_p| over the pieces it
    sees (``q <= p`` on a decoder, every piece on an encoder); word-level rows average a unit's pieces, columns sum them;
    ``all`` is the mean over the queries (a decoder's units after the first), and the one row's own value."""
    encoding = loaded.tokenizer(example.text, example.text_pair, return_offsets_mapping=True)
    spans = [default_word_spans(example.text)] + ([default_word_spans(example.text_pair)] if example.text_pair else [])
    alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), spans)
    share, n = alignment.assignment, len(encoding["input_ids"])
    units = alignment.num_units
    to_class = []
    for u in range(units):
        total = 0.0
        for p in range(n):
            keys = [q for q in range(n) if q <= p or not causal]
            total += share[u, p] * sum(share[v, q] / len(keys) for v in member_units for q in keys)
        to_class.append(total / share[u].sum())
    start = 1 if causal else 0
    return float(np.mean(to_class[start:])), to_class


def test_the_uniform_column_equals_loops_and_the_null_decoder_names_no_head(gpt2_64, llama64):
    from bertology.families.classes import Classes
    from bertology.families.classes.report import top_heads

    for loaded in (gpt2_64, llama64):
        expected = []
        for example in EXAMPLES:
            spans = default_word_spans(example.text)
            encoding = loaded.tokenizer(example.text, return_offsets_mapping=True)
            alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [spans])
            member_units = {alignment.word_unit[k] for k, (a, b) in enumerate(spans) if example.text[a:b].casefold() == "the"}
            if member_units:
                every, rows = uniform_class_values(loaded, example, member_units, causal=True)
                expected.append((every, rows[-1]))
        for null in (None, "uniform"):
            analyzer = ClassAttention(loaded.kind, (THE,))
            Engine(loaded, batch_size=3, progress=False, null=null).run(EXAMPLES, [analyzer])
            table = analyzer.result()
            for row, k in (("all", 0), ("last_row", 1)):
                got = table[table.row == row]
                np.testing.assert_allclose(got.uniform, np.mean([e[k] for e in expected]), rtol=1e-12)
                if null is None:
                    np.testing.assert_allclose(got.excess, got.value - got.uniform, rtol=1e-9, atol=1e-12)
                else:  # every head is the uniform head: no excess, no head named
                    np.testing.assert_allclose(got.value, got.uniform, rtol=0, atol=1e-12)
                    np.testing.assert_allclose(got.excess, 0.0, atol=1e-12)
            if null == "uniform":
                assert top_heads(table, 3).empty
                result = type("R", (), {"tables": {"classes": table}})()
                assert Classes().summary(result) == ["no head gives the more attention than a uniform head"]
