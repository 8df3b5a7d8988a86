import numpy as np
import torch

from bertology.core.text.alignment import align, default_word_spans, to_word_level


def encode(model, text, pair=None):
    encoding = model.tokenizer(text, pair, return_offsets_mapping=True)
    return encoding, model.tokenizer.convert_ids_to_tokens(encoding["input_ids"])


def test_default_words_keep_contractions_and_split_punctuation():
    text = "Don't stop, dog's bowl!"
    assert [text[a:b] for a, b in default_word_spans(text)] == ["Don't", "stop", ",", "dog's", "bowl", "!"]


def test_split_words_and_punctuation_map_to_their_word(tiny_bert):
    text = "unbelievably, tokenization splits words!"
    encoding, pieces = encode(tiny_bert, text)
    assert pieces == ["[CLS]", "un", "##believ", "##ably", ",", "token", "##ization", "split", "##s", "word", "##s", "!", "[SEP]"]
    alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [default_word_spans(text)])
    # units: [CLS]=0, unbelievably=1, ","=2, tokenization=3, splits=4, words=5, "!"=6, [SEP]=7
    assert alignment.unit_of_piece.tolist() == [0, 1, 1, 1, 2, 3, 3, 4, 4, 5, 5, 6, 7]
    assert alignment.word_unit.tolist() == [1, 2, 3, 4, 5, 6]
    assert alignment.unit_is_word.tolist() == [False, True, True, True, True, True, True, False]


def test_pairs_number_words_of_sentence_b_after_sentence_a(tiny_bert):
    encoding, pieces = encode(tiny_bert, "the cat.", "we saw it")
    assert pieces == ["[CLS]", "the", "cat", ".", "[SEP]", "we", "saw", "it", "[SEP]"]
    alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [default_word_spans("the cat."), default_word_spans("we saw it")])
    assert alignment.unit_of_piece.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert alignment.word_unit.tolist() == [1, 2, 3, 5, 6, 7]  # the second [SEP] and first [SEP] are units 8 and 4
    assert not alignment.unit_is_word[[0, 4, 8]].any()


def test_roberta_pieces_with_leading_space_and_empty_pieces(tiny_roberta):
    text, pair = "the cat sat.", "where is it?"
    encoding, pieces = encode(tiny_roberta, text, pair)
    alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [default_word_spans(text), default_word_spans(pair)])
    words = [text[a:b] for a, b in default_word_spans(text)] + [pair[a:b] for a, b in default_word_spans(pair)]
    # Every non-special piece lands on the word its characters spell (a lone "Ġ" joins the next word).
    for piece, unit, segment in zip(pieces, alignment.unit_of_piece, encoding.sequence_ids()):
        if segment is None:
            assert not alignment.unit_is_word[unit]
        else:
            word = int(np.flatnonzero(alignment.word_unit == unit)[0])
            assert piece.replace("\u0120", "") in words[word], (piece, words[word])
    assert (alignment.word_unit >= 0).all()
    assert alignment.num_units == len(words) + 4  # <s>, </s>, </s>, </s>


def test_word_level_attention_sums_columns_and_averages_rows():
    # pieces: [CLS], "un", "##believ", "!", [SEP]  ->  units [CLS], unbelievable, !, [SEP]
    from bertology.core.text.alignment import WordAlignment

    assignment = np.zeros((4, 5))
    assignment[[0, 1, 1, 2, 3], range(5)] = 1
    alignment = WordAlignment(assignment, np.array([1, 2]), np.array([False, True, True, False]))
    rng = np.random.default_rng(0)
    attention = rng.dirichlet(np.ones(5), size=5)
    merged = to_word_level(attention, alignment)
    expected = np.zeros((4, 4))
    groups = [[0], [1, 2], [3], [4]]
    for u, rows in enumerate(groups):
        for v, cols in enumerate(groups):
            expected[u, v] = np.mean([attention[i, cols].sum() for i in rows])
    np.testing.assert_allclose(merged, expected)
    np.testing.assert_allclose(merged.sum(axis=1), 1.0)
    batched = to_word_level(torch.tensor(np.stack([attention, attention])), alignment)
    np.testing.assert_allclose(batched.numpy()[1], expected)


def test_ud_contraction_shares_the_straddling_piece_between_its_words(tmp_path):
    """UD splits "don't" into "do" + "n't"; BERT's pieces are "don", "'", "t"."""
    from transformers import AutoTokenizer

    from bertology.core.model.models import default_model_path
    from bertology.core.text.corpora import read_conllu

    conllu = tmp_path / "c.conllu"
    conllu.write_text(
        "1\tI\t_\t_\t_\t_\t3\tnsubj\t_\t_\n2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n2\tdo\t_\t_\t_\t_\t4\taux\t_\t_\n"
        "3\tn't\t_\t_\t_\t_\t4\tadvmod\t_\t_\n4\tknow\t_\t_\t_\t_\t0\troot\t_\tSpaceAfter=No\n5\t.\t_\t_\t_\t_\t4\tpunct\t_\t_\n\n"
    )
    (example,) = read_conllu(conllu)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    encoding = tokenizer(example.text, return_offsets_mapping=True)
    assert tokenizer.convert_ids_to_tokens(encoding["input_ids"]) == ["[CLS]", "i", "don", "'", "t", "know", ".", "[SEP]"]
    alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), [list(example.word_spans)])
    assert (alignment.word_unit >= 0).all()
    do, nt = alignment.word_unit[1], alignment.word_unit[2]
    np.testing.assert_allclose(alignment.assignment[[do, nt]][:, 2:5], [[2 / 3, 0, 0], [1 / 3, 1, 1]])
    np.testing.assert_allclose(alignment.assignment.sum(axis=0), 1.0)
    attention = np.random.default_rng(1).dirichlet(np.ones(8), size=8)
    merged = to_word_level(attention, alignment)
    np.testing.assert_allclose(merged.sum(axis=1), 1.0)
    # attention TO "do" is 2/3 of the attention to "don"; FROM "do" is the row of "don"
    np.testing.assert_allclose(merged[:, do], (alignment.assignment / alignment.assignment.sum(1, keepdims=True)) @ attention[:, 2] * 2 / 3)
    np.testing.assert_allclose(merged[do], attention[2] @ alignment.assignment.T)
