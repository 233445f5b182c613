"""--help, make help and the docs' flag table (docs/cli.md) come from one source (the Config fields' metadata);
make lab keeps --allow-root as root; the Jupyter kernel lives in the venv and papermill uses it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from hetero.core.partition import SCHEMES
from hetero.trainer.cli import build_parser, flag_help, flag_table
from hetero.trainer.config import Config
from hetero.trainer.models import MODELS

from helpers import ROOT


def test_every_flag_has_help_with_its_default_and_choices():
    text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    for f in fields(Config):
        assert f.metadata.get("help"), f"{f.name}: no help in the field's metadata"
        assert f"--{f.name.replace('_', '-')}" in text and " ".join(flag_help(f.name).split()) in text
    assert "choices: sync, dp, edp, affine; default: edp" in flag_help("scheme")
    assert "default: 256)" in flag_help("global_batch") and "choices: true, false; default: false" in flag_help("bf16")
    assert 'default: "")' in flag_help("hetero")


def test_choices_match_what_validation_accepts():
    meta = {f.name: f.metadata["choices"] for f in fields(Config)}
    assert sorted(meta["model"]) == sorted(MODELS) and list(meta["scheme"]) == list(SCHEMES)
    for name, values in meta.items():
        for v in values:
            Config(**{name: v})  # each listed choice is accepted
        if values:
            with pytest.raises(ValueError):
                Config(**{name: "not-a-choice"})


def test_docs_flag_table_is_the_generated_one():
    page = (ROOT / "docs" / "cli.md").read_text()
    assert flag_table(markdown=True) in page, "regenerate it: python -m hetero.trainer.cli --markdown"


# the cases that launch processes
def _make(*args: str) -> str:
    # -n: print the recipes only; a venv that does not exist, so nothing would be installed either
    p = subprocess.run(["make", "-n", "--no-print-directory", *args, "VENV=/nonexistent-venv",
                        f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.launch
def test_help_through_the_command_line():
    p = subprocess.run([sys.executable, "-m", "hetero.trainer", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "--global-batch GLOBAL_BATCH" in p.stdout and "samples per step" in p.stdout


@pytest.mark.launch
def test_make_help_lists_every_field_with_its_help():
    p = subprocess.run(["make", "--no-print-directory", "help", "VENV=/nonexistent-venv", f"PYTHON={sys.executable}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for f in fields(Config):
        assert f"{f.name.upper()} " in p.stdout and flag_help(f.name) in p.stdout
    listed = re.search(r"^FIELDS := ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert set(listed.replace("\\", " ").split()) == {f.name.upper() for f in fields(Config)}  # every flag a variable


@pytest.mark.launch
def test_lab_adds_its_arguments_to_allow_root_and_kernel_is_the_venvs():
    lab = [ln for ln in _make("lab", "LAB_ARGS=--no-browser").splitlines() if "jupyter lab" in ln]
    assert len(lab) == 1 and "--no-browser" in lab[0]
    assert ("--allow-root" in lab[0]) == (os.geteuid() == 0)
    out = _make("install", "grid")
    assert "ipykernel install --sys-prefix --name hetero" in out and "--user" not in out
    assert "papermill -k hetero " in out
