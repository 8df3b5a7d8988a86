"""What one pass computes beyond the attention weights, and which analyzers fold a layer's maps by row blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bertology.core.errors import BertologyError
from bertology.core.measures.contributions import CONTRIBUTION_MEASURES
from bertology.core.measures.norms import CONTRIBUTION_VIEWS, WEIGHTINGS

#: What an analyzer's ``needs`` may name: the mixing ratios, every layer's output, the key/value/transformed vector norms
#: and the contribution measures (:data:`~bertology.core.measures.contributions.CONTRIBUTION_MEASURES`).
KNOWN_NEEDS = frozenset({"mixing", "hidden_states", "vectors", *CONTRIBUTION_MEASURES})


@dataclass(frozen=True)
class PassNeeds:
    """What one pass computes beyond the attention weights, decoded once from its analyzers' ``needs`` and views
    (:meth:`of`).

    ``norms``, every head's ``||f_h(x_j)||`` (the ``norm`` view); ``mixing``, every token's context-mixing ratios;
    ``hidden_states``, every layer's output; ``vectors``, every head's key, value and transformed vector norms;
    ``contributions``, each named measure's maps (``alti``, ``value_zeroing``); ``views``, the per-head contribution
    maps of those views (``alti``, ``value-zeroing``) for :meth:`Batch.weighted`.
    """

    norms: bool = False
    mixing: bool = False
    hidden_states: bool = False
    vectors: bool = False
    contributions: tuple[str, ...] = ()
    views: tuple[str, ...] = ()

    @classmethod
    def of(cls, analyzers: Sequence, weightings: Sequence[str]) -> "PassNeeds":
        """The needs of ``analyzers``, analyzer k receiving the view ``weightings[k]``; an unknown need is refused."""
        named = set().union(*(getattr(analyzer, "needs", frozenset()) for analyzer in analyzers))
        if named - KNOWN_NEEDS:
            raise BertologyError(f"unknown analyzer needs {sorted(named - KNOWN_NEEDS)}: an analyzer may need {', '.join(sorted(KNOWN_NEEDS))}")
        return cls(norms="norm" in weightings, mixing="mixing" in named, hidden_states="hidden_states" in named,
                   vectors="vectors" in named, contributions=tuple(measure for measure in CONTRIBUTION_MEASURES if measure in named),
                   views=tuple(view for view in CONTRIBUTION_VIEWS if view in weightings))

    @property
    def anything(self) -> bool:
        """Whether the pass computes more than the weights (a pass that does needs the engine's own forward pass)."""
        return self != NO_NEEDS

    @property
    def values(self) -> bool:
        """Whether the pass captures each layer's value vectors."""
        return self.norms or self.mixing or self.vectors or bool(self.contributions or self.views)

    @property
    def layer_inputs(self) -> bool:
        """Whether the pass keeps each layer's input ``x`` (the residual): for the mixing ratios and the contributions."""
        return self.mixing or bool(self.contributions or self.views)

    def reads_blocks(self, known_layout: bool) -> bool:
        """Whether the pass reads the model's attention blocks (:func:`~bertology.core.model.models.attention_blocks`): for the
        norms and the layers' inputs (mixing, contributions) whatever the layout (an unknown one is refused there); where the
        layout is known, also for the vector norms' transformed norm and for the hidden states (taken from the layers' inputs)."""
        return self.norms or self.layer_inputs or ((self.vectors or self.hidden_states) and known_layout)


NO_NEEDS = PassNeeds()


def checked_weightings(analyzers: Sequence, weightings: Sequence[str] | None) -> list[str]:
    """The view of attention each analyzer receives (default: the weights for every one), one per analyzer, each a known one
    (:data:`~bertology.core.measures.norms.WEIGHTINGS`) or refused in one line."""
    weightings = list(weightings) if weightings is not None else ["attention"] * len(analyzers)
    if len(weightings) != len(analyzers):
        raise ValueError("give one weighting per analyzer")
    for weighting in weightings:
        if weighting not in WEIGHTINGS:
            raise BertologyError(f"unknown weighting {weighting!r}: use {' or '.join(WEIGHTINGS)}")
    return weightings


def is_layerwise(analyzer) -> bool:
    """True for an analyzer that folds a batch one layer at a time (:class:`~bertology.core.analyzer.LayerwiseAnalyzer`)."""
    return callable(getattr(analyzer, "update_layer", None)) and callable(getattr(analyzer, "finish_batch", None))


#: The views of attention a pass by blocks of queries gives: the weights and the norm shares (row by row); the contribution
#: views rerun or decompose the whole block.
BLOCKED_VIEWS = ("attention", "norm")
#: What an analyzer may need and still fold blocks of queries: the mixing ratios and contribution maps read whole maps.
BLOCKED_NEEDS = frozenset({"hidden_states", "vectors"})


def folds_row_blocks(analyzer, weighting: str = "attention") -> bool:
    """Whether ``analyzer`` receiving the view ``weighting`` takes each layer's maps as blocks of query rows
    (:attr:`LayerMaps.rows`): a layerwise analyzer that says so (``folds_row_blocks``), in a view made row by row
    (:data:`BLOCKED_VIEWS`), needing nothing that reads whole maps (:data:`BLOCKED_NEEDS`)."""
    return (is_layerwise(analyzer) and bool(getattr(analyzer, "folds_row_blocks", False)) and weighting in BLOCKED_VIEWS
            and getattr(analyzer, "needs", frozenset()) <= BLOCKED_NEEDS)

