"""docs/quickstart.md as a reader runs it: its script makes the ImageFolder of random images, then its two torchrun
commands run (2 CPU ranks, gloo) from that folder, as written. The baseline splits every step 32/32; on hetero, with
rank 1 emulated 3x slower, every step's sizes still sum to the global batch of 64 and the fast rank 0 ends with
more of it."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, clean_env

# two launches of the example: 6.4 min on 2 cores under a load average of 14
pytestmark = [pytest.mark.launch, pytest.mark.slow]

PAGE = (ROOT / "docs" / "quickstart.md").read_text()
BASH = re.findall(r"```bash\n(.*?)```", PAGE, re.S)


def _script() -> str:
    block = next(b for b in BASH if "<<'PY'" in b)
    return block.split("<<'PY'\n", 1)[1].split("\nPY", 1)[0]


def _commands() -> list[list[str]]:
    block = next(b for b in BASH if b.startswith("torchrun"))
    lines = block.replace("\\\n", " ").splitlines()
    return [[sys.executable, "-m", "torch.distributed.run", *shlex.split(ln)[1:]] for ln in lines if ln.strip()]


def _run(cmd: list[str], cwd) -> str:
    cmd = [str(ROOT / a) if a.startswith("examples/") else a for a in cmd]
    p = subprocess.run(cmd, cwd=cwd, env=clean_env(threads="1"), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p.stdout


def test_the_quickstart_runs_as_written(tmp_path):
    subprocess.run([sys.executable, "-c", _script()], cwd=tmp_path, check=True, timeout=300)
    assert len(list((tmp_path / "data" / "tiny" / "train").rglob("*.png"))) == 512
    baseline, balanced = _commands()
    assert "examples/plain_torch_baseline.py" in baseline and "examples/plain_torch.py" in balanced
    epochs = re.findall(r"^epoch \d+: train loss [\d.]+ \((\d+) samples on rank 0\)$", _run(baseline, tmp_path), re.M)
    assert epochs == ["256"] * 3  # 8 steps of 32 on rank 0
    out = _run(balanced, tmp_path)
    sizes = [(int(a), int(b)) for a, b in re.findall(r"^epoch \d+: .*batch sizes \[(\d+), (\d+)\]$", out, re.M)]
    assert len(sizes) == 3 and all(a + b == 64 for a, b in sizes), out
    assert sizes[-1][0] > sizes[-1][1], out  # the fast rank 0 has the larger part of the step
