"""Ablation and gradient importance on the pairs of ``bertology patch``, and how the methods rank the heads.

See docs/methods.md#which-heads-matter-causally.

On the clean prompt ``x`` of every pair, with ``LD = logit_a - logit_b``:

- zero ablation (Kovaleva et al. 2019; Michel et al. 2019's masking): ``LD(x; z_h = 0) - LD(x)``;
- mean ablation (Wang et al. 2022): ``LD(x; z_h = mean z_h) - LD(x)``, the mean over positions of every clean and corrupted
  prompt of the pairs;
- gradient importance (Michel et al. 2019): ``|dLD/dxi_h|`` at ``xi_h = 1`` for a gate ``xi_h`` on the head's output,
  ``= |sum_positions z_h . dLD/dz_h|``, per pair (a magnitude).

They run on the :class:`~bertology.studies.heads.patching.Patcher`'s machinery in the noising direction (its target run is
the clean prompt): a zero or mean ``z`` as the source of exact patching, and attribution from a zero source, ``-z . dLD/dz``.
Their rank agreement with activation patching, Spearman's rho of ``|change|`` over heads and the overlap of the top ``k``,
is where a reader sees zero ablation overstate heads off the model's distribution (Heimersheim & Nanda 2024).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.studies.heads.pairs import EncodedPair
from bertology.studies.heads.patching import Patcher

#: The methods whose rankings of the heads are compared, as ``patching.csv`` names them.
RANKED = ("activation", "attribution", "zero ablation", "mean ablation", "gradient importance")


def mean_outputs(patcher: Patcher, pairs: list[EncodedPair]) -> list[torch.Tensor]:
    """Each layer's ``z`` averaged over every position of every clean and corrupted prompt, ``[heads, d_head]``."""
    sums, count = None, 0
    with torch.inference_mode():
        for pair in pairs:
            for pieces in (pair.clean, pair.corrupt):
                with patcher.heads.recorded() as z:
                    patcher.model(input_ids=patcher._ids(pieces))
                totals = [layer[0].double().sum(0) for layer in z]
                sums = totals if sums is None else [a + b for a, b in zip(sums, totals)]
                count += len(pieces)
    return [(total / count).cpu() for total in sums]


def ablation_effects(model: torch.nn.Module, pairs: list[EncodedPair], means: list[torch.Tensor], progress: bool = False) -> dict[str, np.ndarray]:
    """Per pair, layer and head ``[n, layers, heads]``: the change of the clean run's ``LD`` under zero and mean ablation
    (``means``: :func:`mean_outputs` of every pair of the run, not only of these), and the gradient importance (``|z . dLD/dz|``)."""
    from tqdm.auto import tqdm

    patcher = Patcher(model, "noise")
    found = {"zero ablation": [], "mean ablation": [], "gradient importance": []}
    for pair in tqdm(pairs, desc="zero and mean ablation", disable=not progress):
        shape = (1, len(pair.clean), patcher.heads.num_heads, patcher.heads.head_dim)
        zeros = [torch.zeros(shape, device=model.device, dtype=model.dtype)] * patcher.heads.num_layers
        run = patcher.target_run(pair, zeros, drop_gradients=False)
        found["zero ablation"].append(patcher.exact(pair, zeros, run.hidden))
        averages = [mean.to(model.device, model.dtype).expand(shape) for mean in means]
        found["mean ablation"].append(patcher.exact(pair, averages, run.hidden))
        found["gradient importance"].append(np.abs(run.attribution))  # |(0 - z) . dLD/dz|
    return {method: np.stack(values) for method, values in found.items()}


def rank_agreement(table: pd.DataFrame) -> pd.DataFrame:
    """For every two methods of :data:`RANKED` in ``table`` (at all positions): Spearman's rho of their ``|logit_diff_change|``
    over heads, and the share of the ``k`` heads one ranks highest that the other ranks among its ``k`` highest (``k``:
    the heads that matter by activation patching, at least 1); none where activation patching tested no head."""
    from scipy.stats import spearmanr

    every = table[table.position == "all"]
    if every[every.method == "activation"].p.isna().all():  # nothing was tested: no ranking to compare
        return pd.DataFrame(columns=["method_a", "method_b", "spearman", "top_k", "top_k_overlap"])
    scores = {method: every[every.method == method].sort_values(["layer", "head"]).logit_diff_change.abs().to_numpy()
              for method in RANKED if (every.method == method).any()}
    k = max(1, int(every[every.method == "activation"].matters.sum()))
    rows = []
    for i, a in enumerate(scores):
        for b in list(scores)[i + 1:]:
            varies = min(len(np.unique(scores[a])), len(np.unique(scores[b]))) > 1
            rho = float(spearmanr(scores[a], scores[b]).statistic) if varies else float("nan")
            top = [set(np.argsort(-scores[m], kind="stable")[:k]) for m in (a, b)]
            rows.append({"method_a": a, "method_b": b, "spearman": rho, "top_k": k, "top_k_overlap": len(top[0] & top[1]) / k})
    return pd.DataFrame(rows, columns=["method_a", "method_b", "spearman", "top_k", "top_k_overlap"])
