"""Shared test helpers: run the real command line (python -m hetero.train, under torchrun) in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hetero.launch import ROOT, clean_env, torchrun_cmd

CIFAR_JPG = ROOT.parent / "shared" / "data" / "cifar10-jpg"

# Small, fast defaults for CPU runs: tiny model, synthetic data, no augmentation noise in timing.
TINY = ["--model", "tiny", "--data", "synthetic", "--subset", "2048", "--test-subset", "512",
        "--global-batch", "128", "--epochs", "2"]


def _env() -> dict[str, str]:
    return clean_env(threads=os.environ.get("OMP_NUM_THREADS", "1"))


def run_train(args: list[str], nproc: int = 1, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m hetero.train ARGS` (nproc=0) or `torchrun --standalone --nproc-per-node=N -m hetero.train ARGS`."""
    cmd = [sys.executable, "-m", "hetero.train", *args] if nproc == 0 else torchrun_cmd(nproc, args)
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n"
                             f"--- stderr\n{p.stderr[-6000:]}")
    return p


def read_run(run_dir: Path) -> dict:
    """The run folder's tables and JSON files."""
    out = {t: pd.read_csv(run_dir / f"{t}.csv") for t in ("epochs", "ranks", "steps")}
    out["summary"] = json.loads((run_dir / "summary.json").read_text())
    out["config"] = json.loads((run_dir / "config.json").read_text())
    return out


@pytest.fixture
def env() -> dict[str, str]:
    return _env()
