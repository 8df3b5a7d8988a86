"""Leave-one-out disabling (Kovaleva et al. 2019; Michel et al. 2019's exact ablation): the task metric with each single
head, and each whole layer, masked or made uniform.

The hidden state entering layer ``l`` does not depend on an intervention at layer ``l``, so it is computed once per batch
and the ``H + 1`` variants of layer ``l`` run from there, stacked into one batch. For first-token classifiers the last layer
is computed for the first token only. Each change comes with a paired bootstrap interval over examples and an
FDR-corrected p (:func:`bertology.core.statistics.stats.paired_bootstrap`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.learning.tasks import TaskData, TaskModel, collate_rows, positive_index
from bertology.core.model.hooks import Hooks
from bertology.core.model.interventions import INTERVENTIONS, Intervention, LayerReplay, attach_variants, reads_first_token_only
from bertology.core.statistics.stats import MIN_SAMPLE, corrected, paired_bootstrap
from bertology.studies.heads.method import HeadMethod


def _variants(kind: str, layer: int, num_heads: int) -> list[Intervention]:
    """Each head of ``layer`` alone, then the whole layer."""
    return [Intervention.of(kind, layer, head) for head in range(num_heads)] + [Intervention.of(kind, layer)]


class LeaveOneOut(HeadMethod):
    """Predictions with each head, and each layer, disabled on its own.

    ``reuse=False`` is the naive way (a full forward pass per variant), kept for checking and benchmarks.
    ``first_token_only`` (with reuse, for first-token classifiers) computes the last layer for the first token only.
    """

    def __init__(self, task_model: TaskModel, intervention: str = "mask", *, batch_size: int = 16, reuse: bool = True,
                 first_token_only: bool = True, progress: bool = True):
        if intervention not in INTERVENTIONS:
            raise ValueError(f"unknown intervention {intervention!r}; known: {', '.join(INTERVENTIONS)}")
        super().__init__(task_model, batch_size=batch_size, progress=progress)
        self.intervention, self.reuse = intervention, reuse
        self.first_token_only = reuse and first_token_only and reads_first_token_only(task_model.model)

    def variants(self) -> pd.DataFrame:
        """``layer, head`` of each variant in the order of :meth:`predict`'s output (head -1: the whole layer)."""
        heads = self.task_model.num_heads
        return pd.DataFrame([(layer, head) for layer in range(self.task_model.num_layers) for head in [*range(heads), -1]], columns=["layer", "head"])

    def predict(self, rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """Logits without intervention ``[n, C]`` and with each variant ``[variants, n, C]``."""
        tm = self.task_model
        layers, heads = tm.num_layers, tm.num_heads
        base, variants = None, None
        replay = LayerReplay(tm.model) if self.reuse else None
        with torch.inference_mode():
            for chunk in self.batches(rows, f"leave-one-out ({self.intervention})"):
                inputs = collate_rows(tm.tokenizer, [rows[i] for i in chunk], tm.device)
                inputs.pop("labels")
                if self.reuse:
                    with replay.record() as hidden:
                        clean = tm.model(**inputs).logits
                else:
                    clean = tm.model(**inputs).logits
                if base is None:
                    base = np.empty((len(rows), clean.shape[1]), dtype=np.float32)
                    variants = np.empty((layers * (heads + 1), len(rows), clean.shape[1]), dtype=np.float32)
                base[chunk] = clean.float().cpu().numpy()
                for layer in range(layers):
                    block = _variants(self.intervention, layer, heads)
                    span = slice(layer * (heads + 1), (layer + 1) * (heads + 1))
                    if self.reuse:
                        stacked = {k: v.repeat(len(block), *([1] * (v.dim() - 1))) for k, v in inputs.items()}
                        start = hidden[layer - 1].repeat(len(block), 1, 1) if layer > 0 else None
                        hooks = attach_variants(Hooks(), block, heads)
                        with replay.start_at(layer, start, first_token_only=self.first_token_only), hooks.attach(tm.model):
                            logits = tm.model(**stacked).logits
                        variants[span, chunk] = logits.view(len(block), len(chunk), -1).float().cpu().numpy()
                    else:
                        for index, variant in zip(range(span.start, span.stop), block):
                            with variant.attach_to(Hooks(), heads).attach(tm.model):
                                variants[index, chunk] = tm.model(**inputs).logits.float().cpu().numpy()
        return base, variants


def ablation_table(task: TaskData, gold: np.ndarray, base: np.ndarray, variants: np.ndarray, layout: pd.DataFrame, intervention: str,
                   *, replicates: int = 10000, seed: int = 0, correction: str = "fdr_bh", min_sample: int = MIN_SAMPLE) -> pd.DataFrame:
    """``layer, head, intervention, metric, value, delta, ci_low, ci_high, p, p_adj`` per variant and task metric.

    ``p_adj`` is corrected (statsmodels ``multipletests``, ``correction``) across all variants of one metric.
    A bootstrap p is at least 2/(B + 1), so with 78 tests Benjamini-Hochberg can only reach 0.05 if
    B is in the thousands: hence 10,000 replicates by default. On fewer than ``min_sample`` examples no p is reported.
    """
    tables = []
    for metric in task.metrics:
        scores = paired_bootstrap(gold, base.argmax(-1), variants.argmax(-1), len(task.labels), metric, positive_index(task), replicates, seed,
                                  min_sample)
        scores["p_adj"] = corrected(scores.p, correction)[0]
        tables.append(pd.concat([layout.reset_index(drop=True), scores], axis=1).assign(intervention=intervention, metric=metric))
    columns = ["layer", "head", "intervention", "metric", "value", "delta", "ci_low", "ci_high", "p", "p_adj"]
    return pd.concat(tables, ignore_index=True)[columns]
