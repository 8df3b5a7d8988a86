"""Half precision that overflows (issue 49): a model whose scores pass float16's largest value (65504) on a text gets NaN
maps there; every command that runs the engine's pass fails in one line naming float16, the layer and the sequence, and
writes no table; the load probe tells float16's range from a broken config.json.

The models are the conftest's tiny float32 BERT and Llama, changed so that one piece ``house`` scores itself at 4 x 65504 in
one layer's head 0 (float32 holds it: that row attends to itself alone) and every other pair at exactly 0: the two
embedding columns 0 and 1 are made equal everywhere, so a norm keeps them equal and ``x_0 - x_1`` is exactly 0, except for
``house``, whose word vector is ``(1, -1, 0, ...)``; head 0's first query and key read ``64 (x_0 - x_1)``. The layers before it
add nothing (their output projections zero), so ``x_0 - x_1`` is about 8 for ``house`` there too (the norm of a vector
``(1, -1, small)`` over 32 dimensions), its score about ``(64 * 8)^2 = 262,144``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TEXTS, WORDS, save_tiny_decoder
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, BertTokenizerFast
from typer.testing import CliRunner

from bertology import analyze
from bertology.cli import app
from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Engine, PassNeeds, RunStats
from bertology.core.errors import ModelError
from bertology.core.model.finite import FLOAT16_MAX, NonFiniteError, finite_maps, finite_states
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Example
from core.storage.test_runfolder import snapshot
from core.test_host_transfers import CountHostTransfers

#: Where each tiny model keeps its layers, head 0's query and key, and what a layer adds to the residual stream.
PARTS = {"bert": ("encoder.layer", "attention.self.query", "attention.self.key", ("attention.output.dense", "output.dense")),
         "llama": ("layers", "self_attn.q_proj", "self_attn.k_proj", ("self_attn.o_proj", "mlp.down_proj"))}
SCALE = 64.0  # head 0's query and key read SCALE (x_0 - x_1): the piece scores itself about (64 * 8)^2, 4 x 65504
TARGET = "house"  # in TEXTS[2] and TEXTS[5]: examples 3 and 6 of the corpus
ADVICE = ("float16's range (largest 65504) is too narrow for this model's activations; run with --dtype float32 or --dtype bfloat16 "
          "(float32's range)")


@torch.no_grad()
def overflowing_copy(source, folder, layer: int, target: int | None = None):
    """The float32 model at ``source`` whose layer ``layer`` scores the piece ``target`` (default: :data:`TARGET`'s) against
    itself past float16's range (module doc), and that piece."""
    model, tokenizer = AutoModel.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    stack, query, key, outputs = PARTS[model.config.model_type]
    if target is None:
        ids = tokenizer(TEXTS[2])["input_ids"]
        target = next(i for i, token in zip(ids, tokenizer.convert_ids_to_tokens(ids)) if token.lstrip("Ġ") == TARGET)
        assert target != 1  # not the load probe's piece (two of id 1): the model loads
    for module in model.modules():  # every embedding table and norm: columns 0 and 1 made equal
        for name in ("weight", "bias"):
            tensor = getattr(module, name, None) if isinstance(module, torch.nn.Embedding) or "Norm" in type(module).__name__ else None
            if tensor is not None:
                tensor[..., :2] = tensor[..., :2].mean(-1, keepdim=True)
    words = model.get_input_embeddings().weight
    words[target] = 0.0
    words[target, :2] = torch.tensor([1.0, -1.0])
    layers = model.get_submodule(stack)
    for earlier in layers[:layer]:
        for name in outputs:
            for tensor in earlier.get_submodule(name).parameters():
                tensor.zero_()
    for name in (query, key):
        projection = layers[layer].get_submodule(name)
        for tensor in projection.parameters():
            tensor.zero_()
        projection.weight[0, :2] = torch.tensor([SCALE, -SCALE])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, target


def expected_sequences(folder, target: int, texts) -> list[int]:
    """The corpus positions (from 0) of the texts whose pieces hold ``target``: the tokenizer's cut, not the engine's."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [position for position, text in enumerate(texts) if target in tokenizer(text)["input_ids"]]


def quoted(text: str) -> str:
    words = text.split()
    return repr(" ".join(words[:8]) + (" ..." if len(words) > 8 else ""))


def bertology(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "bertology.cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


@pytest.fixture(scope="module")
def overflowing_bert(tiny_bert_dir, tmp_path_factory):
    return overflowing_copy(tiny_bert_dir, tmp_path_factory.mktemp("bert-x"), layer=1)


@pytest.fixture(scope="module")
def overflowing_llama(tmp_path_factory):
    source = save_tiny_decoder("llama", tmp_path_factory.mktemp("llama"))
    return overflowing_copy(source, tmp_path_factory.mktemp("llama-x"), layer=1)


def test_the_construction_scores_the_piece_past_float16s_range_in_float32_alone(overflowing_bert):
    """The independent check of the models: in float32, layer 1 head 0's largest score ``q . k`` per text, from the model's
    own query and key, passes 65504 exactly on the texts that hold the piece; the pass in float32 reads finite maps."""
    folder, target = overflowing_bert
    model, tokenizer = AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    largest = []
    for text in TEXTS:
        with torch.no_grad():
            x = model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True).hidden_states[1][0]
            attention = model.encoder.layer[1].attention.self
            q, k = attention.query(x)[:, :8], attention.key(x)[:, :8]  # head 0 of 4, 8 dimensions each
        largest.append(float((q @ k.T).abs().max()))
    past = [position for position, score in enumerate(largest) if score > FLOAT16_MAX]
    assert past == expected_sequences(folder, target, TEXTS) == [2, 5]
    assert max(largest) < 4.5 * FLOAT16_MAX and max(score for score in largest if score <= FLOAT16_MAX) < 1.0


@pytest.mark.parametrize("which, budget", [("bert", "auto"), ("llama", "auto"), ("bert", "2048")])
def test_analyze_in_float16_fails_in_one_line_and_leaves_the_earlier_run_folder(which, budget, overflowing_bert, overflowing_llama, corpus, tmp_path):
    """Whole maps, and (budget 2,048 bytes) maps by blocks of a few query rows, whose flags AND into one per layer."""
    folder, target = {"bert": overflowing_bert, "llama": overflowing_llama}[which]
    out = tmp_path / "run"
    analyze(str(folder), str(corpus), out=str(out), device="cpu", dtype="float32", view=False, progress=False)
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"  # float32 holds the scores: the same model gives tables
    files = snapshot(out)
    result = bertology("analyze", "-m", folder, "-c", corpus, "--dtype", "float16", "--out", out, "--device", "cpu", "-q",
                       "--attention-budget", budget)
    assert result.returncode == 2, result.stderr
    first, *others = expected_sequences(folder, target, TEXTS)
    assert result.stderr.strip().splitlines() == [
        f"error: layer 1's attention maps are NaN or infinite in float16 on example {first + 1} (tiny.txt:{first + 1}: {quoted(TEXTS[first])}) "
        f"and {len(others)} more of its batch: {ADVICE}"]
    assert snapshot(out) == files  # untouched: no table, no resume state


def test_analyze_in_bfloat16_gives_float32s_tables(overflowing_bert, corpus):
    """bfloat16 has float32's range: the advice works, the same model and corpus give float32's head table within bfloat16's
    rounding (2^-8 absolute, 2^-6 relative, as test_precision_and_placement states)."""
    runs = [analyze(str(overflowing_bert[0]), str(corpus), device="cpu", dtype=dtype, view=False, progress=False) for dtype in ("float32", "bfloat16")]
    single, half = (run.table("heads").select_dtypes("number").to_numpy(float) for run in runs)
    assert not runs[1].failures and np.isfinite(single).any()
    np.testing.assert_allclose(half, single, rtol=2.0**-6, atol=2.0**-8)


def refusal(args) -> str:
    """The one line a command of the CLI (in this process) fails with."""
    result = CliRunner().invoke(app, [*map(str, args), "--dtype", "float16", "--device", "cpu"])
    assert isinstance(result.exception, NonFiniteError), result.output
    message = str(result.exception)
    assert "\n" not in message
    return message


def test_view_in_float16_fails_naming_the_layer_and_the_text(overflowing_bert, tmp_path):
    page = tmp_path / "view.html"
    message = refusal(["view", TEXTS[5], "--model", overflowing_bert[0], "--out", page])
    assert message == f"layer 1's attention maps are NaN or infinite in float16 on example 1 (the text to view: {quoted(TEXTS[5])}): {ADVICE}"
    assert not page.exists()


def test_compare_in_float16_fails_in_one_line(overflowing_bert, tiny_bert_dir, corpus, tmp_path):
    message = refusal(["compare", tiny_bert_dir, overflowing_bert[0], "-c", corpus, "--out", tmp_path / "run", "-q"])
    assert message.startswith(f"layer 1's attention maps are NaN or infinite in float16 on example 3 (tiny.txt:3: {quoted(TEXTS[2])})")
    assert not (tmp_path / "run").exists()


def test_track_in_float16_fails_in_one_line(overflowing_bert, corpus, tmp_path):
    folder = overflowing_bert[0]
    message = refusal(["track", folder, folder, "--steps", "0,10", "-c", corpus, "--bootstrap", 100, "--out", tmp_path / "run", "-q"])
    assert message.startswith("layer 1's attention maps are NaN or infinite in float16 on example 3 (tiny.txt:3: ")
    assert not (tmp_path / "run").exists()


@torch.no_grad()
def test_sinks_in_float16_fails_on_the_last_hidden_states(tmp_path, corpus):
    """Maps finite, the last layer's output past float16's range (Llama's final norm scaled to 60000): the hidden states are
    checked too, and the first sequence named is the first whose float32 output passes 65504 at a token."""
    from transformers import LlamaModel

    source = save_tiny_decoder("llama", tmp_path / "llama")
    model = LlamaModel.from_pretrained(source)
    model.norm.weight.fill_(60000.0)
    model.save_pretrained(tmp_path / "big")
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path / "big")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "big")
    largest = [float(model(**tokenizer(text, return_tensors="pt")).last_hidden_state.abs().max()) for text in TEXTS]
    first = next(position for position, value in enumerate(largest) if value > FLOAT16_MAX)
    message = refusal(["sinks", "-m", tmp_path / "big", "-c", corpus, "--out", tmp_path / "run", "-q"])
    assert message.startswith(f"layer 1's output (hidden states) is NaN or infinite in float16 on example {first + 1} (tiny.txt:{first + 1}: ")


class FailsOnNaN(LayerwiseAnalyzer):
    """An analyzer that raises its own error on NaN maps (as scikit-learn does), inside the layer-by-layer pass."""

    name = "fails"

    def update_layer(self, batch, maps):
        if not torch.isfinite(maps.attention).all():
            raise ValueError("Input contains NaN")

    def finish_batch(self, batch):
        pass

    def merge(self, other):
        return self

    def result(self):
        return pd.DataFrame()


def test_an_analyzer_failing_on_nan_maps_gives_way_to_the_engines_line(overflowing_bert):
    engine = Engine(load_model(overflowing_bert[0], device="cpu", dtype="float16"), progress=False)
    for isolate in (False, True):
        with pytest.raises(NonFiniteError, match=r"^layer 1's attention maps are NaN or infinite in float16 on example 3 \("):
            engine.run([Example(text) for text in TEXTS], [FailsOnNaN(), FailsOnNaN()], isolate=isolate)


def test_the_checks_equal_isfinite_all_and_leave_padding_out():
    generator = torch.Generator().manual_seed(0)
    maps = torch.softmax(torch.randn(5, 3, 6, 6, generator=generator), -1)
    maps[1, 2, 4, 0], maps[3, 0, 0, 5] = torch.nan, torch.inf
    assert finite_maps(maps).tolist() == torch.isfinite(maps).flatten(1).all(1).tolist() == [True, False, True, False, True]
    states = torch.randn(3, 4, 5, 7, generator=generator, dtype=torch.float64).to(torch.float16)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2, 3:] = False
    states[1, 0, 2, 6], states[2, 1, 0, 0], states[0, 2, 4, 1] = torch.nan, -torch.inf, torch.nan  # the last: padding
    expected = (torch.isfinite(states).all(-1) | ~mask).all(-1)
    assert finite_states(states, mask).tolist() == expected.tolist()
    assert expected.tolist() == [[True] * 4, [False, True, True, True], [True, False, True, True]]


def test_the_load_probe_tells_float16s_range_from_a_broken_config(tiny_bert_dir, tmp_path):
    folder, _ = overflowing_copy(tiny_bert_dir, tmp_path / "probe", layer=0, target=1)  # the probe's own piece ([UNK]) overflows
    probe = "layer 0's attention maps are NaN or infinite on two tokens in {} though every weight is finite; "
    with pytest.raises(ModelError) as caught:
        load_model(folder, device="cpu", dtype="float16")
    assert str(caught.value) == f"{folder}: {probe.format('float16')}in float32 they are finite: {ADVICE}"
    load_model(folder, device="cpu", dtype="float32")  # finite there
    broken = shutil.copytree(tiny_bert_dir, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "layer_norm_eps": -1.0}))  # sqrt(variance - 1): NaN in any dtype
    config_line = "a value in config.json (a norm's epsilon, a scale) breaks the model"
    for dtype, cause in (("float16", f"they are in float32 too: {config_line}"), ("float32", config_line)):
        with pytest.raises(ModelError) as caught:
            load_model(broken, device="cpu", dtype=dtype)
        assert str(caught.value) == f"{broken}: {probe.format(dtype)}{cause}"


def test_the_check_reads_back_once_a_batch_whatever_the_layers(tmp_path):
    """The flags stay on the maps' device until the batch's end: the copies to the host (or waits) of a batch's pass, maps
    and hidden states, are as many with 6 layers as with 2 (one per layer would add 4)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", "!", ";", "'"] + WORDS
    counts = {}
    for layers in (2, 6):
        folder = tmp_path / str(layers)
        BertTokenizerFast(vocab={piece: i for i, piece in enumerate(vocab)}, do_lower_case=True).save_pretrained(folder)
        config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=64)
        BertModel(config).save_pretrained(folder)
        engine = Engine(load_model(folder, device="cpu"), progress=False)
        items = list(engine.encode(enumerate(Example(text) for text in TEXTS), RunStats()))
        for on_layer in (None, lambda batch, layer, maps: None):
            with CountHostTransfers() as counter:
                engine.run_batch(items, PassNeeds(hidden_states=True), on_layer=on_layer)
            counts.setdefault(layers, []).append(counter.count)
    assert counts[2] == counts[6], counts
