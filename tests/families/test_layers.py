"""Layer-wise probes (the Primer; Hewitt & Liang 2019; Tenney et al. 2019; METHODS.md section 9): word vectors against
transformers' hidden states, the probe on planted representations, the control task, the center of gravity, the command."""

import subprocess
import sys
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import bertology
from bertology.core.corpora import Example
from bertology.core.engine import Engine
from bertology.families.layers.analyzer import LayerSentence, WordVectors
from bertology.families.layers.probes import center_of_gravity, control_labels, probe_layers
from conftest import gold_example

TAGS = ("NOUN", "VERB", "DET", "ADJ")


def planted_sentences(count=240, layers=4, dim=16, informative=2, seed=0):
    """Sentences of 6 words whose UPOS tag is linearly encoded (a fixed direction per tag, plus noise) in layer
    ``informative`` only; every other layer is noise. The relation copies the tag, so both tasks see the same signal."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(len(TAGS), dim)) * 3
    vocabulary = [f"w{k}" for k in range(60)]
    sentences = []
    for index in range(count):
        tags = rng.integers(len(TAGS), size=6)
        vectors = rng.normal(size=(layers, 6, dim))
        vectors[informative] += directions[tags]
        sentences.append(LayerSentence((index, "", ""), tuple(rng.choice(vocabulary, 6)), tuple(TAGS[t] for t in tags), tuple(TAGS[t].lower() for t in tags),
                                       (0, 1, 1, 1, 1, 1), vectors.astype(np.float16)))
    return sentences


def test_the_probe_finds_the_one_layer_that_encodes_the_label():
    table = probe_layers(planted_sentences(), seed=1, bootstrap=200)
    for task, rows in table.groupby("task"):
        rows = rows.set_index("layer")
        assert rows.accuracy.idxmax() == 2
        assert rows.accuracy[2] > 0.95 and rows.ci_low[2] > 0.9
        assert (rows.accuracy.drop(2) < 0.45).all()  # four balanced tags: chance is 0.25
        assert rows.selectivity.idxmax() == 2 and rows.selectivity[2] > 0.5
        assert (rows.ci_low <= rows.accuracy).all() and (rows.accuracy <= rows.ci_high).all()
    assert (table.n_train + table.n_test == 240 * 6).all()


def test_the_control_task_gives_each_word_type_one_label_drawn_from_the_task_distribution():
    forms = [f"w{k % 500}" for k in range(20000)] + ["The", "the", "THE"]
    distribution = Counter({"NOUN": 6, "VERB": 3, "DET": 1})
    labels = control_labels(forms, distribution, "upos", seed=2)
    by_type = {}
    for form, label in zip(forms, labels):
        assert by_type.setdefault(form.casefold(), label) == label  # one label per type, case folded
    shares = Counter(by_type[f"w{k}"] for k in range(500))
    assert abs(shares["NOUN"] / 500 - 0.6) < 0.07 and abs(shares["DET"] / 500 - 0.1) < 0.05
    assert (control_labels(forms[:100], distribution, "upos", seed=2) == labels[:100]).all()  # the same in training and test
    assert (control_labels(forms[:500], distribution, "upos", seed=3) != labels[:500]).any()


def test_center_of_gravity_follows_tenney_with_the_best_accuracy_so_far():
    # gains of the running best: layer 1 +0.2, layer 2 +0.1, layer 3 0 (a drop), layer 4 +0.1 -> (1*0.2 + 2*0.1 + 4*0.1) / 0.4 = 2.0
    assert center_of_gravity([0.5, 0.7, 0.8, 0.6, 0.9]) == pytest.approx(2.0)
    assert center_of_gravity([0.5, 0.9, 0.8, 0.7]) == pytest.approx(1.0)
    assert np.isnan(center_of_gravity([0.9, 0.8, 0.7]))


def gold_examples():
    texts = ["the cat sat on the mat .", "unbelievably , tokenization splits words !", "we saw the big dog ."]
    return [gold_example(line, text) for line, text in enumerate(texts, start=1)]


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_word_vectors_equal_transformers_hidden_states(pooling, tiny_bert_dir):
    model = bertology.load_model(tiny_bert_dir, device="cpu")
    model.model.double()
    examples = gold_examples()
    analyzer = WordVectors(pooling=pooling)
    Engine(model, batch_size=2, progress=False).run(examples, [analyzer])
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    reference = AutoModel.from_pretrained(tiny_bert_dir, attn_implementation="eager").double().eval()
    for example, kept in zip(examples, analyzer.ordered()):
        encoding = tokenizer(example.text, return_offsets_mapping=True)
        with torch.no_grad():
            states = torch.stack(reference(torch.tensor([encoding["input_ids"]]), output_hidden_states=True).hidden_states)[:, 0].numpy()
        expected = []
        for begin, end in example.word_spans:
            pieces = [p for p, (a, b) in enumerate(encoding["offset_mapping"]) if b > a and a < end and begin < b]
            expected.append(states[:, pieces[0]] if pooling == "first" else states[:, pieces].mean(axis=1))
        np.testing.assert_allclose(kept.vectors.astype(np.float64), np.stack(expected, axis=1), rtol=2e-3, atol=2e-3)  # kept in float16
    if pooling == "mean":
        first = WordVectors(pooling="first")
        Engine(model, progress=False).run(examples, [first])
        assert not np.allclose(first.ordered()[1].vectors, analyzer.ordered()[1].vectors)


def test_the_cap_keeps_the_first_sentences_whatever_the_batches(tiny_bert):
    examples = gold_examples() * 3
    examples = [Example(**{**e.__dict__, "source": f"gold:{k}"}) for k, e in enumerate(examples, start=1)]
    small = WordVectors(max_sentences=4)
    Engine(tiny_bert, batch_size=1, progress=False).run(examples[::-1], [small])  # reversed: the first lines are still kept
    assert [s.key[0] for s in small.ordered()] == [1, 2, 3, 4]
    shards = [WordVectors(max_sentences=4), WordVectors(max_sentences=4)]
    Engine(tiny_bert, batch_size=5, progress=False).run(examples[5:], [shards[0]])
    Engine(tiny_bert, batch_size=5, progress=False).run(examples[:5], [shards[1]])
    merged = shards[0].merge(shards[1])
    assert [s.key[0] for s in merged.ordered()] == [1, 2, 3, 4] and merged.capped and merged.seen == 9


def test_layers_command_on_real_trees(shared_data, tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "layers", "-c", str(shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu"),
                           "--limit", "150", "--probe-bootstrap", "200", "--out", str(out), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "upos: best layer" in done.stdout and "center of gravity" in done.stdout
    table = pd.read_csv(out / "layer_probes.csv")
    assert list(table.columns) == ["layer", "task", "accuracy", "ci_low", "ci_high", "control_accuracy", "selectivity", "majority", "n_train", "n_test"]
    assert sorted(table.layer.unique()) == list(range(7)) and set(table.task) == {"upos", "deprel"}
    upos = table[table.task == "upos"].set_index("layer")
    assert (upos.accuracy > upos.majority + 0.3).all()  # real vectors know the tags
    assert (out / "layer_probes.png").exists() and "Where in the layers" in (out / "report.html").read_text()
    capped = subprocess.run([sys.executable, "-m", "bertology.cli", "layers", "-c", str(shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu"),
                             "--limit", "40", "--probe-sentences", "20", "--probe-bootstrap", "100", "--out", str(tmp_path / "c"), "-q"],
                            capture_output=True, text=True)
    assert capped.returncode == 0 and "kept the first 20 of 40 sentences (--probe-sentences)" in capped.stderr


@pytest.mark.parametrize("layout", ["bert", "distilbert", "albert", "electra"])
def test_the_engines_hidden_states_are_transformers_own_and_leave_the_model_picklable(layout, tiny_encoder_dirs):
    """Every layer's output as the engine takes it (the attention's input, then the last output) equals transformers'
    ``output_hidden_states``, and the run leaves no hook in the model (a Ray actor must be able to take it)."""
    import pickle

    from bertology.core.engine import RunStats

    model = bertology.load_model(tiny_encoder_dirs[layout], device="cpu")
    model.model.double()
    engine = Engine(model, progress=False)
    items = list(engine.encode(enumerate([Example("the cat sat on the mat."), Example("where is the dog?")]), RunStats()))
    batch = engine.run_batch(items, hidden_states=True)
    pickle.dumps(model.model)
    reference = AutoModel.from_pretrained(tiny_encoder_dirs[layout], attn_implementation="eager").double().eval()
    for b, item in enumerate(items):
        with torch.no_grad():
            states = torch.stack(reference(torch.tensor([item.input_ids]), output_hidden_states=True).hidden_states)[:, 0]
        torch.testing.assert_close(batch.hidden_states[:, b, : len(item)], states, rtol=1e-10, atol=1e-10)
