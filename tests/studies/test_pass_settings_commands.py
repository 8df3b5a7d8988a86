"""The pass's settings through the command line (issue 50): one option group (``PASS_SETTINGS``) gives analyze, compare and
track their ``--attention-budget``, and analyze's and compare's manifests record the pass's settings whole, as the engine
fixed them on the model."""

import dataclasses
import json

import pytest
from conftest import TEXTS
from typer.testing import CliRunner

from bertology.cli import app
from bertology.core.engine import PassSettings
from bertology.core.errors import BertologyError
from bertology.core.model.models import load_model
from bertology.core.options import PASS_SETTINGS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def invoke(*args):
    return CliRunner().invoke(app, [str(arg) for arg in args])


@pytest.mark.parametrize("command", ["analyze", "compare", "track"])
def test_every_command_that_runs_a_pass_takes_the_attention_budget_from_the_one_group(command):
    from bertology.studies import get_study

    budget = next(option for option in PASS_SETTINGS if option.name == "attention_budget")
    assert budget in get_study(command).options


def test_analyze_records_the_pass_settings_whole_as_the_engine_fixed_them(tiny_bert_dir, corpus, tmp_path):
    out = tmp_path / "run"
    result = invoke("analyze", "-m", tiny_bert_dir, "-c", corpus, "-o", out, "--batch-size", 2, "--punct", "clark", "--attention-budget", 10**9,
                    "--no-patterns", "--device", "cpu", "-q")
    assert result.exit_code == 0, result.output
    settings = json.loads((out / "manifest.json").read_text())["settings"]
    model_length = load_model(tiny_bert_dir, device="cpu").max_length
    expected = PassSettings(batch_size=2, punct="clark", attention_budget=10**9, max_length=model_length, device="cpu")
    assert {name: settings[name] for name in (field.name for field in dataclasses.fields(PassSettings))} == dataclasses.asdict(expected)
    assert settings["analyses"] == ["profile", "roles", "rollout", "mixing"] and settings["kind"] == "encoder"


def test_compare_takes_the_budget_refuses_a_pass_past_it_and_records_it(tiny_bert_dir, corpus, tmp_path):
    refused = invoke("compare", tiny_bert_dir, tiny_bert_dir, "-c", corpus, "-o", tmp_path / "small", "--attention-budget", 100, "--device", "cpu",
                     "--no-layer-probes", "-q")
    assert isinstance(refused.exception, BertologyError)
    assert "exceed the attention budget of 100 bytes" in str(refused.exception) and "\n" not in str(refused.exception)
    out = tmp_path / "whole"
    done = invoke("compare", tiny_bert_dir, tiny_bert_dir, "-c", corpus, "-o", out, "--attention-budget", "none", "--batch-size", 3, "--device",
                  "cpu", "--no-layer-probes", "-q")
    assert done.exit_code == 0, done.output
    settings = json.loads((out / "manifest.json").read_text())["settings"]
    assert (settings["attention_budget"], settings["batch_size"], settings["device"]) == (None, 3, "cpu")


def test_track_takes_the_budget_and_refuses_a_pass_past_it_in_one_line(tiny_bert_dir, corpus, tmp_path):
    refused = invoke("track", tiny_bert_dir, "--steps", 0, "-c", corpus, "-o", tmp_path / "track", "--attention-budget", 100, "--bootstrap", 100,
                     "--device", "cpu", "-q")
    assert isinstance(refused.exception, BertologyError)
    assert "exceed the attention budget of 100 bytes" in str(refused.exception) and "\n" not in str(refused.exception)
