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
