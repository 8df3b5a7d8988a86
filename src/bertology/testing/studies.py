"""The contract of a study (a command) as named checks, one function ``check_NAME`` per rule, in :data:`STUDY_CHECKS`.

Each is called ``check_NAME(study, **given)``, in the idiom of scikit-learn's ``parametrize_with_checks``: a test suite
gives every study each rule as its own test id (:func:`bertology.testing.parametrize_with_checks`), and
:func:`bertology.testing.check_study` runs them all at once. ``given`` is the study's small inputs, its options by name
(a corpus, a model, ``limit``); each check runs the study into ``given["out"]``, or where that is left out into a fresh
temporary folder.

The rules: its command's ``--help`` answers without importing anything heavy; a run writes its folder whole, with a
``manifest.json`` that says ``complete``, its declared tables and, where it has one, ``report.html``; a run that fails
before its folder is swapped in leaves the previous run as it was, with nothing of its own beside it; and on its command
line an ``--out`` of other files, one that holds an input of the run, or an earlier run folder that holds files the run did
not write, is refused in one line and left as it was. All but the first are skipped for a study that writes no run folder.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import SkipTest, mock

from bertology.core.storage.runfolder import RunFolder
from bertology.studies import Study

#: Top-level packages whose import ``--help`` must not pay for.
HEAVY_PACKAGES = ("torch", "transformers", "numpy", "pandas", "scipy", "sklearn", "statsmodels", "matplotlib", "spacy", "ray", "pyarrow")

#: What ``--help`` runs in a fresh interpreter: the study's module imported (it registers a study of the user's; bertology's
#: own are found anyway), then the command line, then the top-level packages imported by then.
_HELP_SCRIPT = """import importlib, sys
try:
    importlib.import_module({module!r})
except ImportError:
    pass
from bertology.studies import registered_studies
if {name!r} not in registered_studies():
    print('\\nUNREGISTERED')
    sys.exit(0)
sys.argv = ['bertology', {command!r}, '--help']
from bertology.cli import main
try:
    main()
except SystemExit:
    pass
print('\\nIMPORTED ' + ' '.join(sorted({{name.split('.')[0] for name in sys.modules}})))
"""


def check_help_imports_nothing_heavy(study: Study, **given) -> None:
    """``bertology NAME --help`` answers without importing any of :data:`HEAVY_PACKAGES` (run in a fresh interpreter, which
    imports the study's module first). Skipped for a study that importing its module does not register (one registered by a
    script or a notebook)."""
    script = _HELP_SCRIPT.format(module=type(study).__module__, name=study.name, command=study.name.replace("_", "-"))
    outcome = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert outcome.returncode == 0, f"study {study.name}: --help failed: {outcome.stderr[-2000:]}"
    if outcome.stdout.endswith("\nUNREGISTERED\n"):
        raise SkipTest(f"study {study.name} is not registered by importing its module {type(study).__module__}: its --help cannot be run afresh")
    assert "Usage:" in outcome.stdout, f"study {study.name}: --help printed no usage"
    imported = set(outcome.stdout.rsplit("IMPORTED ", 1)[1].split())
    heavy = sorted(imported & set(HEAVY_PACKAGES))
    assert not heavy, f"study {study.name}: --help imports {', '.join(heavy)}"


def _folder_check(check: Callable) -> Callable:
    """``check`` as a check of a study that writes a run folder (skipped for any other), into ``given["out"]`` or, where that
    is left out, a fresh temporary folder."""

    @functools.wraps(check)
    def checked(study: Study, **given) -> None:
        if study.writes != "folder":
            raise SkipTest(f"{study.name} writes {'one file' if study.writes == 'file' else 'nothing'}, not a run folder")
        if given.get("out") is not None:
            return check(study, given)
        with tempfile.TemporaryDirectory(prefix=f"bertology-check-{study.name}-") as folder:
            return check(study, {**given, "out": Path(folder) / "run"})

    return checked


def settings_with_defaults(study: Study, given: dict) -> dict:
    """Every option of ``study`` by name: the given value, else its default."""
    unknown = set(given) - {option.name for option in study.options}
    assert not unknown, f"study {study.name} has no options {sorted(unknown)}"
    return {option.name: given.get(option.name, option.default) for option in study.options}


@_folder_check
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


@_folder_check
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


@_folder_check
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


@_folder_check
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


@_folder_check
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


#: The study checks by rule: ``check(study, **given)``; all but the first need the study's small inputs (``given``).
STUDY_CHECKS: dict[str, Callable] = {
    "help_imports_nothing_heavy": check_help_imports_nothing_heavy,
    "folder_written_whole": check_folder_written_whole,
    "failed_run_keeps_previous": check_failed_run_keeps_previous,
    "out_of_other_files_refused": check_out_of_other_files_refused,
    "input_inside_out_refused": check_input_inside_out_refused,
    "foreign_files_kept": check_foreign_files_kept,
}

