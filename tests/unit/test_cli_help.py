"""--help, make help and the docs' flag table (docs/cli.md) come from one source (the Config fields' metadata);
make lab keeps --allow-root as root; the Jupyter kernel lives in the venv and papermill uses it.
Here the cases in one process; those that launch processes: tests/integration/test_cli_help_launch.py."""
from __future__ import annotations

from dataclasses import fields

import pytest

from hetero.core.partition import SCHEMES
from hetero.lab.launch import ROOT
from hetero.trainer.cli import build_parser, flag_help, flag_table
from hetero.trainer.config import Config
from hetero.trainer.models import MODELS


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
