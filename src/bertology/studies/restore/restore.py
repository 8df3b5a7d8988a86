"""Layers of a fine-tuned classifier put back to their pre-trained weights (the Primer, section 6.3).

See docs/methods.md#restore.

A fine-tuned classifier's encoder is cut into units: the embeddings (unit 0) and each layer (unit l, 1-based, as the
probes number the layer outputs). For each unit alone, and for the first k units for every k, the unit's weights are
put back to the pre-trained model's, the task is evaluated on its dev split, and the metric is compared with the
fine-tuned model's by a paired bootstrap over the dev examples (:func:`~bertology.core.statistics.stats.paired_bootstrap`),
corrected within each kind of restoration (``layer``, ``first_k``) with statsmodels' ``multipletests``. The classifier
head and the pooler stay fine-tuned. Restoring every unit gives back the pre-trained encoder exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from statsmodels.stats.multitest import multipletests
from tqdm.auto import tqdm

from bertology.core.errors import BertologyError, ModelError
from bertology.core.learning.tasks import TaskData, TaskModel, load_task_model, positive_index, seeded_subset, task_score
from bertology.core.model.interventions import known_layout
from bertology.core.model.models import DEFAULT_MODEL, default_model_path, load_model
from bertology.core.options import check_seed
from bertology.core.statistics.stats import MIN_SAMPLE, corrected, paired_bootstrap
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run

RESTORE_KINDS = ("layer", "first_k")


def _names(base: torch.nn.Module, module: torch.nn.Module) -> list[str]:
    """The names in ``base.state_dict()`` of ``module``'s weights (and saved buffers)."""
    prefix = next(name for name, inner in base.named_modules() if inner is module)
    return list(module.state_dict(prefix=f"{prefix}." if prefix else ""))


def encoder_units(base: torch.nn.Module) -> dict[str, int]:
    """Each weight of ``base`` (a bare model, ``model.base_model``) by its name in ``base.state_dict()``, and its unit, as the
    model's layout (:mod:`bertology.core.model.layouts`) places it: 0 for the embeddings, l + 1 for layer l; other weights
    (the pooler, a decoder's final norm) are in none. Layers that share weights (ALBERT's) are refused: one of them cannot
    be put back alone."""
    layout = known_layout(base)
    layers = layout.layers(base)
    if len(layers) != base.config.num_hidden_layers:
        raise ModelError(f"{type(base).__name__}: its layers share weights, so one layer cannot be restored alone")
    units = {name: 0 for module in layout.embeddings(base) for name in _names(base, module)}
    units.update((name, layer + 1) for layer, module in enumerate(layers) for name in _names(base, module))
    return units


def pooler_weights(base: torch.nn.Module) -> set[str]:
    """The names of the weights of ``base``'s pooler (:meth:`~bertology.core.model.layouts.base.Layout.pooler`), which
    belongs with the classifier's head; empty where there is none."""
    pooler = known_layout(base).pooler(base)
    return set(_names(base, pooler)) if pooler is not None else set()


def recorded_base(folder: str | Path) -> str:
    """The pre-trained model a ``bertology finetune`` folder records in ``metrics.json`` (the bundled model by its name)."""
    metrics = Path(folder) / "metrics.json"
    try:
        source = json.loads(metrics.read_text(encoding="utf-8"))["model"]
    except (OSError, ValueError, KeyError):
        raise BertologyError(f"{folder}: no metrics.json of `bertology finetune` names its pre-trained model: give --base") from None
    return DEFAULT_MODEL if Path(source) == default_model_path() or source == DEFAULT_MODEL else source


class Restorer:
    """Puts units of a fine-tuned classifier's encoder back to pre-trained weights, and takes them out again."""

    def __init__(self, task_model: TaskModel, pretrained: torch.nn.Module):
        self.encoder = task_model.model.base_model
        tuned = self.encoder.state_dict()
        base = pretrained.state_dict()
        self.units = encoder_units(self.encoder)
        missing = sorted(name for name in self.units if name not in base or base[name].shape != tuned[name].shape)
        if missing:
            raise ModelError(f"the pre-trained model does not match the fine-tuned encoder ({missing[0]} and {len(missing) - 1} more weights differ)")
        #: Encoder weights in no unit (beyond the pooler), left fine-tuned: restoring every unit then is not the whole encoder.
        pooler = pooler_weights(self.encoder)
        self.unassigned = sorted(name for name in tuned if name not in self.units and name not in pooler)
        self.tuned = {name: tensor.clone() for name, tensor in tuned.items() if name in self.units}
        self.base = {name: base[name].to(tuned[name].device, tuned[name].dtype) for name in self.units}

    @property
    def count(self) -> int:
        return max(self.units.values()) + 1

    def restore(self, units) -> None:
        """Pre-trained weights for ``units``, fine-tuned ones for every other unit."""
        chosen = set(units)
        state = {name: (self.base if unit in chosen else self.tuned)[name] for name, unit in self.units.items()}
        self.encoder.load_state_dict(state, strict=False)


@dataclass
class RestoreStudy:
    """The result of :func:`restore_layers`: the ``restore`` table and what the run folder needs."""

    restore: pd.DataFrame
    fine_tuned: dict[str, float]
    pretrained_name: str
    model: dict
    task: str
    examples: int
    settings: dict
    warnings: list[str] = field(default_factory=list)

    @claims_out
    def save(self, out, command: list[str] | None = None):
        """Write ``restore.csv``/``.parquet``, the figure, ``report.html`` and ``manifest.json``, replacing ``out`` whole."""
        from bertology.render.html import Report
        from bertology.studies.restore.report import restore_section

        folder = RunFolder(out)
        folder.write_table("restore", self.restore)
        section = restore_section(folder, self.restore, self.fine_tuned)
        summary = {"model": self.model["name"], "pre-trained": self.pretrained_name, "task": self.task, "dev examples": self.examples,
                   **{f"{metric} (fine-tuned)": f"{value:.4f}" for metric, value in self.fine_tuned.items()}}
        report = Report(f"bertology: layers restored after fine-tuning on {self.task}", summary, [section]).render()
        return complete_run(folder, {"model": self.model, "pretrained": self.pretrained_name, "task": self.task, "examples": self.examples,
                           "fine_tuned": self.fine_tuned, "settings": self.settings, "warnings": self.warnings}, report=report, command=command) / "report.html"


@claims_out(words=("correction", "device"))
def restore_layers(model: str | Path, task: TaskData, *, base: str | Path | None = None, max_dev_examples: int | None = None,
                   bootstrap: int = 10000, correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE, batch_size: int = 32, max_length: int = 128, seed: int = 0,
                   device: str = "auto", trust_remote_code: bool = False, out=None, progress: bool = True,
                   command: list[str] | None = None) -> RestoreStudy:
    """Evaluate ``model`` (a fine-tuned classifier's folder) on ``task``'s dev split with each encoder unit, and the first k
    units for every k, put back to the pre-trained weights of ``base`` (default: the model ``bertology finetune`` recorded).

    Table ``restore``: ``kind`` and ``layer`` (``layer``: that unit alone, 0 = the embeddings, l = layer l's output block;
    ``first_k``: units 0..layer all restored), ``metric``, ``value``, ``delta`` (restored minus fine-tuned), its 95%
    bootstrap interval, ``p`` and ``p_adj`` (empty on fewer than ``min_sample`` dev examples: no claim on too little data).
    """
    check_seed(seed)
    try:
        multipletests([0.5], method=correction)
    except ValueError:
        raise BertologyError(f"unknown correction {correction!r} (statsmodels multipletests: fdr_bh, bonferroni, holm, ...)") from None
    base = base if base is not None else recorded_base(model)
    task_model = load_task_model(model, device=device, max_length=max_length, trust_remote_code=trust_remote_code)
    pretrained = load_model(None if base == DEFAULT_MODEL else base, device=task_model.device, trust_remote_code=trust_remote_code)
    restorer = Restorer(task_model, pretrained.model)
    warnings = [f"{len(restorer.unassigned)} encoder weights belong to no layer and stay fine-tuned ({', '.join(restorer.unassigned[:3])}"
                f"{', ...' if len(restorer.unassigned) > 3 else ''})"] if restorer.unassigned else []
    dev = seeded_subset(task.dev, max_dev_examples, seed)
    rows, gold = task_model.encode(dev, "dev")
    variants = [("layer", unit, (unit,)) for unit in range(restorer.count)] + [("first_k", unit, tuple(range(unit + 1))) for unit in range(restorer.count)]
    predictions = []
    fine_tuned_logits = task_model.logits(rows, batch_size)
    with tqdm(total=len(variants), unit="variant", desc="restoring layers", disable=not progress) as bar:
        for _, _, units in variants:
            restorer.restore(units)
            predictions.append(task_model.logits(rows, batch_size).argmax(-1))
            bar.update(1)
    restorer.restore(())
    tables = []
    layout = pd.DataFrame([{"kind": kind, "layer": unit} for kind, unit, _ in variants])
    for metric in task.metrics:
        scores = paired_bootstrap(gold, fine_tuned_logits.argmax(-1), np.stack(predictions), len(task.labels), metric, positive_index(task), bootstrap, seed,
                                  min_sample)
        table = pd.concat([layout, scores], axis=1).assign(metric=metric)
        for kind in RESTORE_KINDS:  # each kind of restoration is one family of tests
            rows_of_kind = table.kind == kind
            table.loc[rows_of_kind, "p_adj"] = corrected(table.p[rows_of_kind], correction)[0]
        tables.append(table)
    columns = ["kind", "layer", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj"]
    study = RestoreStudy(pd.concat(tables, ignore_index=True)[columns], task_score(task, gold, fine_tuned_logits), pretrained.name, task_model.info(),
                         task.name, len(rows), {"base": str(base), "max_dev_examples": max_dev_examples, "bootstrap": bootstrap,
                                                "correction": correction, "min_sample": min_sample, "batch_size": batch_size,
                                                "max_length": max_length, "seed": seed,
                                                "device": str(task_model.device)}, warnings)
    if out is not None:
        study.save(out, command=command)
    return study
