"""``bertology patch``: which heads matter, causally, on prompt pairs (docs/methods.md#which-heads-matter-causally).

Every head of every layer is patched exactly (:class:`~bertology.studies.heads.patching.Patcher`) and by attribution,
on pairs read from a JSON-lines file (:mod:`bertology.studies.heads.pairs`) or built in (:mod:`bertology.studies.heads.pair_tasks`);
each head's normalised effect gets a bootstrap interval over pairs and a corrected p
(:mod:`bertology.studies.heads.patch_statistics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bertology.core.backends import DEFAULT_CPU_ACTORS, LocalBackend, RayBackend, backend_named
from bertology.core.errors import BertologyError
from bertology.core.model.interventions import known_layout
from bertology.core.model.models import DEFAULT_MODEL, LANGUAGE_MODEL, model_name, model_source
from bertology.core.options import check_seed
from bertology.core.statistics.stats import MIN_SAMPLE
from bertology.core.storage.runfolder import claims_out
from bertology.studies.heads.pair_ablations import ablation_effects, mean_outputs, rank_agreement
from bertology.studies.heads.pair_tasks import TASK_PAIRS, TASKS, task_pairs
from bertology.studies.heads.pairs import read_pairs
from bertology.studies.heads.patch_statistics import ablation_table, agreement, pairs_table, patching_table
from bertology.studies.heads.patching import DIRECTIONS, POSITIONS, PairEffects, Patcher


@dataclass
class PatchStudy:
    """What a ``patch`` run found: ``patching`` (one row per head and method), ``pairs`` (per pair), the mean ``LD`` of the
    clean and corrupted prompts, attribution's ``agreement`` with exact patching, every two methods' ``rankings`` agreement
    and the ``settings`` it ran with."""

    model: dict
    source: str
    patching: pd.DataFrame
    pairs: pd.DataFrame
    ld_clean: float
    ld_corrupt: float
    agreement: dict
    rankings: pd.DataFrame
    prompts: pd.DataFrame
    settings: dict

    def mattering(self, method: str = "activation") -> pd.DataFrame:
        """The heads that matter by ``method``, largest effect first."""
        rows = self.patching[(self.patching.method == method) & (self.patching.position == "all") & self.patching.matters]
        return rows.sort_values("effect", key=abs, ascending=False)

    @claims_out
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write ``patching``, ``patching_pairs``, ``rank_agreement``, ``pair_prompts``, the figures, ``report.html`` and
        ``manifest.json``, replacing ``out`` whole; returns the report path."""
        from bertology.core.storage.runfolder import RunFolder, complete_run
        from bertology.render.html import Report
        from bertology.studies.heads.patch_report import patching_section

        folder = RunFolder(out)
        folder.write_table("patching", self.patching)
        folder.write_table("patching_pairs", self.pairs)
        folder.write_table("rank_agreement", self.rankings)
        folder.write_table("pair_prompts", self.prompts)
        summary = {"model": self.model["name"], "pairs": f"{self.source} ({len(self.pairs.pair.unique())} pairs)",
                   "direction": self.settings["direction"], "mean LD(clean)": f"{self.ld_clean:.4f}", "mean LD(corrupt)": f"{self.ld_corrupt:.4f}"}
        report = Report(f"bertology: which heads matter, causally, on {self.source}", summary, [patching_section(folder, self)]).render()
        return complete_run(folder, {"model": self.model, "source": self.source, "ld_clean": self.ld_clean, "ld_corrupt": self.ld_corrupt,
                                     "agreement": self.agreement, "settings": self.settings}, report=report, command=command) / "report.html"


def prompts_table(pairs: list, tokenizer, labels: tuple[str, ...] | None) -> pd.DataFrame:
    """The prompts each pair stands for, decoded (a built-in set's too, so that a run folder says what it measured): ``pair``,
    ``clean``, ``corrupt``, ``answer``, ``wrong`` (a classifier's: label names)."""
    def named(index: int) -> str:
        return labels[index] if labels is not None else tokenizer.decode([index])

    return pd.DataFrame([{"pair": pair.line, "clean": tokenizer.decode(list(pair.clean)), "corrupt": tokenizer.decode(list(pair.corrupt)),
                          "answer": named(pair.answer), "wrong": named(pair.wrong)} for pair in pairs])


def _check(pairs, task: str | None, n: int | None, direction: str, positions: str, correction: str, bootstrap: int, min_sample: int) -> None:
    """Refuse impossible settings in one line, before the model is loaded."""
    from statsmodels.stats.multitest import multipletests

    if (pairs is None) == (task is None):
        raise BertologyError("give --pairs FILE.jsonl or --task (" + ", ".join(TASKS) + "), one of the two")
    if task is not None and task not in TASKS:
        raise BertologyError(f"unknown --task {task!r}; use {', '.join(TASKS)}")
    if direction not in DIRECTIONS:
        raise BertologyError(f"unknown --direction {direction!r}; use {' or '.join(DIRECTIONS)}")
    if positions not in POSITIONS:
        raise BertologyError(f"unknown --positions {positions!r}; use {' or '.join(POSITIONS)}")
    if pairs is not None and n is not None:
        raise BertologyError("--n draws pairs of a built-in --task; a --pairs file is used whole")
    if (n is not None and n < 1) or bootstrap < 100 or min_sample < 2:
        raise BertologyError("--n must be at least 1, --bootstrap at least 100 and --min-sample at least 2")
    try:
        multipletests([0.5], method=correction)
    except ValueError:
        raise BertologyError(f"unknown --correction {correction!r} (statsmodels multipletests: fdr_bh, bonferroni, holm, ...)") from None


def _head(model: str | Path | None) -> str:
    """The head ``model`` is loaded with: ``classifier`` where its config names a sequence classifier, else its language-model
    head (a model folder that cannot be read is refused by :func:`~bertology.core.model.models.load_model`). The bundled
    model has neither: refused here in one line."""
    from transformers import AutoConfig

    if model_name(model) == DEFAULT_MODEL:
        raise BertologyError(f"patch reads a language-model head or a classifier's, and the bundled model ({DEFAULT_MODEL}, a sentence "
                             "encoder) has none: give --model, a causal LM, an encoder with its masked-LM head or a fine-tuned classifier")
    try:
        architectures = AutoConfig.from_pretrained(model_source(model)).architectures or []
    except (OSError, ValueError):
        return LANGUAGE_MODEL
    return "classifier" if any(name.endswith("ForSequenceClassification") for name in architectures) else LANGUAGE_MODEL


def _pairs(loaded, labels: tuple[str, ...] | None, pairs, task: str | None, n: int, seed: int, positions: str) -> list:
    """The encoded pairs: a classifier's (its ``labels`` given) ``answer`` and ``wrong`` name its labels; per position, every
    pair one length."""
    if labels is not None and task is not None:
        raise BertologyError("--task builds language-model pairs; a classifier needs --pairs whose answer and wrong name two of its labels")
    encoded = read_pairs(pairs, loaded.tokenizer, loaded.kind, labels) if pairs is not None else task_pairs(task, loaded.tokenizer, loaded.kind, n, seed)
    lengths = sorted({len(pair.clean) for pair in encoded})
    if positions == "each" and len(lengths) > 1:
        raise BertologyError(f"--positions each needs every pair to be one length, so that a position means one place; these are "
                             f"{', '.join(map(str, lengths))} pieces long")
    return encoded


def patched(model: torch.nn.Module, pairs: list, direction: str, positions: str, means: list | None, progress: bool = False) -> tuple:
    """The effects of patching on ``pairs``, and (given the run's mean head outputs ``means``) of zero and mean ablation and
    gradient importance (else None)."""
    effects = Patcher(model, direction, positions).effects(pairs, progress=progress)
    return effects, ablation_effects(model, pairs, means, progress=progress) if means is not None else None


def patched_on_worker(source: str, head: str, pairs: list, direction: str, positions: str, means: list | None, device: str) -> tuple:
    """One Ray task: the model at ``source`` loaded on the worker, and :func:`patched` on ``pairs``."""
    from bertology.core.model.models import load_model

    return patched(load_model(source, device=device, head=head).model, pairs, direction, positions, means)


def _effects(loaded, head: str, encoded: list, direction: str, positions: str, ablations: bool, runner: LocalBackend | RayBackend,
             device: str, progress: bool) -> tuple:
    """:func:`patched` here, or on Ray with the pairs cut into one shard per worker, joined in order; mean ablation's means
    are taken here, over every pair."""
    means = mean_outputs(Patcher(loaded.model), encoded) if ablations else None
    if isinstance(runner, LocalBackend):  # the model loaded here, with a progress bar
        return patched(loaded.model, encoded, direction, positions, means, progress)
    source = str(loaded.source) if loaded.source is not None else loaded.name  # a folder by its absolute path, which every node must see
    shards = [shard for shard in np.array_split(np.arange(len(encoded)), min(len(encoded), runner.workers or DEFAULT_CPU_ACTORS)) if len(shard)]
    jobs = [(source, head, [encoded[i] for i in shard], direction, positions, means) for shard in shards]
    done = dict(runner.map(patched_on_worker, jobs, device=device))
    parts = [done[index] for index in range(len(jobs))]
    joined = {method: np.concatenate([part[1][method] for part in parts]) for method in parts[0][1]} if ablations else None
    return PairEffects.joined([part[0] for part in parts]), joined


@claims_out(words=("task", "direction", "positions", "correction", "device", "backend"))
def patch_heads(model: str | Path | None = None, pairs: str | Path | None = None, *, task: str | None = None, n: int | None = None,
                direction: str = "denoise", positions: str = "all", ablations: bool = True, bootstrap: int = 10000, correction: str = "fdr_bh",
                min_sample: int = MIN_SAMPLE, seed: int = 0, device: str = "auto", backend: str = "local", workers: int | None = None,
                address: str | None = None, out: str | Path | None = None, progress: bool = True, command: list[str] | None = None) -> PatchStudy:
    """Patch every head of ``model`` (a causal LM, an encoder with its masked-LM head, or a sequence classifier) on the
    ``pairs`` file or ``n`` pairs (default :data:`TASK_PAIRS`) of the built-in ``task``, in ``direction``, at all positions and (``positions="each"``) at
    each alone; exact and attribution patching (AtP, AtP*), each head's effect with a bootstrap interval (``bootstrap``
    replicates) and a ``correction`` over heads; with ``ablations``, zero and mean ablation and gradient importance on the
    clean prompts too, and every method's rank agreement. ``backend="ray"`` spreads the pairs over ``workers`` (a local cluster, or
    the one at ``address``); the tables are the local run's. A model whose layout bertology does not know is refused before
    any pass. With ``out``, the run folder is written whole."""
    from bertology.core.model.models import load_model

    check_seed(seed)
    _check(pairs, task, n, direction, positions, correction, bootstrap, min_sample)
    runner = backend_named(backend, workers, address)
    head = _head(model)
    loaded = load_model(model, device=device, head=head)
    known_layout(loaded.model)
    labels = tuple(str(loaded.model.config.id2label[i]) for i in range(loaded.model.config.num_labels)) if head == "classifier" else None
    encoded = _pairs(loaded, labels, pairs, task, n or TASK_PAIRS, seed, positions)
    torch.manual_seed(seed)
    effects, ablated = _effects(loaded, head, encoded, direction, positions, ablations, runner, device, progress)
    tests = {"replicates": bootstrap, "seed": seed, "correction": correction, "min_sample": min_sample}
    table = patching_table(effects, direction, **tests)
    if ablated is not None:
        table = pd.concat([table, ablation_table(ablated, effects.clean, effects.corrupt, **tests)], ignore_index=True)
    settings = {"pairs": str(pairs) if pairs is not None else None, "task": task, "n": len(encoded), "direction": direction, "positions": positions,
                "bootstrap": bootstrap, "correction": correction, "min_sample": min_sample, "seed": seed, "device": str(loaded.device),
                "ablations": ablations, "backend": backend, "workers": workers}
    study = PatchStudy(loaded.info(), Path(pairs).name if pairs is not None else f"--task {task}", table,
                       pairs_table(effects, [pair.line for pair in encoded], direction, ablated), float(effects.clean.mean()),
                       float(effects.corrupt.mean()), agreement(table), rank_agreement(table), prompts_table(encoded, loaded.tokenizer, labels),
                       settings)
    if out is not None:
        study.save(out, command)
    return study
