"""One name per knob: Config's fields are the CLI flags, the Makefile's variables and the grid notebook's
parameters, spelled the same way in each (`global_batch`, `--global-batch`, `GLOBAL_BATCH=`).
Here the cases that launch processes; those in one process: tests/unit/test_names.py."""
from __future__ import annotations

import ast
import shutil
import subprocess
from dataclasses import fields

import nbformat
import pytest

from hetero.lab.grid import GRID_KEYS, PARAMETERS
from hetero.lab.launch import ROOT
from hetero.trainer.config import Config

CONFIG = {f.name for f in fields(Config)}


def _make_variable(name: str) -> list[str]:
    """The words of a Makefile variable, as make expands it (no target runs, nothing is installed)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    p = subprocess.run(["make", "-s", "--no-print-directory", "--eval", f"print-var: ; @echo $({name})", "print-var"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_makefile_fields_are_configs_fields():
    assert {v.lower() for v in _make_variable("FIELDS")} == CONFIG
    # a Make setting (NPROC, GRID, ...) never shadows a field
    assert not {v.lower() for v in _make_variable("SETTINGS")} & CONFIG


def test_grid_notebook_parameters_are_configs_fields_or_grid_keys():
    nb = nbformat.read(ROOT / "notebooks" / "grid.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    names = {t.id for n in ast.parse(cell.source).body if isinstance(n, ast.Assign) for t in n.targets}
    assert set(GRID_KEYS) <= names and names - set(GRID_KEYS) <= CONFIG
    assert set(PARAMETERS) == set(GRID_KEYS) | CONFIG and not set(GRID_KEYS) & CONFIG
    # the grid keys that make passes on are spelled as make's settings
    assert {k.upper() for k in GRID_KEYS if k != "runs_root"} <= set(_make_variable("SETTINGS"))
