"""hetero.lab.launch.root(): the folder runs/ and notebooks/ start from, for a checkout and for an installed copy
(issue 33: it assumed a checkout around the package). Each case imports a copy of the package in a fresh python."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.lab import launch

PROBE = "from hetero.lab.launch import from_root; print(from_root('runs'))"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A copy of the package alone in a site-packages-like folder (no pyproject.toml beside it)."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(launch.SOURCE / "hetero", site / "hetero", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _probe(site: Path, cwd: Path, extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), **(extra or {})}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_an_installed_copy_outside_a_checkout_says_so_in_one_line(installed, tmp_path):
    p = _probe(installed, tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith("hetero: error: no hetero checkout holds") and "HETERO_ROOT" in lines[0]


def test_an_installed_copy_finds_the_checkout_around_the_current_folder(installed, tmp_path):
    checkout = tmp_path / "work"
    (checkout / "hetero").mkdir(parents=True)
    (checkout / "hetero" / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text('[project]\nname = "hetero"\n')
    (checkout / "notebooks").mkdir()
    p = _probe(installed, checkout / "notebooks")  # a notebook's kernel starts in notebooks/
    assert p.returncode == 0 and p.stdout.strip() == str((checkout / "runs").resolve()), p.stderr


def test_hetero_root_is_the_explicit_setting(installed, tmp_path):
    (tmp_path / "mine").mkdir()
    p = _probe(installed, tmp_path, {"HETERO_ROOT": str(tmp_path / "mine")})
    assert p.returncode == 0 and p.stdout.strip() == str((tmp_path / "mine" / "runs").resolve()), p.stderr
    p = _probe(installed, tmp_path, {"HETERO_ROOT": str(tmp_path / "none")})
    assert p.returncode == 1 and p.stderr.strip() == f"hetero: error: HETERO_ROOT={tmp_path / 'none'} is not a folder"


def test_this_checkout_is_its_own_root_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert launch.root() == launch.SOURCE and launch.from_root("runs") == launch.SOURCE / "runs"
