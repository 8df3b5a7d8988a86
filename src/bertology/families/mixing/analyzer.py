"""How much each token mixes in from the others, per layer: Kobayashi et al.'s mixing ratios, ALTI and value zeroing.

Kobayashi et al.'s (2021) residual-aware mixing ratios (docs/methods.md#norms-and-mixing) and, where asked for, ALTI's
and value zeroing's share of each token's representation that comes from the other tokens.

:class:`ContextMixing`: per layer, the mean over a sequence's tokens of each context-mixing ratio
``||M_i|| / (||M_i|| + ||P_i||)`` (:func:`bertology.core.measures.norms.mixing_ratios`: the attention alone, with the
residual, and with the residual and the layer norm), and of ``1 - c[i, i]`` for each contribution measure
(:mod:`bertology.core.measures.contributions`: ALTI, Ferrando et al. 2022; value zeroing, Mohebbi et al. 2023; rows of ``c`` sum
to 1, so this is the share from the other tokens) and of ``1 - R_l[i, i]`` for its rollout across layers, ``R_l = c_l R_{l-1}``
(``MEASURE_rollout``: the share of token i's representation after layer l that comes from the other input tokens), then
the mean over sequences with a 95% interval (on a decoder the tokens' mean leaves row 0 out, which sees only itself:
docs/methods.md#decoders). It reads the
engine's ``Batch.mixing`` and contribution maps, not the attention maps, so it is the same under every view of attention.
"""

from __future__ import annotations

import pandas as pd
import torch

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, LayerMaps, stack_layers
from bertology.core.measures.contributions import CONTRIBUTION_MEASURES, rolled_out
from bertology.core.measures.norms import MIXING_RATIOS
from bertology.core.model.kinds import Kind
from bertology.core.statistics.stats import RunningMoments, interval_frame, merge_moments
from bertology.families.kinds import check_kind, check_same_kind
from bertology.families.mixing import RATIO_KINDS


class ContextMixing(LayerwiseAnalyzer):
    """Kobayashi et al.'s (2021) context-mixing ratios per layer, where the ``kind`` of model has them (:data:`RATIO_KINDS`:
    a post-norm encoder's), and the share from other tokens by each of ``measures`` (``alti``, ``value_zeroing``; see the
    module docstring)."""

    name = "mixing"

    def __init__(self, kind: Kind, measures: tuple[str, ...] = ()) -> None:
        unknown = set(measures) - set(CONTRIBUTION_MEASURES)
        if unknown:
            raise ValueError(f"unknown contribution measures {sorted(unknown)}: use {', '.join(CONTRIBUTION_MEASURES)}")
        self.kind = kind
        self.measures = tuple(measure for measure in CONTRIBUTION_MEASURES if measure in measures)
        self.ratios = kind.name in RATIO_KINDS  # Kobayashi et al.'s three ratios (post-norm blocks only)
        if not self.ratios and not self.measures:
            raise ValueError(f"without Kobayashi's ratios (a {kind.name}'s pre-norm blocks) the mixing family needs a contribution measure")
        self.needs = frozenset({"mixing"} if self.ratios else ()) | set(self.measures)
        self._moments: RunningMoments | None = None
        self._rolled: dict[str, torch.Tensor] = {}  # each measure's R_l of the batch so far
        self._pending: list[torch.Tensor] = []  # one [batch, ratio] per layer

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            check_kind(self, batch)
            self._pending, self._rolled = [], {}
        shares = [maps.mixing] if self.ratios else []
        for measure in self.measures:  # 1 - c[i, i] and 1 - R_l[i, i]: the share of token i's representation from the other tokens
            contributions = maps.contributions[measure]
            rolled = self._rolled[measure] = rolled_out(contributions, self._rolled.get(measure))
            shares += [1 - contributions.diagonal(dim1=-2, dim2=-1)[..., None], 1 - rolled.diagonal(dim1=-2, dim2=-1)[..., None]]
        ratios = torch.cat(shares, dim=-1)
        queries = batch.query_mask.to(ratios.dtype)  # [batch, n]: the real tokens; on a decoder not row 0, whose c[0, 0] is 1
        count = queries.sum(dim=1)[:, None]  # a decoder's one-token sequence has no query: NaN, which the moments leave out
        self._pending.append(torch.where(count > 0, torch.einsum("bir,bi->br", ratios, queries) / count, torch.nan))  # [batch, ratio]

    def finish_batch(self, batch: Batch) -> None:
        values = stack_layers(self._pending, batch, dim=1).double().cpu().numpy()  # [batch, layer, ratio]: one copy to the host
        self._pending, self._rolled = [], {}
        if self._moments is None:
            self._moments = RunningMoments(values.shape[1:])
        self._moments.push(values)

    def merge(self, other: "ContextMixing") -> "ContextMixing":
        check_same_kind(self, other)
        if other.measures != self.measures:
            raise ValueError(f"cannot merge mixing over {other.measures} into {self.measures}")
        self._moments = merge_moments(self._moments, other._moments)
        return self

    def result(self) -> pd.DataFrame:
        """``layer, ratio, value, ci_low, ci_high, n``: the mean context-mixing ratio of each kind per layer."""
        if self._moments is None:
            return pd.DataFrame(columns=["layer", "ratio", "value", "ci_low", "ci_high", "n"])
        measures = tuple(name for measure in self.measures for name in (measure, f"{measure}_rollout"))
        ratios = (MIXING_RATIOS if self.ratios else ()) + measures
        index = pd.MultiIndex.from_product([range(self._moments.count.shape[0]), ratios], names=["layer", "ratio"])
        return interval_frame(self._moments, index)
