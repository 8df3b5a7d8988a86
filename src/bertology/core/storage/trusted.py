"""The modules outside bertology whose classes a saved analyzer state may name (:mod:`bertology.core.storage.states`).

The family registry adds each registered family's module (a user's family is already running in the process). This
module imports nothing, so that declaring a family stays cheap.
"""

from __future__ import annotations

trusted_modules: set[str] = set()


def trust_module(name: str) -> None:
    """Let saved states name classes of module ``name``."""
    trusted_modules.add(name)
