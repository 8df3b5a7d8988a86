import pytest

from bertology.core.errors import CorpusError
from bertology.core.text.corpora import Corpus, TableLayout, prepare_jsonl_append, read_conllu, read_labels, read_pairs, read_table, read_text

CONLLU = """# sent_id = 1
# text = I don't know.
1	I	I	PRON	PRP	_	3	nsubj	_	_
2-3	don't	_	_	_	_	_	_	_	_
2	do	do	AUX	VBP	_	4	aux	_	_
3	n't	not	PART	RB	_	4	advmod	_	_
4	know	know	VERB	VB	_	0	root	_	SpaceAfter=No
4.1	knows	know	VERB	VB	_	_	_	3:conj	_
5	.	.	PUNCT	.	_	4	punct	_	_

# sent_id = 2
1	Yes	yes	INTJ	UH	_	0	root	_	_

"""


def write(tmp_path, name, content, mode="w"):
    path = tmp_path / name
    if mode == "wb":
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_text_skips_blank_lines_and_strips_bom_and_crlf(tmp_path):
    path = write(tmp_path, "c.txt", "", mode="w")
    path.write_bytes("\ufeffFirst line.\r\n\r\n   \r\nSecond line.\r\n".encode())
    examples = list(read_text(path))
    assert [e.text for e in examples] == ["First line.", "Second line."]
    assert examples[1].source == "c.txt:4"


@pytest.mark.parametrize("end", [b"\n", b"\r"], ids=["lf", "cr-only"])
def test_invalid_utf8_names_the_line(tmp_path, end):
    path = write(tmp_path, "bad.txt", end.join([b"good", b"also good", b"bad \xff byte", b""]), mode="wb")
    with pytest.raises(CorpusError, match=r"bad\.txt:3: invalid UTF-8 at byte 4 of the line"):
        list(read_text(path))


def test_cr_only_line_ends_split_lines_with_their_numbers(tmp_path):
    path = write(tmp_path, "mac.txt", b"First line.\rSecond line.\r\rThird line.\r", mode="wb")
    assert [(e.text, e.line) for e in read_text(path)] == [("First line.", 1), ("Second line.", 2), ("Third line.", 4)]


def test_cr_lf_cr_and_lf_mixed_each_end_one_line(tmp_path):
    path = write(tmp_path, "mixed.txt", b"\xef\xbb\xbfa\r\nb\rc\nd\r\r\ne", mode="wb")
    assert [(e.text, e.line) for e in read_text(path)] == [("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 6)]


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"], ids=["crlf", "cr", "lf"])
@pytest.mark.parametrize("before", [65_534, 65_535, 65_536])
def test_a_line_end_where_the_file_is_read_in_two_parts_ends_one_line(tmp_path, before, end):
    path = write(tmp_path, "long.txt", b"x" * before + end + b"y" + end, mode="wb")
    assert [(len(e.text), e.line) for e in read_text(path)] == [(before, 1), (1, 2)]


def test_glue_and_conllu_with_cr_only_line_ends(tmp_path):
    sst = write(tmp_path, "sst.tsv", b"sentence\tlabel\rfine .\t1\rbad .\t0\r", mode="wb")
    assert [(e.text, e.label, e.line) for e in Corpus(sst)] == [("fine .", "1", 2), ("bad .", "0", 3)]
    unix = [(e.words, e.heads, e.source) for e in read_conllu(write(tmp_path, "t.conllu", CONLLU))]
    mac = write(tmp_path, "t.conllu", CONLLU.replace("\n", "\r").encode(), mode="wb")
    assert [(e.words, e.heads, e.source) for e in read_conllu(mac)] == unix


LABEL_LINE = '{"text": "a cat.", "layer": 0, "head": 1, "label": "block"}'


def test_a_json_line_nested_too_deep_is_a_one_line_error_naming_its_line(tmp_path):
    path = write(tmp_path, "labels.jsonl", LABEL_LINE + "\n" + "[" * 100_000 + "\n")
    with pytest.raises(CorpusError, match=r"labels\.jsonl:2: JSON nested deeper than 64 levels"):
        list(Corpus(path))


def test_a_json_number_too_long_to_convert_is_a_one_line_error_naming_its_line(tmp_path):
    path = write(tmp_path, "labels.jsonl", LABEL_LINE + "\n" + LABEL_LINE.replace('"layer": 0', '"layer": ' + "9" * 5000) + "\n")
    with pytest.raises(CorpusError, match=r"labels\.jsonl:2: not valid JSON"):
        list(Corpus(path))


def test_prepare_jsonl_append_ends_a_last_line_without_its_line_end(tmp_path):
    path = write(tmp_path, "labels.jsonl", LABEL_LINE + "\n" + LABEL_LINE)
    prepare_jsonl_append(path)
    assert path.read_text() == LABEL_LINE + "\n" + LABEL_LINE + "\n"
    with open(path, "a") as handle:
        handle.write(LABEL_LINE.replace("block", "diagonal") + "\n")
    assert [e.pattern_label for e in read_labels(path)] == [(0, 1, "block"), (0, 1, "block"), (0, 1, "diagonal")]


@pytest.mark.parametrize("content", ["", "\n\n", LABEL_LINE + "\n", LABEL_LINE + "\r\n", LABEL_LINE + "\r"], ids=["empty", "blank", "lf", "crlf", "cr"])
def test_prepare_jsonl_append_leaves_a_file_whose_lines_all_end_as_it_is(tmp_path, content):
    path = write(tmp_path, "labels.jsonl", content)
    prepare_jsonl_append(path)
    assert path.read_bytes() == content.encode()
    prepare_jsonl_append(tmp_path / "new.jsonl")
    assert not (tmp_path / "new.jsonl").exists()


@pytest.mark.parametrize("last", ['{"text": "cut sho', "[1, 2]", "NaN"], ids=["cut-short", "not-an-object", "nan"])
def test_prepare_jsonl_append_refuses_a_bad_last_line_naming_it(tmp_path, last):
    path = write(tmp_path, "labels.jsonl", LABEL_LINE + "\n\n" + last)
    with pytest.raises(CorpusError, match=r"labels\.jsonl:3: "):
        prepare_jsonl_append(path)
    assert path.read_text() == LABEL_LINE + "\n\n" + last


def test_empty_file_is_an_error_naming_the_file(tmp_path):
    path = write(tmp_path, "empty.txt", "\n\n")
    with pytest.raises(CorpusError, match=r"empty\.txt: no examples"):
        Corpus(path, format="text").validate()


def test_pairs_need_two_columns(tmp_path):
    path = write(tmp_path, "p.tsv", "a cat.\ta dog.\tentailment\nonly one column\n")
    with pytest.raises(CorpusError, match=r"p\.tsv:2: expected 2 tab-separated columns"):
        list(read_pairs(path))
    first = next(read_pairs(path))
    assert (first.text, first.text_pair, first.label) == ("a cat.", "a dog.", "entailment")


def test_glue_row_with_missing_columns_names_its_line(tmp_path):
    path = write(tmp_path, "rte.tsv", "index\tsentence1\tsentence2\tlabel\n0\tA\n")
    with pytest.raises(CorpusError, match=r"rte\.tsv:2: expected at least 4 tab-separated columns, found 2"):
        list(Corpus(path))


def test_table_without_a_named_column_names_the_header(tmp_path):
    path = write(tmp_path, "mine.tsv", "text\tgold\nfine\t1\n")
    with pytest.raises(CorpusError, match=r"mine\.tsv:1: missing column 'label' in the header \(found: text, gold\)"):
        list(read_table(path, TableLayout("text", label="label")))


@pytest.mark.parametrize(
    "task, count, pair, first_text",
    [
        ("SST-2", 872, False, "it 's a charming and often affecting journey ."),
        ("MRPC", 408, True, "He said the foodservice pie business doesn't fit the company's long-term growth strategy."),
        ("RTE", 277, True, "Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer at age 44, "
                           "according to the Christopher Reeve Foundation."),
        ("CoLA", 1043, False, "The sailors rode the breeze clear of the rocks."),
    ],
)
def test_glue_dev_sets(shared_data, task, count, pair, first_text):
    corpus = Corpus(shared_data / "glue" / task / "dev.tsv")
    assert corpus.format == "glue"
    examples = list(corpus)
    assert len(examples) == count
    assert examples[0].text == first_text
    assert all((e.text_pair is not None) == pair for e in examples)
    assert all(e.label is not None for e in examples)


def test_conllu_reads_words_heads_and_relations_and_skips_multiword_and_empty_nodes(tmp_path):
    path = write(tmp_path, "t.conllu", CONLLU)
    first, second = read_conllu(path)
    assert first.text == "I don't know."
    assert first.words == ("I", "do", "n't", "know", ".")
    assert first.heads == (3, 4, 4, 0, 4)
    assert first.relations == ("nsubj", "aux", "advmod", "root", "punct")
    assert [first.text[a:b] for a, b in first.word_spans] == ["I", "do", "n't", "know", "."]
    assert first.source == "t.conllu:1"
    assert second.words == ("Yes",) and second.source == "t.conllu:11"


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_", "expected 10 tab-separated CoNLL-U columns, found 9"),
        ("2\tdo\tdo\tAUX\tVBP\t_\tx\taux\t_\t_", "malformed CoNLL-U line"),
        ("7\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_", "word id 7 out of order"),
    ],
)
def test_malformed_conllu_names_the_line(tmp_path, bad_line, message):
    lines = CONLLU.splitlines()
    lines[4] = bad_line  # the line of word 2 ("do") is line 5
    del lines[3]  # drop the multiword token so only the bad line is wrong
    path = write(tmp_path, "bad.conllu", "\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=rf"bad\.conllu:4: {message}"):
        list(read_conllu(path))


def test_an_empty_form_under_a_multiword_token_is_a_one_line_error(tmp_path):
    """Found by fuzzing: words of no characters under a multiword token divided by zero when the surface was split."""
    path = write(tmp_path, "empty.conllu", "1-1\tdo\t_\t_\t_\t_\t_\t_\t_\t_\n1\t\t_\tNOUN\t_\t_\t0\tdep\t_\t_\n")
    with pytest.raises(CorpusError, match=r"empty\.conllu:2: empty FORM column"):
        list(read_conllu(path))


def test_ewt_test_set_aligns_every_word_to_its_surface_text(shared_data):
    examples = list(read_conllu(shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu"))
    assert len(examples) == 2077
    assert sum(len(e.words) for e in examples) == 25094
    for example in examples:
        for word, (a, b) in zip(example.words, example.word_spans):
            assert example.text[a:b].lower() == word.lower()


def test_bundled_sample_corpus_has_sentences_and_pairs():
    corpus = Corpus()
    examples = list(corpus)
    singles = [e for e in examples if e.text_pair is None]
    pairs = [e for e in examples if e.text_pair is not None]
    assert len(singles) >= 200 and len(pairs) >= 90
    assert len({e.text for e in singles}) == len(singles)
    lengths = sorted(len(e.text.split()) for e in singles)
    assert lengths[0] <= 3 and lengths[-1] >= 18  # varied in length
    assert corpus.validate() == len(examples)
    assert len(corpus.sha256()) == 64


def test_auto_format_detection(tmp_path):
    assert Corpus(write(tmp_path, "a.txt", "one line\n")).format == "text"
    assert Corpus(write(tmp_path, "b.tsv", "a\tb\n")).format == "pairs"
    assert Corpus(write(tmp_path, "c.tsv", "sentence\tlabel\nfine .\t1\n")).format == "glue"
    assert Corpus(write(tmp_path, "d.conllu", CONLLU)).format == "conllu"
    with pytest.raises(CorpusError, match="no such file"):
        Corpus(tmp_path / "missing.txt")
    with pytest.raises(CorpusError, match="unknown format 'xml'"):
        Corpus(tmp_path / "a.txt", format="xml")


def test_limit_stops_reading(tmp_path):
    path = write(tmp_path, "a.txt", "one\ntwo\nthree\n")
    assert [e.text for e in Corpus(path, limit=2)] == ["one", "two"]


# A valid sentence (lines 1-3), then "The cat sat ." (lines 5-10; words 1-4 on lines 7-10).
TREE = """# sent_id = 1
1	Yes	yes	INTJ	UH	_	0	root	_	_

# sent_id = 2
# text = The cat sat .
1-2	The cat	_	_	_	_	_	_	_	_
1	The	the	DET	DT	_	2	det	_	_
2	cat	cat	NOUN	NN	_	3	nsubj	_	_
3	sat	sit	VERB	VBD	_	0	root	_	_
4	.	.	PUNCT	.	_	3	punct	_	_
"""


@pytest.mark.parametrize(
    "heads, line, message",
    [
        ((2, 7, 0, 3), 8, "word 2 has head 7, but the sentence has 4 words (heads are 0 to 4)"),
        ((2, -1, 0, 3), 8, "word 2 has head -1, but the sentence has 4 words (heads are 0 to 4)"),
        ((2, 3, 0, 4), 10, "word 4 is its own head"),
        ((2, 4, 0, 2), 8, "words 2 -> 4 -> 2 form a cycle that never reaches the root"),
        ((2, 3, 2, 3), 8, "no word has head 0 (no root): words 2 -> 3 -> 2 form a cycle"),
        ((2, 3, 0, 0), 10, "word 4 is a second root (word 3 has head 0 too); UD allows one root per sentence"),
    ],
)
def test_conllu_trees_are_validated_at_the_offending_token(tmp_path, heads, line, message):
    lines = TREE.splitlines()
    for index, head in enumerate(heads):
        columns = lines[6 + index].split("\t")
        columns[6] = str(head)
        lines[6 + index] = "\t".join(columns)
    path = write(tmp_path, "bad.conllu", "\n".join(lines) + "\n")
    with pytest.raises(CorpusError) as caught:
        list(read_conllu(path))
    assert str(caught.value) == f"{path}:{line}: {message}"
    assert [e.heads for e in read_conllu(write(tmp_path, "good.conllu", TREE))] == [(0,), (2, 3, 0, 3)]


def test_glue_header_must_match_the_format(tmp_path):
    stsb = write(tmp_path, "sts.tsv", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                                      "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA man is dancing.\tA man dances.\t5.000\n")
    with pytest.raises(CorpusError) as caught:
        Corpus(stsb)
    assert str(caught.value) == (f"{stsb}:1: a GLUE-style header this reader does not know (index, genre, filename, year, old_index, source1, "
                                 "source2, sentence1, sentence2, score); known: SST-2, MRPC, RTE, QNLI, QQP, or CoLA without header")
    rte = write(tmp_path, "rte.tsv", "index\tsentence1\tsentence2\tlabel\n0\tA cat.\tA dog.\tentailment\n")
    for format in ("pairs", "text"):
        with pytest.raises(CorpusError) as caught:
            Corpus(rte, format=format)
        assert str(caught.value) == f"{rte}:1: a GLUE header (index, sentence1, sentence2, label), not {format}: use --format glue (or auto)"
    assert Corpus(rte).format == "glue" and Corpus(write(tmp_path, "p.tsv", "a cat.\ta dog.\n"), format="pairs").format == "pairs"
    with pytest.raises(CorpusError, match=r"sts\.tsv:1: not a GLUE TSV header"):
        Corpus(stsb, format="glue").validate()


def test_a_folder_is_not_a_corpus(tmp_path):
    with pytest.raises(CorpusError) as caught:
        Corpus(tmp_path)
    assert str(caught.value) == f"{tmp_path}: is a folder, not a corpus file"


def test_corpus_errors_from_the_command_line_are_one_line(tiny_bert_dir, tmp_path):
    from test_cli import bertology

    stsb = write(tmp_path, "sts.tsv", "index\tgenre\tsentence1\tsentence2\tscore\n0\tmain\tA man is dancing.\tA man dances.\t5.000\n")
    bad_tree = write(tmp_path, "bad.conllu", TREE.replace("3\tsat\tsit\tVERB\tVBD\t_\t0", "3\tsat\tsit\tVERB\tVBD\t_\t3"))
    for corpus, expected in [
        (tmp_path, f"error: {tmp_path}: is a folder, not a corpus file"),
        (stsb, f"error: {stsb}:1: a GLUE-style header this reader does not know (index, genre, sentence1, sentence2, score); "
               "known: SST-2, MRPC, RTE, QNLI, QQP, or CoLA without header"),
        (bad_tree, f"error: {bad_tree}:9: word 3 is its own head"),
    ]:
        result = bertology("analyze", "--model", tiny_bert_dir, "--corpus", corpus, "--out", tmp_path / "run", "-q")
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [expected]
