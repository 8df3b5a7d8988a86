"""Layers restored after fine-tuning (the Primer, section 6.3; METHODS.md section 9)."""

import subprocess
import sys

import pandas as pd
import pytest
import torch
from transformers import BertForSequenceClassification, BertModel, BertTokenizerFast

from bertology.core.errors import BertologyError
from bertology.core.learning.tasks import load_task, load_task_model, task_metrics
from bertology.core.model.models import load_model
from bertology.studies.restore.restore import Restorer, encoder_units, recorded_base, restore_layers


def test_encoder_units_name_the_embeddings_and_each_layer():
    names = ["embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query.weight", "encoder.layer.11.output.dense.bias",
             "pooler.dense.weight", "transformer.layer.3.ffn.lin1.weight", "distilbert.embeddings.position_embeddings.weight"]
    assert encoder_units(names) == {names[0]: 0, names[1]: 1, names[2]: 12, names[4]: 4, names[5]: 0}


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
