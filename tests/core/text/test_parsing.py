import pytest

from bertology.core.errors import BertologyError
from bertology.core.text.corpora import Example
from bertology.core.text.parsing import spacy_trees


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


def test_a_line_too_long_for_spacy_names_its_file_and_line(tmp_path):
    from bertology.core.errors import CorpusError
    from bertology.core.text.corpora import Corpus

    corpus = tmp_path / "long.txt"
    corpus.write_text("a short line.\n\n" + "word " * 200_001 + "\n")
    with pytest.raises(CorpusError) as caught:
        list(spacy_trees(Corpus(corpus)))
    assert str(caught.value) == "long.txt:3: 1000004 characters, more than spaCy parses at once (1000000): split the line"
    with pytest.raises(BertologyError, match=r"^example 2: 1000005 characters, more than spaCy parses at once \(1000000\): split it$"):
        list(spacy_trees([Example("fine."), Example("word " * 200_001)]))


def test_a_line_too_long_for_spacy_is_one_line_from_the_command_line(tiny_bert_dir, tmp_path):
    from test_cli import bertology

    corpus = tmp_path / "long.txt"
    corpus.write_text("a short line.\n" + "word " * 200_001 + "\n")
    result = bertology("analyze", "--model", tiny_bert_dir, "--corpus", corpus, "--parser", "spacy", "--out", tmp_path / "run", "-q")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == ["error: long.txt:2: 1000004 characters, more than spaCy parses at once (1000000): split the line"]
