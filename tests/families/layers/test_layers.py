"""Layer-wise probes (the Primer; Hewitt & Liang 2019; Tenney et al. 2019; docs/methods.md#layer-probes): word vectors
against transformers' hidden states, the probe on planted representations, the control task (case kept, or casefolded on
request), the expected layer of the running-max gains, the summary, the command."""

import subprocess
import sys
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import gold_example
from transformers import AutoModel, AutoTokenizer

import bertology
from bertology.core.engine import Engine, PassNeeds
from bertology.core.text.corpora import Example
from bertology.families import FamilyResult, get_family
from bertology.families.layers.analyzer import LayerSentence, WordVectors
from bertology.families.layers.probes import control_labels, expected_layer_running_max, probe_layers, probe_summary

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
    for casefold in (False, True):
        labels = control_labels(forms, distribution, "upos", seed=2, casefold=casefold)
        by_type = {}
        for form, label in zip(forms, labels):
            assert by_type.setdefault(form.casefold() if casefold else form, label) == label  # one label per type
        shares = Counter(by_type[f"w{k}"] for k in range(500))
        assert abs(shares["NOUN"] / 500 - 0.6) < 0.07 and abs(shares["DET"] / 500 - 0.1) < 0.05
        assert (control_labels(forms[:100], distribution, "upos", seed=2, casefold=casefold) == labels[:100]).all()  # training and test alike
        assert (control_labels(forms[:500], distribution, "upos", seed=3, casefold=casefold) != labels[:500]).any()


def test_the_control_task_keeps_case_by_default_and_casefolds_on_request():
    """Hewitt & Liang's word types are forms as written: "The" and "the" are two types, each with its own draw (so over
    many seeds they disagree about as often as two independent draws do); casefolded, they are one type, one label."""
    distribution = Counter({"NOUN": 1, "VERB": 1, "DET": 1, "ADJ": 1})
    forms = ["The", "the", "THE", "cat", "Cat"]
    kept = [control_labels(forms, distribution, "upos", seed=seed) for seed in range(200)]
    folded = [control_labels(forms, distribution, "upos", seed=seed, casefold=True) for seed in range(200)]
    for labels in folded:
        assert labels[0] == labels[1] == labels[2] and labels[3] == labels[4]
    assert 0.6 < np.mean([labels[0] != labels[1] for labels in kept]) < 0.9  # independent draws of 4 equal labels differ 3/4 of the time
    assert 0.6 < np.mean([labels[3] != labels[4] for labels in kept]) < 0.9
    assert all(k[1] == f[1] and k[3] == f[3] for k, f in zip(kept, folded))  # a lowercase form keeps its draw either way
    assert get_family("layers").options[-1].name == "control_casefold" and get_family("layers").options[-1].default is False


def test_the_control_task_option_reaches_the_probe():
    """``control_casefold`` changes the control labels only where two forms differ in case: on sentences whose forms
    are all lowercase, both settings give the same table; with capitalised copies of half the words they differ."""
    sentences = planted_sentences(count=60, layers=2, informative=1)
    same = [probe_layers(sentences, seed=1, bootstrap=100, control_casefold=casefold) for casefold in (False, True)]
    pd.testing.assert_frame_equal(same[0], same[1])
    mixed = [LayerSentence(s.key, tuple(form.capitalize() if k % 2 else form for k, form in enumerate(s.forms)), s.upos, s.relations, s.heads, s.vectors)
             for s in sentences]
    kept, folded = (probe_layers(mixed, seed=1, bootstrap=100, control_casefold=casefold) for casefold in (False, True))
    pd.testing.assert_series_equal(kept.accuracy, folded.accuracy)  # the task itself does not change
    assert not np.allclose(kept.control_accuracy, folded.control_accuracy)


def expected_layer_by_hand(accuracy):
    """Tenney et al.'s expected layer sum_l l Delta_l / sum_l Delta_l (l = 1..L), Delta_l the gain of the running best
    accuracy, written out one layer at a time."""
    best, numerator, denominator = accuracy[0], 0.0, 0.0
    for layer in range(1, len(accuracy)):
        gain = max(best, accuracy[layer]) - best
        best = max(best, accuracy[layer])
        numerator += layer * gain
        denominator += gain
    return numerator / denominator if denominator else float("nan")


def test_expected_layer_running_max_against_the_formula_by_hand():
    # gains of the running best: layer 1 +0.2, layer 2 +0.1, layer 3 0 (a drop), layer 4 +0.1 -> (1*0.2 + 2*0.1 + 4*0.1) / 0.4 = 2.0
    assert expected_layer_running_max([0.5, 0.7, 0.8, 0.6, 0.9]) == pytest.approx(2.0)
    assert expected_layer_running_max([0.5, 0.9, 0.8, 0.7]) == pytest.approx(1.0)
    assert np.isnan(expected_layer_running_max([0.9, 0.8, 0.7]))
    # not the raw-difference ratio, which for a peak that falls back is (1*0.4 - 2*0.39) / 0.01 = -38
    assert expected_layer_running_max([0.50, 0.90, 0.51]) == pytest.approx(1.0)
    rng = np.random.default_rng(4)
    for _ in range(200):
        accuracy = rng.random(rng.integers(2, 14))
        gains = np.diff(np.maximum.accumulate(accuracy))  # numpy: Delta_l = max_(k<=l) acc_k - max_(k<l) acc_k
        expected = (np.arange(1, len(accuracy)) * gains).sum() / gains.sum() if gains.sum() > 0 else np.nan
        assert expected_layer_running_max(accuracy) == pytest.approx(expected, nan_ok=True)
        assert expected_layer_running_max(accuracy) == pytest.approx(expected_layer_by_hand(accuracy), nan_ok=True)


def test_the_summary_names_the_best_layer_and_the_expected_layer_of_each_task():
    table = pd.DataFrame({"layer": [0, 1, 2, 3] * 2, "task": ["upos"] * 4 + ["deprel"] * 4,
                          "accuracy": [0.5, 0.7, 0.9, 0.8, 0.3, 0.5, 0.6, 0.65],
                          "control_accuracy": [0.4, 0.5, 0.6, 0.7, 0.2, 0.3, 0.3, 0.5]})
    table["selectivity"] = table.accuracy - table.control_accuracy
    summary = probe_summary(table)
    assert list(summary.columns) == ["task", "best_layer", "best_accuracy", "its_selectivity", "most_selective_layer", "selectivity",
                                     "expected_layer_running_max"]
    lines = get_family("layers").summary(FamilyResult(tables={"layer_probes": table, "layer_probe_summary": summary}))
    # upos: gains 0.2 (layer 1), 0.2 (layer 2), 0 (layer 3) -> (1*0.2 + 2*0.2) / 0.4 = 1.5
    # deprel: gains 0.2, 0.1, 0.05 -> (1*0.2 + 2*0.1 + 3*0.05) / 0.35 = 1.571...
    assert lines == [
        "upos probe: best layer 2 (accuracy 0.900, selectivity 0.300); most selective layer 2 (0.300); "
        "expected layer (running-max gains of one probe per layer) 1.50 (layers are hidden states: 0 the embeddings, l block l - 1's output)",
        "deprel probe: best layer 3 (accuracy 0.650, selectivity 0.150); most selective layer 2 (0.300); "
        "expected layer (running-max gains of one probe per layer) 1.57 (layers are hidden states: 0 the embeddings, l block l - 1's output)",
    ]


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
    assert "upos probe: best layer" in done.stdout and "expected layer (running-max gains of one probe per layer)" in done.stdout
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
    batch = engine.run_batch(items, needs=PassNeeds(hidden_states=True))
    pickle.dumps(model.model)
    reference = AutoModel.from_pretrained(tiny_encoder_dirs[layout], attn_implementation="eager").double().eval()
    for b, item in enumerate(items):
        with torch.no_grad():
            states = torch.stack(reference(torch.tensor([item.input_ids]), output_hidden_states=True).hidden_states)[:, 0]
        torch.testing.assert_close(batch.hidden_states[:, b, : len(item)], states, rtol=1e-10, atol=1e-10)


def test_the_report_tables_show_the_accuracy_intervals(tmp_path):
    """Issue 26: the intervals are computed, so the report shows them: the best layer's 95% interval beside its accuracy in
    the summary, and every layer's accuracy with its interval; and the figure keeps a negative selectivity in view."""
    from bertology.core.storage.runfolder import RunFolder
    from bertology.families.layers.report import layers_section, probes_by_layer, with_intervals

    table = probe_layers(planted_sentences(), bootstrap=200)
    summary = probe_summary(table)
    shown = with_intervals(summary, table)
    columns = list(shown.columns)
    assert columns[columns.index("best_accuracy") + 1] == "best_accuracy_ci"
    for row in shown.itertuples():
        best = table[(table.task == row.task) & (table.layer == row.best_layer)].iloc[0]
        assert row.best_accuracy_ci == f"[{best.ci_low:.3f}, {best.ci_high:.3f}]" and best.ci_low <= row.best_accuracy <= best.ci_high
    with RunFolder(tmp_path / "run") as folder:
        section = layers_section(folder, table, summary)
    (_, first), (_, per_layer) = section.tables
    assert "best_accuracy_ci" in first.columns
    np.testing.assert_array_equal(per_layer[["ci_low", "ci_high"]].to_numpy(), table[["ci_low", "ci_high"]].to_numpy())
    below = table.assign(selectivity=table.selectivity - 0.9)  # a control task that beats the probe
    for axis, (_, rows) in zip(probes_by_layer(below).axes, below.groupby("task", sort=False)):
        assert axis.get_ylim()[0] < rows.selectivity.min() and axis.get_ylim()[1] == 1  # every selectivity in view


def probe_table(layers: int = 3) -> pd.DataFrame:
    """A ``layer_probes`` table by hand: both tasks on hidden states ``0..layers - 1`` (0 the embeddings)."""
    return pd.DataFrame([{"task": task, "layer": layer, "accuracy": 0.5 + 0.1 * layer, "ci_low": 0.45 + 0.1 * layer, "ci_high": 0.55 + 0.1 * layer,
                          "control_accuracy": 0.3, "selectivity": 0.2 + 0.1 * layer, "majority": 0.25}
                         for task in ("upos", "deprel") for layer in range(layers)])


def test_the_probe_figure_marks_the_embeddings_and_numbers_the_blocks_as_every_figure(tmp_path):
    """Issue 39: layer_probes.csv's layer 0 is the embeddings and its layer l block l - 1's output; the figure's ticks say
    emb., 0, 1 (blocks 0-based, as every figure), and the section says how the tables count."""
    from bertology.core.storage.runfolder import RunFolder
    from bertology.families.layers.report import HIDDEN_STATES_NUMBERED, layers_section, probes_by_layer
    from bertology.render.figures import HIDDEN_STATE_LABEL

    table = probe_table()
    for axis in probes_by_layer(table).axes:
        assert [tick.get_text() for tick in axis.get_xticklabels()] == ["emb.", "0", "1"]
        assert list(axis.get_xticks()) == [0, 1, 2] and axis.get_xlabel() == HIDDEN_STATE_LABEL
    summary = probe_summary(table)
    with RunFolder(tmp_path / "run") as folder:
        section = layers_section(folder, table, summary)
    assert section.intro.endswith(HIDDEN_STATES_NUMBERED) and "(0 = embeddings)" not in section.intro
    assert "after the embeddings (emb.) and after each block (0-based" in section.figures[0].caption
