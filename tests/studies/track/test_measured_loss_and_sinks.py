"""Issue 39, the track part: each checkpoint's loss measured on the track corpus where it has a language-model head, and
Sink_eps decided against the uniform head, as in the sinks family. Expected numbers come from transformers' own losses and
from hand-made tables, independently of the module."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TEXTS
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from bertology.core.text.corpora import Example
from bertology.studies.track.dynamics import track
from bertology.studies.track.sinks import layer_sink_rates

#: Lines of three to five pieces: the uniform causal head puts mean_{i>=1} 1/(i+1) > 0.3 on the first token.
SHORT_TEXTS = ["we saw it.", "the cat sat.", "where is it?", "a dog ran.", "the cat ran."]


def save_gpt2(tokenizer_dir, folder, seed: int, null: bool = False) -> str:
    """A tiny random GPT-2 (2 layers, 4 heads) in float64 with the tiny byte-level tokenizer; ``null``: every query projection
    zeroed (the first third of ``c_attn``), so that every head attends uniformly over the keys it sees."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_head=4, n_embd=32, n_positions=64,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config).double()
    if null:
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_attn.weight[:, : config.n_embd] = 0  # Conv1D: [in, 3 * out], the queries first
                block.attn.c_attn.bias[: config.n_embd] = 0
    model.save_pretrained(folder)
    return str(folder)


def reference_loss(checkpoint: str, texts: list[str]) -> float:
    """By transformers alone: each text's ``model(input_ids, labels=input_ids).loss`` (its mean next-token cross-entropy), weighted
    by its predicted pieces (n - 1), over all of them."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = GPT2LMHeadModel.from_pretrained(checkpoint).double().eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def test_each_checkpoints_loss_is_measured_on_the_track_corpus(tiny_gpt2_dir, tmp_path):
    checkpoints = [save_gpt2(tiny_gpt2_dir, tmp_path / f"step-{step:06d}", seed) for seed, step in enumerate((0, 100))]
    (tmp_path / "step-000100" / "pretraining_step.json").write_text(json.dumps({"step": 100, "lm_loss": 4.25}))
    expected = [reference_loss(checkpoint, TEXTS) for checkpoint in checkpoints]
    assert abs(expected[0] - expected[1]) > 1e-3  # two models, two losses
    result = track(checkpoints, [Example(text) for text in TEXTS], out=tmp_path / "t", bootstrap=20, batch_size=3, device="cpu", progress=False)
    losses = result.losses
    assert losses.step.tolist() == [0, 100]
    np.testing.assert_allclose(losses.measured_loss, expected, rtol=0, atol=1e-6)
    assert losses.measured_loss_name.str.startswith("causal LM loss (next-token cross-entropy)").all()
    assert np.isnan(losses.recorded_loss[0]) and losses.recorded_loss[1] == 4.25  # the recorded loss stays beside it
    saved = pd.read_csv(tmp_path / "t" / "losses.csv")
    np.testing.assert_allclose(saved.measured_loss, expected, rtol=0, atol=1e-6)
    verdict = json.loads((tmp_path / "t" / "verdict.json").read_text())
    assert verdict["losses"]["measured"] == pytest.approx(expected, abs=1e-6)
    statement = verdict["losses"]["statement"]
    assert "Loss measured here on the track corpus" in statement and f"step 0: {expected[0]:.3f}, step 100: {expected[1]:.3f}" in statement
    report = (tmp_path / "t" / "report.html").read_text()
    assert "measured_loss" in report and f"{expected[1]:.3f}" in report and "4.250" in report
    # a rerun reads each checkpoint's measured loss back from its saved part
    again = track(checkpoints, [Example(text) for text in TEXTS], out=tmp_path / "t", bootstrap=20, batch_size=3, device="cpu", progress=False)
    np.testing.assert_array_equal(again.losses.measured_loss, losses.measured_loss)


def test_a_null_decoder_on_short_lines_has_no_sink_head(tiny_gpt2_dir, tmp_path):
    checkpoints = [save_gpt2(tiny_gpt2_dir, tmp_path / f"step-{step:06d}", seed, null=True) for seed, step in enumerate((0, 10, 100))]
    result = track(checkpoints, [Example(text) for text in SHORT_TEXTS], out=tmp_path / "t", bootstrap=20, device="cpu", progress=False)
    first = result.table[result.table.metric == "first"]
    assert (first.value > 0.3).all()  # eps alone would call every head a sink ...
    layers = result.layers[result.layers.metric == "sink_eps"]
    assert len(layers) == 2 * 3 and (layers.value == 0).all()  # ... none does more than the uniform head
    sinks = result.verdict["sinks"]
    assert sinks["by_layer"] == [[0.0, 0.0]] * 3 and sinks["overall"] == [0.0] * 3
    assert "no attention sink appears" in sinks["statement"]
    assert "no attention sink appears" in (tmp_path / "t" / "report.html").read_text()


def heads_table(first: list[list[float]], uniform: list[float], excess_ci_low: list[list[float]]) -> pd.DataFrame:
    """A profile-like per-head table of ``first`` (``[layer][head]``), the layer's uniform head and the excess's lower 95% end."""
    rows = [{"layer": layer, "head": head, "metric": "first", "value": value, "ci_low": np.nan, "ci_high": np.nan, "n": 20,
             "uniform": uniform[layer], "excess": value - uniform[layer], "excess_ci_low": excess_ci_low[layer][head], "excess_ci_high": np.nan}
            for layer, values in enumerate(first) for head, value in enumerate(values)]
    other = [{**row, "metric": "punct"} for row in rows]  # another metric's rows take no part
    return pd.DataFrame(rows + other)


def test_a_planted_sink_head_is_counted_and_a_uniform_one_is_not():
    uniform = [0.36, 0.36]
    table = heads_table(first=[[0.9, 0.36, 0.36 + 1e-9, 0.2], [0.5, 0.4, 0.36, 0.36]], uniform=uniform,
                        excess_ci_low=[[0.4, 0.0, 0.0, -0.2], [0.1, -0.01, 0.0, 0.0]])
    rates = layer_sink_rates(table, eps=0.3)
    # layer 0: the planted head (0.9, well above the uniform head) is a sink; the uniform head (0.36 > eps) and one within float
    # noise of it are not, nor is a head below eps. Layer 1: 0.5 with its interval above 0 is; 0.4 whose interval reaches 0 is not.
    assert rates.layer.tolist() == [0, 1] and rates.value.tolist() == [0.25, 0.25]
    assert (rates.metric == "sink_eps").all() and rates.ci_low.isna().all()
    assert layer_sink_rates(table, eps=0.95).value.tolist() == [0.0, 0.0]  # and eps still decides


def test_a_masked_lms_loss_is_measured_with_seeded_masks(tiny_mlm_dir, tmp_path):
    from transformers import BertForMaskedLM

    from bertology.core.engine import Engine, RunStats
    from bertology.core.learning.tasks import masked_positions
    from bertology.core.model.models import load_model

    checkpoint = tmp_path / "step-000000"
    BertForMaskedLM.from_pretrained(tiny_mlm_dir).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(tiny_mlm_dir).save_pretrained(checkpoint)
    examples = [Example(text) for text in TEXTS]
    items = list(Engine(load_model(checkpoint, device="cpu"), progress=False).encode(enumerate(examples), RunStats()))
    model = BertForMaskedLM.from_pretrained(checkpoint).eval()
    mask_id = AutoTokenizer.from_pretrained(checkpoint).mask_token_id
    total, count = 0.0, 0
    with torch.inference_mode():  # by transformers alone, each sequence with its seeded masks (15% of its pieces, seed 7)
        for item in items:
            ids = torch.tensor([item.input_ids])
            chosen = torch.as_tensor(masked_positions(item, 0.15, 7))
            labels, masked = torch.full_like(ids, -100), ids.clone()
            labels[0, chosen], masked[0, chosen] = ids[0, chosen], mask_id
            total += float(model(input_ids=masked, labels=labels).loss) * len(chosen)
            count += len(chosen)
    result = track([str(checkpoint)], examples, bootstrap=10, seed=7, device="cpu", progress=False)
    assert result.losses.measured_loss[0] == pytest.approx(total / count, abs=1e-5)
    assert result.losses.measured_loss_name[0] == f"masked-LM loss, mean over {count} masked pieces (15% of each sequence's, seed 7)"
