"""Every `python -m hetero...` command does its job or does not exist: each module with a command line answers
--help with its usage, and every `-m hetero.X` the Makefile, the docs, the notebooks and the scripts name is one of
them (a command that moved leaves no dead name behind)."""
from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ROOT, clean_env

pytestmark = [pytest.mark.launch, pytest.mark.slow]  # one interpreter and torch import per command


def _commands() -> set[str]:
    """Modules with a command line: a __main__.py package, or a module guarding `if __name__ == "__main__"`."""
    out = set()
    for path in (ROOT / "hetero").rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name == "__main__.py":
            out.add(mod.rsplit(".", 1)[0])
        elif re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M):
            out.add(mod)
    return out


def _named() -> set[str]:
    names = set()
    for pattern in ("Makefile", "README.md", "docs/*.md", "notebooks/*.ipynb", "scripts/*", "examples/*.py",
                    ".ci/run"):
        for path in ROOT.glob(pattern):
            names |= set(re.findall(r"-m (hetero(?:\.[a-z_]+)+)", path.read_text()))
    return names


def test_every_command_named_anywhere_exists():
    commands, named = _commands(), _named()
    assert {"hetero.trainer", "hetero.lab.grid", "hetero.lab.bench"} <= commands
    assert named and named <= commands, f"named but not a command: {sorted(named - commands)}"


def test_every_command_answers_help():
    def run(mod: str) -> tuple[str, subprocess.CompletedProcess]:
        return mod, subprocess.run([sys.executable, "-m", mod, "--help"], cwd=ROOT, env=clean_env(threads="1"),
                                   capture_output=True, text=True, timeout=300)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, sorted(_commands())))
    for mod, p in results:
        assert p.returncode == 0, f"python -m {mod} --help exited {p.returncode}: {p.stderr[-800:]}"
        assert p.stdout.strip(), f"python -m {mod} --help printed nothing"
