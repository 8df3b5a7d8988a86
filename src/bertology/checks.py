"""The contracts of families and studies as named checks, in the idiom of scikit-learn's ``parametrize_with_checks``:
each rule is one function ``check_NAME`` listed in :data:`FAMILY_CHECKS` or :data:`STUDY_CHECKS`, so that a test suite
gives every registered family and study each rule as its own test id (``tests/test_checks.py``). The analyzer contract's
rules are :data:`bertology.core.testing.ANALYZER_CHECKS`. A user's own family or study runs the same checks.

Family rules: the tables and documents a run writes are exactly those the family declares (``outputs``, plus
``optional_outputs`` where the run asks for them), each written as files; its report section renders on a full result
and on an empty one (every table without rows, as a corpus where nothing qualifies gives); and its options round-trip from
its command line to ``analyze()``'s keywords.

Study rules: its command's ``--help`` answers without importing anything heavy; a run writes its folder whole, with a
``manifest.json`` that says ``complete``, its declared tables and, where it has one, ``report.html``; a run that fails
before its folder is swapped in leaves the previous run as it was, with nothing of its own beside it; and on its command
line an ``--out`` of other files, one that holds an input of the run, or an earlier run folder that holds files the run did
not write, is refused in one line and left as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pandas as pd
from markupsafe import escape

from bertology.core.options import Option
from bertology.core.storage.runfolder import RunFolder
from bertology.families import COMMON_SETTINGS, Family, FamilyResult
from bertology.render.html import Report
from bertology.studies import Study

#: Top-level packages whose import ``--help`` must not pay for.
HEAVY_PACKAGES = ("torch", "transformers", "numpy", "pandas", "scipy", "sklearn", "statsmodels", "matplotlib", "spacy", "ray", "pyarrow")


def run_family(family: Family, model, examples, out: Path, **settings):
    """Run ``family`` alone over ``examples`` into ``out`` (no viewer, no progress bar); the settings go to ``analyze()``."""
    from bertology.studies.analyze.analysis import analyze

    own = {option.name for option in family.options}
    return analyze(model, examples, analyses=[family.name], out=out, view=False, progress=False,
                   **{name: value for name, value in settings.items() if name in own or name in COMMON_SETTINGS})


def check_tables_declared(family: Family, analysis) -> None:
    """The tables and documents in the run folder of the family run alone (its section's derived tables too) are among
    those declared, every one of ``outputs`` is there, and those the result holds are written."""
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


def _renders(family: Family, result: FamilyResult, settings: dict, folder_path: Path) -> None:
    with RunFolder(folder_path) as folder:
        section = family.section(folder, result, settings)
        if section is not None:
            page = Report(title=family.name, summary={}, sections=[section]).render()
            assert str(escape(section.title)) in page, f"family {family.name}: its section is not on the page"
        family.summary(result)
        family.overview(result)
        family.by_layer(result)


def check_section_renders_full(family: Family, analysis, folder: Path) -> None:
    """The section, the summary lines and the overview come from the run's own result."""
    _renders(family, analysis.by_view["attention"][family.name], analysis.settings, folder)


def check_section_renders_empty(family: Family, analysis, folder: Path) -> None:
    """The same from a result whose every table has its columns but no rows (a corpus where nothing qualifies)."""
    full = analysis.by_view["attention"][family.name]
    empty = FamilyResult(tables={name: table.iloc[:0] for name, table in full.tables.items()}, documents=dict(full.documents),
                         extras={name: value.iloc[:0] if isinstance(value, pd.DataFrame) else value for name, value in full.extras.items()})
    _renders(family, empty, analysis.settings, folder)


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
                               out=Path("unused"), claims_line=lambda: "claims: 0", settings={})


def check_options_round_trip(family: Family) -> None:
    """Each option given on the family's command line reaches ``analyze()`` as the API's value; left out, it is not sent."""
    from typer.testing import CliRunner

    from bertology.cli import app

    runner = CliRunner()
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


#: The family rules, by name.
FAMILY_CHECKS: dict[str, Callable] = {
    "tables_declared": check_tables_declared,
    "section_renders_full": check_section_renders_full,
    "section_renders_empty": check_section_renders_empty,
    "options_round_trip": check_options_round_trip,
}


def check_help_imports_nothing_heavy(study: Study) -> None:
    """``bertology NAME --help`` answers without importing any of :data:`HEAVY_PACKAGES` (run in a fresh interpreter)."""
    script = ("import sys\nsys.argv = ['bertology', %r, '--help']\nfrom bertology.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
              "print('\\nIMPORTED ' + ' '.join(sorted({name.split('.')[0] for name in sys.modules})))") % study.name.replace("_", "-")
    outcome = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert outcome.returncode == 0, f"study {study.name}: --help failed: {outcome.stderr[-2000:]}"
    assert "Usage:" in outcome.stdout, f"study {study.name}: --help printed no usage"
    imported = set(outcome.stdout.rsplit("IMPORTED ", 1)[1].split())
    heavy = sorted(imported & set(HEAVY_PACKAGES))
    assert not heavy, f"study {study.name}: --help imports {', '.join(heavy)}"


def settings_with_defaults(study: Study, given: dict) -> dict:
    """Every option of ``study`` by name: the given value, else its default."""
    unknown = set(given) - {option.name for option in study.options}
    assert not unknown, f"study {study.name} has no options {sorted(unknown)}"
    return {option.name: given.get(option.name, option.default) for option in study.options}


def check_folder_written_whole(study: Study, given: dict) -> None:
    """A run into ``given["out"]`` writes the folder with ``manifest.json`` (``complete``), every declared table and, where the
    study has one, ``report.html``; only declared tables; nothing left beside it."""
    out = Path(given["out"])
    study.run(settings_with_defaults(study, given), command=["check"])
    files = {path.name for path in out.iterdir()}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete", f"study {study.name}: the manifest says {manifest['status']}"
    assert manifest["command"] == ["check"] and "versions" in manifest and "finished" in manifest, f"study {study.name}: the manifest lacks its facts"
    for name in study.outputs:  # a table (CSV and Parquet) or a document (JSON)
        assert {f"{name}.csv", f"{name}.parquet"} <= files or f"{name}.json" in files, f"study {study.name}: declared output {name} is not written"
    tables = {name.removesuffix(".parquet") for name in files if name.endswith(".parquet")}
    undeclared = tables - set(study.outputs) - set(study.optional_outputs)
    assert not undeclared, f"study {study.name} writes tables it does not declare: {sorted(undeclared)}"
    assert ("report.html" in files) == study.report, f"study {study.name}: report.html {'missing' if study.report else 'written'}"
    assert not _beside(out), f"study {study.name} left {_beside(out)} beside its run folder"


def _beside(out: Path) -> list[str]:
    """What a run left beside its folder: a staging ``OUT.tmp-*`` or a previous ``OUT.old-*``."""
    return [path.name for path in out.parent.iterdir() if path.name.startswith(f"{out.name}.")]


def _files(out: Path, work: str | None) -> dict:
    """Every file of the run folder with its bytes, but the lock and the study's own work folder (resumable work it
    writes into ``out`` as it goes, by design)."""
    return {path.relative_to(out): path.read_bytes() for path in sorted(out.rglob("*"))
            if path.is_file() and path.name != ".bertology-lock" and path.relative_to(out).parts[0] != work}


def check_failed_run_keeps_previous(study: Study, given: dict) -> None:
    """Run once, then again with the swap of the new folder for the old failing (a full disk at the rename): the previous
    run stays as it was, file for file (the study's ``work`` folder aside), and nothing is left beside it."""
    out = Path(given["out"])
    study.run(settings_with_defaults(study, given), command=["check"])
    before = _files(out, study.work)
    rename = os.rename

    def full_disk(source, target):
        if ".tmp-" in Path(source).name:  # the staging folder swapped in as out
            raise OSError(28, "No space left on device")
        rename(source, target)

    with mock.patch("bertology.core.storage.runfolder.os.rename", side_effect=full_disk):
        try:
            study.run(settings_with_defaults(study, given), command=["check"])
        except OSError:
            pass
        else:
            raise AssertionError(f"study {study.name}: the run did not fail when its folder could not be swapped in")
    after = _files(out, study.work)
    assert after == before, f"study {study.name}: a failed run changed the previous one ({sorted(set(after) ^ set(before)) or 'contents'})"
    assert not _beside(out), f"study {study.name}: a failed run left {_beside(out)} beside the run folder"


def command_line(study: Study, given: dict) -> list[str]:
    """``given`` (options by name) as the arguments of ``bertology NAME``: flags for options, values for arguments, a switch's
    on or off flag, a repeated flag for each value of a ``multiple`` option."""
    arguments: list[str] = [study.name.replace("_", "-")]
    for option in study.options:
        if option.name not in given:
            continue
        value = given[option.name]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if option.argument:
            arguments += [str(each) for each in values]
        elif "/" in option.cli_flag:  # --x/--no-x
            arguments.append(option.cli_flag.split()[0].split("/")[0 if value else 1])
        elif isinstance(value, bool) and (option.type or type(option.default)) is bool:
            arguments += [option.cli_flag.split()[0]] if value else []
        else:
            for each in values:
                arguments += [option.cli_flag.split()[0], str(each)]
    return arguments


def _refusal(study: Study, given: dict) -> str:
    """Run ``study`` from the command line (in process) with ``given`` and return the one-line error it must stop with."""
    from typer.testing import CliRunner

    from bertology.cli import build_app
    from bertology.core.errors import BertologyError

    outcome = CliRunner().invoke(build_app(), command_line(study, given))  # built now: a study registered after the import has its command
    error = outcome.exception
    assert isinstance(error, BertologyError), f"study {study.name}: the command was not refused ({outcome.exit_code}: {error!r} {outcome.output[-500:]})"
    assert "\n" not in str(error), f"study {study.name}: the refusal is not one line: {error}"
    return str(error)


def check_out_of_other_files_refused(study: Study, given: dict) -> None:
    """On the command line, ``--out`` naming a folder of other files (notes, not a run folder) is refused in one line, and
    the folder is left as it was."""
    out = Path(given["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "notes.txt").write_text("keep\n")
    message = _refusal(study, given)
    assert "not a bertology run folder" in message, f"study {study.name}: refused for another reason: {message}"
    assert [path.name for path in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep\n", (
        f"study {study.name}: the folder of other files changed")


def check_input_inside_out_refused(study: Study, given: dict) -> None:
    """On the command line, an earlier run folder given as ``--out`` that holds one of the run's inputs (its first option
    naming a file or folder: the corpus, the task, the model, a checkpoint) is refused in one line, and nothing in it changes."""
    import shutil

    out = Path(given["out"])
    with RunFolder(out) as folder:
        folder.write_text("report.html", "an earlier run")
    inputs = [(name, value) for name, value in given.items() if name != "out"
              and any(Path(str(each)).exists() for each in (value if isinstance(value, (list, tuple)) else [value]))]
    assert inputs, f"study {study.name}: give the check an input that names a file or folder (a corpus, a model)"
    name, value = inputs[0]
    moved = []
    for each in value if isinstance(value, (list, tuple)) else [value]:
        source = Path(str(each))
        target = out / f"input-{len(moved)}-{source.name}"
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)
        moved.append(str(target))
    before = _files(out, None)
    message = _refusal(study, {**given, name: moved if isinstance(value, (list, tuple)) else moved[0]})
    assert "holds the input" in message, f"study {study.name}: refused for another reason: {message}"
    assert _files(out, None) == before, f"study {study.name}: a refused run changed the folder that holds its input"


def check_foreign_files_kept(study: Study, given: dict) -> None:
    """On the command line, a run into ``given["out"]`` and then, after the user put notes, a file and a folder of figures
    into it, the same command again: refused in one line naming ``--out``, the folder and the first of them, before any
    computing (nothing staged beside the folder), and every file in it, theirs and the earlier run's, left byte for byte."""
    from typer.testing import CliRunner

    from bertology.cli import build_app

    out = Path(given["out"])
    first = CliRunner().invoke(build_app(), command_line(study, given))
    assert first.exit_code == 0, f"study {study.name}: the first run failed ({first.exit_code}: {first.exception!r} {first.output[-500:]})"
    (out / "NOTES.md").write_text("# what I saw\n")
    (out / "x.txt").write_bytes(b"\x00 mine")
    (out / "my_figures").mkdir()
    (out / "my_figures" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n mine")
    before = _files(out, study.work)
    message = _refusal(study, given)
    assert message.startswith(f"{out}: holds NOTES.md,") and "--out" in message, f"study {study.name}: refused for another reason: {message}"
    assert _files(out, study.work) == before, f"study {study.name}: a refused run changed the earlier run folder"
    assert not _beside(out), f"study {study.name}: the run was refused after it computed (it left {_beside(out)} beside the folder)"


#: The study rules, by name; all but the first need the study's small inputs (``given``).
STUDY_CHECKS: dict[str, Callable] = {
    "help_imports_nothing_heavy": check_help_imports_nothing_heavy,
    "folder_written_whole": check_folder_written_whole,
    "failed_run_keeps_previous": check_failed_run_keeps_previous,
    "out_of_other_files_refused": check_out_of_other_files_refused,
    "input_inside_out_refused": check_input_inside_out_refused,
    "foreign_files_kept": check_foreign_files_kept,
}
