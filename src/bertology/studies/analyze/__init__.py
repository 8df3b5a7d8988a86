"""``bertology analyze``: every analysis family over a corpus in one pass, and a command for each family that has one.

The options are the shared pass settings (:data:`bertology.core.options.ANALYSIS`), a ``--F/--no-F`` switch per family,
and the families' own options, all from the two registries (:func:`~bertology.studies.analyze.analysis.analyze` runs the
pass).
"""

from __future__ import annotations

from bertology.core.options import ANALYSIS, Option
from bertology.families import Family, registered
from bertology.studies import Study, default_out, register_study


def _default_switch(family) -> str:
    """When ``analyze`` runs ``family`` unasked, in the words of its switch's help."""
    if not family.default:
        return "off"
    if family.needs_trees:
        return "on when the corpus has trees"
    return "on" if family.default_kinds is None else f"on for {' and '.join(sorted(family.default_kinds))}s"


class Analyze(Study):
    """Families run by a command: ``switches`` are switched on and off by ``--F/--no-F`` (``analyze``); without switches
    the command runs ``families`` (a one-family command)."""

    name = "analyze"
    work = "resume"
    libraries = ("bertology.studies.analyze.analysis", "transformers.modeling_utils")  # the latter: every model's base
    title = ("Run the analysis families over a corpus in one pass (by default the profile, roles and patterns, plus syntax when the "
             "corpus has trees); write a run folder with report.html.")

    def families(self) -> list[Family]:
        return list(registered().values())

    @property
    def outputs(self) -> tuple[str, ...]:
        """A one-family command writes its family's tables; ``analyze`` writes those of the families that apply to the corpus."""
        families = self.families()
        return families[0].outputs if len(families) == 1 else ()

    @property
    def optional_outputs(self) -> tuple[str, ...]:
        return tuple(name for family in self.families() for name in (*family.outputs, *family.optional_outputs))

    def switched(self) -> list[Family]:
        return self.families()

    @property
    def options(self) -> tuple[Option, ...]:
        families = self.families()
        corpus_flag = families[0].corpus_flag if len(families) == 1 else None
        shared = tuple(option.but(flag=f"{option.cli_flag} {corpus_flag}") if option.name == "corpus" and corpus_flag else option
                       for option in ANALYSIS)
        switches = tuple(
            Option(f"run_{family.name}", None, f"{family.title} [default: "
                   f"{_default_switch(family)}]",
                   type=bool, flag=f"--{family.name}/--no-{family.name}")
            for family in self.switched())
        return shared + switches + tuple(option for family in families for option in family.options)

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.studies.analyze.analysis import analyze

        settings = dict(settings)
        switches = {family.name: settings.pop(f"run_{family.name}") for family in self.switched()}
        declared = {option.name: option for family in self.families() for option in family.options}
        given = {name: option.parse(settings[name]) if option.parse is not None else settings[name] for name, option in declared.items()
                 if settings[name] != option.default and not (option.multiple and not settings[name])}
        for name in declared:
            settings.pop(name)
        quiet, skip_long = settings.pop("quiet"), settings.pop("skip_long")
        settings["out"] = settings["out"] or default_out(self.name, settings["model"], settings["corpus"])
        if not self.switched():
            settings["analyses"] = [family.name for family in self.families()]
        return analyze(settings.pop("model"), settings.pop("corpus"), overflow="skip" if skip_long else "truncate", progress=not quiet,
                       command=command, include=[name for name, on in switches.items() if on],
                       exclude=[name for name, on in switches.items() if on is False], **settings, **given)

    def summary(self, result, settings: dict) -> list[str]:
        stats = result.stats
        short = f", {stats.degenerate} skipped as shorter than 2 pieces" if stats.degenerate else ""
        lines = [f"{stats.sequences} sequences ({stats.truncated} truncated, {stats.skipped} skipped as too long{short}) in {stats.seconds:.1f} s"]
        registry = registered()
        for name, family_result in result.results.items():
            lines += registry[name].summary(family_result)
        lines += [result.claims_line()] + ([f"calibration, {result.settings['calibration']}"] if result.settings.get("calibration") else [])
        lines += [f"warning: {warning}" for warning in result.warnings] + list(result.left_out.values())  # "NAME left out: why"
        return [*lines, f"report: {(result.out / 'report.html').resolve()}"]

    def failed(self, result) -> str | None:
        if not result.failures:
            return None
        failed = "; ".join(f"{family} failed: {message}" for family, message in result.failures.items())
        return f"{failed}; the other analyses are saved in {result.out.resolve()}"


class FamilyCommand(Analyze):
    """``bertology NAME``: one family on its own, with its options."""

    def __init__(self, family: Family):
        self.family = family
        self.name = family.name
        self.title = family.title

    def families(self) -> list[Family]:
        return [self.family]

    def switched(self) -> list[Family]:
        return []


register_study(Analyze())
for _family in registered().values():
    if _family.command:
        register_study(FamilyCommand(_family))

