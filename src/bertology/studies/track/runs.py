"""One run per series: ``bertology pretrain`` writes its run's identity into every checkpoint's ``pretraining_step.json``
(``run``: a random ``id``, the ``seed`` and a digest of the ``recipe``, :func:`~bertology.studies.pretrain.training.run_identity`),
and ``track`` refuses checkpoints of two runs, two seeds of one recipe among them, as one series (:func:`check_one_run`).
Checkpoints that name no run (written before runs had an identity, a Trainer's, a hub model's) are taken as they are."""

from __future__ import annotations

from pathlib import Path

from bertology.core.errors import BertologyError
from bertology.core.storage.safeload import field, read_json

#: The file ``bertology pretrain`` writes into each checkpoint, and the key of the run's identity in it.
MARKER, RUN = "pretraining_step.json", "run"


def run_identity_of(checkpoint: str) -> dict | None:
    """The run identity ``checkpoint``'s :data:`MARKER` names (``id``, ``seed``, ``recipe``); None where it has no such file or
    the file names no run. A damaged one is refused in one line naming the file."""
    path = Path(checkpoint) / MARKER
    if not path.is_file():
        return None
    document = read_json(path)
    if not isinstance(document, dict) or RUN not in document:
        return None
    identity = field(document, RUN, dict, path)
    for key, kind in (("id", str), ("seed", int), ("recipe", str)):
        field(identity, key, kind, f"{path} ({RUN!r})")
    return identity


def check_one_run(checkpoints: list[str]) -> None:
    """Refuse checkpoints that name two runs (:func:`run_identity_of`) before any of them runs: the first that names another run
    than the first checkpoint that names one, in one line naming both folders and the two runs."""
    named = [(checkpoint, identity) for checkpoint in checkpoints if (identity := run_identity_of(checkpoint)) is not None]
    if not named:
        return
    (first, expected), *others = named
    for checkpoint, identity in others:
        if identity != expected:
            raise BertologyError(f"{checkpoint}: not of one run with {first}: its {MARKER} names run {_named(identity)}, not "
                                 f"{_named(expected)}; track the checkpoints of one run")


def _named(identity: dict) -> str:
    """A run identity in words: ``1f2e3d4c5b6a (seed 1, recipe 0a1b2c3d4e5f6a7b)``."""
    return f"{identity['id'][:12]} (seed {identity['seed']}, recipe {identity['recipe']})"
