"""The ``bertology`` command line: one command per registered study, its flags from the study's options.

The commands come from the study registry (:mod:`bertology.studies`). Every user error is printed as one line
(``error: ...``), exit 2.
"""

from __future__ import annotations

import errno
import gc
import importlib
import inspect
import sys
from pathlib import Path
from typing import Optional

import typer

from bertology.core.errors import BertologyError
from bertology.core.options import Option
from bertology.studies import Study, registered_studies

#: A disk (or a quota) that is full: a user's error to fix, said in one line.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def _plain(text: str) -> str:
    """Help text as written: typer reads its help as rich markup, where "[default: ...]" and "bertology[ray]" would vanish."""
    return text.replace("[", "\\[")


def _parameter(option: Option) -> inspect.Parameter:
    """An :class:`~bertology.core.options.Option` as a typer argument or option."""
    if option.argument:
        annotation = list[option.cli_type] if option.multiple else option.cli_type
        if not option.required:
            annotation = Optional[annotation]
        default = typer.Argument(... if option.required else None, help=_plain(option.help), show_default=False)
    elif option.multiple:
        annotation = Optional[list[str]]
        default = typer.Option(None, *option.cli_flag.split(), help=_plain(option.help) + " Repeat the flag for several.")
    else:
        annotation = option.cli_type if option.default is not None or option.required else Optional[option.cli_type]
        default = typer.Option(... if option.required else option.default, *option.cli_flag.split(), help=_plain(option.help),
                               min=option.minimum, max=option.maximum)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def check_out_before_parsing(study: Study, settings: dict) -> None:
    """Refuse, in one line, an ``--out`` that is or holds what the run reads, as the command line gives it: every option of
    type ``Path`` and every one that ``reads_files`` (a model given as text, ``--class NAME=words:FILE``), before the study
    parses its options into values that may name no path, and whatever the study's own code checks (a study of the user's
    too)."""
    from bertology.core.storage.runfolder import check_out  # here: --help imports nothing heavy

    inputs = [settings[option.name] for option in study.options if option.name != "out" and (option.reads_files or option.cli_type is Path)]
    check_out(settings["out"], inputs=inputs, work=study.work)


def import_libraries(study: Study) -> None:
    """Import the study's :attr:`~bertology.studies.Study.libraries` while the collector is paused, collect once (the
    cycles their imports left), freeze every object alive (``gc.freeze``: the modules, functions and classes of torch,
    transformers, scipy and pandas, which live until the process ends) and let the collector run again. Imported with the
    collector running, their objects set off seven full collections, each walking the heap as it grew (0.8 s of
    ``bertology analyze``'s 4.2 s of imports); and no later collection walks them again. Without the one collection, the
    frozen heap kept 300,000 dead objects and the run was no faster."""
    for name in study.libraries:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.enable()


def _command(app: typer.Typer, study: Study) -> None:
    """Add ``bertology NAME`` to ``app``: run the study with the values given, print its summary, and fail as it says."""

    def command(**settings) -> None:
        if not gc.isenabled():  # the console entry point paused the collector (main): the libraries come in first
            import_libraries(study)
        if study.writes == "folder" and settings.get("out") is not None:
            check_out_before_parsing(study, settings)
        result = study.run(settings, command=sys.argv)
        for line in study.summary(result, settings):
            typer.echo(line, err=line.startswith("warning: "))
        failure = study.failed(result)
        if failure is not None:
            raise BertologyError(failure)

    command.__signature__ = inspect.Signature([_parameter(option) for option in study.options])
    command.__doc__ = study.title
    app.command(study.name.replace("_", "-"))(command)


def build_app() -> typer.Typer:
    """The command line of every study registered now (a study registered after ``bertology.cli`` was imported gets its
    command in a new app)."""
    app = typer.Typer(help="What every attention head of an encoder or decoder does, and how sure we can be of it.", no_args_is_help=True,
                      add_completion=False, pretty_exceptions_enable=False)
    for study in registered_studies().values():
        _command(app, study)
    return app


app = build_app()


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit status 2.

    The garbage collector is paused until the command has imported its libraries (:func:`import_libraries`).

    Every object alive at the end is frozen (``gc.freeze``) before the interpreter exits: its last collection walked every
    object torch and transformers made, about a second of every command's time, to free memory the operating system
    takes back anyway (objects are still freed by their reference counts, and ``atexit`` handlers run as before)."""
    gc.disable()  # until the command's libraries are imported (import_libraries)
    try:
        app()
    except BertologyError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        typer.echo(f"error: {exc.strerror or 'no space left on the device'}{where}: free some space or write elsewhere; what this run had "
                   "begun to write was removed, and every earlier file is as it was", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    finally:
        gc.freeze()
        gc.enable()  # a command that never began (--help, a bad option) left it paused


if __name__ == "__main__":
    main()
