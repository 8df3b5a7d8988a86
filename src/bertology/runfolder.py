"""The run folder: tidy tables (CSV and Parquet), figures, report and manifest, written atomically.

Every file is written to a temporary name in the same folder and renamed into place, so a
crashed run never leaves a half-written table that looks complete. ``manifest.json`` is written
last and says whether the run finished.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(temporary_path)``, then rename the temporary file to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


class RunFolder:
    """A folder that receives one run's outputs."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def write_table(self, name: str, table: pd.DataFrame) -> tuple[Path, Path]:
        """``name.csv`` and ``name.parquet``."""
        csv = atomic_write(self.path / f"{name}.csv", lambda p: table.to_csv(p, index=False))
        parquet = atomic_write(self.path / f"{name}.parquet", lambda p: table.to_parquet(p, index=False))
        return csv, parquet

    def write_json(self, name: str, data: dict) -> Path:
        return atomic_write(self.path / name, lambda p: p.write_text(json.dumps(data, indent=2, default=str) + "\n"))

    def write_text(self, name: str, text: str) -> Path:
        return atomic_write(self.path / name, lambda p: p.write_text(text, encoding="utf-8"))

    def write_figure(self, name: str, figure) -> Path:
        """Save a matplotlib figure as ``name.png`` and close it."""
        import matplotlib.pyplot as plt

        try:
            return atomic_write(self.path / f"{name}.png", lambda p: figure.savefig(p, format="png", dpi=110, bbox_inches="tight"))
        finally:
            plt.close(figure)
