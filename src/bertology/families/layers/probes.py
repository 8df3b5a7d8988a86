"""Linear probes of every layer's word vectors, with Hewitt & Liang's control task (docs/methods.md#layer-probes).

For each task (``upos``: the word's UPOS tag; ``deprel``: its relation to its head) and layer, a logistic regression
(scikit-learn, L2 with ``C = 0.1``, at most 100 L-BFGS iterations, on standardised features) is trained on the words of a
seeded 80% of the sentences and tested on the
other 20% (split by sentence, so no sentence is on both sides):

- ``accuracy`` with a 95% percentile interval from a bootstrap over the test sentences;
- ``majority``: the accuracy of always answering the most frequent training label;
- ``control_accuracy``: the same probe on Hewitt & Liang's (2019) control task, where every word type gets one fixed
  label drawn at random from the task's training label distribution; ``selectivity = accuracy - control_accuracy``
  says how much of the accuracy the representation, not the probe's memory, gives. A word type is the form as
  written, case kept, as in Hewitt & Liang (``The`` and ``the`` are two types, with labels drawn independently);
  ``control_casefold=True`` (``--control-casefold``) merges the forms that differ only in case into one type.

The expected layer, running-max variant (``expected_layer_running_max``). Tenney et al. (2019, "BERT rediscovers the
classical NLP pipeline") train a *cumulative* probe for every l, on a learned scalar mix of layers 0..l, score it
(``S_l``), and summarise the gains ``Delta_l = S_l - S_(l-1)`` by their expected layer

    ``E_Delta[l] = sum_(l>=1) l * Delta_l / sum_(l>=1) Delta_l``.

(Their other summary, the "center of gravity" ``E_s[l] = sum_l l * s_l``, weights the layers by the scalar-mix weights
of one probe over all layers; bertology computes neither the mix nor that statistic.) bertology trains one probe per
layer, not cumulative ones, and stands in for ``S_l`` with the best single-layer accuracy of layers 0..l,
``S_l = max_(k<=l) acc_k``, so that ``Delta_l = max_(k<=l) acc_k - max_(k<l) acc_k >= 0``. In principle this is a
lower bound on Tenney's cumulative score (the mix may put all its weight on the best layer so far, and may do better
by combining layers), and its gains come only from layers that beat every layer below them: a layer that adds
something the layers below lack, but scores less than one of them on its own, adds nothing here. The scores are
accuracies of word-level classifiers, where Tenney et al. score span-level edge probes by F1. The raw differences
``acc_l - acc_(l-1)`` would not do: they fall after the peak, and their sum, ``acc_L - acc_0``, can be near zero,
which sends the ratio anywhere. NaN where no layer gains.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pandas as pd
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from tqdm.auto import tqdm

from bertology.core.errors import BertologyError
from bertology.core.statistics.stats import keyed_rng
from bertology.families.layers.analyzer import LayerSentence

PROBE_TASKS = ("upos", "deprel")
PROBE_COLUMNS = ["layer", "task", "accuracy", "ci_low", "ci_high", "control_accuracy", "selectivity", "majority", "n_train", "n_test"]


def task_labels(sentence: LayerSentence, task: str) -> tuple[str, ...]:
    return sentence.upos if task == "upos" else sentence.relations


def control_labels(forms: Sequence[str], distribution: Counter, task: str, seed: int, casefold: bool = False) -> np.ndarray:
    """Hewitt & Liang's control task: each word type gets one label drawn from ``distribution`` by a generator keyed by
    the type, so the same type has the same label everywhere, in training and test. A type is the form as written (case
    kept, as in Hewitt & Liang 2019), or with ``casefold`` the casefolded form (``The`` and ``the`` one type)."""
    labels = sorted(distribution)
    weights = np.array([distribution[label] for label in labels], dtype=np.float64)
    weights /= weights.sum()
    types = [str(form).casefold() if casefold else str(form) for form in forms]  # str: a numpy string's repr would change the key
    chosen = {}
    for key in types:
        if key not in chosen:
            chosen[key] = labels[keyed_rng(seed, "control", task, key).choice(len(labels), p=weights)]
    return np.array([chosen[key] for key in types])


def split_sentences(count: int, test_share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sentence positions of the training and test sides: a seeded permutation, its first ``test_share`` for testing."""
    order = np.random.default_rng(seed).permutation(count)
    test = max(1, int(round(test_share * count)))
    return np.sort(order[test:]), np.sort(order[:test])


def fit_and_score(train_x, train_y, test_x, test_y, seed: int, max_iter: int = 100, regularisation: float = 0.1) -> np.ndarray:
    """Whether each test word is labelled right by a logistic regression fitted on standardised training features
    (``regularisation``: scikit-learn's ``C``; unconverged fits after ``max_iter`` iterations are kept, quietly)."""
    scaler = StandardScaler().fit(train_x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        classifier = LogisticRegression(C=regularisation, max_iter=max_iter, random_state=seed).fit(scaler.transform(train_x), train_y)
    return classifier.predict(scaler.transform(test_x)) == test_y


def bootstrap_accuracy(correct: np.ndarray, sentence_of_word: np.ndarray, sentences: int, replicates: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of the accuracy, resampling test sentences (words stay with their sentence)."""
    hits = np.bincount(sentence_of_word, weights=correct.astype(np.float64), minlength=sentences)
    words = np.bincount(sentence_of_word, minlength=sentences).astype(np.float64)
    counts = np.random.default_rng(seed).multinomial(sentences, np.full(sentences, 1.0 / sentences), size=replicates)
    accuracies = (counts @ hits) / (counts @ words)
    low, high = np.percentile(accuracies, [2.5, 97.5])
    return float(low), float(high)


def probe_layers(sentences: Sequence[LayerSentence], tasks: Sequence[str] = PROBE_TASKS, *, test_share: float = 0.2, bootstrap: int = 1000,
                 seed: int = 0, control_casefold: bool = False, progress: bool = False) -> pd.DataFrame:
    """The ``layer_probes`` table (see the module docstring): one row per layer and task. ``control_casefold``: the
    control task's word types are casefolded forms (default: forms as written, as in Hewitt & Liang); ``progress``: a bar
    over the tasks' layers."""
    train_ids, test_ids = split_sentences(len(sentences), test_share, seed)
    sides = {}
    for name, ids in (("train", train_ids), ("test", test_ids)):
        chosen = [sentences[i] for i in ids]
        sides[name] = {
            "vectors": np.concatenate([s.vectors for s in chosen], axis=1),  # float16 [layer, word, dim]; float32 one layer at a time
            "forms": [form for s in chosen for form in s.forms],
            "sentence": np.repeat(np.arange(len(chosen)), [len(s.forms) for s in chosen]),
            "labels": {task: np.array([label for s in chosen for label in task_labels(s, task)]) for task in tasks},
        }
    train, test = sides["train"], sides["test"]
    rows = []
    with tqdm(total=len(tasks) * train["vectors"].shape[0], unit="probe", desc="layer probes", disable=not progress) as bar:
        for task in tasks:
            distribution = Counter(train["labels"][task])
            if len(distribution) < 2:
                raise BertologyError(f"the {task} probe needs at least two labels among its training words, not only {sorted(distribution)}")
            majority_label = max(sorted(distribution), key=distribution.__getitem__)
            control_train = control_labels(train["forms"], distribution, task, seed, casefold=control_casefold)
            control_test = control_labels(test["forms"], distribution, task, seed, casefold=control_casefold)
            for layer in range(train["vectors"].shape[0]):
                train_x, test_x = train["vectors"][layer].astype(np.float32), test["vectors"][layer].astype(np.float32)
                correct = fit_and_score(train_x, train["labels"][task], test_x, test["labels"][task], seed)
                control = fit_and_score(train_x, control_train, test_x, control_test, seed)
                low, high = bootstrap_accuracy(correct, test["sentence"], len(test_ids), bootstrap, seed)
                rows.append({"layer": layer, "task": task, "accuracy": correct.mean(), "ci_low": low, "ci_high": high,
                             "control_accuracy": control.mean(), "selectivity": correct.mean() - control.mean(),
                             "majority": float(np.mean(test["labels"][task] == majority_label)), "n_train": len(train["forms"]),
                             "n_test": len(test["forms"])})
                bar.update(1)
    return pd.DataFrame(rows, columns=PROBE_COLUMNS)


def expected_layer_running_max(accuracy_by_layer: Sequence[float]) -> float:
    """A variant of Tenney et al.'s (2019) expected layer ``E_Delta[l] = sum_l l Delta_l / sum_l Delta_l`` (l >= 1) for one
    probe per layer: ``Delta_l`` is the gain of the running maximum, the best accuracy of layers 0..l over that of layers
    0..l-1, in place of the gain of Tenney's cumulative (scalar-mix) probes (see the module docstring); NaN where no layer gains."""
    accuracy = np.maximum.accumulate(np.asarray(accuracy_by_layer, dtype=np.float64))
    gains = np.diff(accuracy)
    total = gains.sum()
    return float((np.arange(1, len(accuracy)) * gains).sum() / total) if total != 0 else float("nan")


def probe_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per task: the best layer by accuracy and by selectivity, and the expected layer of the running-max gains
    (:func:`expected_layer_running_max`)."""
    rows = []
    for task, group in table.groupby("task", sort=False):
        group = group.sort_values("layer")
        best = group.loc[group.accuracy.idxmax()]
        selective = group.loc[group.selectivity.idxmax()]
        rows.append({"task": task, "best_layer": int(best.layer), "best_accuracy": best.accuracy, "its_selectivity": best.selectivity,
                     "most_selective_layer": int(selective.layer), "selectivity": selective.selectivity,
                     "expected_layer_running_max": expected_layer_running_max(group.accuracy.to_numpy())})
    return pd.DataFrame(rows)
