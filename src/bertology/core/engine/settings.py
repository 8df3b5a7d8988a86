"""Every setting of one pass in one frozen object, :class:`PassSettings`.

Built once, so that the engine (``Engine(model, settings)``), a Ray actor (which receives it whole) and a run's manifest
(which records it whole, ``dataclasses.asdict``) never disagree. Its options on the command line are one group,
:data:`bertology.core.options.PASS_SETTINGS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from bertology.core.errors import BertologyError
from bertology.core.model.memory import resolved_attention_budget
from bertology.core.model.models import PUNCT_SETS, LoadedModel

OVERFLOW_POLICIES = ("truncate", "skip")
#: The null models a pass can run in place of the model's attention (:attr:`PassSettings.null`): None, the model itself.
NULL_MODELS = (None, "uniform")
#: The default cap on a batch's padded attention size, ``layers * heads * batch * n^2``: at 512 pieces, three sequences of a
#: 6 x 12-head model (one layer's maps, all the layer-by-layer pass holds, about 40 MB in float32), whatever the batch size.
MAX_ATTENTION_ELEMENTS = 2**26


@dataclass(frozen=True)
class PassSettings:
    """How one pass loads its model, reads the corpus into batches and computes each batch's maps.

    Reading: ``batch_size``, the most sequences per forward pass (and, with ``batch_tokens``, the sort window's unit);
    ``batch_tokens``, batches packed by tokens instead: as many length-sorted sequences as fit in that many padded pieces
    (``count x longest``; at least one sequence); ``max_length``, the most pieces per sequence (None: the model's limit, which
    also bounds it); ``overflow``, what longer sequences get, ``truncate`` or ``skip`` (counted either way); ``sort_window``,
    sequences sorted by length within windows of ``batch_size * sort_window`` examples; ``max_attention_elements``, the cap
    on one batch's padded attention size ``layers * batch * heads * n * n`` (:data:`MAX_ATTENTION_ELEMENTS`).

    Maps: ``punct``, the punctuation set of ``Batch.punct_mask`` (:data:`~bertology.core.model.models.PUNCT_SETS`,
    docs/methods.md#head-profile); ``null``, ``"uniform"`` to run the null model instead of the model's attention, every head
    uniform over the keys the model's mask lets each query see (:func:`~bertology.core.model.hooks.uniform_attention`,
    docs/methods.md#the-null-model); ``attention_budget``, the most bytes of one layer's maps (``batch * heads * n * n`` in
    float32 at least) a batch holds at once: past it each layer's maps go by blocks of query rows to the analyzers that fold
    them (:func:`~bertology.core.engine.needs.folds_row_blocks`), the others left out with one line; ``"auto"``, the smaller
    of 64 MiB and a sixteenth of the free memory of the devices that hold the layers
    (:func:`~bertology.core.model.memory.auto_attention_budget`), a number of bytes (text on the command line), or None
    (``"none"``) for whole maps; ``query_block``, every layer's maps this many query rows at a time whatever the budget (a
    fixed size, for tests); ``layerwise``, each layer's maps handed to the analyzers inside the forward pass where every one
    folds layers (:class:`~bertology.core.analyzer.LayerwiseAnalyzer`), else every layer's maps stacked.

    The model and the run: ``device``, ``dtype``, ``device_map`` and ``trust_remote_code`` as
    :func:`~bertology.core.model.models.load_model` takes them (a Ray actor loads its model so), and ``seed``.

    :meth:`resolved` fixes what depends on the model (``max_length``, ``attention_budget`` in bytes): the engine's own."""

    batch_size: int = 32
    batch_tokens: int | None = None
    max_length: int | None = None
    overflow: str = "truncate"
    seed: int = 0
    device: str = "auto"
    punct: str = "upos"
    null: str | None = None
    attention_budget: int | str | None = "auto"
    sort_window: int = 32
    max_attention_elements: int = MAX_ATTENTION_ELEMENTS
    query_block: int | None = None
    layerwise: bool = True
    dtype: str = "auto"
    device_map: str | dict | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.punct not in PUNCT_SETS:
            raise BertologyError(f"unknown punctuation set {self.punct!r}: use {' or '.join(PUNCT_SETS)}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, not {self.overflow!r}")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError("batch_tokens must be at least 1")
        if self.null not in NULL_MODELS:
            raise BertologyError(f"unknown null model {self.null!r}: use {' or '.join(repr(name) for name in NULL_MODELS)}")
        if self.query_block is not None and self.query_block < 1:
            raise BertologyError("a block of queries must hold at least 1 row")

    @classmethod
    def of(cls, options: Mapping) -> "PassSettings":
        """The settings among a command's options (its study's ``settings``, or an API function's keywords): each field it
        names, and ``skip_long`` as ``overflow="skip"``; other options are not the pass's."""
        known = {field.name for field in fields(cls)}
        chosen = {name: value for name, value in options.items() if name in known}
        if options.get("skip_long"):
            chosen["overflow"] = "skip"
        return cls(**chosen)

    def resolved(self, model: LoadedModel) -> "PassSettings":
        """These settings on ``model``: ``max_length`` at most the model's (its own where None) and the attention budget in
        bytes (``auto`` measured now, :func:`~bertology.core.model.memory.resolved_attention_budget`) or None."""
        return replace(self, max_length=min(self.max_length or model.max_length, model.max_length),
                       attention_budget=resolved_attention_budget(self.attention_budget, model.model))

    @property
    def window_size(self) -> int:
        """The examples of one sort window, ``batch_size * sort_window``: a Ray shard, a resumed run's unit."""
        return self.batch_size * self.sort_window
