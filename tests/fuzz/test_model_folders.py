"""Fuzzing with Hypothesis: model folders (issue 37, "a model is loaded whole or refused").

A saved 2-layer Llama and a 2-layer BERT have one thing changed: a field of ``config.json`` (a size, a count, a token id,
a type; or the field deleted), a tensor of ``model.safetensors`` (deleted, added, reshaped, given a NaN), or a tokenizer
file (a field of ``tokenizer.json`` or ``tokenizer_config.json`` changed, or the file deleted). :func:`load_model` then
either loads a model that is the checkpoint (every weight it holds is the stored tensor, and two tokens run through it to
finite states) or refuses the folder in one line that names it. No other exception escapes, and loading changes no file.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_decoder
from core.storage.test_runfolder import snapshot
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from bertology.core.errors import BertologyError
from bertology.core.model.models import load_model
from fuzz.documents import DELETE, changed, paths

FUZZ = settings(deadline=None, database=None, max_examples=80,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: Values a config field may be changed to: small counts (no value that would allocate gigabytes), signs, types, nothing.
CONFIG_VALUES = st.one_of(st.integers(-3, 70), st.sampled_from([0.5, -1.0, float("nan"), "", "x", None, [], {}, True, DELETE]))


@pytest.fixture(scope="module", params=["llama", "bert"])
def saved(request, tiny_bert_dir, tmp_path_factory) -> Path:
    if request.param == "bert":
        return tiny_bert_dir
    return save_tiny_decoder("llama", tmp_path_factory.mktemp("llama-fuzz"))


def _stored_names(model: torch.nn.Module, stored: dict) -> dict:
    """The stored tensor of each of ``model``'s weights, found under its own name or its base model's prefix."""
    prefix = model.base_model_prefix + "."
    found = {}
    for name in model.state_dict():
        for key in (name, prefix + name, name.removeprefix(prefix)):
            if key in stored:
                found[name] = stored[key]
                break
    return found


def _load_or_refuse(folder: Path) -> None:
    before = snapshot(folder)
    try:
        loaded = load_model(folder, device="cpu")
    except BertologyError as error:
        assert "\n" not in str(error) and str(error).startswith(str(folder)), str(error)
        event("refused")
    else:
        event("loaded")
        stored = load_file(folder / "model.safetensors")
        matched = _stored_names(loaded.model, stored)
        for name, tensor in loaded.model.state_dict().items():
            if name.startswith("pooler."):  # never read, and may be absent from a checkpoint
                continue
            if name in matched:
                assert torch.equal(tensor, matched[name]), name
            else:  # not stored: a buffer the model computes (rotary frequencies, position ids) or a tied weight
                assert name not in dict(loaded.model.named_parameters()) or any(torch.equal(tensor, t) for t in matched.values()), name
        ids = torch.tensor([[loaded.tokenizer.convert_tokens_to_ids(loaded.tokenizer.tokenize("the cat")[0])] * 2])
        with torch.inference_mode():
            states = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        assert torch.isfinite(states).all()
    assert snapshot(folder) == before


def _fresh(saved: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(saved, folder)
    return folder


@FUZZ
@given(data=st.data())
def test_a_changed_config_is_loaded_whole_or_refused(saved, tmp_path, data):
    folder = _fresh(saved, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    path = data.draw(st.sampled_from([p for p in paths(config) if p]))
    (folder / "config.json").write_text(json.dumps(changed(config, path, data.draw(CONFIG_VALUES))))
    _load_or_refuse(folder)


@FUZZ
@given(data=st.data())
def test_changed_weights_are_loaded_whole_or_refused(saved, tmp_path, data):
    folder = _fresh(saved, tmp_path)
    weights = load_file(folder / "model.safetensors")
    name = data.draw(st.sampled_from(sorted(weights)))
    change = data.draw(st.sampled_from(["delete", "add", "reshape", "nan", "inf", "half"]))
    if change == "delete":
        del weights[name]
    elif change == "add":
        weights[name.replace(".0.", ".7.") if ".0." in name else f"{name}.extra"] = weights[name].clone()
    elif change == "reshape":
        weights[name] = weights[name].reshape(-1)[: max(1, weights[name].numel() - 1)].clone()
    elif change == "half":
        weights[name] = weights[name].half()
    else:
        weights[name] = weights[name].clone()
        weights[name].view(-1)[0] = float(change)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    _load_or_refuse(folder)


@FUZZ
@given(data=st.data())
def test_changed_tokenizer_files_are_loaded_whole_or_refused(saved, tmp_path, data):
    folder = _fresh(saved, tmp_path)
    files = sorted(path.name for path in folder.iterdir() if path.name.startswith(("tokenizer", "special_tokens", "vocab")))
    name = data.draw(st.sampled_from(files))
    if name.endswith(".json") and data.draw(st.booleans()):
        document = json.loads((folder / name).read_text())
        path = data.draw(st.sampled_from([p for p in paths(document) if p]))
        (folder / name).write_text(json.dumps(changed(document, path, data.draw(CONFIG_VALUES))))
    else:
        (folder / name).unlink()
    _load_or_refuse(folder)


def test_a_tokenizer_that_panics_on_a_text_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    # found by the fuzz above: a post-processor template naming a special token it does not define makes the Rust tokenizer
    # panic (pyo3's PanicException, no Exception) on every text; it escaped the loader as a Rust backtrace
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    document = json.loads((folder / "tokenizer.json").read_text())
    document["post_processor"]["special_tokens"] = {}
    (folder / "tokenizer.json").write_text(json.dumps(document))
    with pytest.raises(BertologyError, match=r"the tokenizer cannot encode the text 'the cat' \(no entry found for key\)") as refused:
        load_model(folder, device="cpu")
    assert "\n" not in str(refused.value) and str(refused.value).startswith(str(folder))
