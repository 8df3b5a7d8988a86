"""The paired engine: two models' passes over the same inputs, batch by batch, for analyzers that compare them.

For example Kovaleva et al. 2019's per-head similarity of a model and its fine-tuned twin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bertology.core.engine import Batch, Engine, RunStats
from bertology.core.errors import BertologyError
from bertology.core.text.corpora import Example


@dataclass
class BatchPair:
    """The same batch run through model A and model B."""

    a: Batch
    b: Batch


class CompareEngine:
    """Two engines over one tokenization and batching (model A's); both models need the same vocabulary, shape and kind
    (:mod:`bertology.core.model.kinds`: an encoder's maps and a decoder's are not measured alike)."""

    def __init__(self, engine_a: Engine, engine_b: Engine):
        a, b = engine_a.model, engine_b.model
        if a.tokenizer.get_vocab() != b.tokenizer.get_vocab():
            raise BertologyError(f"{a.name} and {b.name} have different vocabularies: their attention maps cannot be compared token by token")
        if (a.num_layers, a.num_heads) != (b.num_layers, b.num_heads):
            raise BertologyError(f"{a.name} has {a.num_layers}x{a.num_heads} heads and {b.name} {b.num_layers}x{b.num_heads}: compare models of one shape")
        if a.kind is not b.kind:
            raise BertologyError(f"{a.name} is a model of kind {a.kind.name} and {b.name} of kind {b.kind.name}: compare models of one kind")
        self.engine_a, self.engine_b = engine_a, engine_b

    def run(self, examples: Iterable[Example], analyzers: Sequence, *, total: int | None = None, **options) -> RunStats:
        """Feed every analyzer a :class:`BatchPair` per batch; ``options`` go to :meth:`Engine.run` (``start``, ``isolate``, ...)."""
        return self.engine_a.run(
            examples, analyzers, total=total, desc="comparing",
            step=lambda items: BatchPair(self.engine_a.run_batch(items), self.engine_b.run_batch(items)), **options,
        )
