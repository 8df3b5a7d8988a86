"""The layering is a test: core below render below families below studies below the API and the command line (the checks on
top), with no exception listed, every module of the package in a layer, and ruff (import order included) clean."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def contract(number: int = 0) -> dict:
    """The package's layers (0), and inside core its rooms' (1)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][number]


def layered_names(layers: dict) -> set[str]:
    return {name.strip() for layer in layers["layers"] for name in layer.split("|")}


def rooms(package: Path, prefix: str) -> set[str]:
    """The modules and subpackages of ``package``, as ``prefix.name``."""
    modules = {f"{prefix}.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__"}
    return modules | {f"{prefix}.{path.name}" for path in package.iterdir() if (path / "__init__.py").is_file()}


def tool(name: str) -> str:
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return str(found)


def test_the_layers_contract_lists_no_exception_and_every_module_of_the_package():
    layers = contract()
    assert layers["type"] == "layers" and "ignore_imports" not in layers and "unmatched_ignore_imports_alerting" not in layers
    named = layered_names(layers)
    modules = rooms(ROOT / "src" / "bertology", "bertology")
    assert modules == named, f"modules in no layer: {sorted(modules - named)}; layers naming nothing: {sorted(named - modules)}"


def test_nothing_imports_upward():
    done = subprocess.run([tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "2 kept, 0 broken" in done.stdout, done.stdout[-3000:]


def test_the_layers_contract_catches_an_upward_import(tmp_path):
    """A copy of the package where core imports a study breaks the contract."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "bertology", copy / "bertology", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "bertology" / "core" / "upward.py").write_text("from bertology.studies import Study\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    done = subprocess.run([tool("lint-imports"), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(copy), "PATH": ""})
    assert done.returncode != 0 and "bertology.core.upward -> bertology.studies" in done.stdout, done.stdout[-3000:]


def test_core_is_rooms_in_layers_each_module_in_one():
    """Core is split into rooms (the model, the maps' measures, text, statistics, storage, learning) under the pass, with no
    exception listed and every module and room of core in a layer."""
    layers = contract(1)
    assert layers["type"] == "layers" and layers["containers"] == ["bertology.core"] and "ignore_imports" not in layers
    named = {f"bertology.core.{name}" for name in layered_names(layers)}
    assert rooms(ROOT / "src" / "bertology" / "core", "bertology.core") == named
    assert len(list((ROOT / "src" / "bertology" / "core").glob("*.py"))) <= 8, "core's top holds the pass, its contract and the errors"


def test_the_core_contract_catches_storage_importing_the_model(tmp_path):
    """A copy of the package where a run folder imports the model breaks the contract inside core."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "bertology", copy / "bertology", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "bertology" / "core" / "storage" / "upward.py").write_text("from bertology.core.model import models\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    done = subprocess.run([tool("lint-imports"), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(copy), "PATH": ""})
    assert done.returncode != 0 and "bertology.core.storage.upward -> bertology.core.model" in done.stdout, done.stdout[-3000:]


def test_ruff_with_import_sorting_passes():
    done = subprocess.run([tool("ruff"), "check", "src", "tests", "bench", "tools"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "I" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["select"]
