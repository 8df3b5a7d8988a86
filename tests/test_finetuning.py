import math
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from bertology.core.errors import BertologyError, CorpusError
from bertology.workflows.finetuning import TaskData, finetune, load_task, random_states, restore_random_states, task_metrics
from bertology.core.models import load_model
from test_runfolder import snapshot

SENTENCES = ["the cat sat.", "the dog ran.", "a cat and a dog.", "where is the dog?", "we saw the cat.", "the big red house.",
             "the small tree.", "they ran fast.", "you saw a cat here.", "the dog is under the table.", "it is here.", "we ran slowly."]


@pytest.fixture
def sst_like(tmp_path):
    """A task whose label is learnable: 1 when the sentence mentions a cat."""
    folder = tmp_path / "SST-2"
    folder.mkdir()
    rows = [f"{s}\t{int('cat' in s)}" for s in SENTENCES]
    (folder / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    (folder / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:6]) + "\n")
    return folder


def test_metrics_by_hand():
    gold = ["1", "1", "0", "0", "1"]
    predicted = ["1", "0", "0", "1", "1"]
    mrpc = TaskData("mrpc", ("f1", "accuracy"), ("0", "1"), [], [], positive_label="1")
    values = task_metrics(mrpc, gold, predicted)
    assert values["accuracy"] == pytest.approx(3 / 5)
    assert values["f1"] == pytest.approx(2 / 3)  # tp 2, fp 1, fn 1
    cola = TaskData("cola", ("matthews_correlation",), ("0", "1"), [], [])
    tp, tn, fp, fn = 2, 1, 1, 1
    assert task_metrics(cola, gold, predicted)["matthews_correlation"] == pytest.approx((tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))


def test_fine_tuning_lowers_the_loss_and_writes_a_usable_model(tiny_bert_dir, sst_like, tmp_path):
    task = load_task(sst_like)
    assert (task.name, task.labels, task.metrics) == ("sst2", ("0", "1"), ("accuracy",))
    metrics = finetune(task, tmp_path / "model", model=tiny_bert_dir, batch_size=4, epochs=34, learning_rate=1e-3, max_length=16, progress=False)
    assert len(metrics["loss_curve"]) >= 2 and metrics["loss_curve"][-1] < metrics["loss_curve"][0]
    assert metrics["steps"] == 3 * 34 and metrics["train_examples"] == 12
    assert set(metrics["metric"]) == {"accuracy"} and metrics["majority_baseline"]["accuracy"] == pytest.approx(3 / 6)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "metrics.json"):
        assert (tmp_path / "model" / name).is_file()
    assert not (tmp_path / "model" / "checkpoint").exists()
    loaded = load_model(tmp_path / "model", device="cpu")  # every command accepts it as --model
    assert (loaded.num_layers, loaded.num_heads) == (2, 4)


def test_an_interrupted_run_resumes_to_the_same_model(tiny_bert_dir, sst_like, tmp_path):
    task = load_task(sst_like)
    settings = dict(model=tiny_bert_dir, batch_size=4, epochs=3, learning_rate=1e-3, max_length=16, progress=False, checkpoint_every=2)
    whole = finetune(task, tmp_path / "whole", **settings)
    stopped = finetune(task, tmp_path / "resumed", max_steps=5, **settings)
    assert stopped == {"interrupted_at_step": 5, "total_steps": 9}
    assert (tmp_path / "resumed" / "checkpoint" / "state.pt").is_file()
    resumed = finetune(task, tmp_path / "resumed", **settings)
    assert resumed["resumed_from_step"] == 5 and resumed["metric"] == whole["metric"]
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finetune(task, tmp_path / "resumed2", max_steps=1, **settings)
    with pytest.raises(BertologyError, match="checkpoint of a run with other settings"):
        finetune(task, tmp_path / "resumed2", **{**settings, "learning_rate": 5e-4})


def test_dev_label_unknown_to_training_names_file_and_line(sst_like):
    (sst_like / "dev.tsv").write_text("sentence\tlabel\nthe cat.\t1\nthe dog.\t7\n")
    with pytest.raises(CorpusError, match=r"dev\.tsv:3: label '7' does not occur in the training data"):
        load_task(sst_like)


def test_user_tsv_with_named_columns(tmp_path):
    for split in ("train", "dev"):
        (tmp_path / f"{split}.tsv").write_text("id\tquestion\tanswer\tgold\n1\tis it?\tyes\tyes\n2\tis it not?\tno\tno\n")
    task = load_task(train=tmp_path / "train.tsv", dev=tmp_path / "dev.tsv", text_column="question", text_pair_column="answer", label_column="gold")
    assert task.labels == ("no", "yes") and task.train[0].text_pair == "yes" and task.metrics == ("accuracy", "macro_f1")
    with pytest.raises(CorpusError, match=r"train\.tsv:1: not a GLUE TSV header .* name its columns with --text-column and --label-column"):
        load_task(train=tmp_path / "train.tsv", dev=tmp_path / "dev.tsv")
    assert np.isclose(task_metrics(task, ["yes", "no"], ["yes", "yes"])["macro_f1"], (2 / 3 + 0) / 2)


class Planted:
    """A pickle that writes a marker file when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_planted_pickle_in_the_checkpoint_never_runs(tiny_bert_dir, sst_like, tmp_path):
    task = load_task(sst_like)
    settings = dict(model=tiny_bert_dir, batch_size=4, epochs=3, max_length=16, progress=False, checkpoint_every=2)
    finetune(task, tmp_path / "model", max_steps=2, **settings)
    state = tmp_path / "model" / "checkpoint" / "state.pt"
    marker = tmp_path / "pwned"
    torch.save({"model": Planted(marker), "step": 2}, state)
    with pytest.raises(BertologyError) as error:
        finetune(task, tmp_path / "model", **settings)
    assert not marker.exists()
    assert str(state) in str(error.value) and "\n" not in str(error.value)


def test_a_state_saved_by_an_older_bertology_is_refused_in_one_line(tiny_bert_dir, sst_like, tmp_path):
    task = load_task(sst_like)
    settings = dict(model=tiny_bert_dir, batch_size=4, epochs=3, max_length=16, progress=False, checkpoint_every=2)
    finetune(task, tmp_path / "model", max_steps=2, **settings)
    state = tmp_path / "model" / "checkpoint" / "state.pt"
    older = torch.load(state, weights_only=True)
    del older["random"]  # the previous version kept no random states
    torch.save(older, state)
    with pytest.raises(BertologyError) as error:
        finetune(task, tmp_path / "model", **settings)
    assert str(error.value) == f"{state}: a training state from an older bertology (missing random); delete {state.parent} to start again"


def test_random_states_round_trip_through_a_weights_only_load(tmp_path):
    random.seed(1), random.gauss(0, 1)  # a cached Gaussian is part of the state
    np.random.seed(2), np.random.standard_normal()
    torch.manual_seed(3)
    torch.save(random_states(), tmp_path / "state.pt")
    expected = random.random(), random.gauss(0, 1), np.random.standard_normal(3), torch.rand(3)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_random_states(torch.load(tmp_path / "state.pt", weights_only=True))
    again = random.random(), random.gauss(0, 1), np.random.standard_normal(3), torch.rand(3)
    assert again[:2] == expected[:2] and np.array_equal(again[2], expected[2]) and torch.equal(again[3], expected[3])


def test_out_is_checked_before_the_model_loads(sst_like, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file\n")
    with pytest.raises(BertologyError, match="is a file"):
        finetune(load_task(sst_like), taken, model="nobody/no-such-model", progress=False)


def test_a_failure_while_saving_keeps_the_earlier_model_and_the_checkpoint(tiny_bert_dir, sst_like, tmp_path, monkeypatch):
    task = load_task(sst_like)
    out = tmp_path / "model"
    settings = dict(model=tiny_bert_dir, batch_size=4, epochs=1, max_length=16, progress=False)
    finetune(task, out, **settings)
    earlier = snapshot(out)

    def killed(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", killed)
    with pytest.raises(OSError, match="No space left"):
        finetune(task, out, learning_rate=1e-3, **settings)
    assert {name: data for name, data in snapshot(out).items() if not name.startswith("checkpoint/")} == earlier  # the earlier model, whole
    assert (out / "checkpoint" / "state.pt").is_file()  # the new run's training is not lost
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("model")] == ["model"]
    monkeypatch.undo()
    metrics = finetune(task, out, learning_rate=1e-3, **settings)
    assert metrics["resumed_from_step"] == metrics["steps"] and metrics["settings"]["learning_rate"] == 1e-3
    assert not (out / "checkpoint").exists()
