"""The attention budget's arithmetic: a batch's bytes of one layer's maps, and the query rows per block that fit.

An analyzer that reads whole maps, or holds more than the budget beside the blocks, is left out of such a batch with one
line that says why (:meth:`AttentionBudgeting.refusal`).
"""

from __future__ import annotations

import torch

from bertology.core.engine.batch import Encoded
from bertology.core.engine.settings import PassSettings
from bertology.core.model.models import LoadedModel


class AttentionBudgeting:
    """The :class:`~bertology.core.engine.run.Engine`'s attention budget (a part of the engine: it reads the engine's
    model and its settings' ``attention_budget`` and ``query_block``)."""

    model: LoadedModel
    settings: PassSettings  # resolved on the model: the attention budget in bytes, or None

    def layer_bytes(self, items: list[Encoded]) -> int:
        """Bytes of one layer's maps of a batch: ``batch * heads * n * n`` in the statistics dtype (float32 at least)."""
        width = max(len(item) for item in items)
        itemsize = torch.promote_types(self.model.model.dtype, torch.float32).itemsize
        return len(items) * self.model.num_heads * width * width * itemsize

    def query_rows(self, items: list[Encoded]) -> int | None:
        """The query rows per block of a batch's maps (the settings' ``query_block``, or as many as fit their ``attention_budget``, at
        least one), or None where its whole maps fit (computed at once)."""
        width = max(len(item) for item in items)
        if self.settings.query_block is not None:
            return self.settings.query_block if self.settings.query_block < width else None
        if self.settings.attention_budget is None or self.layer_bytes(items) <= self.settings.attention_budget:
            return None
        return max(1, self.settings.attention_budget * width // self.layer_bytes(items))

    def held_past_budget(self, analyzer, items: list[Encoded]) -> int | None:
        """The bytes an analyzer that folds blocks holds beside them for a batch (its ``held_bytes(count, width)``, where it
        has one: rollout's running products), where they exceed the attention budget; else None."""
        held = getattr(analyzer, "held_bytes", None)
        if self.settings.attention_budget is None or held is None:
            return None
        size = held(len(items), max(len(item) for item in items))
        return size if size > self.settings.attention_budget else None

    def refusal(self, analyzer, items: list[Encoded], rows: int) -> str:
        """The one line that leaves ``analyzer`` out of a batch whose maps go by blocks of ``rows`` query rows."""
        name, held = getattr(analyzer, "name", type(analyzer).__name__), self.held_past_budget(analyzer, items)
        if held is not None:
            return f"{name} left out: it holds {held:,} bytes for this batch, past the attention budget of {self.settings.attention_budget:,} bytes"
        why = (f"a layer's maps of this batch ({self.layer_bytes(items):,} bytes) exceed the attention budget of {self.settings.attention_budget:,} bytes"
               if self.settings.query_block is None else f"the pass computes maps by blocks of {rows} query rows (query_block)")
        return f"{name} left out: {why}, and it reads whole maps"

