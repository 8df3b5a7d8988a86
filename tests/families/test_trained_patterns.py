"""Pattern classes learned from hand labels: features that do not depend on n, cross-validation by text, a JSON
classifier that loads without running code, and the labels corpus."""

import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import bertology
from bertology.core.corpora import Corpus
from bertology.core.errors import BertologyError, CorpusError
from bertology.families.patterns.analyzer import PATTERNS
from bertology.families.patterns.trained import GRID, TrainedClassifier, map_features, train_classifier


def planted_map(pattern: str, n: int, rng: np.random.Generator, half: int | None = None) -> np.ndarray:
    """A hand-built map of one class on n tokens ([CLS] first, [SEP] last; a pair's second sentence from ``half``)."""
    noise = rng.dirichlet(np.ones(n), size=n)
    if pattern == "vertical":
        core = np.zeros((n, n))
        core[:, rng.choice([0, n - 1])] = 1.0
    elif pattern == "diagonal":
        core = np.eye(n, k=rng.choice([-1, 1]))
        core[core.sum(1) == 0, 0] = 1.0
    elif pattern == "vertical+diagonal":
        core = 0.5 * np.eye(n, k=-1) + 0.5 * np.eye(n, k=0)[:, [0] * n]
        core[0, 0] += 0.5
    elif pattern == "block":
        core = np.zeros((n, n))
        core[: half, : half] = 1.0 / half
        core[half:, half:] = 1.0 / (n - half)
    else:
        core = rng.dirichlet(np.full(n, 0.3), size=n)
    return 0.85 * core / core.sum(1, keepdims=True) + 0.15 * noise


def planted_items(count_per_class=24, seed=0):
    rng = np.random.default_rng(seed)
    items = []
    for k, pattern in enumerate(PATTERNS):
        for m in range(count_per_class):
            n = int(rng.integers(8, 40))
            half = n // 2
            segments = torch.full((1, n), 0)
            segments[0, 0] = segments[0, -1] = -1
            if pattern == "block" or m % 3 == 0:
                segments[0, half:-1] = 1
                segments[0, half - 1] = -1
            maps = torch.from_numpy(planted_map(pattern, n, rng, half))[None, None]
            mask = torch.ones(1, n, dtype=torch.bool)
            special = torch.zeros(1, n, dtype=torch.bool)
            special[0, [0, n - 1]] = True
            items.append({"features": map_features(maps, mask, special, segments)[0, 0], "label": pattern, "group": f"text {m}",
                          "rules": "heterogeneous", "maps": (maps, mask, special, segments)})
    return items


def test_features_do_not_depend_on_length_for_the_same_picture():
    """A diagonal map of 16 tokens and of 64 tokens pool to the same picture: every row of it sums to 1."""
    features = []
    for n in (16, 64):
        maps = torch.eye(n, dtype=torch.float64)[None, None]
        features.append(map_features(maps, torch.ones(1, n, dtype=torch.bool), torch.zeros(1, n, dtype=torch.bool), torch.zeros(1, n, dtype=torch.long)))
    picture = [f[0, 0, : GRID * GRID].reshape(GRID, GRID) for f in features]
    np.testing.assert_allclose(picture[0], picture[1], atol=1e-12)
    np.testing.assert_allclose(picture[0], np.eye(GRID), atol=1e-12)
    np.testing.assert_allclose(picture[1].sum(1), 1.0)


def test_training_on_planted_maps_separates_the_classes_and_the_json_classifies_alike(tmp_path):
    items = planted_items()
    training, confusion, document = train_classifier(items, seed=0)
    trained = training[training.method == "trained"].set_index("class")
    assert (trained.loc[list(PATTERNS), "f1"] > 0.85).all(), trained
    assert (trained.loc[list(PATTERNS), "support"] == 24).all()
    assert confusion[confusion.method == "trained"]["count"].sum() == len(items)
    path = tmp_path / "classifier.json"
    path.write_text(json.dumps(document))
    text = path.read_text()
    assert "__" not in text and "pickle" not in text  # numbers and names only
    classifier = TrainedClassifier.load(path)
    right = sum(PATTERNS[int(classifier.classify(*item["maps"])[0, 0])] == item["label"] for item in items)
    assert right / len(items) > 0.95  # on its own training maps


def test_cross_validation_keeps_a_text_on_one_side():
    """Two texts whose maps copy each other: if folds split a text, the copy would be learned; by text, it cannot."""
    rng = np.random.default_rng(1)
    items = [{"features": rng.normal(size=GRID * GRID + 4), "label": PATTERNS[k % 2], "group": f"g{k % 6}", "rules": "vertical"} for k in range(60)]
    for item in items:  # the label is only a function of the group: unlearnable across groups
        item["label"] = PATTERNS[int(item["group"][1]) % 2]
        item["features"] = rng.normal(size=GRID * GRID + 4)
    training, _, _ = train_classifier(items)
    assert training.query("method == 'trained' and `class` == 'macro (labelled classes)'").f1.iloc[0] < 0.75


def test_a_classifier_file_that_is_not_ours_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "classifier.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(BertologyError, match="not a pattern classifier bertology wrote"):
        TrainedClassifier.load(bad)
    bad.write_text("not json")
    with pytest.raises(BertologyError, match="cannot read the pattern classifier"):
        TrainedClassifier.load(bad)


@pytest.mark.parametrize("line, message", [
    ('{"text": "a b", "layer": 0, "head": 1}', "missing key(s) label"),
    ('{"text": "a b", "layer": -1, "head": 1, "label": "block"}', "layer must be a whole number from 0"),
    ('{"text": "a b", "layer": 0, "head": 1, "label": "diagonalish"}', 'label "diagonalish" is not one of'),
])
def test_bad_label_lines_name_their_line(tmp_path, line, message):
    path = tmp_path / "labels.jsonl"
    path.write_text('{"text": "a b", "layer": 0, "head": 1, "label": "block"}\n' + line + "\n")
    assert Corpus(path).format == "labels"
    with pytest.raises(CorpusError, match=f"labels.jsonl:2: .*{re.escape(message)}"):
        list(Corpus(path))


def labels_file(path, model, count=40):
    """Labels written here for the tiny model: each head's class is what the rules say of its map, so training must
    reproduce the rules (a model with fixed random weights has no hand labels to offer)."""
    from bertology.core.engine import Engine
    from bertology.families.patterns.analyzer import RuleClassifier
    from conftest import TEXTS, PAIRS

    engine = Engine(model, progress=False)
    lines = []
    inputs = [(t, None) for t in TEXTS] + list(PAIRS)
    for k, (text, pair) in enumerate(inputs):
        from bertology.core.corpora import Example
        from bertology.core.engine import RunStats
        items = list(engine.encode([(0, Example(text, pair))], RunStats()))
        batch = engine.run_batch(items)
        special = batch.cls_mask | batch.sep_mask
        for layer in range(2):
            classes = RuleClassifier().classify(batch.attentions[layer], batch.mask, special, batch.segment_ids)[0]
            for head in range(4):
                lines.append({"text": text, **({"text_pair": pair} if pair else {}), "layer": layer, "head": head, "label": PATTERNS[int(classes[head])]})
    path.write_text("\n".join(json.dumps(line) for line in lines[:count * 2]) + "\n")
    return lines


def test_patterns_train_writes_the_classifier_and_it_can_replace_the_rules(tiny_bert_dir, tiny_bert, tmp_path):
    labels = tmp_path / "labels.jsonl"
    labels_file(labels, tiny_bert)
    out = tmp_path / "trained"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "patterns", "--train", str(labels), "-m", str(tiny_bert_dir), "--out", str(out), "-q"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "cross-validated F1 by class, trained (rules):" in done.stdout
    training = pd.read_csv(out / "pattern_training.csv")
    rules = training[training.method == "rules"]
    assert (rules.f1[rules.support > 0] == 1.0).all()  # the labels are the rules' own verdicts
    document = json.loads((out / "classifier.json").read_text())
    assert document["format"] == "bertology-pattern-classifier" and document["trained_on"] == "labels.jsonl"
    assert (out / "pattern_confusion.png").exists() and "trained on the hand labels" in (out / "report.html").read_text()
    used = bertology.analyze(tiny_bert, ["the cat sat on the mat.", "where is the dog?"], analyses=["patterns"], classifier=out / "classifier.json",
                             progress=False, view=False)
    assert used.patterns.share.sum() == pytest.approx(2 * 4 * 1.0 * 1)  # every head's shares sum to 1
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": "the cat sat.", "layer": 7, "head": 0, "label": "block"}\n{"text": "a dog.", "layer": 0, "head": 0, "label": "block"}\n')
    failed = subprocess.run([sys.executable, "-m", "bertology.cli", "patterns", "--train", str(wrong), "-m", str(tiny_bert_dir), "--out",
                             str(tmp_path / "w"), "-q"], capture_output=True, text=True)
    assert failed.returncode == 2 and "wrong.jsonl:1: layer 7, head 0: the model has 2 layers of 4 heads" in failed.stderr


def test_the_bundled_hand_labels_train_a_classifier_for_the_bundled_model(minilm):
    """The 100 MiniLM maps labelled by hand for bertology: every line reads, the maps are recomputed, and the
    cross-validated classifier is scored beside the rules on the same maps."""
    from importlib import resources
    from pathlib import Path

    labels = Path(str(resources.files("bertology") / "data" / "minilm_pattern_labels.jsonl"))
    counts = pd.Series([e.pattern_label[2] for e in Corpus(labels)]).value_counts()
    result = bertology.analyze(minilm, labels, analyses=["patterns"], progress=False, view=False)
    training = result.pattern_training.set_index(["method", "class"])
    for pattern in PATTERNS:
        assert training.loc[("trained", pattern), "support"] == counts.get(pattern, 0)
    assert training.loc[("trained", "macro (labelled classes)"), "f1"] > 0.5
    assert result.classifier["labelled_maps"] == 100 and set(result.classifier["classes"]) == set(counts.index)


def test_a_map_labelled_again_keeps_only_its_last_label(tiny_bert, tmp_path):
    """The labelling page corrects by appending: a map on two lines is one labelled map, with the later label."""
    from bertology.core.engine import Engine
    from bertology.families.patterns.analyzer import RuleClassifier
    from bertology.families.patterns.trained import LabelledMaps

    path = tmp_path / "labels.jsonl"
    path.write_text('{"text": "the cat sat.", "layer": 1, "head": 2, "label": "vertical"}\n'
                    '{"text": "a dog ran.", "layer": 0, "head": 0, "label": "diagonal"}\n'
                    '{"text": "the cat sat.", "layer": 1, "head": 2, "label": "block"}\n')
    for batch_size in (1, 3):
        maps = LabelledMaps(RuleClassifier())
        Engine(tiny_bert, batch_size=batch_size, progress=False).run(Corpus(path), [maps])
        assert sorted((item["source"], item["label"]) for item in maps.ordered()) == [("labels.jsonl:2", "diagonal"), ("labels.jsonl:3", "block")]
    first, second = LabelledMaps(RuleClassifier()), LabelledMaps(RuleClassifier())
    examples = list(Corpus(path))
    Engine(tiny_bert, progress=False).run(examples[2:], [first], start=2)
    Engine(tiny_bert, progress=False).run(examples[:2], [second])
    assert sorted(item["label"] for item in first.merge(second).ordered()) == ["block", "diagonal"]


def test_two_class_probabilities_are_scikit_learns(tmp_path):
    from sklearn.linear_model import LogisticRegression

    items = [item for item in planted_items(12) if item["label"] in ("vertical", "diagonal")]
    _, _, document = train_classifier(items)
    classifier = TrainedClassifier(document)
    features = np.stack([item["features"] for item in items])
    model = LogisticRegression()
    model.classes_ = np.array(document["classes"])
    model.coef_, model.intercept_ = np.array(document["coef"]), np.array(document["intercept"])
    expected = model.predict_proba((features - np.array(document["mean"])) / np.array(document["scale"]))
    got = np.concatenate([classifier.probabilities(*item["maps"])[0] for item in items])
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-10)
