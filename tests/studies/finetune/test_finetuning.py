import math
import random

import numpy as np
import pytest
import torch
from core.storage.test_runfolder import snapshot
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from bertology.core.errors import BertologyError, CorpusError, ModelError, StateError
from bertology.core.learning.tasks import TaskData, load_task, task_metrics
from bertology.core.learning.training import random_states, restore_random_states
from bertology.core.model.models import load_model
from bertology.studies.finetune.finetuning import finetune

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
    assert task_metrics(cola, gold, predicted)["matthews_correlation"] == pytest.approx(
        (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))


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
    # the same settings on other data (issue 25: a resume never mixes two data sets)
    changed = load_task(sst_like)
    changed.train[0] = type(changed.train[0])(text=changed.train[0].text + " again", label=changed.train[0].label, source=changed.train[0].source)
    with pytest.raises(BertologyError, match="other settings, data or starting weights"):
        finetune(changed, tmp_path / "resumed2", **settings)


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


def write_task(folder):
    """The task of :func:`sst_like` in ``folder``."""
    folder.mkdir(parents=True)
    rows = [f"{s}\t{int('cat' in s)}" for s in SENTENCES]
    (folder / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    (folder / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:6]) + "\n")
    return folder


@pytest.fixture(scope="module")
def interrupted(tiny_bert_dir, tmp_path_factory):
    """A fine-tuning run stopped at step 2 of 9 (its checkpoint holds a state), its task and its settings."""
    task = load_task(write_task(tmp_path_factory.mktemp("task") / "SST-2"))
    settings = dict(model=tiny_bert_dir, batch_size=4, epochs=3, max_length=16, progress=False, checkpoint_every=2)
    out = tmp_path_factory.mktemp("finetune") / "model"
    finetune(task, out, max_steps=2, **settings)
    return out, task, settings


def edit(path, where):
    """Rewrite a state (a dict) after ``where`` changed it in place."""
    state = torch.load(path, weights_only=True)
    where(state)
    torch.save(state, path)


def first_weight(state):
    return next(iter(state["model"]))


STATE_DAMAGE = [  # (what changes, what the refusal says)
    (lambda s: s["model"].update({first_weight(s): torch.zeros(3)}),
     "model['bert.embeddings.word_embeddings.weight'] must be a torch.float32 tensor of shape [68, 32]"),
    (lambda s: s["model"][first_weight(s)].__setitem__((0, 0), math.nan), "model['bert.embeddings.word_embeddings.weight'] holds NaN or infinite values"),
    (lambda s: s["model"].pop("classifier.bias"), "model lacks 'classifier.bias'"),
    (lambda s: s["model"].update(extra=torch.zeros(1)), "model has an unexpected key 'extra'"),
    (lambda s: s["model"].update({first_weight(s): s["model"][first_weight(s)].double()}), "must be a torch.float32 tensor"),
    (lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(2, 2)),
     "optimizer['state'][0]['exp_avg'] must be a torch.float32 tensor of shape [68, 32]"),
    (lambda s: s["optimizer"]["state"][0]["exp_avg_sq"].__setitem__((0, 0), -1.0), "optimizer['state'][0] holds a negative step or second moment"),
    (lambda s: s["optimizer"]["state"].update({999: s["optimizer"]["state"][0]}), "optimizer['state'] holds a state for '999', which is none of the model's"),
    (lambda s: s["optimizer"]["param_groups"][0].update(lr="fast"), "optimizer['param_groups'][0]['lr'] must be a finite float, not a str"),
    (lambda s: s["optimizer"]["param_groups"][0].update(eps=math.inf), "optimizer['param_groups'][0]['eps'] must be a finite float"),
    (lambda s: s["optimizer"]["param_groups"].pop(), "optimizer['param_groups'] must be a list of 2 values"),
    (lambda s: s["scheduler"].update(last_epoch=7), "the scheduler is at step 7, the state at step 2"),
    (lambda s: s["scheduler"].update(lr_lambdas=None), "scheduler['lr_lambdas'] must be a list of 2 values"),
    (lambda s: s["random"].update(torch=torch.zeros(10, dtype=torch.uint8)), "random['torch'] is not the state of a torch random generator"),
    (lambda s: s["random"].update(torch=torch.zeros(5056, dtype=torch.uint8)), "random['torch'] is not the state of a torch random generator"),
    (lambda s: s["random"]["numpy"].__setitem__(2, 10_000), "random['numpy'] position = 10000 is out of range (it must be from 0 to 624)"),
    (lambda s: s["random"]["numpy"].__setitem__(1, [-1] * 624), "random['numpy'] keys must be 624 whole numbers"),
    (lambda s: s["random"].update(python=(3, (1, 2), None)), "random['python'] is not a state of Python's random module"),
    (lambda s: s["random"].update(python=s["random"]["python"][:2] + ("x",)), "random['python'] holds a cached Gaussian that is not a finite number"),
    (lambda s: s["random"].pop("cuda"), "'random' must hold the python, numpy, torch and cuda random states"),
    (lambda s: s.update(step=-1), "step = -1 is out of range"),
    (lambda s: s.update(step=2.5), "step must be a whole number, not 2.5"),
    (lambda s: s.update(step=True), "step must be a whole number, not True"),
    (lambda s: s.update(step=50, losses=[0.5] * 50), "step 50 is past the run's 9 steps"),
    (lambda s: s.update(losses=[math.nan, 0.5]), "losses holds NaN or infinite values"),
    (lambda s: s.update(losses=[0.5]), "losses has shape (1,), expected (2,)"),
    (lambda s: s.update(losses="low"), "'losses' must be a list, not a str"),
    (lambda s: s.update(settings=[1, 2]), "'settings' must be a dict, not a list"),
]


@pytest.mark.parametrize("change, message", STATE_DAMAGE)
def test_a_damaged_training_state_is_refused_in_one_line(interrupted, tmp_path, change, message):
    """Weights, moments or RNG states of the wrong shape, a step that is negative or no whole number, a scheduler or
    losses that do not fit it: once a traceback halfway through resuming, or a resumed run that silently went wrong."""
    import shutil

    out, task, settings = interrupted
    shutil.copytree(out, tmp_path / "model")
    state = tmp_path / "model" / "checkpoint" / "state.pt"
    edit(state, change)
    with pytest.raises(StateError) as error:
        finetune(task, tmp_path / "model", **settings)
    assert str(error.value).startswith(f"{state}: ") and message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("damage", [lambda data: data[: len(data) // 2], lambda data: b"PK\x03\x04" + data[4:100], lambda data: b""])
def test_a_truncated_training_state_is_refused_in_one_line(interrupted, tmp_path, damage):
    import shutil

    out, task, settings = interrupted
    shutil.copytree(out, tmp_path / "model")
    state = tmp_path / "model" / "checkpoint" / "state.pt"
    state.write_bytes(damage(state.read_bytes()))
    with pytest.raises(StateError, match=r"state\.pt: cannot read it as a training state \(.*\); delete it to start over$"):
        finetune(task, tmp_path / "model", **settings)


def test_a_model_that_needs_custom_code_is_refused_in_one_line(tiny_bert_dir, sst_like, tmp_path):
    """A config with ``auto_map`` and a model type transformers does not know once raised transformers' ValueError."""
    import json
    import shutil

    custom = tmp_path / "custom"
    shutil.copytree(tiny_bert_dir, custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="my-bert", auto_map={"AutoConfig": "configuration_my.MyConfig", "AutoModelForSequenceClassification": "modeling_my.MyModel"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"custom: this model needs custom code: pass --trust-remote-code if you trust its source$"):
        finetune(load_task(sst_like), tmp_path / "out", model=custom, progress=False)


def test_a_diverging_fine_tuning_stops_at_its_first_non_finite_loss_keeping_a_finite_checkpoint(tiny_bert_dir, sst_like, tmp_path):
    """With a learning rate of 1e30, step 1's update leaves the weights huge and step 2's loss NaN: the run stops there in one
    line, step 1's checkpoint is kept with finite weights and losses, and no model is written."""
    from bertology.core.learning.training import TrainingDiverged, load_training_state

    task = load_task(sst_like)
    out = tmp_path / "model"
    with pytest.raises(TrainingDiverged, match=r"^fine-tuning diverged at step 2: its loss is nan \(--learning-rate 1e\+30\); stopped, its last "
                                                 r"checkpoint is kept in .*checkpoint; lower --learning-rate$"):
        finetune(task, out, model=tiny_bert_dir, batch_size=4, epochs=3, learning_rate=1e30, max_length=16, progress=False, checkpoint_every=1)
    state = load_training_state(out / "checkpoint" / "state.pt")
    assert state["step"] == 1 and np.isfinite(state["losses"]).all()
    assert all(torch.isfinite(tensor).all() for tensor in state["model"].values() if tensor.is_floating_point())
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), 0.0, -1e-3])
def test_a_learning_rate_that_is_not_a_finite_number_above_0_is_refused_before_fine_tuning(sst_like, tmp_path, rate):
    from bertology.core.errors import BertologyError

    with pytest.raises(BertologyError, match="--learning-rate must be a finite number above 0"):
        finetune(load_task(sst_like), tmp_path / "model", learning_rate=rate, progress=False)
    assert not (tmp_path / "model").exists()
