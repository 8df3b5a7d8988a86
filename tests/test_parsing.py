import pytest

from bertology.corpora import Example
from bertology.errors import BertologyError
from bertology.parsing import spacy_trees


def test_spacy_trees_give_words_spans_heads_and_relations():
    (example,) = spacy_trees([Example("The cat sat on the mat.")])
    assert example.words == ("The", "cat", "sat", "on", "the", "mat", ".")
    assert [example.text[a:b] for a, b in example.word_spans] == list(example.words)
    assert example.heads[2] == 0 and example.relations[2] == "root"
    assert example.heads[1] == 3 and example.relations[1] == "nsubj"
    assert example.heads[0] == 2 and example.relations[0] == "det"


def test_examples_with_gold_trees_pass_through():
    gold = Example("a b", words=("a", "b"), word_spans=((0, 1), (2, 3)), heads=(0, 1), relations=("root", "dep"))
    assert list(spacy_trees([gold])) == [gold]


def test_missing_pipeline_is_a_one_line_error():
    with pytest.raises(BertologyError, match="no spaCy English pipeline no_such_pipeline is installed"):
        list(spacy_trees([Example("x")], pipeline="no_such_pipeline"))
