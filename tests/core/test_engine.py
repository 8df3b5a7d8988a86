import math

import numpy as np
import pytest
import torch
from conftest import tiny_examples

from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError
from bertology.core.model.kinds import ENCODER
from bertology.core.text.corpora import Example


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
    assert set(ids[batch.anchors["cls"][batch.mask]].tolist()) == {tiny_bert.cls_token_id}
    assert set(ids[batch.anchors["sep"][batch.mask]].tolist()) == {tiny_bert.sep_token_id}
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



def test_batches_packed_by_tokens_hold_at_most_that_many_padded_pieces_and_give_the_same_tables(tiny_bert):
    from bertology.families.profile.analyzer import GeneralProfile

    # short and long sequences: packed by tokens, the short ones go many to a batch and the long ones few
    examples = [Example(" ".join(["the"] * words)) for words in (2, 3, 2, 30, 28, 3, 2, 25, 4, 3)]
    collect = Collect()
    Engine(tiny_bert, batch_tokens=64, progress=False).run(examples, [collect])
    sizes = [(b.size, int(b.lengths.max())) for b in collect.batches]
    assert all(count * longest <= 64 or count == 1 for count, longest in sizes), sizes
    assert sum(count for count, _ in sizes) == len(examples)
    assert sizes[0][0] > 2 and sizes[-1][0] <= 2  # many short ones together (sorted by length), the long ones apart
    # batching changes no number (the analyzer contract): the same profile as batches of 32 sequences
    packed, by_count = GeneralProfile(ENCODER), GeneralProfile(ENCODER)
    Engine(tiny_bert, batch_tokens=64, progress=False).run(examples, [packed])
    Engine(tiny_bert, batch_size=32, progress=False).run(examples, [by_count])
    a, b = packed.result(), by_count.result()
    np.testing.assert_allclose(a.value, b.value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(a.excess, b.excess, rtol=1e-5, atol=1e-6)

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
    assert int(batch.anchors["sep"].sum()) == 3 and int(batch.anchors["cls"].sum()) == 1
    assert batch.input_ids[0, 0] == tiny_roberta.cls_token_id
    assert math.isclose(float(batch.attentions[0, 0, 0].sum()), int(batch.lengths[0]), rel_tol=1e-5)
    assert np.isfinite(batch.attentions.numpy()).all()


@pytest.mark.parametrize("family", ["distilbert", "albert", "electra", "bert"])
def test_every_family_loads_from_a_folder_and_runs(family, tiny_bert_dir, tmp_path):
    import transformers as tf

    from bertology.core.model.models import load_model
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
    profile = GeneralProfile(ENCODER)
    stats = Engine(model, batch_size=4, progress=False).run(tiny_examples(), [profile])
    assert stats.sequences == len(tiny_examples())
    result = profile.result()
    assert len(result) == 3 * 4 * 9 and result.value.notna().all()


def long_line(characters: int, seed: int = 0) -> str:
    """Words of the tiny vocabulary with accented and CJK words among them (several bytes a character in UTF-8), joined by
    spaces up to ``characters`` characters."""
    rng = np.random.default_rng(seed)
    words = np.array("the cat sat on the mat , where is the dog ? unbelievably tokenization ran fast café über 日本語 !".split())
    line = " ".join(rng.choice(words, size=characters // 3))
    return line[:characters]


class TokenizerSpy:
    """Records the length of every text (and pair text) the tokenizer class is called with."""

    def __init__(self, monkeypatch, tokenizer):
        self.lengths, original = [], type(tokenizer).__call__

        def spy(tokenizer, text, text_pair=None, **options):
            self.lengths.append(len(text) + len(text_pair or ""))
            return original(tokenizer, text, text_pair, **options)

        monkeypatch.setattr(type(tokenizer), "__call__", spy)


@pytest.fixture(scope="module")
def readers(tiny_bert, tiny_gpt2_dir, tiny_llama_dir):
    """WordPiece with [CLS] and [SEP] (BERT), byte-level BPE without special tokens (GPT-2) and with BOS (Llama)."""
    from bertology.core.model.models import load_model

    return {"bert": tiny_bert, "gpt2": load_model(tiny_gpt2_dir, device="cpu"), "llama": load_model(tiny_llama_dir, device="cpu")}


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_a_multi_megabyte_line_is_tokenized_from_a_bounded_part_and_keeps_the_whole_lines_first_pieces(kind, readers, monkeypatch):
    from bertology.core.engine import CHARS_PER_PIECE, CUT_MARGIN

    model, line = readers[kind], long_line(2_000_000)
    whole = model.tokenizer(line, truncation=True, max_length=16, return_offsets_mapping=True)  # the whole line, truncated by transformers
    assert len(model.tokenizer(line[:100_000])["input_ids"]) > 16
    spy = TokenizerSpy(monkeypatch, model.tokenizer)
    stats = RunStats()
    items = list(Engine(model, max_length=16, progress=False).encode([(0, Example(line))], stats))
    assert 0 < max(spy.lengths) <= CUT_MARGIN + CHARS_PER_PIECE * 16
    assert (stats.truncated, len(items)) == (1, 1) and items[0].truncated
    assert items[0].input_ids == whole["input_ids"] and items[0].offsets == [tuple(o) for o in whole["offset_mapping"]]
    assert items[0].sequence_ids == whole.sequence_ids()
    skipped = RunStats()
    assert list(Engine(model, max_length=16, overflow="skip", progress=False).encode([(0, Example(line, source="big.txt:1"))], skipped)) == []
    assert (skipped.skipped, skipped.truncated, skipped.skipped_sources) == (1, 0, ["big.txt:1"])


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_bounded_reading_cuts_no_line_that_fits_and_pairs_keep_the_pieces_of_the_whole_pair(kind, readers):
    model = readers[kind]
    line = long_line(3000, seed=1)
    examples = [Example(line), Example(line, "the cat sat."), Example("the cat sat.", line), Example(line[:1100]), Example(line[:1500], line[:40]),
                Example(" " * 5000 + line[:60]), Example("the " + "a" * 4000 + " cat")]  # spaces make no piece in WordPiece; a long word one [UNK]
    for max_length in (16, 17, 64):
        for overflow in ("truncate", "skip"):
            stats = RunStats()
            items = {item.index: item for item in Engine(model, max_length=max_length, overflow=overflow, progress=False).encode(enumerate(examples), stats)}
            too_long = [len(model.tokenizer(e.text, e.text_pair)["input_ids"]) > max_length for e in examples]
            assert (stats.truncated, stats.skipped) == ((sum(too_long), 0) if overflow == "truncate" else (0, sum(too_long)))
            for index, example in enumerate(examples):
                if overflow == "skip" and too_long[index]:
                    assert index not in items
                    continue
                whole = model.tokenizer(example.text, example.text_pair, truncation="longest_first", max_length=max_length, return_offsets_mapping=True)
                item = items[index]
                assert item.input_ids == whole["input_ids"] and item.offsets == [tuple(o) for o in whole["offset_mapping"]], (max_length, index)
                assert item.sequence_ids == whole.sequence_ids() and item.truncated == too_long[index]


def test_sequences_of_fewer_than_two_pieces_are_skipped_counted_and_named(readers):
    gpt2, llama = readers["gpt2"], readers["llama"]
    examples = [Example(""), Example("the cat sat on the mat."), Example("cat", source="c.txt:3"), Example("we saw it."), Example("the dog ran.")]
    assert [len(gpt2.tokenizer(e.text)["input_ids"]) for e in examples] == [0, 11, 1, 7, 5]
    collect, positions = Collect(), []
    engine = Engine(gpt2, batch_size=1, sort_window=2, progress=False)
    stats = engine.run(examples, [collect], on_batch=lambda stats, position: positions.append(position))
    assert (stats.sequences, stats.degenerate, stats.skipped, stats.seen) == (3, 2, 0, 5)
    assert stats.skipped_sources == ["example 1", "c.txt:3"] and stats.as_dict()["degenerate"] == 2
    assert sorted(collect.maps) == [1, 3, 4] and min(map(len, (m[0, 0] for m in collect.maps.values()))) >= 2
    # The second window starts after the four examples the first one read, the two it skipped included (where a resumed run starts).
    assert [p["window_start"] for p in positions] == [0, 0, 4] and positions[-1]["degenerate_before"] == 2
    # Llama puts BOS first: an empty text is one piece; at --max-length 1 every text is cut to one.
    assert len(llama.tokenizer("")["input_ids"]) == 1
    assert Engine(llama, progress=False).run([Example(""), Example("the cat.")], [Collect()]).degenerate == 1
    stats = Engine(llama, max_length=1, progress=False).run([Example("the cat.", source="t:1"), Example("we saw it.")], [Collect()])
    assert (stats.sequences, stats.truncated, stats.degenerate) == (0, 0, 2)
    with pytest.raises(BertologyError) as refused:
        stats.check_counted(1)
    assert str(refused.value) == "no sequence to analyse: every one was skipped, 2 of fewer than 2 pieces (the first: t:1)"


def test_an_analyzers_needs_are_decoded_once_and_an_unknown_one_is_refused():
    from types import SimpleNamespace

    from bertology.core.engine import NO_NEEDS, PassNeeds

    mixing, states = SimpleNamespace(needs=frozenset({"mixing", "alti"})), SimpleNamespace(needs=frozenset({"hidden_states"}))
    needs = PassNeeds.of([mixing, states], ["norm", "alti"])
    assert needs == PassNeeds(norms=True, mixing=True, hidden_states=True, contributions=("alti",), views=("alti",))
    assert needs.values and needs.layer_inputs and needs.anything
    only_states = PassNeeds.of([states, SimpleNamespace()], ["attention", "attention"])
    assert only_states == PassNeeds(hidden_states=True) and not only_states.values and not only_states.layer_inputs
    assert PassNeeds.of([SimpleNamespace()], ["attention"]) == NO_NEEDS and not NO_NEEDS.anything
    with pytest.raises(BertologyError, match=r"unknown analyzer needs \['mixng'\]"):
        PassNeeds.of([SimpleNamespace(needs=frozenset({"mixng"}))], ["attention"])


@pytest.mark.parametrize("query_rows", [None, 1], ids=["whole-maps", "a-row-at-a-time"])
def test_a_pass_that_stops_after_a_layer_runs_no_later_layer_and_hands_over_the_same_maps(tiny_llama_dir, query_rows):
    from bertology.core.engine import PassNeeds
    from bertology.core.model.models import load_model

    model = load_model(tiny_llama_dir, device="cpu")
    engine = Engine(model, batch_size=2, progress=False)
    items = list(engine.encode(enumerate(tiny_examples()[:2]), RunStats()))
    layers = [module for name, module in model.model.named_modules() if name.endswith("layers")][0]
    assert len(layers) >= 2

    def run(last_layer):
        seen, ran = {}, []

        def keep(batch, layer, maps):  # every block of the layer's rows, in order
            block = maps("attention").attention.clone()
            seen[layer] = torch.cat([seen[layer], block], dim=-2) if layer in seen else block

        handle = layers[1].register_forward_pre_hook(lambda module, args: ran.append(1))
        try:
            engine.run_batch(items, PassNeeds(norms=True), on_layer=keep, query_rows=query_rows, last_layer=last_layer)
        finally:
            handle.remove()
        return seen, ran

    whole, ran_whole = run(None)
    first, ran_first = run(0)
    assert sorted(whole) == list(range(len(layers))) and len(ran_whole) == 1
    assert list(first) == [0] and ran_first == []  # layer 1 never ran
    torch.testing.assert_close(first[0], whole[0], rtol=0, atol=0)
    with pytest.raises(BertologyError, match="without hidden states"):
        engine.run_batch(items, PassNeeds(hidden_states=True), on_layer=lambda *args: None, last_layer=0)


@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["stacked", "layer-by-layer"])
def test_a_batch_and_its_tensors_are_freed_as_soon_as_it_is_dropped(tiny_llama_dir, layer_by_layer):
    # no reference cycle (the hooks' handlers are the capture's methods): a long input's batches are not left to the
    # garbage collector, which a pass of few Python objects seldom runs
    import gc
    import weakref

    from bertology.core.engine import PassNeeds
    from bertology.core.model.models import load_model

    engine = Engine(load_model(tiny_llama_dir, device="cpu"), batch_size=2, progress=False)
    items = list(engine.encode(enumerate(tiny_examples()[:2]), RunStats()))
    collecting = gc.isenabled()
    gc.disable()
    try:
        batch = engine.run_batch(items, PassNeeds(hidden_states=True, norms=True), on_layer=(lambda *args: None) if layer_by_layer else None)
        held = [weakref.ref(batch), weakref.ref(batch.hidden_states)] + ([] if layer_by_layer else [weakref.ref(batch.attentions)])
        del batch
        assert [ref() for ref in held] == [None] * len(held)
    finally:
        if collecting:
            gc.enable()
