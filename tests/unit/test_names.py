"""One name per knob: Config's fields are the CLI flags, the Makefile's variables and the grid notebook's
parameters, spelled the same way in each (`global_batch`, `--global-batch`, `GLOBAL_BATCH=`).
Here the cases in one process; those that launch processes: tests/integration/test_names_launch.py."""
from __future__ import annotations

from dataclasses import fields

from hetero.lab.launch import ROOT
from hetero.trainer.cli import build_parser
from hetero.trainer.config import Config

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
