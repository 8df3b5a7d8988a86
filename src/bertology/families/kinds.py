"""What the families' analyzers share about the kind of model they are built for (:mod:`bertology.core.model.kinds`).

An analyzer whose measures depend on the kind is given it when it is built (``Family.analyzers(settings, kind)``), keeps it
as ``kind``, refuses a batch of another kind (:func:`check_kind`) and refuses to merge with an analyzer of another kind
(:func:`check_same_kind`): nothing about the kind is learnt from the data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bertology.core.analyzer import Analyzer
    from bertology.core.engine import Batch
    from bertology.core.model.kinds import Kind


def check_kind(analyzer: Analyzer, batch: Batch) -> None:
    """Refuse a ``batch`` of another kind of model than the one ``analyzer`` (with a ``kind``) was built for."""
    if batch.kind is not analyzer.kind:
        raise ValueError(f"{type(analyzer).__name__} was built for a model of kind {analyzer.kind.name!r}, not {batch.kind.name!r}")


def check_same_kind(analyzer: Analyzer, other: Analyzer) -> None:
    """Refuse to merge ``other`` into ``analyzer``: another type (TypeError), or built for another kind of model (ValueError)."""
    analyzer._check_mergeable(other)
    if other.kind is not analyzer.kind:
        raise ValueError(f"cannot merge a {type(other).__name__} of kind {other.kind.name!r} into one of kind {analyzer.kind.name!r}: "
                         "their measures differ")


def one_row(kind: Kind) -> str:
    """The one position whose row a family reports beside the mean over every query: the first anchor's (``cls_row``,
    [CLS]'s) where that row sees the other tokens, else the last token's (``last_row``, the one a decoder predicts the next
    token from; its first token's row sees only itself)."""
    return f"{kind.anchors[0]}_row" if kind.sees_later_keys else "last_row"
