"""Michel et al. (2019)'s gradient importance of each head, and its normalisations."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.errors import BertologyError
from bertology.core.learning.tasks import LanguageModel, TaskModel
from bertology.core.model.hooks import Hooks
from bertology.core.model.interventions import HeadGates
from bertology.studies.heads.method import HeadMethod


class GradientImportance(HeadMethod):
    """Michel et al. (2019): ``I_h = E_x |dL(x)/d xi_h|`` with ``L(x)`` the model's loss on example ``x`` (its ``losses``): a
    classifier's cross-entropy of the gold label, or a decoder's causal LM loss, the mean next-token cross-entropy over the
    sequence's real pieces (:func:`~bertology.core.learning.tasks.next_token_losses`; padding takes no part).

    ``MHA(x) = sum_h xi_h Att_h(x)`` with a gate ``xi_h = 1`` per example, so ``dL(x)/d xi_h`` is example
    ``x``'s own gradient: its absolute value is taken per example, then averaged over the ``N`` examples.

    The Hugging Face bertology script (``examples/research_projects/bertology/run_bertology.py``) adds
    ``|head_mask.grad|`` once per *batch*, for one gate shared by the batch and the batch's mean loss, so
    signs cancel within a batch (``sum_b |mean_{x in b} dL(x)/d xi_h|``); it never zeroes
    ``head_mask.grad``, so batch ``b`` adds the absolute gradient summed over batches ``1..b``; and it
    divides by the number of tokens, not of examples. With batch size 1 (its default) and the gradient
    zeroed per batch, its importance is ``N / tokens`` times this one, so the two agree once normalised per
    layer. A gate per token would give ``E_x sum_t |dL(x)/d xi_{h,t}|``, at least this value since
    ``dL(x)/d xi_h = sum_t dL(x)/d xi_{h,t}``, and larger wherever a head's tokens pull the loss in
    opposite directions.
    """

    def __init__(self, task_model: TaskModel | LanguageModel, *, batch_size: int = 32, progress: bool = True):
        super().__init__(task_model, batch_size=batch_size, progress=progress)

    def attribute(self, rows: list[dict], head_mask: np.ndarray | None = None) -> np.ndarray:
        """Mean absolute gradient per ``[layer, head]``; masked heads (``head_mask == 0``) stay gated at 0."""
        tm = self.task_model
        mask = torch.ones(tm.num_layers, tm.num_heads) if head_mask is None else torch.as_tensor(head_mask, dtype=torch.float32)
        total = torch.zeros(tm.num_layers, tm.num_heads, dtype=torch.float64)
        dtype = next(tm.model.parameters()).dtype
        for chunk in self.batches(rows, "head importance"):
            gates = mask[:, None, :].expand(-1, len(chunk), -1).to(tm.device, dtype).clone().requires_grad_(True)
            loss = tm.losses([rows[i] for i in chunk], HeadGates(gates).attach_to(Hooks())).sum()  # sum: each example's own gradient
            (gradient,) = torch.autograd.grad(loss, gates)
            total += gradient.abs().sum(1).double().cpu()
        return (total / len(rows)).numpy()


NORMALISATIONS = ("layer", "global", "layer+global", "none")


def check_normalisation(how: str) -> None:
    if how not in NORMALISATIONS:
        raise BertologyError(f"unknown normalisation {how!r}; use {', '.join(NORMALISATIONS)}")


def normalise_importance(importance: np.ndarray, how: str = "layer") -> np.ndarray:
    """Normalised ``[layer, head]`` importances; ``how`` matches the Hugging Face bertology script's flags.

    * ``layer`` (Michel et al. 2019): ``I_lh / sqrt(sum_h' I_lh'^2)``, each layer by its l2 norm
      (the script with ``--dont_normalize_global_importance``);
    * ``global``: ``(I - min I) / (max I - min I)`` over all heads (the script with
      ``--dont_normalize_importance_by_layer``); the order of the heads is the raw one;
    * ``layer+global``: ``layer``, then ``global`` (the script's default); the order is that of ``layer``;
    * ``none``: the raw importance (the script with both flags).

    A layer whose importances are all 0 stays 0, and so does every head when all importances are equal
    (where the script gives 0 and NaN).
    """
    check_normalisation(how)
    if how.startswith("layer"):
        norms = np.linalg.norm(importance, axis=1, keepdims=True)
        importance = importance / np.where(norms > 0, norms, 1.0)
    if how.endswith("global"):
        spread = importance.max() - importance.min()
        importance = (importance - importance.min()) / spread if spread > 0 else np.zeros_like(importance)
    return importance


def importance_table(importance: np.ndarray, normalise: str = "layer") -> pd.DataFrame:
    """``layer, head, importance, importance_normalised`` (normalised as :func:`normalise_importance` says)."""
    layers, heads = importance.shape
    return pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers),
                         "importance": importance.ravel(), "importance_normalised": normalise_importance(importance, normalise).ravel()})
