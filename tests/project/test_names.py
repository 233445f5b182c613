"""One name per knob: Config's fields are the CLI flags, the Makefile's variables and the grid notebook's
parameters, spelled the same way in each (`global_batch`, `--global-batch`, `GLOBAL_BATCH=`)."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
from dataclasses import fields

import nbformat
import pytest

from hetero.lab.grid import GRID_KEYS, PARAMETERS
from hetero.trainer.cli import build_parser
from hetero.trainer.config import Config

from helpers import ROOT

CONFIG = {f.name for f in fields(Config)}


def test_cli_flags_are_configs_fields():
    flags = {s for a in build_parser()._actions for s in a.option_strings if s not in ("-h", "--help")}
    assert flags == {"--" + name.replace("_", "-") for name in CONFIG}


def test_the_api_pages_module_map_names_every_module_and_only_files_that_exist():
    text = (ROOT / "docs" / "api.md").read_text()  # the one module map; the README links to it
    table = next(p for p in text[text.index("## Modules"):].split("\n\n") if p.startswith("| path"))
    named = set()
    for line in table.splitlines()[2:]:
        cells = line.split("|")[1].replace("`", "").split(",")
        folder = cells[0].strip().rsplit("/", 1)[0] + "/" if "/" in cells[0].strip().rstrip("/") else ""
        named |= {c.strip() if "/" in c else folder + c.strip() for c in cells}
    assert all((ROOT / n).exists() for n in named if not n.startswith("runs")), named
    modules = {str(p.relative_to(ROOT)) for d in ("hetero", "scripts") for p in (ROOT / d).rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert modules <= named, modules - named


def test_the_docs_example_diffs_are_the_examples_diffs():
    import importlib.util
    spec = importlib.util.spec_from_file_location("example_diffs", ROOT / "scripts" / "example_diffs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        assert mod.regenerate(text) == text, f"{page.name}: stale example diff (run python scripts/example_diffs.py)"
    assert mod.NAMED.search((ROOT / "docs" / "quickstart.md").read_text())  # the check can see a named diff


# issue 46: names that moved (docs/api.md#migrating). A page or example still teaching one would send a user to an
# AttributeError or to a private field; only the migration table may name them.
GONE = re.compile(r"bal\.size\b|bal\.global_step|\bengine\.(set_weight|mark_backward|begin|end|sync_now|step|fsdp|plan|"
                  r"fingerprint)\b|\bwatch\(|ckpt\.(epoch|step)\b|\.resume\(bal, ")


def _teaching(text: str) -> str:
    """A page's text less its migration table (the one place that names the old spellings)."""
    if "## Migrating from 0.1" not in text:
        return text
    head, rest = text.split("## Migrating from 0.1", 1)
    return head + (rest[rest.index("\n## "):] if "\n## " in rest else "")


def test_no_page_or_example_teaches_a_name_that_moved():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files for m in GONE.finditer(_teaching(p.read_text()))]
    assert not found, found
    assert GONE.search(_teaching((ROOT / "docs" / "api.md").read_text())) is None  # the table itself is left out
    assert GONE.search((ROOT / "docs" / "api.md").read_text())  # ... and the check sees the names it lists


# the cases that launch processes
def _make_variable(name: str) -> list[str]:
    """The words of a Makefile variable, as make expands it (no target runs, nothing is installed)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    p = subprocess.run(["make", "-s", "--no-print-directory", "--eval", f"print-var: ; @echo $({name})", "print-var"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


@pytest.mark.launch
def test_makefile_fields_are_configs_fields():
    assert {v.lower() for v in _make_variable("FIELDS")} == CONFIG
    # a Make setting (NPROC, GRID, ...) never shadows a field
    assert not {v.lower() for v in _make_variable("SETTINGS")} & CONFIG


@pytest.mark.launch
def test_grid_notebook_parameters_are_configs_fields_or_grid_keys():
    nb = nbformat.read(ROOT / "notebooks" / "grid.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    names = {t.id for n in ast.parse(cell.source).body if isinstance(n, ast.Assign) for t in n.targets}
    assert set(GRID_KEYS) <= names and names - set(GRID_KEYS) <= CONFIG
    assert set(PARAMETERS) == set(GRID_KEYS) | CONFIG and not set(GRID_KEYS) & CONFIG
    # the grid keys that make passes on are spelled as make's settings
    assert {k.upper() for k in GRID_KEYS if k != "runs_root"} <= set(_make_variable("SETTINGS"))
