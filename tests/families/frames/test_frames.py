"""Frame-semantic heads (Kovaleva et al. 2019, section 4.3; METHODS.md section 9): the reader's checks, the score against
numpy from transformers' own maps, the position-matched baseline, and the command."""

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import bertology
from bertology.core.engine import Engine, RunStats, capture, model_forward
from bertology.core.errors import CorpusError
from bertology.core.statistics.stats import keyed_rng, sequence_key
from bertology.core.text.alignment import default_word_spans
from bertology.core.text.corpora import Corpus
from bertology.families.frames.analyzer import FrameHeads, shifted_pair

FRAMES_EXAMPLE = Path(str(resources.files("bertology") / "data" / "frames_example.jsonl"))


def numpy_pair_score(maps, offsets, target, element):
    """``max(max_{i in E, j in T} a[i, j], max_{i in T, j in E} a[i, j])`` per head, pieces found by their offsets."""
    def pieces(span):
        return [p for p, (a, b) in enumerate(offsets) if b > a and a < span[1] and span[0] < b]

    t, e = pieces(target), pieces(element)
    return np.maximum(maps[:, :, e][:, :, :, t].max(axis=(-2, -1)), maps[:, :, t][:, :, :, e].max(axis=(-2, -1)))


def test_the_bundled_example_file_reads_and_its_spans_name_what_they_should():
    examples = list(Corpus(FRAMES_EXAMPLE))
    assert len(examples) >= 20
    first = examples[0].frames[0]
    text = examples[0].text
    assert text[slice(*first.target)] == "bought"
    assert {name: text[slice(*span)] for name, span in first.elements} == {"Buyer": "The baker", "Goods": "three sacks of flour", "Seller": "the mill"}
    assert Corpus(FRAMES_EXAMPLE).format == "frames"


@pytest.mark.parametrize("record, message", [
    ("{not json", "not valid JSON"),
    ('{"text": "a b", "frame": "F", "target": [0, 1]}', "missing key(s) elements"),
    ('{"text": "a b", "frame": "F", "target": [0, 9], "elements": {"X": [2, 3]}}', "target [0, 9] lies outside the text's 3 characters"),
    ('{"text": "a b", "frame": "F", "target": [0, 1], "elements": {"X": [0, 3]}}', "element 'X' [0, 3] overlaps the target [0, 1]"),
    ('{"text": "a b", "frame": "F", "target": [0, 1], "elements": {"X": "b"}}', "element 'X' must be [start, end]"),
    ('{"text": "a b", "frame": "F", "target": [0, 1], "elements": {}}', "elements must be an object of at least one"),
])
def test_malformed_lines_are_one_line_errors_with_their_line_number(tmp_path, record, message):
    path = tmp_path / "frames.jsonl"
    path.write_text('{"text": "a b", "frame": "F", "target": [0, 1], "elements": {"X": [2, 3]}}\n\n' + record + "\n")
    with pytest.raises(CorpusError) as caught:
        list(Corpus(path))
    assert str(caught.value).startswith(f"{path}:3: ") and message in str(caught.value)


def test_the_baseline_moves_target_and_element_together_inside_the_sentence():
    text = "one two three four five six"
    words = default_word_spans(text)
    target, element = words[1], words[3]  # "two", "four": two words apart
    seen = set()
    for seed in range(40):
        moved = shifted_pair(text, target, element, np.random.default_rng(seed))
        assert moved is not None
        (t0, t1), (e0, e1) = moved
        shift = [w[0] for w in words].index(t0) - 1
        assert shift != 0 and text[t0:t1] == text.split()[1 + shift] and text[e0:e1] == text.split()[3 + shift]
        seen.add(shift)
    assert seen == {-1, 1, 2}  # every shift that keeps both inside, none other
    assert shifted_pair("one two", words[0], words[1], np.random.default_rng(0)) is None  # no room to move


def test_frame_scores_equal_numpy_from_transformers_maps(tiny_bert_dir):
    model = bertology.load_model(tiny_bert_dir, device="cpu")
    model.model.double()
    examples = list(Corpus(FRAMES_EXAMPLE))[:10]
    analyzer = FrameHeads(seed=5)
    Engine(model, batch_size=4, progress=False).run(examples, [analyzer])
    table = analyzer.result().sort_values(["layer", "head"])

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    reference = AutoModel.from_pretrained(tiny_bert_dir, attn_implementation="eager").double().eval()
    scores, baselines, pair_differences, differences = [], [], [], []
    for example in examples:
        encoding = tokenizer(example.text, return_offsets_mapping=True)
        with torch.no_grad():
            maps = torch.stack(reference(torch.tensor([encoding["input_ids"]]), output_attentions=True).attentions)[:, 0].numpy()
        offsets = encoding["offset_mapping"]
        pair_scores, pair_baselines = [], []
        annotation = example.frames[0]
        for name, span in annotation.elements:
            score = numpy_pair_score(maps, offsets, annotation.target, span)
            pair_scores.append(score)
            moved = shifted_pair(example.text, annotation.target, span, keyed_rng(5, *sequence_key(example), 0, name))
            if moved is not None:
                pair_baselines.append((score, numpy_pair_score(maps, offsets, *moved)))
        scores += pair_scores
        baselines += [b for _, b in pair_baselines]
        pair_differences += [s - b for s, b in pair_baselines]
        differences.append(np.mean([s - b for s, b in pair_baselines], axis=0))
    # score, baseline and difference: means over pairs (Kovaleva et al.); the test: over sentences' mean differences
    np.testing.assert_allclose(table.score.to_numpy(), np.mean(scores, axis=0).ravel(), rtol=1e-12)
    np.testing.assert_allclose(table.baseline.to_numpy(), np.mean(baselines, axis=0).ravel(), rtol=1e-12)
    np.testing.assert_allclose(table.difference.to_numpy(), np.mean(pair_differences, axis=0).ravel(), rtol=1e-10, atol=1e-14)
    # an encoder's uniform head gives every pair 1/n, its random pair too: its difference is 0 and the excess is the difference
    uniform = np.mean([1 / len(tokenizer(example.text)["input_ids"]) for example in examples for _ in example.frames[0].elements])
    np.testing.assert_allclose(table.uniform.to_numpy(), uniform, rtol=1e-12)
    np.testing.assert_allclose(table.excess.to_numpy(), table.difference.to_numpy(), rtol=0, atol=1e-15)
    from scipy import stats
    low = np.mean(scores, axis=0) - stats.t.ppf(0.975, len(scores) - 1) * np.std(scores, axis=0, ddof=1) / np.sqrt(len(scores))
    np.testing.assert_allclose(table.ci_low.to_numpy(), low.ravel(), rtol=1e-9)
    expected_p = stats.ttest_1samp(np.stack(differences), 0.0, alternative="greater").pvalue.ravel()
    np.testing.assert_allclose(table.p.to_numpy(), expected_p, rtol=1e-6)
    assert (table.n == 10).all() and (table.pairs == sum(len(e.frames[0].elements) for e in examples)).all()


def test_a_head_planted_between_target_and_elements_scores_one_and_is_significant(tiny_bert, monkeypatch):
    """Layer 1, head 2 puts all of every query's weight on the frame's target: every pair scores 1 (elements attend to
    it fully), the random pairs less, and the head is the only one significant after the correction."""
    examples = list(Corpus(FRAMES_EXAMPLE))
    planted = {}
    for example in examples:
        planted[example.text] = example.frames[0].target

    engine = Engine(tiny_bert, batch_size=1, progress=False)
    encoded = list(engine.encode(enumerate(examples), RunStats()))

    def planted_forward(model, tensors, hooks, *args):
        item = next(i for i in encoded if i.input_ids == tensors["input_ids"][0].tolist())
        start, end = planted[item.example.text]
        keys = torch.tensor([float(b > a and a < end and start < b) for a, b in item.offsets])

        def plant(layer, pattern):
            if layer == 1:
                pattern = pattern.clone()
                pattern[:, 2] = keys / keys.sum()
                return pattern

        hooks._handlers["pattern"].insert(0, plant)
        return model_forward(model, tensors, hooks, *args)

    result = bertology.analyze(tiny_bert, examples, analyses=["frames"], progress=False, view=False)
    assert "frames" in result.results
    analyzer = FrameHeads(seed=0)
    monkeypatch.setattr(capture, "model_forward", planted_forward)
    engine.run(examples, [analyzer])
    from bertology.families.frames import corrected
    table = corrected(analyzer.result(), "fdr_bh").set_index(["layer", "head"])
    assert table.loc[(1, 2), "score"] == pytest.approx(1.0, abs=1e-6)
    assert table.loc[(1, 2), "baseline"] < 0.9
    assert table.loc[(1, 2), "significant"]
    assert table.loc[(1, 2), "difference"] == table.difference.max()


def test_frames_command_reads_the_file_given_with_frames(tiny_bert_dir, tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "frames", "-m", str(tiny_bert_dir), "--frames", str(FRAMES_EXAMPLE),
                           "--out", str(out), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "frame heads by score (vs random pairs):" in done.stdout and "by excess over random pairs:" in done.stdout
    table = pd.read_csv(out / "frames.csv")
    assert len(table) == 2 * 4 and {"score", "baseline", "p_adj", "significant"} <= set(table.columns)
    assert (out / "frames_heatmaps.png").exists() and "Frame-semantic heads" in (out / "report.html").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a b", "frame": "F", "target": [0, 1], "elements": {"X": [1, 9]}}) + "\n")
    failed = subprocess.run([sys.executable, "-m", "bertology.cli", "frames", "-m", str(tiny_bert_dir), "--frames", str(bad),
                             "--out", str(tmp_path / "x"), "-q"], capture_output=True, text=True)
    assert failed.returncode == 2 and failed.stderr.strip() == f"error: {bad}:1: element 'X' [1, 9] lies outside the text's 3 characters (or is empty)"
    plain = subprocess.run([sys.executable, "-m", "bertology.cli", "frames", "-m", str(tiny_bert_dir), "--out", str(tmp_path / "y"), "-q"],
                           capture_output=True, text=True)
    assert plain.returncode == 2 and "frames needs frame annotations" in plain.stderr


def test_a_null_decoder_names_no_frame_head_though_its_shifted_pairs_sit_at_other_rows(tiny_gpt2_dir):
    """Under the uniform null a decoder's row i gives 1/(i + 1): a pair shifted right scores less than the pair itself, so
    the raw difference is not 0; the excess over the uniform head is, and no head is named (issue 39)."""
    from conftest import float64_model

    from bertology.families.frames import corrected

    loaded = float64_model(tiny_gpt2_dir)
    examples = list(Corpus(FRAMES_EXAMPLE))
    analyzer = FrameHeads(seed=5)
    Engine(loaded, batch_size=4, progress=False, null="uniform").run(examples, [analyzer])
    table = corrected(analyzer.result(), "fdr_bh")
    assert (table.score - table.uniform).abs().max() < 1e-12  # every head is the uniform head
    assert table.difference.abs().max() > 1e-3  # the raw difference of a uniform decoder head is not 0
    assert table.excess.abs().max() < 1e-12 and not table.significant.any()
