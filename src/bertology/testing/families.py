"""The contract of an analysis family as named checks, one function ``check_NAME`` per rule, in :data:`FAMILY_CHECKS`.

Each is called ``check_NAME(family, model=None, corpus=None, **settings)``, in the idiom of scikit-learn's
``parametrize_with_checks``: a test suite gives every family each rule as its own test id
(:func:`bertology.testing.parametrize_with_checks`), and :func:`bertology.testing.check_family` runs them all at once.

The rules: the tables and documents a run writes are exactly those the family declares (``outputs``, plus
``optional_outputs`` where the run asks for them), each written as files; its report section renders on a full result
and on an empty one (every table without rows, as a corpus where nothing qualifies gives); and its options round-trip from
its command line to ``analyze()``'s keywords.

The checks that read a run share one: the family run alone on ``model`` over ``corpus`` with ``settings`` (``analyze()``'s
keywords), into a temporary folder, made by the first of them and kept for the others (:func:`family_run`). ``model`` and
``corpus`` are those of ``analyze()``: None is the bundled model and sample corpus (the bundled frames for a family that needs
frames); give a tiny model and a small corpus to keep the checks quick, a decoder for a family with no meaning on an encoder,
a CoNLL-U corpus for a family that needs trees.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Hashable
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from unittest import SkipTest, mock

import pandas as pd
from markupsafe import escape

from bertology.core.options import Option
from bertology.core.storage.runfolder import RunFolder
from bertology.families import COMMON_SETTINGS, Family, FamilyResult, registered
from bertology.render.html import Report
from bertology.studies import registered_studies
from bertology.testing.recent import Recent

#: The frames corpus bundled with bertology, the default corpus of a family that needs frames.
FRAMES_EXAMPLE = Path(str(resources.files("bertology") / "data" / "frames_example.jsonl"))


def run_family(family: Family, model, corpus, out: Path, **settings):
    """Run ``family`` alone over ``corpus`` into ``out`` (no viewer, no progress bar); the settings go to ``analyze()``."""
    from bertology.studies.analyze.analysis import analyze

    own = {option.name for option in family.options}
    return analyze(model, corpus, analyses=[family.name], out=out, view=False, progress=False,
                   **{name: value for name, value in settings.items() if name in own or name in COMMON_SETTINGS})


def _key(value) -> Hashable:
    """``value`` as part of a key: itself where it is hashable (a path, a name, None), else its identity (a loaded model, a
    list of texts), which the kept run's inputs keep alive."""
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


#: The runs of the families checked last, each with its inputs and the temporary folder it lies in.
_runs = Recent()


def family_run(family: Family, model=None, corpus=None, **settings):
    """The run of ``family`` alone on ``model`` over ``corpus`` with ``settings`` (into a temporary folder), made once for the
    checks of one family and inputs; the family must be registered, as ``analyze()`` runs families by name."""
    if registered().get(family.name) is None:
        raise AssertionError(f"family {family.name} is not registered: bertology.register_family({type(family).__name__}()) before checking it")
    if corpus is None and family.needs_frames:
        corpus = FRAMES_EXAMPLE

    def run():
        folder = tempfile.TemporaryDirectory(prefix=f"bertology-check-{family.name}-")
        return folder, (model, corpus, settings), run_family(family, model, corpus, Path(folder.name) / "run", **settings)

    key = (type(family), family.name, _key(model), _key(corpus), tuple(sorted((name, _key(value)) for name, value in settings.items())))
    return _runs.get(key, run)[2]


def check_tables_declared(family: Family, model=None, corpus=None, **settings) -> None:
    """The tables and documents in the run folder of the family run alone (its section's derived tables too) are among
    those declared, every one of ``outputs`` is there, and those the result holds are written."""
    analysis = family_run(family, model, corpus, **settings)
    files = {path.name for path in Path(analysis.out).iterdir()}
    written = {name.removesuffix(".parquet") for name in files if name.endswith(".parquet")}
    written |= {name.removesuffix(".json") for name in files if name.endswith(".json")} - {"manifest"}
    undeclared = written - set(family.outputs) - set(family.optional_outputs)
    assert not undeclared, f"family {family.name} writes tables it does not declare: {sorted(undeclared)}"
    missing = set(family.outputs) - written
    assert not missing, f"family {family.name} declares outputs it did not write: {sorted(missing)}"
    result = analysis.results[family.name]
    for name in result.tables:
        assert {f"{name}.csv", f"{name}.parquet"} <= files, f"family {family.name}: table {name} is not in the run folder"
    for name in result.documents:
        assert f"{name}.json" in files, f"family {family.name}: document {name} is not in the run folder"
    kept = set(result.extras) - set(family.in_memory)
    assert not kept, f"family {family.name} keeps results in memory it does not declare: {sorted(kept)}"


def _renders(family: Family, result: FamilyResult, settings: dict) -> None:
    with tempfile.TemporaryDirectory(prefix=f"bertology-check-{family.name}-") as scratch, RunFolder(Path(scratch) / "section") as folder:
        section = family.section(folder, result, settings)
        if section is not None:
            page = Report(title=family.name, summary={}, sections=[section]).render()
            assert str(escape(section.title)) in page, f"family {family.name}: its section is not on the page"
        family.summary(result)
        family.overview(result)
        family.by_layer(result)


def check_section_renders_full(family: Family, model=None, corpus=None, **settings) -> None:
    """The section, the summary lines and the overview come from the run's own result."""
    analysis = family_run(family, model, corpus, **settings)
    _renders(family, analysis.by_view["attention"][family.name], analysis.settings)


def check_section_renders_empty(family: Family, model=None, corpus=None, **settings) -> None:
    """The same from a result whose every table has its columns but no rows (a corpus where nothing qualifies)."""
    analysis = family_run(family, model, corpus, **settings)
    full = analysis.by_view["attention"][family.name]
    empty = FamilyResult(tables={name: table.iloc[:0] for name, table in full.tables.items()}, documents=dict(full.documents),
                         extras={name: value.iloc[:0] if isinstance(value, pd.DataFrame) else value for name, value in full.extras.items()})
    _renders(family, empty, analysis.settings)


def _probe_value(option: Option):
    """A value other than the default to give on the command line, as text, and the value ``analyze()`` should then get;
    None where no such value can be made up (a word from a list the option knows, a structured option)."""
    if option.multiple or option.parse is not None:
        return None
    if option.cli_type is bool:
        flipped = not option.default
        positive, _, negative = (option.flag or f"--{option.name.replace('_', '-')}/--no-{option.name.replace('_', '-')}").partition("/")
        return [positive if flipped else negative], flipped
    if option.cli_type is int:
        value = (option.default if option.default is not None else int(option.minimum or 1)) + 1
        if option.maximum is not None and value > option.maximum:
            value = int(option.maximum) - 1
        return [option.cli_flag.split()[0], str(value)], value
    if option.cli_type is float:
        base = option.default if option.default is not None else (option.minimum or 1.0)
        value = base / 2 if option.minimum is None or base / 2 >= option.minimum else base
        if value == option.default and option.maximum is not None:
            value = (base + option.maximum) / 2
        return [option.cli_flag.split()[0], repr(value)], value
    return None


#: What the options check's stand-in for ``analyze()`` returns: a run of nothing, for the command's summary lines.
_NOTHING_RUN = SimpleNamespace(stats=SimpleNamespace(sequences=0, truncated=0, skipped=0, degenerate=0, seconds=0.0), results={}, warnings=[], failures={},
                               left_out={}, out=Path("unused"), claims_line=lambda: "claims: 0", settings={})


def check_options_round_trip(family: Family, model=None, corpus=None, **settings) -> None:
    """Each option given on the family's command line reaches ``analyze()`` as the API's value; left out, it is not sent (no
    run: the inputs are not read). Skipped for a family without a command (``command = False``, or registered after
    bertology made its commands)."""
    from typer.testing import CliRunner

    from bertology.cli import build_app

    if not family.command or family.name not in registered_studies():
        raise SkipTest(f"family {family.name} has no command of its own")
    runner, app = CliRunner(), build_app()  # built now, from the studies registered now
    for option in family.options:
        probe = _probe_value(option)
        with mock.patch("bertology.studies.analyze.analysis.analyze", return_value=_NOTHING_RUN) as analyze:
            outcome = runner.invoke(app, [family.name, *(probe[0] if probe else []), "--out", "unused"], catch_exceptions=False)
        assert outcome.exit_code == 0, f"family {family.name}: option {option.name}: the command failed: {outcome.output}"
        assert analyze.call_count == 1, f"family {family.name}: option {option.name}: the command did not run analyze()"
        keywords = analyze.call_args.kwargs
        if probe is None:
            assert option.name not in keywords, f"family {family.name}: option {option.name} was sent though left at its default"
        else:
            assert keywords.get(option.name) == probe[1], (
                f"family {family.name}: option {option.name} given as {probe[0]} reached analyze() as {keywords.get(option.name)!r}, not {probe[1]!r}")


#: The family checks by rule: ``check(family, model=None, corpus=None, **settings)``.
FAMILY_CHECKS: dict[str, Callable] = {
    "tables_declared": check_tables_declared,
    "section_renders_full": check_section_renders_full,
    "section_renders_empty": check_section_renders_empty,
    "options_round_trip": check_options_round_trip,
}

