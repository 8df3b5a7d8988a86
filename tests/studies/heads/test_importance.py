import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from bertology.core.errors import BertologyError, CorpusError
from bertology.core.learning.tasks import TaskData, load_task, load_task_model
from bertology.core.model.hooks import Hooks
from bertology.core.model.interventions import HeadGates, Intervention
from bertology.core.text.corpora import Example
from bertology.studies.heads.ablation import LeaveOneOut, ablation_table
from bertology.studies.heads.importance import GradientImportance, importance_table, normalise_importance
from bertology.studies.heads.pruning import prune_and_time, pruning_curve, task_scorer
from bertology.studies.heads.study import study_heads


@pytest.fixture
def task_model(tiny_classifier_dir):
    return load_task_model(tiny_classifier_dir, device="cpu")


@pytest.fixture
def rows(task_model, cat_task):
    return task_model.encode(load_task(cat_task).dev, "dev.tsv")


@pytest.mark.parametrize("intervention", ["mask", "zero", "mean", "resample", "uniform"])
def test_leave_one_out_with_reuse_equals_the_naive_way(task_model, rows, intervention):
    encoded, _ = rows
    quick = LeaveOneOut(task_model, intervention, resamples=2, batch_size=5, reuse=True, progress=False)
    naive = LeaveOneOut(task_model, intervention, resamples=2, batch_size=3, reuse=False, progress=False)
    base_quick, variants_quick = quick.predict(encoded)
    base_naive, variants_naive = naive.predict(encoded)
    np.testing.assert_allclose(base_quick, base_naive, atol=1e-5)
    np.testing.assert_allclose(variants_quick, variants_naive, atol=1e-5)
    layout = quick.variants()
    assert len(layout) == len(variants_quick) == 3 * 5
    assert variants_quick.shape == (15, 2 if intervention == "resample" else 1, len(encoded), 2)
    if intervention in ("mean", "resample"):
        return
    # spot-check one variant against a plain pass with the head gated (mask, zero) or made uniform by the hooks
    kind = "uniform" if intervention == "uniform" else "mask"
    index = layout.index[(layout.layer == 1) & (layout["head"] == 2)][0]
    single = task_model.logits(encoded, intervention=Intervention.of(kind, 1, 2))
    np.testing.assert_allclose(variants_quick[index, 0], single, atol=1e-5)
    whole = layout.index[(layout.layer == 2) & (layout["head"] == -1)][0]
    np.testing.assert_allclose(variants_quick[whole, 0], task_model.logits(encoded, intervention=Intervention.of(kind, 2)), atol=1e-5)


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
    from bertology.core.learning.tasks import collate_rows

    return collate_rows(task_model.tokenizer, encoded, task_model.device)


def test_importance_of_a_masked_head_is_measured_with_the_mask_in_place(task_model, rows):
    encoded, _ = rows
    scorer = GradientImportance(task_model, progress=False)
    mask = np.ones((3, 4))
    mask[0, 0] = 0
    assert not np.allclose(scorer.attribute(encoded, mask), scorer.attribute(encoded))


RAW = np.array([[0.2, 0.5, 0.1, 0.9], [3.0, 1.0, 2.0, 8.0], [0.0, 0.0, 0.0, 0.0]])


def _by_layer(raw):
    norms = np.sqrt((raw**2).sum(axis=1, keepdims=True))
    return np.divide(raw, norms, out=np.zeros_like(raw), where=norms > 0)


def _min_max(raw):
    return (raw - raw.min()) / (raw.max() - raw.min())


@pytest.mark.parametrize("how, expected", [("layer", _by_layer(RAW)), ("global", _min_max(RAW)), ("layer+global", _min_max(_by_layer(RAW))),
                                           ("none", RAW)])
def test_normalisations_match_numpy_on_the_raw_importances(how, expected):
    np.testing.assert_allclose(normalise_importance(RAW, how), expected, rtol=1e-12)
    table = importance_table(RAW, how)
    assert list(table.columns) == ["layer", "head", "importance", "importance_normalised"]
    np.testing.assert_array_equal(table.importance, RAW.ravel())
    np.testing.assert_allclose(table.importance_normalised, expected.ravel(), rtol=1e-12)


def test_normalisation_by_layer_by_hand_and_degenerate_cases():
    np.testing.assert_allclose(normalise_importance(np.array([[3.0, 4.0], [0.0, 0.0]]), "layer"), [[0.6, 0.8], [0.0, 0.0]])
    np.testing.assert_array_equal(normalise_importance(np.full((2, 2), 0.7), "global"), np.zeros((2, 2)))  # the script gives NaN
    with pytest.raises(BertologyError, match="unknown normalisation 'l2'.*layer, global, layer\\+global, none"):
        normalise_importance(RAW, "l2")


def test_ablation_table_by_hand():
    task = TaskData("sst2", ("accuracy",), ("0", "1"), [], [])
    gold = np.tile([1, 0, 1, 1, 0, 0, 1, 0], 5)
    base = np.eye(2)[gold]  # always right
    same = base.copy()
    worse = np.eye(2)[np.where(np.arange(40) < 20, 1 - gold, gold)]  # half wrong
    layout = pd.DataFrame({"layer": [0, 0], "head": [0, -1]})
    table = ablation_table(task, gold, base, np.stack([same, worse]), layout, "mask", replicates=500, seed=1)
    assert list(table.columns) == ["layer", "head", "intervention", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj", "matters", "n"]
    assert table.value.tolist() == [1.0, 0.5] and table.matters.tolist() == [False, True] and (table.n == 40).all()
    assert table.delta.tolist() == [0.0, -0.5]
    assert table.loc[0, "p"] == 1.0 and table.loc[0, "ci_low"] == table.loc[0, "ci_high"] == 0.0
    assert table.loc[1, "ci_low"] < -0.5 < table.loc[1, "ci_high"] < 0
    assert table.loc[1, "p"] == pytest.approx(2 / 501)  # no resample has delta >= 0 (all 20 wrong ones left out: 2^-40)
    assert (table.p_adj >= table.p).all()


def test_pruning_curve_goes_down_to_one_head_per_layer_and_stops_at_keep_at(task_model, rows, cat_task):
    encoded, gold = rows
    task = load_task(cat_task)
    curve = pruning_curve(task_model, encoded, task_scorer(task_model, task, encoded, gold, 64), step=0.2, keep_at=7, progress=False)
    pruned = curve.table.heads_pruned.tolist()
    assert pruned[0] == 0 and pruned == sorted(pruned) and pruned[-1] == 12 - 3
    assert 12 - 7 in curve.masks
    assert all(mask.sum(1).min() >= 1 for mask in curve.masks.values())
    assert (curve.masks[pruned[-1]].sum(1) == 1).all()
    np.testing.assert_allclose(curve.table.share_pruned, curve.table.heads_pruned / 12)
    # each step names the heads it removed (layer-head): the mask's zeros that the step before had not
    steps = curve.table.drop_duplicates("heads_pruned").set_index("heads_pruned").removed
    assert steps.loc[0] == ""
    previous = np.ones((3, 4))
    for count, removed in steps.items():
        gone = {f"{layer}-{head}" for layer, head in zip(*np.nonzero((previous == 1) & (curve.masks[count] == 0)))}
        assert set(removed.split()) == gone and len(gone) == count - int(12 - previous.sum())
        previous = curve.masks[count]
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


# raw importances whose per-layer normalised order differs from the raw one: layer 1 has large raw values
PRUNING_RAW = np.array([[0.1, 0.5, 0.6, 0.9], [10.0, 20.0, 30.0, 40.0], [3.0, 1.0, 2.0, 8.0]])
BY_LAYER_ORDER = [(0, 0), (2, 1), (1, 0), (2, 2), (2, 0), (1, 1), (0, 1), (0, 2), (1, 2)]  # 0.084 0.113 0.183 0.226 0.340 0.365 0.418 0.502 0.548
RAW_ORDER = [(0, 0), (0, 1), (0, 2), (2, 1), (2, 2), (2, 0), (1, 0), (1, 1), (1, 2)]  # each layer's last head stays


@pytest.mark.parametrize("how, order", [("layer", BY_LAYER_ORDER), ("layer+global", BY_LAYER_ORDER), ("global", RAW_ORDER), ("none", RAW_ORDER)])
def test_pruning_curve_prunes_heads_in_the_order_of_the_normalised_importance(task_model, rows, cat_task, monkeypatch, how, order):
    encoded, gold = rows
    monkeypatch.setattr(GradientImportance, "attribute", lambda self, rows, head_mask=None: PRUNING_RAW.copy())
    kwargs = {} if how == "layer" else {"normalise": how}  # layer is the default
    scorer = task_scorer(task_model, load_task(cat_task), encoded, gold, 64)
    curve = pruning_curve(task_model, encoded, scorer, step=0.05, progress=False, **kwargs)  # one head a step
    assert sorted(curve.masks) == list(range(10))
    pruned = [tuple(map(int, np.argwhere(curve.masks[k - 1] - curve.masks[k])[0])) for k in range(1, 10)]
    assert pruned == order


def _gradients_by_hand(model_dir, sentences, labels):
    """dL(x)/d xi_h ``[examples, layers, heads]`` and token counts, with plain transformers in float64: one example
    at a time, a gate xi on each head's slice of the attention output (the input of BertSelfOutput.dense)."""
    from transformers import BertForSequenceClassification, BertTokenizerFast

    model = BertForSequenceClassification.from_pretrained(model_dir, attn_implementation="eager").double().eval()
    tokenizer = BertTokenizerFast.from_pretrained(model_dir)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    size = model.config.hidden_size // heads
    gates = torch.ones(layers, heads, dtype=torch.float64, requires_grad=True)
    handles = [layer.attention.output.dense.register_forward_pre_hook(lambda module, args, i=i: (args[0] * gates[i].repeat_interleave(size),))
               for i, layer in enumerate(model.bert.encoder.layer)]
    gradients, tokens = [], []
    for sentence, label in zip(sentences, labels):
        inputs = tokenizer(sentence, return_tensors="pt")
        loss = torch.nn.functional.cross_entropy(model(**inputs).logits, torch.tensor([label]))
        gradients.append(torch.autograd.grad(loss, gates)[0].numpy())
        tokens.append(int(inputs["attention_mask"].sum()))
    for handle in handles:
        handle.remove()
    return np.stack(gradients), np.array(tokens)


def _importance_by_hand(model_dir, sentences, labels):
    """Michel et al.'s E_x |dL(x)/d xi_h|."""
    return np.abs(_gradients_by_hand(model_dir, sentences, labels)[0]).mean(axis=0)


def test_importance_examples_with_the_dev_split_uses_exactly_that_many(task_model, tiny_classifier_dir, cat_task, tmp_path):
    task_model.model.double()  # float64 on both sides: agreement to 1e-9
    study = study_heads(task_model, load_task(cat_task), importance=True, importance_split="dev", importance_examples=10, out=tmp_path / "run",
                        progress=False)
    dev = pd.read_csv(cat_task / "dev.tsv", sep="\t")
    chosen = dev.iloc[sorted(np.random.default_rng(0).permutation(len(dev))[:10])]  # the seeded subset, seed 0
    expected = _importance_by_hand(tiny_classifier_dir, chosen.sentence.tolist(), chosen.label.tolist())
    everything = _importance_by_hand(tiny_classifier_dir, dev.sentence.tolist(), dev.label.tolist())
    assert not np.allclose(everything, expected, rtol=1e-3)  # the two subsets tell apart
    np.testing.assert_allclose(study.importance.importance.to_numpy().reshape(3, 4), expected, rtol=1e-9)
    np.testing.assert_allclose(pd.read_csv(tmp_path / "run" / "importance.csv").importance.to_numpy().reshape(3, 4), expected, rtol=1e-9)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["importance_examples"] == 10 and manifest["examples"] == 12
    assert manifest["settings"]["importance_split"] == "dev" and manifest["settings"]["normalise"] == "layer"


def test_an_ablate_run_records_only_the_settings_that_applied(task_model, cat_task, tmp_path):
    study_heads(task_model, load_task(cat_task), ablate=True, bootstrap=200, out=tmp_path / "run", progress=False)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["importance_examples"] is None
    assert set(manifest["settings"]) == {"intervention", "bootstrap", "correction", "min_sample", "max_examples", "batch_size", "max_length", "seed",
                                         "device"}
    assert manifest["settings"]["bootstrap"] == 200 and manifest["settings"]["max_length"] == 128 and manifest["settings"]["device"] == "cpu"
    # the report describes the files the run wrote, and no other
    report = (tmp_path / "run" / "report.html").read_text()
    assert "ablation.csv" in report and (tmp_path / "run" / "ablation.csv").is_file()
    assert "importance.csv" not in report and "pruning.csv" not in report and not (tmp_path / "run" / "pruning.csv").exists()


@pytest.mark.parametrize("settings, message", [
    ({"importance": True, "bootstrap": 500}, "bootstrap applies only to ablate"),
    ({"importance": True, "intervention": "uniform"}, "intervention applies only to ablate"),
    ({"ablate": True, "normalise": "global"}, "normalise applies only to importance or prune"),
    ({"ablate": True, "importance_split": "dev", "importance_examples": 10}, "importance_split, importance_examples apply only to importance or prune"),
    ({"importance": True, "step": 0.2}, "step applies only to prune"),
    ({"importance": True, "prune_to": 6}, "prune_to applies only to prune"),
    ({"importance": True, "normalise": "l2"}, "unknown normalisation 'l2'"),
    ({"importance": True, "importance_examples": 0}, "^--importance-examples must be at least 1"),
    ({"prune": True, "step": 0.0}, "^--step must be in"),
    ({"ablate": True, "correction": "fdr"}, "unknown correction 'fdr'"),
    ({"importance": True, "max_length": 64}, "max_length applies only to a model given by its path"),
])
def test_an_option_that_cannot_apply_is_refused_in_one_line(task_model, cat_task, settings, message):
    with pytest.raises(BertologyError, match=message) as refused:
        study_heads(task_model, load_task(cat_task), progress=False, **settings)
    assert "\n" not in str(refused.value)


def test_the_command_line_importance_on_ten_dev_examples_with_global_normalisation(tiny_classifier_dir, cat_task, tmp_path):
    def bertology(*args):
        return subprocess.run([sys.executable, "-m", "bertology.cli", "importance", cat_task, "--model", tiny_classifier_dir, "--device", "cpu", "-q",
                               *map(str, args)], capture_output=True, text=True, timeout=300)

    result = bertology("--importance-split", "dev", "--importance-examples", 10, "--normalise", "global", "--out", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    assert "importance measured on 10 dev examples" in result.stdout
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["importance_examples"] == 10 and manifest["settings"]["normalise"] == "global"
    table = pd.read_csv(tmp_path / "run" / "importance.csv")
    np.testing.assert_allclose(table.importance_normalised, _min_max(table.importance.to_numpy()), rtol=1e-12)
    report = (tmp_path / "run" / "report.html").read_text()
    assert "importance.csv" in report and "ablation.csv" not in report and not (tmp_path / "run" / "ablation.csv").exists()

    result = bertology("--normalise", "l2", "--out", tmp_path / "refused")
    assert result.returncode == 2 and result.stderr.startswith("error: unknown normalisation 'l2'")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()


def test_layer_normalised_importance_equals_the_hugging_face_script_once_its_accumulation_is_fixed(task_model, tiny_classifier_dir, cat_task):
    task_model.model.double()
    dev = pd.read_csv(cat_task / "dev.tsv", sep="\t")
    ours = GradientImportance(task_model, batch_size=5, progress=False).attribute(task_model.encode(load_task(cat_task).dev, "dev")[0])
    gradients, tokens = _gradients_by_hand(tiny_classifier_dir, dev.sentence.tolist(), dev.label.tolist())
    # run_bertology.py with --batch_size 1: head_importance += |head_mask.grad| per batch, then / tot_tokens
    fixed = np.abs(gradients).sum(axis=0) / tokens.sum()  # head_mask.grad zeroed after each batch
    as_published = np.abs(np.cumsum(gradients, axis=0)).sum(axis=0) / tokens.sum()  # never zeroed: the sum of all batches so far
    np.testing.assert_allclose(ours, fixed * tokens.sum() / len(dev), rtol=1e-9)
    np.testing.assert_allclose(normalise_importance(ours, "layer"), _by_layer(fixed), rtol=1e-9)
    assert not np.allclose(normalise_importance(ours, "layer"), _by_layer(as_published), rtol=1e-2)
