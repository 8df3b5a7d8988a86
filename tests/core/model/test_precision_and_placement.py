"""``--dtype`` and ``--device-map`` (issue 40): tables from bfloat16 weights equal float32's within stated tolerances, the
softmax and every statistic are float32 whatever the weights' dtype, and accelerate's placement gives the same tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tiny_examples

from bertology import analyze
from bertology.core.errors import ModelError
from bertology.core.model.hooks import Hooks
from bertology.core.model.models import load_model

#: bfloat16 keeps 8 bits of mantissa (7 stored): each weight, score and value vector is rounded to a relative 2^-9, about
#: 3 significant digits. The tables are means over rows and sequences of float32 softmaxes of those rounded scores, so
#: their errors stay within a few roundings: measured on the tiny BERT and Llama below, at most 2.6e-4 absolute on a share
#: of attention (profile, roles, rollout) and 8.5e-3 relative on a hidden-state or key-norm statistic (sinks). Stated:
#: 2^-8 absolute (one bfloat16 ulp at 1.0) and 2^-6 relative (four ulps).
BF16_ATOL, BF16_RTOL = 2.0**-8, 2.0**-6
#: Test statistics (t, p) divide a difference of means by its standard error: a rounding of the means moves them by that
#: error over the standard error, which on nearly uniform random heads is unbounded; the means they test are compared instead.
TEST_STATISTICS = ("t", "t_excess", "p", "p_excess", "p_corrected", "p_excess_corrected", "p_adj")


def numeric_tables(run) -> dict[str, pd.DataFrame]:
    """Every table of a run with its numeric columns, test statistics left out, by ``family.table``."""
    tables = {}
    for family, result in run.results.items():
        for name, table in result.tables.items():
            if isinstance(table, pd.DataFrame):
                tables[f"{family}.{name}"] = table.drop(columns=[c for c in TEST_STATISTICS if c in table]).select_dtypes("number")
    return tables


def assert_tables_close(expected, actual, rtol: float, atol: float) -> None:
    expected_tables, actual_tables = numeric_tables(expected), numeric_tables(actual)
    assert expected_tables.keys() == actual_tables.keys()
    for name, table in expected_tables.items():
        np.testing.assert_allclose(actual_tables[name].to_numpy(float), table.to_numpy(float), rtol=rtol, atol=atol, err_msg=name)


@pytest.fixture(scope="module", params=["bert", "llama"])
def model_dir(request, tiny_bert_dir, tiny_llama_dir):
    """The conftest's tiny random BERT and Llama (grouped-query attention), each built and saved in float32."""
    return {"bert": tiny_bert_dir, "llama": tiny_llama_dir}[request.param]


def run(model_dir, device: str = "cpu", **loading):
    """``analyze`` with the patterns besides the default families, on ``device`` (a device map places the model itself)."""
    device = "auto" if "device_map" in loading else device
    return analyze(str(model_dir), tiny_examples(), include=["patterns"], device=device, view=False, progress=False, **loading)


def test_bfloat16_tables_equal_float32_within_stated_tolerances(model_dir):
    single, half = run(model_dir, dtype="float32"), run(model_dir, dtype="bfloat16")
    assert (single.model["dtype"], half.model["dtype"]) == ("float32", "bfloat16")
    assert {"profile", "roles", "patterns"} <= set(half.results)
    assert_tables_close(single, half, rtol=BF16_RTOL, atol=BF16_ATOL)
    labels = single.table("patterns").select_dtypes(exclude="number")
    pd.testing.assert_frame_equal(half.table("patterns").select_dtypes(exclude="number"), labels)  # each head's pattern class


def test_the_pattern_hook_point_reads_float32_maps_from_bfloat16_weights(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir, device="cpu", dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16 and loaded.info()["dtype"] == "bfloat16"
    dtypes = []
    hooks = Hooks().add("pattern", lambda layer, pattern: dtypes.append(pattern.dtype))
    ids = loaded.tokenizer("the cat sat", return_tensors="pt")
    with torch.inference_mode(), hooks.attach(loaded.model):
        loaded.model(**ids)
    assert dtypes == [torch.float32] * loaded.num_layers


def test_auto_keeps_the_checkpoints_own_dtype(tiny_bert_dir):
    assert load_model(tiny_bert_dir, device="cpu").info()["dtype"] == "float32"


def test_an_unknown_dtype_is_refused_in_one_line(tiny_bert_dir):
    with pytest.raises(ModelError, match=r"^unknown dtype 'float8': use auto, float32, bfloat16, float16$"):
        load_model(tiny_bert_dir, device="cpu", dtype="float8")


def test_float16_on_cpu_runs_with_float32_maps(tiny_bert_dir):
    """torch's CPU kernels take float16 matmuls and softmaxes (torch 2.x): the model loads and its tables are within the
    float16 tolerances (11 bits of mantissa: tighter than bfloat16's)."""
    assert_tables_close(run(tiny_bert_dir, dtype="float32"), run(tiny_bert_dir, dtype="float16"), rtol=BF16_RTOL, atol=BF16_ATOL)


def explicit_cpu_map(model_dir) -> dict[str, str]:
    """Every top-level module of the model on "cpu", named one by one: accelerate's device-map path, on one CPU."""
    loaded = load_model(model_dir, device="cpu")
    return {name: "cpu" for name, _ in loaded.model.named_children()}


def test_a_device_map_gives_the_same_tables(model_dir):
    placed = run(model_dir, device_map=explicit_cpu_map(model_dir))
    assert placed.model["device_map"] and set(placed.model["device_map"].values()) == {"cpu"}
    assert_tables_close(run(model_dir), placed, rtol=1e-6, atol=1e-9)


def test_device_and_device_map_together_are_refused_in_one_line(tiny_bert_dir):
    with pytest.raises(ModelError, match=r"^--device cpu and --device-map auto both place the model: give one of them$"):
        load_model(tiny_bert_dir, device="cpu", device_map="auto")


def test_a_device_map_without_accelerate_names_the_extra(tiny_bert_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(ModelError, match=r"^--device-map needs accelerate: pip install 'bertology\[multi-device\]'$"):
        load_model(tiny_bert_dir, device_map="auto")


def test_the_command_line_takes_dtype_and_records_it(tiny_bert_dir, tmp_path):
    from typer.testing import CliRunner

    from bertology.cli import app

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(example.text for example in tiny_examples()) + "\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["analyze", "-m", str(tiny_bert_dir), "-c", str(corpus), "-o", str(out), "--dtype", "bfloat16",
                                      "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["model"]["dtype"] == "bfloat16"


#: A GPU's float32 kernels sum in another order than the CPU's: tables within 1e-4, as the brief asks of every GPU check.
GPU_ATOL, GPU_RTOL = 1e-4, 1e-4
on_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@on_a_gpu
def test_the_gpus_tables_equal_the_cpus(model_dir):
    cpu, gpu = run(model_dir), run(model_dir, device="cuda")
    assert gpu.model["device"].startswith("cuda")
    assert_tables_close(cpu, gpu, rtol=GPU_RTOL, atol=GPU_ATOL)
    labels = cpu.table("patterns").select_dtypes(exclude="number")
    pd.testing.assert_frame_equal(gpu.table("patterns").select_dtypes(exclude="number"), labels)


@on_a_gpu
def test_bfloat16_on_the_gpu_equals_float32_on_the_cpu_within_stated_tolerances(model_dir):
    assert_tables_close(run(model_dir, dtype="float32"), run(model_dir, device="cuda", dtype="bfloat16"), rtol=BF16_RTOL, atol=BF16_ATOL)
