"""Attention to token classes (Kovaleva et al. 2019; METHODS.md section 9) against numpy from transformers' own maps."""

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import gold_example
from transformers import AutoModel, AutoTokenizer

import bertology
from bertology.core.engine import Engine, RunStats, capture, model_forward
from bertology.core.errors import BertologyError, CorpusError
from bertology.families.classes import default_classes, parse_class, parse_classes
from bertology.families.classes.analyzer import ClassAttention

# Sentences with gold words, UPOS tags and (flat) trees written here; "not" and "never" are negation words.
SENTENCES = [
    ("the cat did not sit on the mat .", "DET NOUN AUX PART VERB ADP DET NOUN PUNCT"),
    ("we saw the big dog .", "PRON VERB DET ADJ NOUN PUNCT"),
    ("the dog never ran fast , but the cat ran .", "DET NOUN ADV VERB ADV PUNCT CCONJ DET NOUN VERB PUNCT"),
    ("where is it ?", "ADV AUX PRON PUNCT"),
]


def gold_examples():
    return [gold_example(line, text, tags) for line, (text, tags) in enumerate(SENTENCES, start=1)]


def numpy_class_attention(folder, examples, members_of):
    """Per class: ``[sequence, layer, head, (all, cls_row)]`` and the baselines, straight from the definition:
    transformers' eager maps in float64, pieces grouped into words by their offsets, rows averaged and columns summed."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").double().eval()
    values, baselines = [], []
    for example in examples:
        encoding = tokenizer(example.text, return_offsets_mapping=True)
        with torch.no_grad():
            maps = torch.stack(model(torch.tensor([encoding["input_ids"]]), output_attentions=True).attentions)[:, 0].numpy()
        units = []  # each unit's pieces: special tokens alone, words by their character span
        for p, (begin, end) in enumerate(encoding["offset_mapping"]):
            if begin == end:
                units.append([p])
        word_units = []
        for begin, end in example.word_spans:
            word_units.append(len(units))
            units.append([p for p, (a, b) in enumerate(encoding["offset_mapping"]) if b > a and a < end and begin < b])
        order = sorted(range(len(units)), key=lambda u: units[u][0])
        rows = np.stack([maps[:, :, units[u]].mean(axis=2) for u in order], axis=2)  # [layer, head, unit, n]
        word_maps = np.stack([rows[..., units[u]].sum(axis=-1) for u in order], axis=-1)  # [layer, head, unit, unit]
        position = {u: k for k, u in enumerate(order)}
        cls_unit = position[0]
        members = members_of(example)
        chosen = [position[word_units[w]] for w in np.flatnonzero(members)]
        values.append(np.stack([word_maps[..., chosen].sum(-1).mean(-1), word_maps[:, :, cls_unit][..., chosen].sum(-1)], axis=-1)
                      if chosen else None)
        baselines.append(len(chosen) / len(example.words) if chosen else None)
    return values, baselines


@pytest.mark.parametrize("spec, members_of", [
    ("noun=upos:NOUN", lambda e: np.array([t == "NOUN" for t in e.upos])),
    ("negation=words:negation", lambda e: np.array([w in ("not", "never") for w in e.words])),
    (r"punctuation=regex:[^\w\s]+", lambda e: np.array([w in (".", ",", "?") for w in e.words])),
])
def test_class_attention_equals_numpy_from_the_definition(spec, members_of, bert64, tiny_bert_dir):
    examples = gold_examples()
    analyzer = ClassAttention(bert64.kind, parse_classes([spec]))
    Engine(bert64, batch_size=3, progress=False).run(examples, [analyzer])
    table = analyzer.result()
    values, baselines = numpy_class_attention(tiny_bert_dir, examples, members_of)
    present = [v for v in values if v is not None]
    expected = np.mean(present, axis=0)  # [layer, head, row]
    baseline = np.mean([b for b in baselines if b is not None])
    for row, k in (("all", 0), ("cls_row", 1)):
        got = table[table.row == row].sort_values(["layer", "head"])
        np.testing.assert_allclose(got.value.to_numpy(), expected[..., k].ravel(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got.baseline.to_numpy(), baseline, rtol=1e-12)
        np.testing.assert_allclose(got.ratio.to_numpy(), expected[..., k].ravel() / baseline, rtol=1e-10)
        assert (got.n == len(present)).all()
        spread = np.std([v[..., k] for v in present], axis=0, ddof=1).ravel() / np.sqrt(len(present))
        from scipy import stats
        np.testing.assert_allclose((got.ci_high - got.value).to_numpy(), stats.t.ppf(0.975, len(present) - 1) * spread, rtol=1e-8, atol=1e-14)


def test_a_head_planted_on_nouns_gives_all_its_attention_to_them(tiny_bert, monkeypatch):
    """Layer 0, head 1 is made to attend only to the pieces of nouns: its value is 1 from every query and from [CLS],
    its ratio 1 / (the nouns' share of words)."""
    examples = gold_examples()
    engine = Engine(tiny_bert, batch_size=1, progress=False)
    encoded = list(engine.encode(enumerate(examples), RunStats()))

    def planted(model, tensors, hooks, *args):
        example = next(item for item in encoded if item.input_ids == tensors["input_ids"][0].tolist()).example
        nouns = [span for span, tag in zip(example.word_spans, example.upos) if tag == "NOUN"]
        offsets = next(item for item in encoded if item.example is example).offsets
        keys = torch.tensor([float(z > a and any(a < end and begin < z for begin, end in nouns)) for a, z in offsets])

        def plant(layer, pattern):
            if layer == 0 and keys.any():  # a sentence without nouns keeps its maps (a row of 0 / 0 would be NaN, refused)
                pattern = pattern.clone()
                pattern[:, 1] = keys / keys.sum()
                return pattern

        hooks._handlers["pattern"].insert(0, plant)  # before the engine's own handler reads the maps
        return model_forward(model, tensors, hooks, *args)

    monkeypatch.setattr(capture, "model_forward", planted)
    analyzer = ClassAttention(tiny_bert.kind, parse_classes(["noun=upos:NOUN"]))
    engine.run(examples, [analyzer])
    row = analyzer.result().query("layer == 0 and head == 1")
    np.testing.assert_allclose(row.value, 1.0, rtol=1e-6)
    shares = np.mean([sum(t == "NOUN" for t in e.upos) / len(e.upos) for e in examples if "NOUN" in e.upos])
    np.testing.assert_allclose(row.baseline, shares, rtol=1e-12)
    np.testing.assert_allclose(row.ratio, 1.0 / shares, rtol=1e-6)
    from bertology.families.classes.report import top_heads

    top = top_heads(analyzer.result(), 1)  # the planted head does more than the uniform head: it is the one named
    assert top[["layer", "head"]].values.tolist() == [[0, 1]] and (top.excess > 0.3).all()


def uniform_class_values(loaded, example, member_units):
    """The uniform head's attention to a class on an encoder, by loops from the definition: piece p spreads 1/n over the n
    pieces; word-level rows average a unit's pieces, columns sum them; ``all`` is the mean over every unit, and each row."""
    from bertology.core.text.alignment import align, default_word_spans

    encoding = loaded.tokenizer(example.text, example.text_pair, return_offsets_mapping=True)
    spans = [default_word_spans(example.text)] + ([default_word_spans(example.text_pair)] if example.text_pair else [])
    alignment = align(encoding["offset_mapping"], encoding.sequence_ids(), spans)
    share, n = alignment.assignment, len(encoding["input_ids"])
    rows = [sum(share[u, p] * share[v, q] / n for p in range(n) for v in member_units for q in range(n)) / share[u].sum()
            for u in range(alignment.num_units)]
    return float(np.mean(rows)), rows


def test_the_uniform_column_of_an_encoder_and_its_null_model(tiny_bert, tiny_bert_dir):
    """The uniform head's attention to a class (each piece spreading 1/n over the n pieces, [CLS]/[SEP] included) against
    loops from the definition, on single sentences and on pairs; the null model's heads are that head: no head is named."""
    from conftest import PAIRS

    from bertology.core.text.corpora import Example
    from bertology.families.classes.analyzer import TokenClass, class_units
    from bertology.families.classes.report import top_heads

    the = TokenClass("the", "words", "the", frozenset({"the"}))
    examples = [Example(t) for t in ("the cat sat on the mat.", "where is the dog?", "we saw it.")] + [Example(a, b) for a, b in PAIRS]
    engine = Engine(tiny_bert, batch_size=2, progress=False)
    encoded = list(engine.encode(enumerate(examples), RunStats()))
    expected = []
    for item in encoded:
        alignment = engine.run_batch([item]).alignments[0]
        members, _ = class_units(item.example, alignment, (the,))
        units = set(np.flatnonzero(members[:, 0]))
        if units:
            every, rows = uniform_class_values(tiny_bert, item.example, units)
            expected.append((every, rows[0]))
    assert len(expected) >= 3
    for null in (None, "uniform"):
        analyzer = ClassAttention(tiny_bert.kind, (the,))
        Engine(tiny_bert, batch_size=2, progress=False, null=null).run(examples, [analyzer])
        table = analyzer.result()
        for row, k in (("all", 0), ("cls_row", 1)):
            got = table[table.row == row]
            np.testing.assert_allclose(got.uniform, np.mean([e[k] for e in expected]), rtol=1e-6)
            if null == "uniform":
                np.testing.assert_allclose(got.value, got.uniform, rtol=1e-5)
        if null == "uniform":
            assert top_heads(table, 3).empty


def test_class_specs_parse_and_bad_ones_are_one_line_errors(tmp_path):
    assert parse_class("subj=deprel:nsubj").members(["a", "b", "c"], None, ("nsubj", "nsubj:pass", "obj")).tolist() == [True, True, False]
    assert parse_class("x=regex:a.").members(["ab", "abc", "b"], None, None).tolist() == [True, False, False]  # the whole word
    words = tmp_path / "neg.txt"
    words.write_text("# a comment\nNot\n\nnever\n")
    assert parse_class(f"neg=words:{words}").members(["not", "NEVER", "no"], None, None).tolist() == [True, True, False]
    for bad, message in [("noun", "NAME=KIND:VALUE"), ("noun=pos:NOUN", "unknown kind 'pos'"), ("x=regex:(", "not a regular expression")]:
        with pytest.raises(BertologyError, match=message):
            parse_class(bad)
    with pytest.raises(CorpusError, match="missing.txt: no such word list"):
        parse_class(f"neg=words:{tmp_path / 'missing.txt'}")
    with pytest.raises(BertologyError, match="given twice"):
        parse_classes(["a=upos:NOUN", "a=upos:VERB"])
    assert [c.name for c in default_classes(True)] == ["noun", "verb", "negation", "punctuation"]
    assert [c.name for c in default_classes(False)] == ["negation", "punctuation"]


def test_analyze_with_classes_warns_of_a_missing_class_and_needs_trees_for_tags(tiny_bert):
    texts = ["the cat sat on the mat.", "we saw it, and it ran!"]
    result = bertology.analyze(tiny_bert, texts, classes=["negation=words:negation", "cat=regex:cat"], progress=False, view=False)
    assert "classes" in result.results  # giving the family's setting runs it
    assert any("'negation' never occurs" in w for w in result.warnings)
    assert result.table("classes").query("`class` == 'cat'").n.max() == 1
    with pytest.raises(BertologyError, match="needs dependency trees"):
        bertology.analyze(tiny_bert, texts, classes=["noun=upos:NOUN"], progress=False, view=False)


def test_classes_command_writes_table_figure_and_section(tiny_bert_dir, tmp_path):
    corpus = tmp_path / "gold.conllu"
    blocks = []
    for text, tags in SENTENCES:
        words = text.split()
        blocks.append("\n".join(f"{k + 1}\t{w}\t_\t{t}\t_\t_\t{0 if k == 0 else 1}\t{'root' if k == 0 else 'dep'}\t_\t_"
                                for k, (w, t) in enumerate(zip(words, tags.split()))))
    corpus.write_text("\n\n".join(blocks) + "\n")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "classes", "-m", str(tiny_bert_dir), "-c", str(corpus), "--out", str(out), "-q",
                           "--class", "noun=upos:NOUN", "--class", "neg=words:negation", "--min-sample", "2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "most attention to noun beyond a uniform head:" in done.stdout
    table = pd.read_csv(out / "classes.csv")
    assert set(table["class"]) == {"noun", "neg"} and set(table.row) == {"all", "cls_row"}
    assert (out / "classes_heatmaps.png").exists()
    assert "Attention to token classes" in (out / "report.html").read_text()
    bad = subprocess.run([sys.executable, "-m", "bertology.cli", "classes", "-m", str(tiny_bert_dir), "-c", str(corpus), "--out", str(tmp_path / "x"),
                          "-q", "--class", "noun=upos"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "NAME=KIND:VALUE" in bad.stderr


def test_classes_run_under_both_views_in_one_pass(tiny_bert):
    """Under --weighting attention,norm the class table carries both views; the weights' rows equal a run of the weights alone."""
    texts = ["the cat did not sit.", "we never saw it, and it ran!"]
    both = bertology.analyze(tiny_bert, texts, analyses=["classes"], classes=["negation=words:negation"], weighting="attention,norm",
                             progress=False, view=False).table("classes")
    alone = bertology.analyze(tiny_bert, texts, analyses=["classes"], classes=["negation=words:negation"], progress=False, view=False).table("classes")
    assert set(both.weighting) == {"attention", "norm"}
    weights = both[both.weighting == "attention"].drop(columns="weighting").reset_index(drop=True)
    pd.testing.assert_frame_equal(weights, alone, check_exact=False, rtol=1e-6)
    assert not np.allclose(both[both.weighting == "norm"].value, weights.value)
