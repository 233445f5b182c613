"""--help, make help and the docs' flag table (docs/cli.md) come from one source (the Config fields' metadata);
make lab keeps --allow-root as root; the Jupyter kernel lives in the venv and papermill uses it.
Here the cases that launch processes; those in one process: tests/unit/test_cli_help.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields

from hetero.lab.launch import ROOT
from hetero.trainer.cli import flag_help
from hetero.trainer.config import Config


def _make(*args: str) -> str:
    # -n: print the recipes only; a venv that does not exist, so nothing would be installed either
    p = subprocess.run(["make", "-n", "--no-print-directory", *args, "VENV=/nonexistent-venv",
                        f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_help_through_the_command_line():
    p = subprocess.run([sys.executable, "-m", "hetero.trainer", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "--global-batch GLOBAL_BATCH" in p.stdout and "samples per step" in p.stdout


def test_make_help_lists_every_field_with_its_help():
    p = subprocess.run(["make", "--no-print-directory", "help", "VENV=/nonexistent-venv", f"PYTHON={sys.executable}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for f in fields(Config):
        assert f"{f.name.upper()} " in p.stdout and flag_help(f.name) in p.stdout
    listed = re.search(r"^FIELDS := ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert set(listed.replace("\\", " ").split()) == {f.name.upper() for f in fields(Config)}  # every flag a variable


def test_lab_adds_its_arguments_to_allow_root_and_kernel_is_the_venvs():
    lab = [ln for ln in _make("lab", "LAB_ARGS=--no-browser").splitlines() if "jupyter lab" in ln]
    assert len(lab) == 1 and "--no-browser" in lab[0]
    assert ("--allow-root" in lab[0]) == (os.geteuid() == 0)
    out = _make("install", "grid")
    assert "ipykernel install --sys-prefix --name hetero" in out and "--user" not in out
    assert "papermill -k hetero " in out
