import numpy as np
import pandas as pd
import pytest
import torch

from bertology.corpora import Example
from bertology.errors import CorpusError
from bertology.finetuning import TaskData, load_task
from bertology.hooks import Hooks
from bertology.importance import (
    GradientImportance,
    LeaveOneOut,
    ablation_table,
    importance_table,
    load_task_model,
    normalise_per_layer,
    prune_and_time,
    pruning_curve,
)
from bertology.interventions import HeadGates, Intervention


@pytest.fixture
def task_model(tiny_classifier_dir):
    return load_task_model(tiny_classifier_dir, device="cpu")


@pytest.fixture
def rows(task_model, cat_task):
    return task_model.encode(load_task(cat_task).dev, "dev.tsv")


@pytest.mark.parametrize("intervention", ["mask", "uniform"])
def test_leave_one_out_with_reuse_equals_the_naive_way(task_model, rows, intervention):
    encoded, _ = rows
    quick = LeaveOneOut(task_model, intervention, batch_size=5, reuse=True, progress=False)
    naive = LeaveOneOut(task_model, intervention, batch_size=3, reuse=False, progress=False)
    base_quick, variants_quick = quick.predict(encoded)
    base_naive, variants_naive = naive.predict(encoded)
    np.testing.assert_allclose(base_quick, base_naive, atol=1e-5)
    np.testing.assert_allclose(variants_quick, variants_naive, atol=1e-5)
    layout = quick.variants()
    assert len(layout) == len(variants_quick) == 3 * 5
    # spot-check one variant against a plain masked pass
    index = layout.index[(layout.layer == 1) & (layout["head"] == 2)][0]
    single = task_model.logits(encoded, intervention=Intervention.of(intervention, 1, 2))
    np.testing.assert_allclose(variants_quick[index], single, atol=1e-5)
    whole = layout.index[(layout.layer == 2) & (layout["head"] == -1)][0]
    np.testing.assert_allclose(variants_quick[whole], task_model.logits(encoded, intervention=Intervention.of(intervention, 2)), atol=1e-5)


def test_gradient_importance_agrees_with_finite_differences(task_model, rows):
    encoded, gold = rows
    task_model.model.double()
    importance = GradientImportance(task_model, batch_size=4, progress=False).attribute(encoded)
    inputs = {k: v for k, v in _batch(task_model, encoded).items() if k != "labels"}
    labels = torch.as_tensor(gold)
    eps = 1e-6

    def losses(layer, head, value):
        gates = torch.ones(3, len(encoded), 4, dtype=torch.float64)
        gates[layer, :, head] = value
        with torch.no_grad(), HeadGates(gates).attach_to(Hooks()).attach(task_model.model):
            out = task_model.model(**inputs).logits
        return torch.nn.functional.cross_entropy(out, labels, reduction="none").numpy()

    for layer, head in [(0, 0), (1, 3), (2, 1)]:
        derivative = (losses(layer, head, 1 + eps) - losses(layer, head, 1 - eps)) / (2 * eps)
        assert importance[layer, head] == pytest.approx(np.abs(derivative).mean(), rel=1e-5)
    task_model.model.float()


def _batch(task_model, encoded):
    from bertology.finetuning import collate_rows

    return collate_rows(task_model.tokenizer, encoded, task_model.device)


def test_importance_of_a_masked_head_is_measured_with_the_mask_in_place(task_model, rows):
    encoded, _ = rows
    scorer = GradientImportance(task_model, progress=False)
    mask = np.ones((3, 4))
    mask[0, 0] = 0
    assert not np.allclose(scorer.attribute(encoded, mask), scorer.attribute(encoded))


def test_normalisation_divides_each_layer_by_its_l2_norm():
    importance = np.array([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(normalise_per_layer(importance), [[0.6, 0.8], [0.0, 0.0]])
    table = importance_table(importance)
    assert list(table.columns) == ["layer", "head", "importance", "importance_normalised"]
    assert table.importance_normalised.tolist() == [0.6, 0.8, 0.0, 0.0]


def test_ablation_table_by_hand():
    task = TaskData("sst2", ("accuracy",), ("0", "1"), [], [])
    gold = np.tile([1, 0, 1, 1, 0, 0, 1, 0], 5)
    base = np.eye(2)[gold]  # always right
    same = base.copy()
    worse = np.eye(2)[np.where(np.arange(40) < 20, 1 - gold, gold)]  # half wrong
    layout = pd.DataFrame({"layer": [0, 0], "head": [0, -1]})
    table = ablation_table(task, gold, base, np.stack([same, worse]), layout, "mask", replicates=500, seed=1)
    assert list(table.columns) == ["layer", "head", "intervention", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj"]
    assert table.value.tolist() == [1.0, 0.5]
    assert table.delta.tolist() == [0.0, -0.5]
    assert table.loc[0, "p"] == 1.0 and table.loc[0, "ci_low"] == table.loc[0, "ci_high"] == 0.0
    assert table.loc[1, "ci_low"] < -0.5 < table.loc[1, "ci_high"] < 0
    assert table.loc[1, "p"] == pytest.approx(2 / 501)  # no resample has delta >= 0 (all 20 wrong ones left out: 2^-40)
    assert (table.p_adj >= table.p).all()


def test_pruning_curve_goes_down_to_one_head_per_layer_and_stops_at_keep_at(task_model, rows, cat_task):
    encoded, gold = rows
    task = load_task(cat_task)
    curve = pruning_curve(task_model, task, encoded, encoded, gold, step=0.2, keep_at=7, progress=False)
    pruned = curve.table.heads_pruned.tolist()
    assert pruned[0] == 0 and pruned == sorted(pruned) and pruned[-1] == 12 - 3
    assert 12 - 7 in curve.masks
    assert all(mask.sum(1).min() >= 1 for mask in curve.masks.values())
    assert (curve.masks[pruned[-1]].sum(1) == 1).all()
    np.testing.assert_allclose(curve.table.share_pruned, curve.table.heads_pruned / 12)
    # each step's value is the metric of the masked model
    mask = curve.masks[5]
    masked = Intervention(masked=frozenset(zip(*map(lambda a: a.tolist(), np.nonzero(mask == 0)))))
    accuracy = (task_model.logits(encoded, intervention=masked).argmax(-1) == gold).mean()
    assert curve.table.set_index("heads_pruned").loc[5, "value"] == pytest.approx(accuracy)


def test_prune_and_time_saves_a_smaller_model_that_predicts_like_the_masked_one(task_model, rows, cat_task, tmp_path):
    encoded, gold = rows
    task = load_task(cat_task)
    mask = np.ones((3, 4))
    mask[0, [0, 2]] = 0
    mask[2, 3] = 0
    result = prune_and_time(task_model, task, mask, encoded, gold, tmp_path / "pruned", repeats=1)
    assert result["heads_pruned"] == 3 and result["parameters_pruned"] < result["parameters_full"]
    assert result["max_logit_difference_vs_masked"] < 1e-5
    assert result["speedup"] > 0
    again = load_task_model(tmp_path / "pruned", device="cpu")
    assert again.info()["pruned_heads"] == {"0": [0, 2], "2": [3]}
    masked = Intervention(masked=frozenset({(0, 0), (0, 2), (2, 3)}))
    np.testing.assert_allclose(again.logits(encoded), task_model.logits(encoded, intervention=masked), atol=1e-5)


def test_a_label_the_model_does_not_know_names_the_file_and_line(task_model):
    with pytest.raises(CorpusError, match=r"dev.tsv:7: label 'maybe'"):
        task_model.encode([Example("the cat sat.", label="maybe", source="dev.tsv:7")], "dev.tsv")
