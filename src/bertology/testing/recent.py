"""What the checks made last (a family's run, an analyzer's contract), kept so that the checks of one object share it."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class Recent:
    """A memo of the last ``size`` values by key: the checks of one object run one after another (as their test ids are
    ordered), so a few suffice, and memory stays bounded over a long test session."""

    def __init__(self, size: int = 8):
        self.size, self.values = size, {}

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value kept for ``key``, else ``make()``, kept in place of the oldest."""
        if key not in self.values:
            self.values[key] = make()
            while len(self.values) > self.size:
                del self.values[next(iter(self.values))]
        return self.values[key]
