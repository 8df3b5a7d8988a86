"""User-facing errors: each renders as one line that says what is wrong and where."""

from __future__ import annotations

from pathlib import Path


class BertologyError(Exception):
    """An error caused by the user's input or settings; the CLI prints it as one line."""


class CorpusError(BertologyError):
    """A problem in an input file, located by file and (where known) line number.

    >>> str(CorpusError("data.tsv", 3, "expected 2 columns, found 1"))
    'data.tsv:3: expected 2 columns, found 1'
    """

    def __init__(self, path: str | Path, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class StateError(BertologyError):
    """A file bertology keeps or reads back (a resume state, a checkpoint, a classifier, track's parts) that is damaged
    or forged: refused in one line that names the file and what is wrong.

    >>> str(StateError("runs/a/resume/state.json", "missing key 'progress'"))
    "runs/a/resume/state.json: missing key 'progress'"
    """

    def __init__(self, path: str | Path, message: str):
        self.path = str(path)
        self.message = message
        super().__init__(f"{self.path}: {message}")


class ModelError(BertologyError):
    """A model could not be found, loaded, or does not expose attention."""


def one_line_error(error: Exception) -> str:
    """An error as one line: a user's error by its message, any other with its type in front."""
    message = " ".join(str(error).split())
    return message if isinstance(error, BertologyError) else f"{type(error).__name__}: {message}"
