"""Fine-tuning an encoder on a GLUE-style classification task, with resumable checkpoints.

Tasks: SST-2 and CoLA (single sentences), MRPC and RTE (pairs), read from a folder with
``train.tsv`` and ``dev.tsv`` in GLUE's format, or any TSV pair with named text and label columns.
Training is a standard loop: AdamW with linear warm-up and decay (``transformers``'
``get_linear_schedule_with_warmup``), length-padded batches in a seeded order. Every
``checkpoint_every`` steps the model, optimiser, scheduler and random states are saved in
``out/checkpoint/``, so an interrupted run started again with the same command resumes where it
stopped; the state holds only tensors and plain values and is read with ``weights_only=True``, so a
planted pickle is refused, never run. The result is a model folder (safetensors, tokenizer, config,
``metrics.json``) that every bertology command accepts as ``--model``; it replaces ``out`` whole at
the end (:class:`~bertology.core.runfolder.RunFolder`), the checkpoint with it.

Metrics on dev, as GLUE reports them: accuracy (SST-2, RTE), F1 and accuracy (MRPC), Matthews
correlation (CoLA), each against the majority-class baseline (the most frequent training label).
"""

from __future__ import annotations

import json
import math
import pickle
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import confusion_matrix
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from bertology.core.corpora import Example, TableLayout, glue_layout, read_table
from bertology.core.errors import BertologyError, CorpusError, StateError
from bertology.core.hooks import Hooks
from bertology.core.models import default_model_path, loading_errors, require_safetensors, resolve_device
from bertology.core.runfolder import RunFolder, claims_out
from bertology.core.safeload import finite_array, whole_number
from bertology.core.stats import confusion_metric

#: GLUE tasks bertology knows: folder name -> (task, metrics, positive label for F1).
GLUE_TASKS = {
    "sst-2": ("sst2", ("accuracy",), None),
    "cola": ("cola", ("matthews_correlation",), None),
    "mrpc": ("mrpc", ("f1", "accuracy"), "1"),
    "rte": ("rte", ("accuracy",), None),
}


@dataclass(frozen=True)
class TaskData:
    """A classification task: its name, metrics, label names and train/dev examples."""

    name: str
    metrics: tuple[str, ...]
    labels: tuple[str, ...]
    train: list[Example]
    dev: list[Example]
    positive_label: str | None = None


def _check_labels(examples: list[Example], labels: tuple[str, ...], split: str) -> None:
    for example in examples:
        if example.label is None or example.label == "":
            raise CorpusError(split, example.line, "missing label")
        if example.label not in labels:
            raise CorpusError(split, example.line, f"label {example.label!r} does not occur in the training data ({', '.join(labels)})")


def load_task(folder: str | Path | None = None, *, train: str | Path | None = None, dev: str | Path | None = None,
              text_column: str | None = None, text_pair_column: str | None = None, label_column: str | None = None) -> TaskData:
    """A GLUE folder (``train.tsv``, ``dev.tsv``; the task from the folder's name), or user TSVs with named columns."""
    if folder is not None:
        folder = Path(folder)
        train, dev = folder / "train.tsv", folder / "dev.tsv"
        for path in (train, dev):
            if not path.is_file():
                raise CorpusError(path, None, "no such file (a task folder needs train.tsv and dev.tsv)")
    if train is None or dev is None:
        raise BertologyError("give a task folder, or --train and --dev files")
    train, dev = Path(train), Path(dev)
    if text_column is not None:
        if label_column is None:
            raise BertologyError("--text-column needs --label-column")
        layout = TableLayout(text_column, text_pair_column, label_column)
        train_examples, dev_examples = list(read_table(train, layout)), list(read_table(dev, layout))
        name, metrics, positive = train.parent.name or "custom", ("accuracy", "macro_f1"), None
    else:
        try:
            layouts = glue_layout(train), glue_layout(dev)
        except CorpusError as exc:
            raise CorpusError(exc.path, exc.line, f"{exc.message}; for another TSV name its columns with --text-column and --label-column") from exc
        train_examples, dev_examples = list(read_table(train, layouts[0])), list(read_table(dev, layouts[1]))
        key = train.parent.name.lower()
        if key not in GLUE_TASKS:
            raise BertologyError(f"{train.parent}: not a GLUE task folder bertology knows ({', '.join(GLUE_TASKS)}); name the columns with --text-column and --label-column")
        name, metrics, positive = GLUE_TASKS[key]
    labels = tuple(sorted({e.label for e in train_examples if e.label}))
    if len(labels) < 2:
        raise CorpusError(train, None, f"the training data has {len(labels)} label(s); classification needs at least 2")
    _check_labels(train_examples, labels, str(train))
    _check_labels(dev_examples, labels, str(dev))
    return TaskData(name, metrics, labels, train_examples, dev_examples, positive)


def seeded_subset(examples: list[Example], limit: int | None, seed: int) -> list[Example]:
    """A seeded random subset of ``limit`` examples, kept in file order (all of them when ``limit`` is None or larger)."""
    if limit is None or limit >= len(examples):
        return examples
    keep = np.random.default_rng(seed).permutation(len(examples))[:limit]
    return [examples[i] for i in sorted(keep)]


def positive_index(task: TaskData) -> int | None:
    """Index of the positive label (for F1) in ``task.labels``."""
    return task.labels.index(task.positive_label) if task.positive_label is not None else None


def task_metrics(task: TaskData, gold: list[str], predicted: list[str]) -> dict[str, float]:
    """The task's metrics on label strings, from scikit-learn's confusion matrix (:func:`bertology.core.stats.confusion_metric`)."""
    confusion = confusion_matrix(gold, predicted, labels=list(task.labels))
    return {metric: float(confusion_metric(confusion, metric, positive_index(task))) for metric in task.metrics}


@dataclass
class FinetuneSettings:
    """What a fine-tuning run does (saved with its checkpoints: a resume must match)."""

    model: str
    task: str
    max_length: int = 128
    batch_size: int = 32
    epochs: float = 1.0
    learning_rate: float = 5e-5
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_train_examples: int | None = None
    seed: int = 0
    data: str = ""  # sha256 of the task's examples (texts and labels, both splits): a resume never mixes two data sets
    weights: str = ""  # sha256 of the starting model's weight files (a local folder; a hub name stands for itself)


def task_digest(task: TaskData) -> str:
    """sha256 of every example of ``task`` (both splits: text, pair and label, in order)."""
    import hashlib

    combined = hashlib.sha256()
    for split, examples in (("train", task.train), ("dev", task.dev)):
        for example in examples:
            combined.update(json.dumps([split, example.text, example.text_pair, example.label]).encode("utf-8") + b"\n")
    return combined.hexdigest()


def encode_examples(tokenizer, examples: list[Example], label_ids: dict[str, int], max_length: int) -> list[dict]:
    """Tokenised rows (``input_ids``, ...) with the label's id under ``labels``."""
    texts = [e.text for e in examples]
    pairs = [e.text_pair for e in examples]
    encoded = tokenizer(texts, pairs if any(p is not None for p in pairs) else None, truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in encoded]
    return [{**{k: encoded[k][i] for k in keys}, "labels": label_ids[e.label]} for i, e in enumerate(examples)]


def collate_rows(tokenizer, rows: list[dict], device) -> dict[str, torch.Tensor]:
    """Pad rows into a batch of tensors on ``device`` (labels included)."""
    batch = tokenizer.pad([{k: v for k, v in row.items() if k != "labels"} for row in rows], return_tensors="pt")
    batch["labels"] = torch.tensor([row["labels"] for row in rows])
    return {k: v.to(device) for k, v in batch.items()}


def length_batches(rows: list[dict], batch_size: int) -> list[list[int]]:
    """Row indices in batches of similar length (less padding)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def predict_logits(model, tokenizer, rows: list[dict], batch_size: int, device, hooks: Hooks | None = None) -> np.ndarray:
    """Logits ``[rows, classes]`` of a sequence classifier, with ``hooks`` (e.g. interventions) attached if given."""
    model.eval()
    logits = None
    with torch.inference_mode(), (hooks.attach(model) if hooks is not None else nullcontext()):
        for chunk in length_batches(rows, batch_size):
            inputs = collate_rows(tokenizer, [rows[i] for i in chunk], device)
            inputs.pop("labels")
            scores = model(**inputs).logits.float().cpu().numpy()
            logits = np.empty((len(rows), scores.shape[1]), dtype=np.float32) if logits is None else logits
            logits[chunk] = scores
    return logits


def random_states() -> dict:
    """Python's, NumPy's, torch's and CUDA's random states as tensors and plain values (what a ``weights_only`` load reads)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), position, has_gauss, cached_gaussian],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_random_states(states: dict) -> None:
    """Set the random states saved by :func:`random_states` (checked by :func:`check_random_states`)."""
    random.setstate(states["python"])
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def check_generator_state(value, name: str, path: Path) -> None:
    """Refuse ``value`` unless it is the state of a torch CPU generator (torch checks its size and its Mersenne Twister)."""
    try:
        torch.Generator().set_state(value)
    except (TypeError, RuntimeError):
        raise StateError(path, f"{name} is not the state of a torch random generator") from None


def check_random_states(states, path: Path) -> None:
    """Refuse random states that :func:`restore_random_states` could not set or that would break the generators later."""
    if not isinstance(states, dict) or not {"python", "numpy", "torch", "cuda"} <= states.keys():
        raise StateError(path, "'random' must hold the python, numpy, torch and cuda random states")
    python = states["python"]
    try:
        random.Random().setstate(python)  # checks the version, the 625 words and the position
    except (TypeError, ValueError, OverflowError, KeyError, IndexError):
        raise StateError(path, "random['python'] is not a state of Python's random module") from None
    if not (python[2] is None or isinstance(python[2], float) and math.isfinite(python[2])):
        raise StateError(path, "random['python'] holds a cached Gaussian that is not a finite number")
    numpy = states["numpy"]
    if not isinstance(numpy, (list, tuple)) or len(numpy) != 5 or not isinstance(numpy[0], str) or numpy[0] != "MT19937":
        raise StateError(path, "random['numpy'] is not a NumPy MT19937 state (name, keys, position, has_gauss, cached_gaussian)")
    keys = finite_array(numpy[1], "random['numpy'] keys", path, shape=(624,))
    if keys.dtype.kind not in "iu" or keys.min() < 0 or keys.max() >= 2**32:
        raise StateError(path, "random['numpy'] keys must be 624 whole numbers from 0 to 2**32 - 1")
    whole_number(numpy[2], "random['numpy'] position", path, high=624)
    whole_number(numpy[3], "random['numpy'] has_gauss", path, high=1)
    finite_array(numpy[4], "random['numpy'] cached_gaussian", path, shape=())
    check_generator_state(states["torch"], "random['torch']", path)
    cuda = states["cuda"]
    if cuda is not None and not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.ndim == 1 for t in cuda)):
        raise StateError(path, "random['cuda'] must be None or a list of CUDA generator states (byte tensors)")


def _describe(value) -> str:
    """What ``value`` is, for a message: a tensor by its dtype and shape, anything else by its type."""
    if isinstance(value, torch.Tensor):
        unusual = "" if value.layout == torch.strided and value.device.type == "cpu" else f" ({value.layout} on {value.device.type})"
        return f"a {value.dtype} tensor of shape {list(value.shape)}{unusual}"
    return f"a {type(value).__name__}"


def check_like(found, expected, name: str, path: Path) -> None:
    """Refuse ``found`` unless it is built like ``expected``: dicts with the same keys, lists and tuples as long,
    CPU tensors of the same dtype and shape with finite values, whole numbers where ``expected`` has them, finite numbers
    where it has floats, and the same flags, names and ``None`` (settings, such as an optimizer's ``amsgrad``)."""
    if isinstance(expected, torch.Tensor):
        if (not isinstance(found, torch.Tensor) or found.layout != torch.strided or found.device.type != "cpu"
                or found.dtype != expected.dtype or found.shape != expected.shape):
            raise StateError(path, f"{name} must be a {expected.dtype} tensor of shape {list(expected.shape)}, not {_describe(found)}")
        if found.is_floating_point() and not bool(torch.isfinite(found).all()):
            raise StateError(path, f"{name} holds NaN or infinite values")
    elif isinstance(expected, dict):
        if not isinstance(found, dict):
            raise StateError(path, f"{name} must be a dict, not {_describe(found)}")
        missing, extra = [key for key in expected if key not in found], [key for key in found if key not in expected]
        if missing or extra:
            what = f"lacks {missing[0]!r}" if missing else f"has an unexpected key {' '.join(repr(extra[0]).split())[:80]}"
            raise StateError(path, f"{name} {what} ({len(missing)} missing, {len(extra)} unexpected)")
        for key, value in expected.items():
            check_like(found[key], value, f"{name}[{key!r}]", path)
    elif isinstance(expected, (list, tuple)):
        if not isinstance(found, (list, tuple)) or len(found) != len(expected):
            raise StateError(path, f"{name} must be a list of {len(expected)} values, not {_describe(found)}")
        for k, (item, value) in enumerate(zip(found, expected)):
            check_like(item, value, f"{name}[{k}]", path)
    elif isinstance(expected, (bool, str)) or expected is None:
        if type(found) is not type(expected) or found != expected:
            raise StateError(path, f"{name} must be {expected!r}, not {repr(found)[:60] if type(found) is type(expected) else _describe(found)}")
    elif (isinstance(found, bool) or not isinstance(found, int if isinstance(expected, int) else (int, float))
          or not -sys.float_info.max <= found <= sys.float_info.max):
        raise StateError(path, f"{name} must be a finite {type(expected).__name__}, not {_describe(found)}")


def resume_training(path: Path, state: dict, network, optimizer: torch.optim.AdamW, scheduler) -> None:
    """Set ``network``, its AdamW ``optimizer``, ``scheduler`` and the random states from a state read by
    :func:`load_training_state`, each checked first against what it replaces (a damaged or forged part is refused in one
    line naming ``path``, never a traceback)."""
    check_like(state["model"], network.state_dict(), "model", path)
    saved, fresh = state["optimizer"], optimizer.state_dict()
    if saved.keys() != fresh.keys() or not isinstance(saved["state"], dict):
        raise StateError(path, "optimizer must hold a dict 'state' and 'param_groups'")
    check_like(saved["param_groups"], fresh["param_groups"], "optimizer['param_groups']", path)
    for group, own in zip(saved["param_groups"], fresh["param_groups"]):  # the same parameters and settings; lr as scheduled
        if {key: value for key, value in group.items() if key != "lr"} != {key: value for key, value in own.items() if key != "lr"}:
            raise StateError(path, "optimizer's parameter groups are not this run's (their parameters or settings differ)")
        if not 0 <= group["lr"] <= group["initial_lr"]:
            raise StateError(path, f"optimizer's learning rate {group['lr']} is outside 0 to the run's {group['initial_lr']}")
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    for index, moments in saved["state"].items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(parameters):
            raise StateError(path, f"optimizer['state'] holds a state for {str(index)[:40]!r}, which is none of the model's {len(parameters)} parameters")
        shape = torch.empty_like(parameters[index], device="meta")  # AdamW's per-parameter state: a step and two moments
        check_like(moments, {"step": torch.empty((), device="meta"), "exp_avg": shape, "exp_avg_sq": shape}, f"optimizer['state'][{index}]", path)
        if moments["step"] < 0 or (moments["exp_avg_sq"] < 0).any():
            raise StateError(path, f"optimizer['state'][{index}] holds a negative step or second moment")
    own = scheduler.state_dict()
    check_like(state["scheduler"], own, "scheduler", path)
    if any(state["scheduler"][key] != value for key, value in own.items() if key not in ("last_epoch", "_step_count", "_last_lr")):
        raise StateError(path, "scheduler's settings are not this run's")
    if state["scheduler"]["last_epoch"] != state["step"]:
        raise StateError(path, f"the scheduler is at step {state['scheduler']['last_epoch']}, the state at step {state['step']}")
    network.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_random_states(state["random"])


#: What every training state holds (a fine-tuning state just these); a state without one of them is from an older bertology.
TRAINING_STATE_KEYS = ("model", "optimizer", "scheduler", "step", "losses", "settings", "random")


def load_training_state(path: Path, keys: tuple[str, ...] = ()) -> dict:
    """A state written by :func:`save_training_state`, loaded on the CPU with ``weights_only=True``: anything else is refused, never run.

    It must hold :data:`TRAINING_STATE_KEYS` and ``keys`` (one missing: a state saved by an older bertology, a one-line
    error); checked here: the step a whole number from 0, the settings a dict, the losses a list, the model's,
    optimizer's and scheduler's states dicts (:func:`resume_training` checks them against what they replace), the random
    states ones that can be set (:func:`check_random_states`). A damaged state is refused in one line naming ``path``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise StateError(path, "refused: not a training state of tensors and plain values (damaged, or loading it could run code); "
                               "delete it to start over") from exc
    except Exception as exc:  # torch's reader raises many kinds for damaged bytes (EOFError, KeyError, IndexError, MemoryError, ...)
        raise StateError(path, f"cannot read it as a training state ({' '.join(str(exc).split())[:120]}); delete it to start over") from None
    if not isinstance(state, dict):
        raise StateError(path, "not a training state; delete it to start over")
    missing = [key for key in dict.fromkeys((*keys, *TRAINING_STATE_KEYS)) if key not in state]
    if missing:
        raise StateError(path, f"a training state from an older bertology (missing {', '.join(missing)}); delete {path.parent} to start again")
    whole_number(state["step"], "step", path)
    for key, kind in (("model", dict), ("optimizer", dict), ("scheduler", dict), ("settings", dict), ("losses", list)):
        if not isinstance(state[key], kind):
            raise StateError(path, f"{key!r} must be a {kind.__name__}, not {_describe(state[key])}")
    check_random_states(state["random"], path)
    return state


def save_training_state(folder: Path, state: dict, tokenizer=None) -> None:
    """Atomically replace ``folder`` with ``state.pt`` holding ``state`` (tensors and plain values only) and the tokenizer if given."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    torch.save(state, partial / "state.pt")
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    partial.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


@claims_out(work="checkpoint")
def finetune(
    task: TaskData,
    out: str | Path,
    *,
    model: str | Path | None = None,
    max_length: int = 128,
    batch_size: int = 32,
    epochs: float = 1.0,
    learning_rate: float = 5e-5,
    warmup: float = 0.1,
    weight_decay: float = 0.01,
    max_train_examples: int | None = None,
    seed: int = 0,
    device: str = "auto",
    checkpoint_every: int = 200,
    max_steps: int | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> dict:
    """Fine-tune ``model`` (default: all-MiniLM-L6-v2) on ``task``; write the model folder ``out`` and return its metrics.

    ``out`` is checked and claimed before anything else. ``max_steps`` stops training early (the run
    can be resumed later: tests use it to interrupt).
    """
    out = Path(out)
    source = str(default_model_path()) if model is None else str(model)
    from bertology.core.digests import folder_weights_digest

    settings = FinetuneSettings(source, task.name, max_length, batch_size, epochs, learning_rate, warmup, weight_decay, max_train_examples, seed,
                                data=task_digest(task), weights=folder_weights_digest(Path(source)) if Path(source).is_dir() else source)
    torch_device = resolve_device(device)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    label_ids = {label: i for i, label in enumerate(task.labels)}
    if Path(source).is_dir():
        require_safetensors(source)
    with loading_errors(source):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        network = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=len(task.labels), id2label=dict(enumerate(task.labels)), label2id=label_ids,
            trust_remote_code=trust_remote_code, ignore_mismatched_sizes=True, use_safetensors=True,
        )
    network.to(torch_device)

    train = seeded_subset(task.train, max_train_examples, seed)
    train_rows = encode_examples(tokenizer, train, label_ids, max_length)
    dev_rows = encode_examples(tokenizer, task.dev, label_ids, max_length)
    steps_per_epoch = math.ceil(len(train_rows) / batch_size)
    total_steps = max(1, math.ceil(steps_per_epoch * epochs))

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {"params": [p for n, p in network.named_parameters() if not n.endswith(no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in network.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(warmup * total_steps), total_steps)

    checkpoint = out / "checkpoint"
    step, losses = 0, []
    if (checkpoint / "state.pt").is_file():
        # Loaded on the CPU: RNG states must stay CPU tensors; load_state_dict moves the rest to the model's device.
        state = load_training_state(checkpoint / "state.pt")
        if state.get("settings") != asdict(settings):
            raise BertologyError(f"{checkpoint}: a checkpoint of a run with other settings, data or starting weights is there; "
                                 "use another --out or delete it")
        if state["step"] > total_steps:
            raise StateError(checkpoint / "state.pt", f"step {state['step']} is past the run's {total_steps} steps; delete {checkpoint} to start over")
        finite_array(state["losses"], "losses", checkpoint / "state.pt", shape=(state["step"],))  # one per step
        resume_training(checkpoint / "state.pt", state, network, optimizer, scheduler)
        step, losses = state["step"], state["losses"]
    resumed_from = step

    started = time.perf_counter()
    network.train()
    stop_at = total_steps if max_steps is None else min(total_steps, max_steps)
    with tqdm(total=total_steps, initial=step, unit="step", desc="fine-tuning", disable=not progress) as bar:
        while step < stop_at:
            epoch, position = divmod(step, steps_per_epoch)
            order = np.random.default_rng((seed, epoch)).permutation(len(train_rows))
            chunk = order[position * batch_size : (position + 1) * batch_size]
            loss = network(**collate_rows(tokenizer, [train_rows[i] for i in chunk], torch_device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
            if step % checkpoint_every == 0 or step == stop_at:
                save_training_state(checkpoint, {
                    "model": network.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "losses": losses, "settings": asdict(settings), "random": random_states(),
                })
    seconds = time.perf_counter() - started
    if step < total_steps:
        return {"interrupted_at_step": step, "total_steps": total_steps}

    predicted = predict_logits(network, tokenizer, dev_rows, batch_size * 2, torch_device).argmax(-1)
    gold = [e.label for e in task.dev]
    majority = max(task.labels, key=[e.label for e in train].count)
    metrics = {
        "task": task.name,
        "model": source,
        "metric": task_metrics(task, gold, [task.labels[i] for i in predicted]),
        "majority_baseline": task_metrics(task, gold, [majority] * len(gold)),
        "majority_label": majority,
        "train_examples": len(train_rows),
        "dev_examples": len(dev_rows),
        "steps": total_steps,
        "resumed_from_step": resumed_from or None,
        "seconds": round(seconds, 1),
        "loss_curve": [round(float(np.mean(losses[i : i + 50])), 4) for i in range(0, len(losses), 50)],
        "settings": asdict(settings),
    }
    folder = RunFolder(out)  # the model replaces out whole; the checkpoint goes with the previous contents
    network.save_pretrained(folder.path)
    tokenizer.save_pretrained(folder.path)
    folder.write_json("metrics.json", metrics)
    folder.commit()
    return metrics
