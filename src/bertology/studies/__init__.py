"""Studies: the registry of bertology's commands, one study each, and how a user adds their own.

A study is one room, ``bertology/studies/<name>/``, whose :class:`Study` subclasses declare in its ``__init__.py``:
each command's ``name`` and ``title`` (its help), its ``options`` (the shared groups of :mod:`bertology.core.options`
and its own, help included), what it runs (:meth:`Study.run`, which writes the run folder through
:func:`~bertology.core.storage.runfolder.complete_run`), the tables it writes (``outputs``) and the lines it prints
(:meth:`Study.summary`). ``bertology.cli`` generates a command for every registered study; users add their own
with :func:`register_study`, as they add families with :func:`~bertology.families.register_family`.

Declaring a study imports nothing heavy: a study imports its work inside :meth:`Study.run`, so that
``bertology --help`` answers at once.
"""

from __future__ import annotations

import datetime as dt
import importlib
import keyword
import pkgutil
import re
from pathlib import Path
from typing import Any, ClassVar

from bertology.core.errors import BertologyError
from bertology.core.options import TASK, Option

#: The room whose commands ``bertology --help`` lists first (the analysis families' own follow it); the other rooms, every
#: package in this folder, follow in alphabetical order: adding a study is adding its folder.
FIRST_ROOM = "analyze"
#: What a study's command writes: a run folder (whole, with ``manifest.json``), one file, or nothing.
WRITES = ("folder", "file", "nothing")


class Study:
    """A command of bertology (see the module docstring). Subclasses set the class attributes and implement :meth:`run`.

    ``outputs``: the tables (``NAME.csv`` and ``NAME.parquet``) a run always writes; ``optional_outputs``: those it
    writes only when asked (``prune --prune-to``) or when the data allow (``track``'s emergence needs three
    checkpoints); ``writes``: one of :data:`WRITES`; ``report``: the run folder holds ``report.html``; ``work``: the folder
    inside ``out`` where a run keeps the work it resumes from as it goes (:data:`bertology.core.storage.runfolder.WORK_FOLDERS`);
    ``libraries``: what its run imports that takes long.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ()
    optional_outputs: ClassVar[tuple[str, ...]] = ()
    writes: ClassVar[str] = "folder"
    report: ClassVar[bool] = True
    work: ClassVar[str | None] = None
    #: The modules its run imports that take long (torch, transformers, scipy, pandas and what imports them): the command
    #: line imports them first, with the garbage collector paused (:func:`bertology.cli.main`).
    libraries: ClassVar[tuple[str, ...]] = ()

    def run(self, settings: dict, command: list[str] | None = None) -> Any:
        """Do the work with ``settings`` (every option by name, the given value or its default) and write the output;
        return the result :meth:`summary` reads. Where ``out`` was left out, the study puts the folder it chose in
        ``settings["out"]``; ``command`` is the command line the manifest records."""
        raise NotImplementedError

    def summary(self, result: Any, settings: dict) -> list[str]:
        """Lines the command line prints after a run (``warning: ...`` lines go to stderr)."""
        return []

    def failed(self, result: Any) -> str | None:
        """What failed in a run that still wrote its output (the command then exits with this error), else None."""
        return None


def model_label(model: str | Path | None) -> str:
    """A model's name fit for a folder name (the bundled model's when None)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name if model else "all-MiniLM-L6-v2")


def default_out(command: str, model: str | None, corpus: str | Path | None) -> Path:
    """``runs/COMMAND-MODEL-CORPUS-TIME``: a run folder name nobody has to think of."""
    name = model_label(model)
    corpus_name = Path(corpus).stem if corpus else "sample"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{command}-{name}-{corpus_name}-{stamp}"


def read_task(settings: dict, also: tuple = (), work: str | None = None):
    """The task of a study's ``TASK`` options (:data:`bertology.core.options.TASK`), read after ``out`` is checked (when
    given) against the task's files, the model and ``also``: replacing ``out`` must not delete an input."""
    from bertology.core.learning.tasks import load_task
    from bertology.core.storage.runfolder import check_out

    if settings["out"] is not None:
        check_out(settings["out"], inputs=(settings["task"], settings["train"], settings["dev"], settings["model"], *also), work=work)
    return load_task(settings["task"], **{option.name: settings[option.name] for option in TASK if not option.argument})


_registry: dict[str, Study] = {}


def register_study(study: Study, *, replace: bool = False) -> Study:
    """Add ``study`` (an instance of a :class:`Study` subclass) to the registry and return it; its command is ``bertology NAME``.

    Its name must be a Python identifier (``_`` becomes ``-`` on the command line), its option names unique within it,
    and ``writes`` one of :data:`WRITES`. ``replace=True`` swaps in a new definition under a registered name."""
    name = getattr(study, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise BertologyError(f"a study needs a name that is a Python identifier, not {name!r}")
    if name in _registry and not replace:
        raise BertologyError(f"a study named {name!r} is registered already (replace=True swaps it)")
    names = [option.name for option in study.options]
    repeated = sorted({option for option in names if names.count(option) > 1})
    if repeated:
        raise BertologyError(f"study {name!r}: options given twice: {', '.join(repeated)}")
    if study.writes not in WRITES:
        raise BertologyError(f"study {name!r}: writes is one of {', '.join(WRITES)}, not {study.writes!r}")
    _registry[name] = study
    return study


def registered_studies() -> dict[str, Study]:
    """Every registered study by command name: bertology's own first (in the order of ``--help``), then the users'."""
    rooms = sorted((module.name for module in pkgutil.iter_modules(__path__) if module.ispkg), key=lambda room: (room != FIRST_ROOM, room))
    for room in rooms:
        importlib.import_module(f"{__name__}.{room}")
    return dict(_registry)


def get_study(name: str) -> Study:
    known = registered_studies()
    if name not in known:
        raise BertologyError(f"unknown study {name!r}: choose from {', '.join(known)}")
    return known[name]
