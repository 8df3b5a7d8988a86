import pytest
import torch

from bertology.errors import ModelError
from bertology.models import default_model_path, is_punctuation, load_model, resolve_device


def test_tiny_bert_facts(tiny_bert):
    info = tiny_bert.info()
    assert (info["layers"], info["heads"], info["max_length"]) == (2, 4, 64)
    assert (info["cls_token"], info["sep_token"]) == ("[CLS]", "[SEP]")
    assert tiny_bert.model.config._attn_implementation == "bertology"


def test_roberta_special_tokens_come_from_the_tokenizer(tiny_roberta):
    assert tiny_roberta.tokenizer.convert_ids_to_tokens([tiny_roberta.cls_token_id, tiny_roberta.sep_token_id]) == ["<s>", "</s>"]
    assert tiny_roberta.max_length == 64  # 66 positions minus RoBERTa's padding offset


@pytest.mark.parametrize("piece, expected", [(".", True), ("##.", True), ("\u0120,", True), ("\u2581?", True), ("...", True), ("\u00bf", True), ("a", False), ("##s", False), ("$", False), ("", False), ("\u0120", False)])
def test_punctuation_is_unicode_category_p_without_markers(piece, expected):
    assert is_punctuation(piece) is expected


def test_punctuation_ids_exclude_special_tokens(tiny_bert):
    punct = {tiny_bert.tokenizer.convert_ids_to_tokens(i) for i in range(len(tiny_bert.punct_by_id)) if tiny_bert.punct_by_id[i]}
    assert punct == {".", ",", "?", "!", ";", "'"}


def test_default_model_is_found_through_the_installed_package():
    path = default_model_path()
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_unknown_hub_name_without_network_says_to_pass_a_local_folder():
    with pytest.raises(ModelError, match="pass the path of a local model folder"):
        load_model("no-such-org/no-such-model", device="cpu")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="not a model folder"):
        load_model(tmp_path, device="cpu")


def test_device_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(ModelError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ModelError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
