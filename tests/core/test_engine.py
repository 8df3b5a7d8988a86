import math

import numpy as np
import pytest
import torch
from conftest import tiny_examples

from bertology.core.corpora import Example
from bertology.core.engine import Engine, RunStats


class Collect:
    """A minimal analyzer that keeps every sequence's attention (tests only)."""

    def __init__(self):
        self.maps, self.batches = {}, []

    def update(self, batch):
        self.batches.append(batch)
        for b, index in enumerate(batch.indices):
            n = int(batch.lengths[b])
            self.maps[index] = batch.attentions[:, b, :, :n, :n].clone()
            # padding rows and columns are zero
            assert batch.attentions[:, b, :, n:, :].abs().sum() == 0
            assert batch.attentions[:, b, :, :, n:].abs().sum() == 0


def test_rows_sum_to_one_and_masks_mark_special_tokens(tiny_bert):
    collect = Collect()
    Engine(tiny_bert, batch_size=4, progress=False).run(tiny_examples(), [collect])
    for maps in collect.maps.values():
        torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1]))
    batch = collect.batches[0]
    ids = batch.input_ids[batch.mask]
    assert set(ids[batch.cls_mask[batch.mask]].tolist()) == {tiny_bert.cls_token_id}
    assert set(ids[batch.sep_mask[batch.mask]].tolist()) == {tiny_bert.sep_token_id}
    assert batch.attentions.shape[:3] == (2, batch.size, 4)


def test_a_sequence_gets_the_same_attention_alone_or_padded_in_a_batch(tiny_bert):
    examples = tiny_examples()
    together, alone = Collect(), Collect()
    Engine(tiny_bert, batch_size=len(examples), progress=False).run(examples, [together])
    Engine(tiny_bert, batch_size=1, progress=False).run(examples, [alone])
    for index in range(len(examples)):
        torch.testing.assert_close(together.maps[index], alone.maps[index], atol=1e-6, rtol=1e-5)


def test_batches_are_length_sorted_within_windows_and_keep_every_example(tiny_bert):
    examples = [Example(" ".join(["the"] * k)) for k in (9, 1, 5, 3, 7, 2, 8, 4)]
    engine = Engine(tiny_bert, batch_size=2, sort_window=2, progress=False)
    stats = RunStats()
    batches = list(engine.batches(engine.encode(enumerate(examples), stats)))
    assert sorted(item.index for batch in batches for item in batch) == list(range(8))
    # windows of 4 examples are sorted by length: [1, 3, 5, 9] then [2, 4, 7, 8]
    assert [[len(item) - 2 for item in batch] for batch in batches] == [[1, 3], [5, 9], [2, 4], [7, 8]]


def test_long_sequences_are_truncated_or_skipped_and_counted(tiny_bert):
    examples = [Example("the cat sat."), Example(" ".join(["the cat"] * 20)), Example("a dog.", " ".join(["the"] * 30))]
    collect = Collect()
    stats = Engine(tiny_bert, batch_size=2, max_length=16, progress=False).run(examples, [collect])
    assert (stats.sequences, stats.truncated, stats.skipped) == (3, 2, 0)
    assert max(int(b.lengths.max()) for b in collect.batches) == 16
    stats = Engine(tiny_bert, batch_size=2, max_length=16, overflow="skip", progress=False).run(examples, [Collect()])
    assert (stats.sequences, stats.truncated, stats.skipped) == (1, 0, 2)


def test_attention_budget_caps_the_batch(tiny_bert):
    examples = [Example(" ".join(["the"] * 20)) for _ in range(6)]
    per_sequence = 2 * 4 * 22 * 22  # layers * heads * n * n
    engine = Engine(tiny_bert, batch_size=6, max_attention_elements=2 * per_sequence, progress=False)
    collect = Collect()
    engine.run(examples, [collect])
    assert [b.size for b in collect.batches] == [2, 2, 2]


def test_pair_segments_and_word_alignments(tiny_bert):
    collect = Collect()
    Engine(tiny_bert, batch_size=1, progress=False).run([Example("the cat.", "we saw it")], [collect])
    batch = collect.batches[0]
    assert batch.segment_ids[0].tolist() == [-1, 0, 0, 0, -1, 1, 1, 1, -1]
    alignment = batch.alignments[0]
    assert alignment.num_units == 9 and alignment.unit_is_word.sum() == 6


def test_roberta_pairs_mark_both_separators(tiny_roberta):
    collect = Collect()
    Engine(tiny_roberta, progress=False).run([Example("the cat sat.", "where is it?")], [collect])
    batch = collect.batches[0]
    assert int(batch.sep_mask.sum()) == 3 and int(batch.cls_mask.sum()) == 1
    assert batch.input_ids[0, 0] == tiny_roberta.cls_token_id
    assert math.isclose(float(batch.attentions[0, 0, 0].sum()), int(batch.lengths[0]), rel_tol=1e-5)
    assert np.isfinite(batch.attentions.numpy()).all()


@pytest.mark.parametrize("family", ["distilbert", "albert", "electra", "bert"])
def test_every_family_loads_from_a_folder_and_runs(family, tiny_bert_dir, tmp_path):
    import transformers as tf

    from bertology.core.models import load_model
    from bertology.families.profile.analyzer import GeneralProfile

    tokenizer = tf.AutoTokenizer.from_pretrained(tiny_bert_dir)
    configs = {
        "distilbert": tf.DistilBertConfig(vocab_size=len(tokenizer), dim=32, hidden_dim=64, n_layers=3, n_heads=4, max_position_embeddings=64),
        "albert": tf.AlbertConfig(vocab_size=len(tokenizer), embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, max_position_embeddings=64),
        "electra": tf.ElectraConfig(vocab_size=len(tokenizer), embedding_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, max_position_embeddings=64),
        "bert": tf.BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              max_position_embeddings=64),
    }
    tf.AutoModel.from_config(configs[family]).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cpu")
    assert (model.num_layers, model.num_heads, model.max_length) == (3, 4, 64)
    profile = GeneralProfile()
    stats = Engine(model, batch_size=4, progress=False).run(tiny_examples(), [profile])
    assert stats.sequences == len(tiny_examples())
    result = profile.result()
    assert len(result) == 3 * 4 * 9 and result.value.notna().all()
