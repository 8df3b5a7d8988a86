"""The interface every analyzer implements: fold batches into a bounded summary, merge summaries, report a tidy table.

A summary merges with one of other data (shards of a corpus, workers of a cluster), so results must not depend on batch
size, batch order or sharding, and the same seed gives the same result: :func:`bertology.testing.check_analyzer` checks
this for every analyzer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import pandas as pd

from bertology.core.engine import Batch, LayerMaps


class Analyzer(ABC):
    """Base class of every analyzer. Subclasses set :attr:`name` and implement the three verbs."""

    #: Short name, used for file names in the run folder.
    name: ClassVar[str]
    #: What the analyzer needs from the engine's pass beyond the attention maps: ``"mixing"``, the
    #: context-mixing ratios of every token (``Batch.mixing``); ``"hidden_states"``, every layer's output
    #: (``Batch.hidden_states``).
    needs: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def update(self, batch: Batch) -> None:
        """Fold one batch into the running summary."""

    @abstractmethod
    def merge(self, other: "Analyzer") -> "Analyzer":
        """Fold another analyzer's summary (of disjoint data) into this one; returns self."""

    @abstractmethod
    def result(self) -> pd.DataFrame:
        """The summary so far as a tidy table."""

    def _check_mergeable(self, other: "Analyzer") -> None:
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")


class LayerwiseAnalyzer(Analyzer):
    """An analyzer that folds a batch one layer at a time, so that a pass need never hold every layer's maps.

    In the engine's layer-by-layer pass, :meth:`update_layer` receives each layer's maps inside the forward pass (they
    are released before the next layer runs) and :meth:`finish_batch` the batch once every layer has run (its
    ``attentions`` then None). Per-layer results stay on the maps' device, reduced to a few numbers per sequence, until
    :meth:`finish_batch` moves them to the host in one copy. Under a device map that spreads the layers over several
    devices, :meth:`update_layer` receives the batch on that layer's device (:meth:`~bertology.core.engine.Batch.on`) and
    :meth:`finish_batch` gathers the layers' results on the batch's (:func:`~bertology.core.engine.stack_layers`).
    :meth:`update` (a batch with every layer's maps) feeds the same two methods, so both passes give the same result.
    """

    @abstractmethod
    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        """Fold one layer's maps of ``batch`` (``maps.attention``: ``[batch, head, n, n]``) into the batch's pending results."""

    @abstractmethod
    def finish_batch(self, batch: Batch) -> None:
        """Fold the batch's pending results (every layer seen) into the running summary."""

    def update(self, batch: Batch) -> None:
        for layer in range(batch.num_layers):
            self.update_layer(batch, batch.layer_maps(layer))
        self.finish_batch(batch)
