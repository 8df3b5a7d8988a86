"""Analysis families: the registry of what one pass of ``analyze`` can compute, and how a user adds their own.

A family is one room, ``bertology/families/<name>/``, whose :class:`Family` subclass declares in one place:
its ``name``, the analyzers it feeds from the engine's single pass (:meth:`Family.analyzers`), its
``options`` (the CLI's flags and the API's keywords derive from them, help text included), the tables
it produces (:meth:`Family.finish`, named in ``outputs``), and its figures and report section
(:meth:`Family.section`). Users define families the same way and add them with :func:`register_family`;
``bertology.analyze(analyses=[..., "mine"])`` then runs them in the same pass as the others.

Declaring a family imports nothing heavy: a family imports its analyzers and figures inside its
methods, so that ``bertology --help`` answers at once.
"""

from __future__ import annotations

import importlib
import keyword
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from bertology.core.errors import BertologyError
from bertology.core.options import ANALYSIS, Option
from bertology.core.storage.trusted import trust_module

if TYPE_CHECKING:
    import pandas as pd

    from bertology.core.analyzer import Analyzer
    from bertology.core.engine import Engine
    from bertology.core.model.kinds import Kind
    from bertology.core.storage.runfolder import RunFolder
    from bertology.render.html import Section

#: The families bertology ships, in report order.
BUILTIN_FAMILIES = ("profile", "sinks", "headtypes", "roles", "patterns", "syntax", "classes", "frames", "layers", "rollout", "mixing")
#: Names no family option may take: the settings of the pass that every analysis command shares (its flags), and the other
#: keywords of ``analyze()`` (a test checks that these are exactly its keywords, with the CLI's quiet and skip_long).
COMMON_SETTINGS = frozenset({option.name for option in ANALYSIS} | {"analyses", "include", "exclude", "overflow", "view", "progress", "command"})


@dataclass
class FamilyResult:
    """What a family finished with: ``tables`` (written as ``NAME.csv`` and ``NAME.parquet``), ``documents``
    (``NAME.json``) and ``extras`` (kept in memory for figures and notebooks, not written)."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    documents: dict[str, dict] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        for store in (self.tables, self.documents, self.extras):
            if name in store:
                return store[name]
        return None

    def __contains__(self, name: str) -> bool:
        return any(name in store for store in (self.tables, self.documents, self.extras))


@dataclass
class FamilyContext:
    """What a family may use when it finishes: the run's ``settings``, its ``engine`` (for a second pass,
    such as a probe's test corpus, under the same ``weighting``), the ``corpus`` facts, and ``warnings`` to report."""

    settings: dict
    engine: Engine
    corpus: dict
    warnings: list[str]
    weighting: str = "attention"

    @property
    def progress(self) -> bool:
        """Whether the run shows progress bars (a family's own long steps, such as fitting probes, show one too)."""
        return self.engine.progress


class Family:
    """An analysis family (see the module docstring). Subclasses set the class attributes and implement
    :meth:`analyzers` and :meth:`finish`; :meth:`section` draws the figures and returns the report section.

    ``outputs``: the tables and documents every run writes (its report section's derived tables too);
    ``optional_outputs``: those only some runs write (the trained classifier's, with hand labels); ``in_memory``: results
    kept for figures and notebooks, not written (``extras``); ``default``: ``analyze`` runs it unless told otherwise; ``needs_trees``: it needs dependency trees
    (CoNLL-U, or ``parser="spacy"``) and runs by default only where there are trees; ``command``: the
    CLI gets a ``bertology NAME`` command for it; ``weighted``: its analyzers read the attention maps, so
    it runs once per view of attention the run asks for (``weighting="attention,norm"``); a family that
    does not read them (the mixing ratios) runs once; ``needs_blocks``: it needs to know where the model keeps
    its output projection and layer norm (:func:`~bertology.core.model.models.attention_blocks`): by default it is left out,
    with a warning, for other layouts; ``needs_frames``: it needs frame annotations (the ``frames`` corpus
    format) and runs by default only on such a corpus; ``corpus_flag``: another name its command gives ``--corpus``
    (``--frames``); ``kinds``: the kinds of model (:mod:`bertology.core.model.kinds`) on which the family has a meaning, and
    ``unfit``: the one line that says why not on the others (an encoder's families have none on a decoder's causal attention,
    docs/methods.md#decoders; the sinks family measures what only a decoder has): it is left out of such a model's run, and
    refused there when asked for by name; ``default_kinds``: the kinds on which a default family runs unasked (the decoder head
    types run on an encoder only where asked for).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ()
    optional_outputs: ClassVar[tuple[str, ...]] = ()
    in_memory: ClassVar[tuple[str, ...]] = ()
    default: ClassVar[bool] = True
    needs_trees: ClassVar[bool] = False
    command: ClassVar[bool] = True
    weighted: ClassVar[bool] = True
    needs_blocks: ClassVar[bool] = False
    needs_frames: ClassVar[bool] = False
    corpus_flag: ClassVar[str | None] = None
    kinds: ClassVar[frozenset[str]] = frozenset({"encoder", "decoder"})
    unfit: ClassVar[str | None] = None
    #: The kinds on which ``analyze`` runs a :attr:`default` family unasked (None: every kind in :attr:`kinds`); on the others
    #: it runs where asked for (by name, ``include``, or one of its settings).
    default_kinds: ClassVar[frozenset[str] | None] = None

    def fits(self, kind: Kind, settings: dict | None = None) -> str | None:
        """None where the family has a meaning on this ``kind`` of model with these ``settings``, else the line that says why
        not (:attr:`unfit`)."""
        return None if kind.name in self.kinds else self.unfit or f"it has no meaning on a model of kind {kind.name!r}"

    def prepare(self, settings: dict) -> None:
        """Check the family's inputs before the model loads; raise :class:`~bertology.core.errors.BertologyError` for bad ones."""

    def analyzers(self, settings: dict, kind: Kind) -> dict[str, Analyzer]:
        """The analyzers this family feeds from the engine's pass on a model of this ``kind``, by name."""
        raise NotImplementedError

    def finish(self, analyzers: dict[str, Analyzer], context: FamilyContext) -> FamilyResult:
        """Turn the analyzers, after the pass, into tables."""
        raise NotImplementedError

    def section(self, folder: RunFolder, result: FamilyResult, settings: dict) -> Section | None:
        """Write the family's figures (and any derived tables) into ``folder``; return its report section."""
        return None

    def summary(self, result: FamilyResult) -> list[str]:
        """Lines the command line prints after a run."""
        return []

    def claims(self, result: FamilyResult) -> list[str]:
        """What the run claims of the heads, one line each (a role held, a relation's significant head, a sink head, a pattern's
        majority, a Clark label): the lines a null model (``analyze(null="uniform")``) must leave empty."""
        return []

    def overview(self, result: FamilyResult) -> pd.DataFrame | None:
        """A small table for a notebook's display of the result."""
        return None

    def by_layer(self, result: FamilyResult) -> pd.DataFrame | None:
        """The family's headline quantities per layer, ``quantity, layer, value``: the report sets them side by
        side when a run has several views of attention (weights and norm shares)."""
        return None


_registry: dict[str, Family] = {}


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Add ``family`` (an instance of a :class:`Family` subclass) to the registry and return it.

    Its name must be a Python identifier, and its option names new: neither another family's nor one of
    ``analyze()``'s own keywords. ``replace=True`` swaps in a new definition under a registered name.
    """
    name = getattr(family, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise BertologyError(f"a family needs a name that is a Python identifier, not {name!r}")
    if name in _registry and not replace:
        raise BertologyError(f"a family named {name!r} is registered already (replace=True swaps it)")
    taken = {option.name: other.name for other in _registry.values() if other.name != name for option in other.options}
    for option in family.options:
        if option.name in COMMON_SETTINGS:
            raise BertologyError(f"family {name!r}: option {option.name!r} is one of analyze()'s own settings")
        if option.name in taken:
            raise BertologyError(f"family {name!r}: option {option.name!r} belongs to family {taken[option.name]!r} already")
    trust_module(type(family).__module__)  # its analyzers' states may be resumed
    _registry[name] = family
    return family


def registered() -> dict[str, Family]:
    """Every registered family by name: bertology's own first (in report order), then the users'."""
    for name in BUILTIN_FAMILIES:
        if name not in _registry:
            importlib.import_module(f"bertology.families.{name}")
    order = {name: k for k, name in enumerate(BUILTIN_FAMILIES)}
    return dict(sorted(_registry.items(), key=lambda item: order.get(item[0], len(order))))


def get_family(name: str) -> Family:
    known = registered()
    if name not in known:
        raise BertologyError(f"unknown analysis {name!r}: choose from {', '.join(known)}")
    return known[name]



def family_option(family: str, name: str) -> Option:
    """Family ``family``'s option ``name``: a study that runs the family's analyzers offers it as it is (``track``'s ``--tau``)."""
    return next(option for option in get_family(family).options if option.name == name)
