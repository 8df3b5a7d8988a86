"""Layers restored after fine-tuning (the Primer, section 6.3; METHODS.md section 9)."""

import subprocess
import sys

import pandas as pd
import pytest
import torch
from transformers import (
    AlbertConfig,
    AutoModel,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    DistilBertConfig,
    GPT2Config,
)

from bertology.core.errors import BertologyError, ModelError
from bertology.core.learning.tasks import load_task, load_task_model, task_metrics
from bertology.core.model.models import load_model
from bertology.studies.restore.restore import Restorer, encoder_units, pooler_weights, recorded_base, restore_layers


@pytest.mark.parametrize("config, embeddings, layer, others", [
    (BertConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4), ("embeddings.",),
     "encoder.layer", ("pooler.",)),
    (DistilBertConfig(vocab_size=50, dim=32, hidden_dim=64, n_layers=3, n_heads=4), ("embeddings.",), "transformer.layer", ()),
    (GPT2Config(vocab_size=50, n_embd=32, n_layer=3, n_head=4), ("wte.", "wpe."), "h", ("ln_f.",)),
], ids=["bert", "distilbert", "gpt2"])
def test_encoder_units_name_the_embeddings_and_each_layer(config, embeddings, layer, others):
    base = AutoModel.from_config(config)
    names = list(base.state_dict())
    units = encoder_units(base)
    for name in names:  # by the names transformers gives the weights, independently of the layouts
        if name.startswith(embeddings):
            assert units[name] == 0, name
        elif name.startswith(f"{layer}."):
            assert units[name] == int(name.split(".")[len(layer.split("."))]) + 1, name
        else:
            assert name.startswith(others) and name not in units, name
    assert set(units.values()) == {0, 1, 2, 3} and set(units) <= set(names)
    assert pooler_weights(base) == {name for name in names if name.startswith("pooler.")}


def test_layers_that_share_weights_cannot_be_restored_alone():
    with pytest.raises(ModelError, match="share weights"):
        encoder_units(AutoModel.from_config(AlbertConfig(vocab_size=50, embedding_size=16, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=3, num_attention_heads=4)))


def test_restoring_every_unit_gives_back_the_pretrained_encoder_exactly(tuned_dir, tiny_bert_dir):
    task_model = load_task_model(tuned_dir, device="cpu")
    pretrained = load_model(tiny_bert_dir, device="cpu")
    restorer = Restorer(task_model, pretrained.model)
    ids = torch.tensor([[2, 11, 12, 13, 5, 3]])
    reference = BertModel.from_pretrained(tiny_bert_dir, attn_implementation="eager").eval()
    tuned_states = task_model.model.base_model(ids).last_hidden_state.detach().clone()
    with torch.no_grad():
        restorer.restore(range(restorer.count))
        assert torch.equal(task_model.model.base_model(ids).last_hidden_state, reference(ids).last_hidden_state)
        restorer.restore(())
        assert torch.equal(task_model.model.base_model(ids).last_hidden_state, tuned_states)
        restorer.restore((2,))  # layer 1 alone
    state, base, tuned = task_model.model.base_model.state_dict(), pretrained.model.state_dict(), restorer.tuned
    for name, unit in restorer.units.items():
        assert torch.equal(state[name], base[name] if unit == 2 else tuned[name]), name
    assert restorer.count == 3


def test_restore_table_against_an_independently_built_model(tuned_dir, tiny_bert_dir, cat_task):
    task = load_task(cat_task)
    study = restore_layers(tuned_dir, task, bootstrap=200, device="cpu", progress=False)
    table = study.restore.set_index(["kind", "layer"])
    assert list(study.restore.columns) == ["kind", "layer", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj"]
    assert len(table) == 2 * 3
    # Every unit restored = the pre-trained encoder under the fine-tuned head, built here by hand.
    built = BertForSequenceClassification.from_pretrained(tuned_dir).eval()
    built.bert.load_state_dict({**BertModel.from_pretrained(tiny_bert_dir).state_dict(), **{k: v for k, v in built.bert.state_dict().items()
                                                                                             if k.startswith("pooler.")}})
    tokenizer = BertTokenizerFast.from_pretrained(tuned_dir)
    dev = task.dev
    with torch.no_grad():
        predicted = [built(**tokenizer(e.text, return_tensors="pt")).logits.argmax(-1).item() for e in dev]
    accuracy = task_metrics(task, [e.label for e in dev], [task.labels[p] for p in predicted])["accuracy"]
    assert table.loc[("first_k", 2), "value"] == pytest.approx(accuracy)
    assert study.fine_tuned["accuracy"] == pytest.approx(table.loc[("first_k", 2), "value"] - table.loc[("first_k", 2), "delta"])
    assert table.loc[("layer", 0), "value"] == table.loc[("first_k", 0), "value"]  # the same restoration, two names
    assert (study.restore.p_adj >= study.restore.p).all()


def test_the_base_comes_from_metrics_json_or_is_asked_for(tuned_dir, tiny_bert_dir, tmp_path):
    assert recorded_base(tuned_dir) == str(tiny_bert_dir)
    with pytest.raises(BertologyError, match="give --base"):
        recorded_base(tmp_path)


def test_restore_command(tuned_dir, cat_task, tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "restore", str(cat_task), "--model", str(tuned_dir), "--bootstrap", "200",
                           "--out", str(out), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "restored alone: 0:" in done.stdout and "restored with all below: 0:" in done.stdout
    assert set(pd.read_csv(out / "restore.csv").kind) == {"layer", "first_k"}
    assert (out / "restore_accuracy.png").exists() and "Layers restored" in (out / "report.html").read_text()


def test_the_figure_marks_the_embeddings_and_numbers_the_blocks_as_every_figure(tmp_path):
    """Issue 39: restore.csv counts the embeddings as layer 0 and block l - 1 as layer l; the figure's ticks say emb., 0, 1
    (blocks 0-based, as every figure), its legend what each line restores, and the section how the table counts."""
    from bertology.core.storage.runfolder import RunFolder
    from bertology.studies.restore.report import KIND_TITLES, RESTORED_LABEL, restore_curves, restore_section

    table = pd.DataFrame([{"kind": kind, "layer": layer, "metric": "accuracy", "value": 0.8 - 0.1 * layer, "delta": -0.1 * layer,
                           "ci_low": -0.1 * layer - 0.05, "ci_high": -0.1 * layer + 0.05, "p": 0.01, "p_adj": 0.02}
                          for kind in ("layer", "first_k") for layer in range(3)])
    axis = restore_curves(table, "accuracy", 0.8).axes[0]
    assert [tick.get_text() for tick in axis.get_xticklabels()] == ["emb.", "0", "1"] and list(axis.get_xticks()) == [0, 1, 2]
    assert axis.get_xlabel() == RESTORED_LABEL
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["fine-tuned", *KIND_TITLES.values()]
    with RunFolder(tmp_path / "run") as folder:
        section = restore_section(folder, table, {"accuracy": 0.8})
    assert section.intro.endswith("restore.csv counts the embeddings as layer 0, so its layer l is block l - 1.")
