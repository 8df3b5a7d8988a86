"""Issue 39, the track part: no claim under the null. A rise inside the checkpoint-to-checkpoint noise, or one whose half-rise
step cannot be located more narrowly than the run, is "no evidence"; patterns that peak (or emerge) together tie; a series
of one null model (uniform attention, noise only outside attention) makes no claim. Expected numbers are computed here
with numpy, independently of the module."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import TEXTS
from transformers import BertModel

from bertology.core.model.kinds import ENCODER
from bertology.core.text.corpora import Example
from bertology.studies.track.dynamics import track
from bertology.studies.track.hypothesis import depth_verdict, emergence_verdict
from bertology.studies.track.losses import checkpoint_loss, loss_series

#: The uniform head's attention to each token set in these made-up series (their excess is the strength less this).
UNIFORM = 0.05


def noisy(data: np.ndarray, noise: float, count: int = 400, seed: int = 0) -> np.ndarray:
    """``data [checkpoint, metric]`` -> ``[checkpoint, 1 + count, metric]``: row 0 the data, then the data plus Gaussian noise
    (stand-ins for paired bootstrap replicates)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([data[:, None], data[:, None] + rng.normal(0, noise, (data.shape[0], count, data.shape[1]))], axis=1)


def change_interval(strength: np.ndarray, k: int) -> tuple[float, float]:
    """By hand: the 2.5th and 97.5th percentile of the replicates' last-minus-first change of metric ``k``."""
    low, high = np.percentile(strength[-1, 1:, k] - strength[0, 1:, k], [2.5, 97.5])
    return float(low), float(high)


def test_a_small_rise_inside_the_noise_is_no_evidence():
    steps = [0, 10, 100, 1000]
    rise = np.array([0.389, 0.395, 0.405, 0.413])  # the syntax curve
    strength = noisy(np.stack([rise] * 4, axis=1), 0.03)  # [CLS], [SEP], punctuation, syntax
    verdict, table = emergence_verdict(steps, strength, ENCODER, syntax=True, excess=strength[..., :3] - UNIFORM)
    for k, row in enumerate(table.itertuples()):
        low, high = change_interval(strength, k)
        assert (row.change_low, row.change_high) == pytest.approx((low, high))
        assert low < 0 < high and row.change == pytest.approx(0.024)
        assert row.emerges == "no evidence"
    assert verdict["verdict"] == "no evidence"
    assert "change +0.024" in verdict["statement"] and f"95% interval {low:+.3f} to {high:+.3f}" in verdict["statement"]
    assert "no evidence that it emerges (the change's interval does not exclude 0" in verdict["statement"]
    assert "Dependency heads emerge" not in verdict["statement"]


def test_a_clear_change_between_two_checkpoints_is_not_located_and_so_no_evidence():
    strength = noisy(np.array([[0.1, 0.1, 0.1], [0.5, 0.5, 0.5]]), 0.005)
    verdict, table = emergence_verdict([0, 100], strength, ENCODER, excess=strength - UNIFORM)
    assert change_interval(strength, 0)[0] > 0.3  # the change is real ...
    assert table.located_low.tolist() == [0, 0, 0] and table.located_high.tolist() == [100, 100, 100]  # ... its step is the run
    assert (table.emerges == "no evidence").all() and verdict["verdict"] == "no evidence"
    assert "its half-rise step is not located more narrowly than the run" in verdict["statement"]


def test_a_clear_rise_emerges_and_its_verdict_names_its_numbers():
    steps = [0, 10, 100, 1000, 10000]
    data = np.full((5, 3), 0.1)
    for k, start in enumerate([1, 2, 4]):
        data[start:, k] = 0.5
    strength = noisy(data, 0.005)
    verdict, table = emergence_verdict(steps, strength, ENCODER, excess=strength - UNIFORM)
    assert (table.emerges == "yes").all() and verdict["verdict"] == "supported"
    # [CLS] jumps between steps 0 and 10: half of its rise at ln(1 + s) = ln(11) / 2, bracketed by 0 and 10 in every replicate
    assert table.half_step[0] == pytest.approx(np.sqrt(11) - 1)
    assert table.located_low.tolist() == [0, 10, 1000] and table.located_high.tolist() == [10, 100, 10000]
    low, high = change_interval(strength, 0)
    assert low > 0.35
    assert f"change +0.400, 95% interval {low:+.3f} to {high:+.3f}" in verdict["statement"]
    assert f"crosses half of that rise at step {np.sqrt(11) - 1:.0f}" in verdict["statement"]
    assert "in 95% of the replicates between 0 and 10): it emerges" in verdict["statement"]


def test_patterns_that_peak_in_one_layer_or_emerge_together_tie():
    # [CLS] and [SEP] both peak in layer 1, exactly, in the data and in every replicate: the old verdict was "contradicted"
    means = np.array([[0.1, 0.1, 0.0], [0.5, 0.6, 0.1], [0.1, 0.2, 0.2], [0.0, 0.0, 0.5]])
    replicated = np.repeat(means[None], 51, axis=0)
    verdict = depth_verdict(replicated, ENCODER, excess=replicated - UNIFORM)
    assert verdict["probability"] == 0.0
    assert verdict["verdict"] == "tie" and "[CLS] and [SEP] tie (both peak in layer 1)" in verdict["statement"]
    steps = [0, 10, 100, 1000, 10000]
    data = np.full((5, 3), 0.1)
    for k, start in enumerate([2, 2, 4]):  # [CLS] and [SEP] rise at the same checkpoint
        data[start:, k] = 0.5
    strength = noisy(data, 0.005)
    training, table = emergence_verdict(steps, strength, ENCODER, excess=strength - UNIFORM)
    assert (table.emerges == "yes").all()
    assert training["verdict"] == "tie" and training["pairs"] == {"cls<sep": "tie", "sep<punct": "<"}
    assert "[CLS] and [SEP] tie (half-rise intervals overlap)" in training["statement"]


STEPS = [0, 10, 100, 1000, 10000, 100000]


@pytest.fixture(scope="module")
def null_series(tiny_bert_dir, tmp_path_factory):
    """Six checkpoints of ONE null BERT: every query projection zeroed (attention uniform over the visible keys), each
    checkpoint differing only by small noise on the embeddings' LayerNorm and the intermediate dense layers; each records
    an invented masked-LM validation loss in its pretraining_step.json."""
    folder = tmp_path_factory.mktemp("null-series")
    checkpoints, losses = [], []
    for k, step in enumerate(STEPS):
        target = folder / f"step-{step:06d}"
        shutil.copytree(tiny_bert_dir, target)
        model = BertModel.from_pretrained(tiny_bert_dir)
        generator = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.attention.self.query.weight.zero_()
                layer.attention.self.query.bias.zero_()
                layer.intermediate.dense.weight.add_(0.01 * torch.randn(layer.intermediate.dense.weight.shape, generator=generator))
            norm = model.embeddings.LayerNorm.weight
            norm.add_(0.01 * torch.randn(norm.shape, generator=generator))
        model.save_pretrained(target)
        losses.append(5.0 + 0.001 * k)
        (target / "pretraining_step.json").write_text(json.dumps({"step": step, "mlm_loss": losses[-1], "nsp_accuracy": 0.5}))
        checkpoints.append(str(target))
    return checkpoints, losses


def test_a_series_of_one_null_model_makes_no_claim(null_series, tmp_path):
    checkpoints, losses = null_series
    result = track(checkpoints, [Example(text) for text in TEXTS], parser="spacy", out=tmp_path / "t", bootstrap=50, min_dependents=2,
                   device="cpu", progress=False)
    # uniform attention: every head of every layer gives [CLS], [SEP] and punctuation the same share, at every checkpoint
    heads = result.table[result.table.metric.isin(["cls", "sep", "punct"])]
    spread = heads.groupby("metric").value.agg(np.ptp)
    assert (spread < 1e-6).all(), spread
    strength = result.strength().pivot(index="step", columns="metric", values="value")
    assert (strength.max() - strength.min() < 1e-6).all()
    training, depth = result.verdict["training"], result.verdict["depth"]
    assert (result.emergence.emerges == "no evidence").all()
    assert training["verdict"] == "no evidence"
    # every head is the uniform head: no pattern does more than it in its peak layer, so the order is not judged
    assert depth["verdict"] == "no evidence" and "no evidence on the order" in depth["statement"]
    assert all(peak["excess"] == 0 and not peak["beyond_uniform"] for peak in depth["peaks"].values())
    assert "[CLS] is no more than the uniform head's in layer 0" in depth["statement"]
    assert not {training["verdict"], depth["verdict"]} & {"supported", "contradicted"}
    # each checkpoint's recorded loss, and the per-head trajectories, are in the verdict and the report
    assert result.verdict["losses"]["values"] == pytest.approx(losses) and result.verdict["losses"]["steps"] == STEPS
    report = (tmp_path / "t" / "report.html").read_text()
    assert "masked-LM validation loss" in report and f"{losses[-1]:.3f}" in report
    # the checkpoints are bare encoders (no masked-LM head): no loss is measured on the track corpus, and the report says so
    assert result.losses.measured_loss.isna().all() and result.verdict["losses"]["measured"] == [None] * len(STEPS)
    assert "No checkpoint loads with a language-model head: no loss is measured on the track corpus" in report
    assert "Per-head trajectories" in report and "step 100000" in report
    saved = json.loads((tmp_path / "t" / "verdict.json").read_text())
    assert saved["training"]["verdict"] == "no evidence" and saved["losses"]["values"] == pytest.approx(losses)


def test_a_checkpoints_recorded_loss_is_read_from_its_marker_files(tmp_path):
    pretrained, trainer, damaged, bare = (tmp_path / name for name in ("step-10", "checkpoint-20", "step-30", "step-40"))
    for folder in (pretrained, trainer, damaged, bare):
        folder.mkdir()
    (pretrained / "pretraining_step.json").write_text(json.dumps({"step": 10, "lm_loss": 3.25}))
    history = [{"loss": 9.0, "step": 5}, {"eval_loss": 2.5, "step": 10}, {"eval_loss": 2.0, "step": 20}]
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 20, "log_history": history}))
    (damaged / "pretraining_step.json").write_text("{not json")
    assert checkpoint_loss(str(pretrained))["loss"] == 3.25 and checkpoint_loss(str(pretrained))["name"] == "causal LM validation loss"
    assert checkpoint_loss(str(trainer))["loss"] == 2.0
    assert checkpoint_loss(str(damaged)) is None and checkpoint_loss(str(bare)) is None
    series = loss_series([10, 20, 30, 40], [str(pretrained), str(trainer), str(damaged), str(bare)])
    assert series["values"] == [3.25, 2.0, None, None]
    assert "step 10: 3.250, step 20: 2.000, step 30: none recorded, step 40: none recorded" in series["statement"]
