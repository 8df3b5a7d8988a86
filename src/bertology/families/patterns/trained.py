"""Pattern classes learned from hand labels: a logistic regression on each map's pooled picture and the rules' features.

Kovaleva et al. 2019 trained a CNN on about 400 labelled maps; neither the labels nor the model were released.

Features of one head's map ``a`` on n real tokens, none of which depends on n:

- the map pooled to a ``grid x grid`` picture, ``P = adaptive_avg_pool(a) * n / grid``: cell (r, c) is the mean, over
  the queries of row band r, of the mass they send to column band c (each row of P sums to 1);
- the rule classifier's features (:func:`~bertology.families.patterns.analyzer.pattern_features`): vertical, diagonal
  and block mass, and whether the input is a pair.

The classifier is scikit-learn's multinomial logistic regression on standardised features, cross-validated by text
(:class:`~sklearn.model_selection.GroupKFold`: no sentence is on both sides); its L2 strength is chosen inside each
training fold by a second cross-validation by text (nested), so the reported F1 does not flatter it. It is saved as plain JSON
(``classifier.json``: classes, feature names, the scaler's mean and scale, the coefficients and intercepts), which
loading reads as numbers and never runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps
from bertology.core.errors import BertologyError, StateError
from bertology.core.statistics.stats import sequence_key
from bertology.core.storage.safeload import field, finite_array, read_json, whole_number

if TYPE_CHECKING:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler
from bertology.families.patterns.analyzer import PATTERNS, pattern_features

GRID = 8
CLASSIFIER_FORMAT = "bertology-pattern-classifier"
RULE_FEATURES = ("vertical", "diagonal", "block", "pair")
FEATURE_NAMES = tuple(f"cell_{r}_{c}" for r in range(GRID) for c in range(GRID)) + RULE_FEATURES
#: The finest pooling grid a classifier may use (it has grid x grid + 4 features).
MAX_GRID = 64


def map_features(attention: torch.Tensor, mask: torch.Tensor, special: torch.Tensor, segment_ids: torch.Tensor, grid: int = GRID) -> np.ndarray:
    """``[batch, head, feature]`` features (see the module docstring) of maps ``attention [batch, head, n, n]``."""
    rules = pattern_features(attention, mask, special, segment_ids)
    rows = []
    for b in range(attention.shape[0]):
        n = int(mask[b].sum())
        pooled = torch.nn.functional.adaptive_avg_pool2d(attention[b, :, :n, :n].double(), grid) * n / grid  # [head, grid, grid]
        rows.append(pooled.reshape(attention.shape[1], -1))
    pooled = torch.stack(rows)
    pair = (segment_ids == 1).any(dim=1)[:, None].expand(-1, attention.shape[1])
    extra = torch.stack([rules["vertical"].double(), rules["diagonal"].double(), torch.nan_to_num(rules["block"].double(), nan=0.0), pair.double()], dim=-1)
    return torch.cat([pooled, extra], dim=-1).cpu().numpy()


class LabelledMaps(LayerwiseAnalyzer):
    """Features of the hand-labelled maps of a ``labels`` corpus (each example names one ``layer, head, label``), with the
    rule classifier's verdict on the same map. A map labelled on several lines keeps its last label (the labelling page
    corrects by appending). Examples without a label are passed over."""

    name = "labelled_maps"
    #: The labelled head's rows are put together block by block (:attr:`~bertology.core.engine.LayerMaps.rows`): it holds one
    #: head's whole map per labelled sequence of the batch.
    folds_row_blocks = True

    def __init__(self, rules) -> None:
        self.rules = rules
        self.items: dict[tuple, dict] = {}
        self._blocks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # the layer's blocks of rows so far, by sequence

    def _labelled(self, batch: Batch):
        """``(b, example, key, line)`` of each labelled example of the batch whose map is not labelled again further down."""
        for b, example in enumerate(batch.examples):
            if example.pattern_label is None:
                continue
            layer, head, _ = example.pattern_label
            key = (example.text, example.text_pair or "", layer, head)
            line = example.line if example.line is not None else -1
            if key not in self.items or self.items[key]["line"] <= line:  # the last line wins
                yield b, example, key, line

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        special = batch.anchor_mask
        for b, example, key, line in self._labelled(batch):
            layer, head, label = example.pattern_label
            if layer != maps.layer or head >= batch.num_heads:
                continue
            if maps.starts_layer:
                self._blocks[b] = []
            # the block's rows of the head's map [1, 1, r, n] and of the keys they saw [1, r, n]
            self._blocks[b].append((maps.attention[b : b + 1, head : head + 1], maps.visible(batch)[b : b + 1]))
            if not maps.ends_layer:
                continue
            blocks = self._blocks.pop(b)
            attention, visible = torch.cat([part for part, _ in blocks], dim=-2), torch.cat([part for _, part in blocks], dim=-2)
            args = (attention, batch.mask[b : b + 1], special[b : b + 1], batch.segment_ids[b : b + 1])
            rules = self.rules.classify(*args, visible=visible)  # the rules against the uniform map
            self.items[key] = {"line": line, "source": example.source, "group": repr(sequence_key(example)[1:]), "label": label,
                               "features": map_features(*args)[0, 0], "rules": PATTERNS[int(rules[0, 0])]}

    def finish_batch(self, batch: Batch) -> None:
        self._blocks = {}  # a map labelled again further down the batch leaves its blocks unread
        num_layers, num_heads = batch.num_layers, batch.num_heads
        for _, example, key, line in self._labelled(batch):
            layer, head, _ = example.pattern_label
            if layer >= num_layers or head >= num_heads:
                self.items[key] = {"line": line, "source": example.source,
                                   "error": f"layer {layer}, head {head}: the model has {num_layers} layers of {num_heads} heads"}

    def merge(self, other: "LabelledMaps") -> "LabelledMaps":
        self._check_mergeable(other)
        for key, item in other.items.items():
            if key not in self.items or item["line"] > self.items[key]["line"]:
                self.items[key] = item
        return self

    def ordered(self) -> list[dict]:
        return [self.items[key] for key in sorted(self.items)]

    def result(self) -> pd.DataFrame:
        """The labelled maps: ``source, label, rules`` (the rules' class)."""
        rows = [item for item in self.ordered() if "error" not in item]
        return pd.DataFrame({"source": [r["source"] for r in rows], "label": [r["label"] for r in rows], "rules": [r["rules"] for r in rows]})

    def check(self) -> None:
        """Refuse labels of heads the model does not have, naming the first such line."""
        for item in self.ordered():
            if "error" in item:
                name, _, line = item["source"].rpartition(":")
                raise BertologyError(f"{name}:{line}: {item['error']}")


#: The L2 strengths tried; each fit picks its own by an inner cross-validation by text (macro F1), so the outer folds
#: that report the F1 never see the choice.
REGULARISATIONS = (0.01, 0.03, 0.1, 0.3, 1.0)


def fit(features: np.ndarray, labels: np.ndarray, groups: np.ndarray, seed: int = 0) -> tuple[StandardScaler, LogisticRegression]:
    """Standardise, then fit a logistic regression whose ``C`` is chosen by 3-fold cross-validation by text within ``features``."""
    # scikit-learn's models load only where a classifier is trained: every analyze run holds this family's analyzers
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV, GroupKFold
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(features)
    scaled = scaler.transform(features)
    inner = list(GroupKFold(n_splits=min(3, len(set(groups)))).split(scaled, labels, groups)) if len(set(groups)) >= 2 else None
    if inner is None or any(len(set(labels[train])) < 2 for train, _ in inner):
        return scaler, LogisticRegression(C=0.1, max_iter=2000, random_state=seed).fit(scaled, labels)
    search = GridSearchCV(LogisticRegression(max_iter=2000, random_state=seed), {"C": list(REGULARISATIONS)}, cv=inner, scoring="f1_macro")
    return scaler, search.fit(scaled, labels).best_estimator_


def train_classifier(items: list[dict], folds: int = 5, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Cross-validate by text, fit on everything, and report against the rules.

    Returns ``training`` (per class: ``precision, recall, f1`` of the trained classifier out of fold and of the rules,
    NaN for a class with no label, and the ``support``; and the macro F1 over the labelled classes), ``confusion``
    (``method, label, predicted, count``) and the fitted classifier as a JSON-ready dict.
    """
    from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support
    from sklearn.model_selection import GroupKFold

    features = np.stack([item["features"] for item in items])
    labels = np.array([item["label"] for item in items])
    groups = np.array([item["group"] for item in items])
    rules = np.array([item["rules"] for item in items])
    present = [p for p in PATTERNS if p in set(labels)]
    if len(present) < 2:
        raise BertologyError(f"training needs labels of at least two classes, not only {present}")
    folds = min(folds, len(set(groups)))
    if folds < 2:
        raise BertologyError("training needs labelled maps of at least two different texts (the folds split by text)")
    predicted = np.empty(len(labels), dtype=object)
    for train, test in GroupKFold(n_splits=folds).split(features, labels, groups):
        if len(set(labels[train])) < 2:
            predicted[test] = labels[train][0]
            continue
        scaler, model = fit(features[train], labels[train], groups[train], seed)
        predicted[test] = model.predict(scaler.transform(features[test]))
    rows = []
    for method, guess in (("trained", predicted.astype(str)), ("rules", rules)):
        precision, recall, f1, support = precision_recall_fscore_support(labels, guess, labels=list(PATTERNS), zero_division=0)
        for k, pattern in enumerate(PATTERNS):  # a class nobody labelled has no F1 (NaN), not a zero
            scores = (precision[k], recall[k], f1[k]) if support[k] else (np.nan, np.nan, np.nan)
            rows.append({"method": method, "class": pattern, "precision": scores[0], "recall": scores[1], "f1": scores[2], "support": int(support[k])})
        rows.append({"method": method, "class": "macro (labelled classes)", "precision": np.nan, "recall": np.nan,
                     "f1": f1_score(labels, guess, labels=present, average="macro", zero_division=0), "support": len(labels)})
    training = pd.DataFrame(rows)
    confusion = []
    for method, guess in (("trained", predicted.astype(str)), ("rules", rules)):
        counts = confusion_matrix(labels, guess, labels=list(PATTERNS))
        confusion += [{"method": method, "label": gold, "predicted": guess_class, "count": int(counts[i, j])}
                      for i, gold in enumerate(PATTERNS) for j, guess_class in enumerate(PATTERNS)]
    scaler, model = fit(features, labels, groups, seed)
    document = {"format": CLASSIFIER_FORMAT, "version": 1, "grid": GRID, "features": list(FEATURE_NAMES), "classes": [str(c) for c in model.classes_],
                "regularisation": model.C,
                "mean": scaler.mean_.tolist(), "scale": scaler.scale_.tolist(), "coef": model.coef_.tolist(), "intercept": model.intercept_.tolist(),
                "labelled_maps": len(labels), "folds": folds}
    return training, pd.DataFrame(confusion), document


class TrainedClassifier:
    """A classifier from :func:`train_classifier`'s document (``classifier.json``), with the
    :class:`~bertology.families.patterns.analyzer.PatternClassifier` ``classify`` method.

    The document is checked before use: its format and version, a grid of 1 to :data:`MAX_GRID`, two or more distinct
    known classes, and the scaler's and model's numbers as finite arrays of the shapes the grid and classes give, every
    scale above 0 and none so large that a class score overflows (which would make every head the first class)."""

    def __init__(self, document: dict, source: str = "classifier.json"):
        self.source = source
        if not isinstance(document, dict) or document.get("format") != CLASSIFIER_FORMAT:
            raise StateError(source, f"not a pattern classifier bertology wrote (its format is not {CLASSIFIER_FORMAT!r})")
        if field(document, "version", int, source) != 1:
            raise StateError(source, f"pattern classifier version {document['version']} is not one this bertology reads (1)")
        self.grid = whole_number(field(document, "grid", int, source), "grid", source, low=1, high=MAX_GRID)
        names = field(document, "classes", list, source)
        unknown = [name for name in names if not isinstance(name, str) or name not in PATTERNS]
        if unknown:
            raise StateError(source, f"unknown class {json.dumps(unknown[0], default=str)[:60]} (the classes are {', '.join(PATTERNS)})")
        if len(set(names)) != len(names) or len(names) < 2:
            raise StateError(source, "'classes' must name two or more different classes")
        self.classes = [PATTERNS.index(name) for name in names]
        width = self.grid * self.grid + len(RULE_FEATURES)
        rows = 1 if len(names) == 2 else len(names)  # scikit-learn keeps one row for two classes, the log-odds of the second
        self.mean, self.scale = (finite_array(field(document, key, list, source), key, source, shape=(width,)).astype(np.float64) for key in ("mean", "scale"))
        self.coef = finite_array(field(document, "coef", list, source), "coef", source, shape=(rows, width)).astype(np.float64)
        self.intercept = finite_array(field(document, "intercept", list, source), "intercept", source, shape=(rows,)).astype(np.float64)
        if (self.scale <= 0).any():
            raise StateError(source, "'scale' holds a value that is not above 0 (features are divided by it)")
        with np.errstate(over="ignore", invalid="ignore"):
            reach = np.maximum(np.abs(self.mean), np.abs(1 - self.mean)) / self.scale  # the largest standardised feature (features lie in [0, 1])
            if not np.isfinite(np.abs(self.coef) @ reach + np.abs(self.intercept)).all():
                raise StateError(source, "its numbers are too large: the class scores would overflow")
        if rows == 1:  # two classes: scores (0, s)
            self.coef = np.concatenate([np.zeros_like(self.coef), self.coef])
            self.intercept = np.concatenate([[0.0], self.intercept])

    @classmethod
    def load(cls, path: str | Path) -> "TrainedClassifier":
        """Read ``classifier.json`` (plain JSON: numbers and names, no code), checked as the constructor checks it."""
        return cls(read_json(Path(path)), str(path))

    def probabilities(self, attention, mask, special, segment_ids) -> np.ndarray:
        """``[batch, head, class]`` probabilities, classes in the order of ``self.classes``."""
        features = map_features(attention, mask, special, segment_ids, self.grid)
        scores = ((features - self.mean) / self.scale) @ self.coef.T + self.intercept
        scores -= scores.max(axis=-1, keepdims=True)
        odds = np.exp(scores)
        return odds / odds.sum(axis=-1, keepdims=True)

    def classify(self, attention, mask, special, segment_ids) -> torch.Tensor:
        best = self.probabilities(attention, mask, special, segment_ids).argmax(axis=-1)
        return torch.as_tensor(np.asarray(self.classes)[best], device=attention.device)
