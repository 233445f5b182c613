"""Lightning's own launcher (`python script.py` with devices=2 and strategy ddp or ddp_spawn) sets neither RANK nor,
when the callback is built, WORLD_SIZE: the Balance must learn its rank and world from the trainer, never train on
duplicated data, and move the shares as under torchrun. A tiny model on 8-vectors, 2 CPU processes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetero.lab.launch import clean_env

from helpers import ROOT

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
pytestmark = pytest.mark.slow  # three Lightning launches, about 15 s each on 2 quiet cores
SCRIPT = ROOT / "tests" / "scripts" / "lightning_inside.py"


@pytest.mark.parametrize("how", [[], ["--inside"], ["--spawn"]], ids=["ddp", "built-in-the-processes", "ddp_spawn"])
def test_lightnings_own_launcher_covers_every_sample_and_moves_shares(tmp_path, how):
    out = tmp_path / "rec"
    p = subprocess.run([sys.executable, str(SCRIPT), str(out), *how], cwd=tmp_path, env=clean_env(threads="1"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1"):
        seen = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(seen) == list(range(256)), f"epoch {epoch}: not every sample exactly once"
    d = ranks[0]["decisions"]
    assert d == ranks[1]["decisions"] and len(d) == 8            # every 2 of 8 steps, 2 epochs, on both ranks alike
    assert d[-1]["sizes"][0] > d[-1]["sizes"][1]                # the 3x slower rank 1 gives work away
