"""Which families a run of ``analyze`` runs, with their settings, and which of them run on the loaded model.

Those asked for (or the defaults that apply to the corpus), their settings beside the pass's (:func:`run_settings`),
and, once the model is loaded, those that run on it (:func:`fit_model`); each step returns a new value and changes
nothing in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from bertology.core.engine import PassSettings
from bertology.core.errors import BertologyError
from bertology.core.model.kinds import Kind
from bertology.core.model.models import LoadedModel, attention_blocks
from bertology.core.text.corpora import has_frames, has_trees
from bertology.families import Family, get_family, registered


def choose_families(analyses: Iterable[str] | None, include: Iterable[str], exclude: Iterable[str], with_trees: bool,
                    with_frames: bool, corpus_name: str) -> list[Family]:
    """The families to run: those asked for; or every default family (those that need trees or frames only where
    the corpus has them), with ``include`` added and ``exclude`` left out."""
    def applies(family: Family) -> bool:
        return (with_trees or not family.needs_trees) and (with_frames or not family.needs_frames)

    if analyses is None:
        include, exclude = {get_family(name).name for name in include}, {get_family(name).name for name in exclude}
        analyses = [name for name, family in registered().items()
                    if name not in exclude and (name in include or family.default and applies(family))]
    chosen = [get_family(name) for name in dict.fromkeys(analyses)]
    for family in chosen:
        if family.needs_trees and not with_trees:
            raise BertologyError(f"{family.name} needs dependency trees: give a CoNLL-U corpus or --parser spacy ({corpus_name} has none)")
        if family.needs_frames and not with_frames:
            raise BertologyError(f"{family.name} needs frame annotations: give a frame-annotated .jsonl corpus (--frames) ({corpus_name} has none)")
    return chosen


def family_settings(chosen: list[Family], options: dict) -> dict:
    """Every chosen family's options, the given value or the default; an option of no chosen family is refused."""
    owners = {option.name: (family, option) for family in registered().values() for option in family.options}
    for name in options:
        if name not in owners:
            raise BertologyError(f"unknown setting {name!r}: the families' settings are {', '.join(sorted(owners))}")
        family, option = owners[name]
        if family not in chosen:
            raise BertologyError(f"{option.flag_name} is a setting of {family.name}, which this run does not include")
    return {option.name: options.get(option.name, option.default) for family in chosen for option in family.options}


def requested_families(analyses: Iterable[str] | None, include: Iterable[str], exclude: Iterable[str], options: dict, examples,
                       parser: str | None, corpus_name: str) -> tuple[list[Family], set[str], bool]:
    """The families the run asks for (:func:`choose_families`; giving a family's own setting asks for the family), the
    names asked for by name (refused, not left out, where the model cannot run them), and whether the corpus has trees."""
    analyses = None if analyses is None else list(analyses)
    include = list(include)
    with_trees = parser == "spacy" or has_trees(examples)
    if analyses is None:
        owners = {option.name: name for name, family in registered().items() for option in family.options}
        include = [*include, *(owners[name] for name in options if name in owners)]
    chosen = choose_families(analyses, include, exclude, with_trees, has_frames(examples), corpus_name)
    if not chosen:
        raise BertologyError("nothing to do: every analysis is switched off")
    return chosen, {*(analyses or ()), *include}, with_trees


def run_settings(chosen: list[Family], options: dict, passing: PassSettings, *, with_trees: bool, parser: str | None, views: list[str],
                 limit: int | None, correction: str, min_sample: int) -> dict:
    """The run's settings (in the manifest): the families run, the pass's settings whole, the run's own, then each chosen
    family's; each family checks its own (:meth:`~bertology.families.Family.prepare`)."""
    settings = {
        "analyses": [family.name for family in chosen],
        **asdict(passing),
        "limit": limit,
        "parser": parser or ("gold" if with_trees else None),
        "correction": correction,
        "min_sample": min_sample,
        "weighting": views,
        **family_settings(chosen, options),
    }
    for family in chosen:
        family.prepare(settings)
    return settings


@dataclass(frozen=True)
class Fitted:
    """The families that run on a model (:func:`fit_model`), the run's settings for them (``analyses`` those, the options of
    the families left out for the model's kind gone) and a warning for each family left out where the user may wonder."""

    families: list[Family]
    settings: dict
    warnings: list[str]


def _a(kind: Kind) -> str:
    """``an encoder``, ``a decoder``."""
    return f"{'an' if kind.name[0] in 'aeiou' else 'a'} {kind.name}"


def _without(settings: dict, kept: list[Family], dropped: Iterable[Family]) -> dict:
    """``settings`` for the families ``kept`` alone: their ``analyses``, without the options of those ``dropped``."""
    gone = {option.name for family in dropped for option in family.options}
    return {**{name: value for name, value in settings.items() if name not in gone}, "analyses": [family.name for family in kept]}


def _fit_kind(chosen: list[Family], loaded: LoadedModel, settings: dict, asked: set[str], options: dict) -> Fitted:
    """The chosen families that have a meaning on this kind of model with these settings (:meth:`Family.fits`), and a warning
    for each left out. One asked for by name, or given a setting, is refused in one line instead. A family left out for its
    settings on a kind it supports is warned about; one made only for the other kind (the sinks on an encoder) is left out
    silently."""
    kind = loaded.kind
    unasked = [family for family in chosen if family.default_kinds is not None and kind.name not in family.default_kinds
               and family.name not in asked and not any(option.name in options for option in family.options)]
    if unasked:  # default on other kinds only (the decoder head types on an encoder): left out silently
        chosen = [family for family in chosen if family not in unasked]
        settings = _without(settings, chosen, unasked)
    unfit = {family.name: reason for family in chosen if (reason := family.fits(kind, settings))}
    for name, reason in unfit.items():
        if name in asked:  # asked for by name: refused in one line
            raise BertologyError(f"{name} does not run on {loaded.name} ({_a(kind)}): {reason}")
        given = [option.flag_name for option in get_family(name).options if option.name in options]
        if given:
            raise BertologyError(f"{given[0]} is a setting of {name}, which does not run on {_a(kind)}: {reason}")
    if not unfit:
        return Fitted(chosen, settings, [])
    kept = [family for family in chosen if family.name not in unfit]
    if not kept:
        raise BertologyError(f"nothing to do on {_a(kind)}: {'; '.join(f'{name}: {reason}' for name, reason in unfit.items())}")
    warnings = [f"{name} left out on {_a(kind)}: {reason}" for name, reason in unfit.items() if kind.name in get_family(name).kinds]
    return Fitted(kept, _without(settings, kept, [get_family(name) for name in unfit]), warnings)


def _fit_layout(chosen: list[Family], loaded: LoadedModel, settings: dict, asked: set[str]) -> Fitted:
    """Where bertology does not know the model's layout (where W_O and the layer norm are): norm shares are refused, a family
    that needs the blocks is refused where asked for by name and otherwise left out with a warning (its options stay)."""
    if loaded.layout is not None:
        return Fitted(chosen, settings, [])
    if "norm" in settings["weighting"]:
        attention_blocks(loaded.model)  # its one-line error names the layouts it knows
    unknown = [family.name for family in chosen if family.needs_blocks]
    if set(unknown) & asked:  # asked for by name: refused in one line
        attention_blocks(loaded.model)
    kept = [family for family in chosen if not family.needs_blocks]
    return Fitted(kept, _without(settings, kept, []), [f"{', '.join(unknown)} left out: bertology does not know where "
                                                      f"{loaded.model.config.model_type} models keep their output projection and "
                                                      "layer norm"] if unknown else [])


def fit_model(chosen: list[Family], loaded: LoadedModel, settings: dict, asked: set[str], options: dict) -> Fitted:
    """The chosen families that run on this model, by its kind then its layout, the run's settings for them (with the model's
    ``kind``: the families' analyzers are given the kind itself, the manifest names it) and the warnings for those left out."""
    by_kind = _fit_kind(chosen, loaded, {**settings, "kind": loaded.kind.name}, asked, options)
    by_layout = _fit_layout(by_kind.families, loaded, by_kind.settings, asked)
    return Fitted(by_layout.families, by_layout.settings, by_kind.warnings + by_layout.warnings)
