import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.spatial.distance import jensenshannon

from bertology.analyzers import PROFILE_METRICS, clark_labels, profile_metrics
from bertology.analyzers.profile import pairwise_js


def by_hand(a: np.ndarray, cls: list[int], sep: list[int], punct: list[int]) -> dict:
    """Clark et al.'s metrics of one n x n map, written as plain loops (METHODS.md section 1)."""
    n = a.shape[0]
    smoothed = 0.9999 * a + 0.0001 / n
    row_entropy = [-sum(smoothed[i, j] * math.log(smoothed[i, j]) for j in range(n)) for i in range(n)]
    return {
        "cls": sum(a[i, j] for i in range(n) for j in cls) / n,
        "sep": sum(a[i, j] for i in range(n) for j in sep) / n,
        "punct": sum(a[i, j] for i in range(n) for j in punct) / n,
        "self": sum(a[i, i] for i in range(n)) / n,
        "prev": sum(a[i, i - 1] for i in range(1, n)) / n,
        "next": sum(a[i, i + 1] for i in range(n - 1)) / n,
        "entropy": sum(row_entropy) / n,
        "cls_entropy": row_entropy[cls[0]],
        "distance": sum(a[i, j] * abs(i - j) for i in range(n) for j in range(n)) / n,
    }


def padded_batch(maps, flags):
    """Stack maps of different n into one zero-padded batch of one head, with masks."""
    width = max(m.shape[0] for m in maps)
    attention = torch.zeros(len(maps), 1, width, width, dtype=torch.float64)
    masks = {name: torch.zeros(len(maps), width, dtype=torch.bool) for name in ("mask", "cls", "sep", "punct")}
    for b, (m, (cls, sep, punct)) in enumerate(zip(maps, flags)):
        n = m.shape[0]
        attention[b, 0, :n, :n] = torch.tensor(m)
        masks["mask"][b, :n] = True
        masks["cls"][b, cls] = True
        masks["sep"][b, sep] = True
        masks["punct"][b, punct] = True
    return attention, masks


def test_metrics_match_hand_computation_on_sequences_of_different_length():
    rng = np.random.default_rng(0)
    short = rng.dirichlet(np.ones(4), size=4)  # [CLS] w , [SEP]
    long = rng.dirichlet(np.full(7, 0.3), size=7)  # [CLS] w w [SEP] w . [SEP]
    flags = [([0], [3], [2]), ([0], [3, 6], [5])]
    attention, m = padded_batch([short, long], flags)
    values = profile_metrics(attention, m["mask"], m["cls"], m["sep"], m["punct"]).numpy()
    for b, (matrix, (cls, sep, punct)) in enumerate(zip([short, long], flags)):
        expected = by_hand(matrix, cls, sep, punct)
        for k, metric in enumerate(PROFILE_METRICS):
            assert values[b, 0, k] == pytest.approx(expected[metric], rel=1e-10), metric


def test_uniform_attention_has_entropy_ln_n_and_self_one_over_n():
    n = 6
    attention, m = padded_batch([np.full((n, n), 1 / n)], [([0], [5], [])])
    values = dict(zip(PROFILE_METRICS, profile_metrics(attention, m["mask"], m["cls"], m["sep"], m["punct"])[0, 0].tolist()))
    assert values["entropy"] == pytest.approx(math.log(n))
    assert values["cls_entropy"] == pytest.approx(math.log(n))
    assert values["self"] == pytest.approx(1 / n)
    assert values["cls"] == pytest.approx(1 / n)
    assert values["punct"] == 0


def test_previous_token_head():
    n = 5
    a = np.zeros((n, n))
    a[0, 0] = 1
    for i in range(1, n):
        a[i, i - 1] = 1
    attention, m = padded_batch([a], [([0], [4], [])])
    values = dict(zip(PROFILE_METRICS, profile_metrics(attention, m["mask"], m["cls"], m["sep"], m["punct"])[0, 0].tolist()))
    assert values["prev"] == pytest.approx((n - 1) / n)
    assert values["next"] == 0
    assert values["self"] == pytest.approx(1 / n)
    assert values["distance"] == pytest.approx((n - 1) / n)


def test_pairwise_js_equals_scipy_squared_distance_summed_over_rows():
    rng = np.random.default_rng(3)
    heads = rng.dirichlet(np.ones(5), size=(4, 5))  # 4 heads, 5 rows of 5 keys
    heads[2, :, 4] = 0  # zeros are allowed (padding, hard attention)
    heads[2] /= heads[2].sum(axis=1, keepdims=True)
    matrix = pairwise_js(torch.tensor(heads)).numpy()
    for x in range(4):
        for y in range(4):
            expected = sum(jensenshannon(heads[x, i], heads[y, i]) ** 2 for i in range(5))
            assert matrix[x, y] == pytest.approx(expected, abs=1e-12)


def test_clark_labels_apply_the_thresholds():
    heads = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "metric": ["entropy", "entropy", "sep", "prev"],
            "value": [4.0, 3.0, 0.7, 0.5],
            "ci_low": 0.0,
            "ci_high": 1.0,
            "n": 10,
        }
    )
    labels = clark_labels(heads)
    assert labels[["layer", "head", "label"]].values.tolist() == [[0, 0, "broad"], [1, 0, "sep"]]
    assert clark_labels(heads, {"prev": 0.4}).label.tolist() == ["prev"]


def test_layer_peaks_bootstrap_by_hand():
    from types import SimpleNamespace

    from bertology.analyzers import LayerPeaks
    from bertology.corpora import Example
    from bertology.stats import bootstrap_weights

    rng = np.random.default_rng(1)
    flags = [([0], [3], [2]), ([0], [3, 6], [5]), ([0], [4], [1])]
    lengths = [4, 7, 5]
    # maps[b][layer][head]
    maps = [[[rng.dirichlet(np.full(n, 0.4), size=n) for _ in range(2)] for _ in range(3)] for n in lengths]
    examples = [Example(f"sequence {b}", source=f"s:{b}") for b in range(3)]
    per_layer = []
    for layer in range(3):
        heads = []
        for head in range(2):
            attention, m = padded_batch([maps[b][layer][head] for b in range(3)], flags)
            heads.append(attention)
        per_layer.append(torch.cat(heads, dim=1))
    batch = SimpleNamespace(attentions=torch.stack(per_layer), mask=m["mask"], cls_mask=m["cls"], sep_mask=m["sep"], punct_mask=m["punct"], examples=examples)
    peaks = LayerPeaks(bootstrap=30, seed=2)
    peaks.update(batch)

    # by hand: a sequence's layer value is the mean over heads; replicate r weights sequence b by w_b[r]
    values = np.array([[[np.mean([by_hand(maps[b][layer][head], *flags[b])[metric] for head in range(2)]) for metric in ("cls", "sep", "punct")]
                        for layer in range(3)] for b in range(3)])  # [sequence, layer, metric]
    weights = np.stack([bootstrap_weights(2, 30, e) for e in examples])  # [sequence, 1 + B]
    expected = np.einsum("br,blm->rlm", weights, values) / weights.sum(axis=0)[:, None, None]
    np.testing.assert_allclose(peaks.replicate_means(), expected, rtol=1e-10)
    table = peaks.result()
    np.testing.assert_allclose(table.value, values.mean(axis=0).ravel(), rtol=1e-10)
    found = peaks.peaks().set_index("metric")
    for k, metric in enumerate(("cls", "sep", "punct")):
        assert found.loc[metric, "peak_layer"] == values.mean(axis=0)[:, k].argmax()
        assert found.loc[metric, "agreement"] == pytest.approx(np.mean(expected[1:, :, k].argmax(axis=1) == values.mean(axis=0)[:, k].argmax()))
