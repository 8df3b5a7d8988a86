"""Nothing lost, nothing forged, round two (issue 37): every file bertology writes is its own or refused, every model is
loaded whole or refused, and a resume never mixes two tokenizers. Each case is tried where the user meets it, on the
command line, and the files it must keep are compared byte for byte before and after."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TEXTS, save_tiny_decoder
from safetensors.torch import load_file, save_file
from test_cli import bertology

import bertology as api
from bertology.core.errors import ModelError
from bertology.core.model.models import load_model
from bertology.core.storage.runfolder import RunFolder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama (grouped-query attention, BOS added) saved with its tokenizer."""
    return save_tiny_decoder("llama", tmp_path_factory.mktemp("llama"))


def copy_model(source: Path, target: Path, edit_config=None) -> Path:
    shutil.copytree(source, target)
    if edit_config is not None:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    return target


def one_error_line(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# ---- case 1: every file we write is ours or refused ----

def test_view_out_never_replaces_a_file_that_is_not_a_viewer_page(tiny_bert_dir, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep\n")
    line = one_error_line(bertology("view", "The cat sat.", "--model", tiny_bert_dir, "--out", notes, "--device", "cpu"))
    assert str(notes) in line and "not an earlier output" in line
    assert notes.read_text() == "keep\n"


def test_view_out_never_replaces_the_models_weights(tiny_bert_dir, tmp_path):
    model = copy_model(tiny_bert_dir, tmp_path / "M")
    weights = (model / "model.safetensors").read_bytes()
    one_error_line(bertology("view", "The cat sat.", "--model", model, "--out", model / "model.safetensors", "--device", "cpu"))
    assert (model / "model.safetensors").read_bytes() == weights
    load_model(model, device="cpu")  # still loads


def test_view_out_replaces_its_own_earlier_page_whole(tiny_bert_dir, tmp_path):
    page = tmp_path / "view.html"
    first = bertology("view", "The cat sat.", "--model", tiny_bert_dir, "--out", page, "--device", "cpu")
    assert first.returncode == 0, first.stderr
    second = bertology("view", "The dog ran fast.", "--model", tiny_bert_dir, "--out", page, "--device", "cpu")
    assert second.returncode == 0, second.stderr
    assert "The dog ran fast." in page.read_text() and "The cat sat." not in page.read_text()
    assert [path.name for path in tmp_path.iterdir()] == ["view.html"]  # no temporary file left beside it


@pytest.mark.parametrize("kind", ["dangling link", "link to a note", "pipe"])
def test_view_out_refuses_what_is_not_a_plain_earlier_page(tiny_bert_dir, tmp_path, kind):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep\n")
    out = tmp_path / "view.html"
    if kind == "dangling link":
        out.symlink_to(tmp_path / "nowhere.html")
    elif kind == "link to a note":
        out.symlink_to(notes)
    else:
        os.mkfifo(out)
    one_error_line(bertology("view", "The cat sat.", "--model", tiny_bert_dir, "--out", out, "--device", "cpu"))
    assert notes.read_text() == "keep\n" and (out.is_symlink() or out.is_fifo())


@pytest.mark.parametrize("command", [["classes"], ["analyze", "--classes", "--no-roles", "--no-patterns"]])
@pytest.mark.parametrize("relative", [False, True])
def test_a_word_list_inside_out_is_kept_on_the_command_line(tiny_bert_dir, corpus, tmp_path, command, relative):
    out = tmp_path / "W"
    with RunFolder(out) as folder:
        folder.write_text("report.html", "an earlier run")
    words = out / "myneg.txt"
    words.write_text("not\nnever\n")
    given = Path("W") / "myneg.txt" if relative else words
    result = subprocess.run(  # from tmp_path, so that the relative path names the list
        [sys.executable, "-m", "bertology.cli", *command, "--model", str(tiny_bert_dir), "--corpus", str(corpus), "--class", f"neg=words:{given}",
         "--out", "W" if relative else str(out), "-q", "--device", "cpu"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, timeout=300)
    assert "holds the input" in one_error_line(result)
    assert words.read_text() == "not\nnever\n" and (out / "report.html").read_text() == "an earlier run"


# ---- case 2: a model is loaded whole or refused ----

def _edit(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_weights(folder: Path, edit) -> None:
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _drop_a_tensor(weights: dict) -> None:
    del weights["model.layers.1.self_attn.q_proj.weight"]


def _poison_a_tensor(weights: dict) -> None:
    weights["model.layers.0.self_attn.v_proj.weight"][0, 0] = float("nan")


def _truncate(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _edit_tokenizer(folder: Path, edit) -> None:
    document = json.loads((folder / "tokenizer.json").read_text())
    edit(document)
    (folder / "tokenizer.json").write_text(json.dumps(document))


def _add_token(document: dict) -> None:
    """One more special piece: transformers numbers it after the last (300, the embeddings' size)."""
    document["added_tokens"].append({"id": len(document["model"]["vocab"]), "content": "<extra>", "single_word": False, "lstrip": False, "rstrip": False,
                                     "normalized": False, "special": True})


#: What the user did to a saved 2-layer Llama -> (how, words the one line must hold).
BROKEN_MODELS = {
    "config names 4 layers, weights hold 2": (lambda f: _edit(f, num_hidden_layers=4), "lacks 18 weights that config.json names"),
    "config names 1 layer, weights hold 2": (lambda f: _edit(f, num_hidden_layers=1), "has no place for (model.layers.1."),
    "one tensor deleted": (lambda f: _edit_weights(f, _drop_a_tensor), "lacks 1 weights that config.json names (layers.1.self_attn.q_proj.weight"),
    "hidden size changed in the config": (lambda f: _edit(f, hidden_size=64), "embed_tokens.weight is (300, 32) in the checkpoint but (300, 64)"),
    "a NaN weight": (lambda f: _edit_weights(f, _poison_a_tensor), "weight layers.0.self_attn.v_proj.weight holds NaN"),
    "weights file truncated": (lambda f: _truncate(f / "model.safetensors"), "the weights file cannot be read"),
    "no tokenizer files": (lambda f: [(f / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json")], "no tokenizer files"),
    "tokenizer.json without added_tokens": (lambda f: _edit_tokenizer(f, lambda t: t.pop("added_tokens")), "its tokenizer could not be loaded"),
    "tokenizer ids past the embeddings": (lambda f: _edit_tokenizer(f, _add_token), "has id 300, past the model's 300 embeddings"),
    "max_position_embeddings 0": (lambda f: _edit(f, max_position_embeddings=0), "max_position_embeddings is 0"),
}


@pytest.mark.parametrize("case", list(BROKEN_MODELS))
def test_a_model_that_is_not_whole_is_refused_naming_folder_and_key(llama_dir, tmp_path, case):
    make, words = BROKEN_MODELS[case]
    model = copy_model(llama_dir, tmp_path / "M")
    make(model)
    with pytest.raises(ModelError) as error:
        load_model(model, device="cpu")
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(model)) and words in message, message


@pytest.mark.parametrize("case", ["config names 4 layers, weights hold 2", "a NaN weight", "no tokenizer files"])
@pytest.mark.parametrize("command", ["analyze", "info"])
def test_a_model_that_is_not_whole_is_one_line_on_the_command_line(llama_dir, corpus, tmp_path, case, command):
    make, words = BROKEN_MODELS[case]
    model = copy_model(llama_dir, tmp_path / "M")
    make(model)
    options = ["--corpus", corpus, "--out", tmp_path / "run", "-q"] if command == "analyze" else []
    assert words in one_error_line(bertology(command, "--model", model, *options, "--device", "cpu"))
    assert not (tmp_path / "run").exists()


def test_a_classifier_missing_a_layer_is_refused(tiny_classifier_dir, tmp_path):
    from bertology.core.learning.tasks import load_task_model

    model = copy_model(tiny_classifier_dir, tmp_path / "C", lambda config: config.update(num_hidden_layers=4))
    with pytest.raises(ModelError, match=r"lacks \d+ weights that config.json names \(bert.encoder.layer.3"):
        load_task_model(model, device="cpu")


def test_a_masked_lm_checkpoint_still_loads_as_the_bare_encoder(tiny_mlm_dir):
    """Its pooler is not in the checkpoint and bertology never reads it: no refusal, and every weight it reads is the checkpoint's."""
    loaded = load_model(tiny_mlm_dir, device="cpu")
    stored = load_file(tiny_mlm_dir / "model.safetensors")
    for name, tensor in loaded.model.state_dict().items():
        if not name.startswith("pooler."):
            torch.testing.assert_close(tensor, stored[f"bert.{name}"], rtol=0, atol=0)


# ---- case 3: the resume fingerprint covers the tokenizer ----

def _lowercase(document: dict) -> None:
    """A ``Lowercase`` normaliser added to ``tokenizer.json`` (the issue's probe)."""
    document["normalizer"] = {"type": "Lowercase"} if document["normalizer"] is None else \
        {"type": "Sequence", "normalizers": [document["normalizer"], {"type": "Lowercase"}]}


def test_a_resume_after_the_tokenizer_changed_is_refused(llama_dir, tmp_path):
    from core.test_backends import _interrupt_after

    model = copy_model(llama_dir, tmp_path / "M")
    sentences = [f"{text.capitalize()} Number {k}." for k in range(3) for text in TEXTS]
    options = dict(batch_size=2, progress=False, view=False, analyses=["profile"], checkpoint_every=2)
    out = tmp_path / "run"
    before = load_model(model, device="cpu").tokenizer.tokenize(sentences[0])
    with pytest.MonkeyPatch.context() as patch:
        _interrupt_after(patch, 5)
        with pytest.raises(KeyboardInterrupt):
            api.analyze(model, sentences, out=out, **options)
    assert (out / "resume" / "state.json").is_file()
    _edit_tokenizer(model, _lowercase)
    assert load_model(model, device="cpu").tokenizer.tokenize(sentences[0]) != before  # the change does change the pieces
    with pytest.raises(api.BertologyError, match=r"another model, corpus or settings"):
        api.analyze(model, sentences, out=out, **options)
    assert (out / "resume" / "state.json").is_file()  # the saved work is still there


def test_the_tokenizer_digest_follows_the_pieces_not_the_folder(llama_dir, tmp_path):
    from bertology.core.storage.digests import tokenizer_digest

    same = copy_model(llama_dir, tmp_path / "same")
    lowered = copy_model(llama_dir, tmp_path / "lowered")
    _edit_tokenizer(lowered, _lowercase)
    digests = [tokenizer_digest(load_model(folder, device="cpu").tokenizer) for folder in (llama_dir, same, lowered)]
    assert digests[0] == digests[1] != digests[2]


# ---- case 8: a full disk is one line, and nothing earlier is lost ----

@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (root only; skipped where it cannot be mounted)."""
    place = tmp_path / "disk"
    place.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(place)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield place
    subprocess.run(["umount", "--lazy", str(place)], check=True)  # lazy: a file torch's writer left open until collected


def test_a_full_disk_is_one_line_and_the_earlier_run_stays(tiny_bert_dir, corpus, small_disk):
    out = small_disk / "run"
    with RunFolder(out) as folder:
        folder.write_text("report.html", "an earlier run")
    line = one_error_line(bertology("analyze", "--model", tiny_bert_dir, "--corpus", corpus, "--out", out, "-q", "--device", "cpu"))
    assert os.strerror(errno.ENOSPC) in line
    assert (out / "report.html").read_text() == "an earlier run"
    assert sorted(path.name for path in small_disk.iterdir()) == ["run"]  # the staging folder is gone


# ---- case 8: a malformed roles.csv under view --run is one line naming file and line ----

ROLES_HEADER = "layer,head,role,has_role\n"
MALFORMED_ROLES = {
    "not a table": (b"\x00\xff\xfe binary", "roles.csv: not a table bertology wrote"),
    "empty": (b"", "roles.csv: not a table bertology wrote"),
    "a column missing": (b"layer,head,role\n0,1,local\n", "roles.csv:1: no column 'has_role'"),
    "a layer that is no number": ((ROLES_HEADER + "0,1,local,True\nx,1,local,True\n").encode(), "roles.csv:3: layer 'x' is not a whole number"),
    "a negative head": ((ROLES_HEADER + "0,-1,local,True\n").encode(), "roles.csv:2: head '-1' is not a whole number"),
    "has_role neither True nor False": ((ROLES_HEADER + "0,1,local,maybe\n").encode(), "roles.csv:2: has_role 'maybe' is neither True nor False"),
}


@pytest.mark.parametrize("case", list(MALFORMED_ROLES))
def test_a_malformed_roles_table_is_one_line_naming_file_and_line(tmp_path, case):
    from bertology.studies.view.viewer import head_labels

    data, words = MALFORMED_ROLES[case]
    (tmp_path / "roles.csv").write_bytes(data)
    with pytest.raises(api.BertologyError) as error:
        head_labels(tmp_path)
    assert "\n" not in str(error.value) and str(error.value).startswith(str(tmp_path / "roles.csv")) and words in str(error.value)


def test_view_run_with_a_malformed_roles_table_is_one_line(tiny_bert_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "roles.csv").write_bytes(MALFORMED_ROLES["has_role neither True nor False"][0])
    line = one_error_line(bertology("view", "The cat sat.", "--model", tiny_bert_dir, "--run", run, "--out", tmp_path / "v.html", "--device", "cpu"))
    assert line == f"error: {run / 'roles.csv'}:2: has_role 'maybe' is neither True nor False"
    assert not (tmp_path / "v.html").exists()


# ---- case 8/9: a seed numpy cannot take is refused by every study's API, before any work ----

@pytest.mark.parametrize("study", ["finetune", "study_heads", "restore_layers"])
def test_a_seed_past_2_to_the_32_is_refused_by_the_api_before_any_work(cat_task, tiny_classifier_dir, tmp_path, study):
    from bertology.core.learning.tasks import load_task
    from bertology.studies.finetune.finetuning import finetune
    from bertology.studies.heads.study import study_heads
    from bertology.studies.restore.restore import restore_layers

    call = {"finetune": finetune, "study_heads": study_heads, "restore_layers": restore_layers}[study]
    with pytest.raises(api.BertologyError, match=r"seed must be a whole number from 0 to 4294967295, not 1180591620717411303424"):
        call(tiny_classifier_dir if study != "finetune" else load_task(cat_task), *([load_task(cat_task)] if study != "finetune" else []),
             seed=2**70, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_training_state_that_fills_the_disk_is_a_full_disk_error_and_leaves_nothing(small_disk):
    """torch's writer says "enforce fail at inline_container.cc ... file write failed" on a full disk: it becomes the OSError
    (ENOSPC) that the command line prints in one line, and the half-written state is removed."""
    from bertology.core.learning.training import save_training_state

    with pytest.raises(OSError) as error:
        save_training_state(small_disk / "training", {"model": {"weight": torch.zeros(64 * 1024)}, "step": 1})
    assert error.value.errno == errno.ENOSPC
    assert list(small_disk.iterdir()) == []


# ---- case 7: a corpus of degenerate sequences is one line naming the first, in every command that reads one ----

@pytest.fixture
def one_piece_lines(tmp_path, tiny_gpt2_dir):
    """Lines that the tiny GPT-2 cuts into one piece each (it adds no BOS)."""
    tokenizer = load_model(tiny_gpt2_dir, device="cpu").tokenizer
    words = [word for word in ("a", "the", "cat", "dog", "it") if len(tokenizer.tokenize(word)) == 1]
    assert len(words) >= 3
    path = tmp_path / "short.txt"
    path.write_text("\n".join(words) + "\n")
    return path


@pytest.mark.parametrize("command", ["analyze", "track"])
def test_a_corpus_of_one_piece_lines_is_one_line_naming_the_first(tiny_gpt2_dir, one_piece_lines, tmp_path, command):
    model = ["--model", tiny_gpt2_dir] if command == "analyze" else [tiny_gpt2_dir, tiny_gpt2_dir, "--steps", "0,1"]
    line = one_error_line(bertology(command, *model, "--corpus", one_piece_lines, "--out", tmp_path / "run", "-q", "--device", "cpu"))
    assert "every one was skipped" in line and "of fewer than 2 pieces" in line and "(the first: short.txt:1)" in line, line
    assert not (tmp_path / "run").exists()


def test_view_of_a_one_piece_text_on_a_decoder_is_one_line(tiny_gpt2_dir, tmp_path):
    line = one_error_line(bertology("view", "a", "--model", tiny_gpt2_dir, "--out", tmp_path / "v.html", "--device", "cpu"))
    assert line == "error: the text to view gives fewer than 2 pieces: there is no map to draw; give a longer text"
