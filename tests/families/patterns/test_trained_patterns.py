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
from bertology.core.errors import BertologyError, CorpusError, StateError
from bertology.core.text.corpora import Corpus
from bertology.families.patterns.analyzer import PATTERNS, PatternThresholds
from bertology.families.patterns.trained import FEATURE_NAMES, GRID, TrainedClassifier, map_features, train_classifier


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
    with pytest.raises(BertologyError, match="classifier.json: not valid JSON"):
        TrainedClassifier.load(bad)


def classifier_document(classes=("vertical", "diagonal", "block"), seed=0) -> dict:
    """A hand-made document in the format :func:`train_classifier` writes, with random numbers."""
    rng = np.random.default_rng(seed)
    width, rows = GRID * GRID + 4, 1 if len(classes) == 2 else len(classes)
    return {"format": "bertology-pattern-classifier", "version": 1, "grid": GRID, "features": list(FEATURE_NAMES), "classes": list(classes),
            "regularisation": 0.1, "mean": rng.uniform(0, 1, width).tolist(), "scale": rng.uniform(0.1, 1, width).tolist(),
            "coef": rng.normal(size=(rows, width)).tolist(), "intercept": rng.normal(size=rows).tolist(), "labelled_maps": 40, "folds": 5}


def damaged(change):
    """The JSON text of :func:`classifier_document` after ``change`` (which edits the document in place)."""
    document = classifier_document()
    change(document)
    return json.dumps(document)


@pytest.mark.parametrize("text, message", [
    (damaged(lambda d: d["coef"][1].__setitem__(5, float("nan"))), "not valid JSON (NaN is not a JSON number)"),
    (damaged(lambda d: d["mean"].__setitem__(0, float("inf"))), "not valid JSON (Infinity is not a JSON number)"),
    (damaged(lambda d: d["coef"][0].__setitem__(0, 7.0)).replace("7.0", "1e999"), "not valid JSON (1e999 is too large for a number)"),
    (damaged(lambda d: d["scale"].__setitem__(9, 0.0)), "'scale' holds a value that is not above 0"),
    (damaged(lambda d: d["scale"].__setitem__(9, -0.5)), "'scale' holds a value that is not above 0"),
    (damaged(lambda d: (d["coef"][2].__setitem__(0, 1e308), d["scale"].__setitem__(0, 0.01))), "its numbers are too large: the class scores would overflow"),
    (damaged(lambda d: d["scale"].__setitem__(9, 1e-310)), "its numbers are too large: the class scores would overflow"),
    (damaged(lambda d: d.update(intercept=0.5)), "'intercept' must be list, not 0.5"),
    (damaged(lambda d: d.update(intercept=[0.5, 0.1])), "intercept has shape (2,), expected (3,)"),
    (damaged(lambda d: d.update(coef=d["coef"][:2])), "coef has shape (2, 68), expected (3, 68)"),
    (damaged(lambda d: d.update(mean=d["mean"][:-1])), "mean has shape (67,), expected (68,)"),
    (damaged(lambda d: d["coef"].__setitem__(1, d["coef"][1][:-1])), "coef is not an array of real numbers"),
    (damaged(lambda d: d["mean"].__setitem__(3, "0.5")), "mean is not an array of real numbers"),
    (damaged(lambda d: d.update(mean={"0": 0.5})), "'mean' must be list"),
    (damaged(lambda d: d.update(grid=0)), "grid = 0 is out of range (it must be from 1 to 64)"),
    (damaged(lambda d: d.update(grid=100000)), "grid = 100000 is out of range (it must be from 1 to 64)"),
    (damaged(lambda d: d.update(grid=8.0)), "'grid' must be int, not 8.0"),
    (damaged(lambda d: d.update(grid=True)), "'grid' must be int, not true"),
    (damaged(lambda d: d.update(grid=4)), "mean has shape (68,), expected (20,)"),
    (damaged(lambda d: d.update(classes=["vertical", "sideways", "block"])), 'unknown class "sideways"'),
    (damaged(lambda d: d.update(classes=["vertical", ["block"], "block"])), 'unknown class ["block"]'),
    (damaged(lambda d: d.update(classes=["vertical", "vertical", "block"])), "'classes' must name two or more different classes"),
    (damaged(lambda d: d.update(classes=["vertical"])), "'classes' must name two or more different classes"),
    (damaged(lambda d: d.update(classes="vertical")), "'classes' must be list"),
    (damaged(lambda d: d.pop("coef")), "missing key 'coef'"),
    (damaged(lambda d: d.update(version=2)), "pattern classifier version 2 is not one this bertology reads"),
    (damaged(lambda d: d.update(version="1")), "'version' must be int"),
    ("[" * 100 + "]" * 100, "JSON nested deeper than 64 levels"),
    ("[1, 2]", "not a pattern classifier bertology wrote"),
])
def test_a_damaged_classifier_is_refused_in_one_line_naming_what_is_wrong(tmp_path, text, message):
    """NaN or infinite numbers, a zero scale or overflowing scores once classified every head as the first class; wrong
    shapes, a scalar where an array belongs or deep nesting gave a traceback."""
    path = tmp_path / "classifier.json"
    path.write_text(text)
    with pytest.raises(StateError) as error:
        TrainedClassifier.load(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value) and "\n" not in str(error.value)


def test_a_hand_made_classifier_document_loads(tmp_path):
    path = tmp_path / "classifier.json"
    for classes in (("vertical", "diagonal", "block"), ("vertical", "block")):
        path.write_text(json.dumps(classifier_document(classes)))
        classifier = TrainedClassifier.load(path)
        assert classifier.coef.shape == (len(classes), GRID * GRID + 4) and classifier.classes == [PATTERNS.index(c) for c in classes]


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


#: The rules without their comparison with the uniform map (a margin no excess can miss): the random tiny BERT's maps are
#: near-uniform, so only these give labels of several classes to train on.
RAW_RULES = PatternThresholds(margin=-1.0)


def labels_file(path, model, count=40):
    """Labels written here for the tiny model: each head's class is what the rules say of its map, so training must
    reproduce the rules (a model with fixed random weights has no hand labels to offer)."""
    from conftest import PAIRS, TEXTS

    from bertology.core.engine import Engine
    from bertology.families.patterns.analyzer import RuleClassifier

    engine = Engine(model, progress=False)
    lines = []
    inputs = [(t, None) for t in TEXTS] + list(PAIRS)
    for k, (text, pair) in enumerate(inputs):
        from bertology.core.engine import RunStats
        from bertology.core.text.corpora import Example
        items = list(engine.encode([(0, Example(text, pair))], RunStats()))
        batch = engine.run_batch(items)
        special = batch.anchor_mask
        for layer in range(2):
            classes = RuleClassifier(RAW_RULES).classify(batch.attentions[layer], batch.mask, special, batch.segment_ids)[0]
            for head in range(4):
                lines.append({"text": text, **({"text_pair": pair} if pair else {}), "layer": layer, "head": head, "label": PATTERNS[int(classes[head])]})
    path.write_text("\n".join(json.dumps(line) for line in lines[:count * 2]) + "\n")
    return lines


def test_patterns_train_writes_the_classifier_and_it_can_replace_the_rules(tiny_bert_dir, tiny_bert, tmp_path):
    labels = tmp_path / "labels.jsonl"
    labels_file(labels, tiny_bert)
    out = tmp_path / "trained"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "patterns", "--train", str(labels), "-m", str(tiny_bert_dir), "--out", str(out), "-q",
                           "--pattern-thresholds", "margin=-1"], capture_output=True, text=True)
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
    assert used.table("patterns").share.sum() == pytest.approx(2 * 4 * 1.0 * 1)  # every head's shares sum to 1
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
    training = result.table("pattern_training").set_index(["method", "class"])
    for pattern in PATTERNS:
        assert training.loc[("trained", pattern), "support"] == counts.get(pattern, 0)
    assert training.loc[("trained", "macro (labelled classes)"), "f1"] > 0.5
    assert result.table("classifier")["labelled_maps"] == 100 and set(result.table("classifier")["classes"]) == set(counts.index)


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
