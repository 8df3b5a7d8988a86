import pytest
import torch

from bertology.core.errors import ModelError
from bertology.core.model.models import default_model_path, is_punctuation, load_model, resolve_device


def test_tiny_bert_facts(tiny_bert):
    info = tiny_bert.info()
    assert (info["layers"], info["heads"], info["max_length"]) == (2, 4, 64)
    assert (info["cls_token"], info["sep_token"]) == ("[CLS]", "[SEP]")
    assert tiny_bert.model.config._attn_implementation == "bertology"


def test_roberta_special_tokens_come_from_the_tokenizer(tiny_roberta):
    assert tiny_roberta.tokenizer.convert_ids_to_tokens([tiny_roberta.cls_token_id, tiny_roberta.sep_token_id]) == ["<s>", "</s>"]
    assert tiny_roberta.max_length == 64  # 66 positions minus RoBERTa's padding offset


@pytest.mark.parametrize("piece, expected", [(".", True), ("##.", True), ("\u0120,", True), ("\u2581?", True), ("...", True), ("\u00bf", True),
                                             ("a", False), ("##s", False), ("$", False), ("", False), ("\u0120", False)])
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


def test_devices_the_machine_lacks_are_refused(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ModelError, match=r"^device 'mps' was asked for, but Apple MPS is not available on this machine$"):
        resolve_device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ModelError, match=r"^device 'cuda:5' was asked for, but this machine has only cuda:0$"):
        resolve_device("cuda:5")
    for device in ("meta", "xla", "cpu:1"):
        with pytest.raises(ModelError, match=rf"^unknown device '{device}': use auto, cpu, cuda, cuda:N or mps$"):
            resolve_device(device)


def pickled_model(tiny_bert_dir, folder):
    """The tiny BERT with its weights as a pickle (``pytorch_model.bin``) instead of safetensors."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(tiny_bert_dir, folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


PICKLE_REFUSED = ("only pickle weights (pytorch_model.bin), which bertology never loads: convert them to model.safetensors "
                  "where you trust the file (from_pretrained, then save_pretrained)")


def _finetune(folder, tmp_path):
    from bertology.core.learning.tasks import TaskData
    from bertology.studies.finetune.finetuning import finetune

    finetune(TaskData("sst2", ("accuracy",), ("0", "1"), [], []), tmp_path / "out", model=folder, device="cpu")


def _task_model(folder, tmp_path):
    from bertology.core.learning.tasks import load_task_model

    load_task_model(folder, device="cpu")


@pytest.mark.parametrize("loader", [lambda folder, tmp_path: load_model(folder, device="cpu"), _task_model, _finetune],
                         ids=["load_model", "load_task_model", "finetune"])
def test_pickle_weights_are_refused_without_being_loaded(loader, tiny_bert_dir, tmp_path, monkeypatch):
    """The encoder, the head studies' classifier and fine-tuning all refuse a pickle-only folder before any unpickling."""
    folder = pickled_model(tiny_bert_dir, tmp_path / "pickled")
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("the pickle was loaded"))
    with pytest.raises(ModelError) as caught:
        loader(folder, tmp_path)
    assert str(caught.value) == f"{folder}: {PICKLE_REFUSED}"


def test_device_and_weight_errors_from_the_command_line_are_one_line(tiny_bert_dir, tmp_path):
    from test_cli import bertology

    missing_cuda = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    cuda_message = (f"this machine has only {', '.join(f'cuda:{i}' for i in range(torch.cuda.device_count()))}" if torch.cuda.is_available()
                    else "CUDA is not available on this machine")
    pickled = pickled_model(tiny_bert_dir, tmp_path / "pickled")
    for args, expected in [
        (["--model", tiny_bert_dir, "--device", "mps"], "error: device 'mps' was asked for, but Apple MPS is not available on this machine"),
        (["--model", tiny_bert_dir, "--device", missing_cuda], f"error: device '{missing_cuda}' was asked for, but {cuda_message}"),
        (["--model", tiny_bert_dir, "--device", "meta"], "error: unknown device 'meta': use auto, cpu, cuda, cuda:N or mps"),
        (["--model", pickled, "--device", "cpu"], f"error: {pickled}: {PICKLE_REFUSED}"),
    ]:
        result = bertology("info", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [expected]


def test_a_tokenizer_that_makes_no_pieces_of_text_is_refused(tiny_llama_dir, tmp_path):
    """A post-processor template with nothing in it drops every text (found by tests/fuzz/test_model_folders.py): refused in
    one line at load, not a model whose every sequence is skipped."""
    import json
    import shutil

    from bertology.core.errors import ModelError

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    document = json.loads((folder / "tokenizer.json").read_text())
    document["post_processor"]["single"] = []
    (folder / "tokenizer.json").write_text(json.dumps(document))
    with pytest.raises(ModelError, match=r"the tokenizer makes no pieces of the text 'the cat': its files are damaged$"):
        load_model(folder, device="cpu")
    load_model(tiny_llama_dir, device="cpu")  # the whole tokenizer loads
