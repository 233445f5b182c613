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


def test_a_fit_resumed_from_a_mid_epoch_checkpoint_keeps_the_slow_ranks_share_and_its_coverage(tmp_path):
    """BalanceCallback's state_dict is the Balance's: stopped at step 11 (3 steps into epoch 1) and resumed with
    trainer.fit(ckpt_path=...), the resumed run's first step already gives the 3x slower rank 1 less than half
    (no reset to an even split), and epoch 1's steps before and after the checkpoint consume each sample once."""
    script, out, folder = ROOT / "tests" / "scripts" / "lightning_resume.py", tmp_path / "rec", tmp_path / "ckpt"
    for phase in ("first", "again"):
        p = subprocess.run([sys.executable, str(script), str(out), str(folder), phase], cwd=tmp_path,
                           env=clean_env(threads="1"), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
    first, again = ([json.loads((tmp_path / f"rec.{ph}.rank{r}.json").read_text()) for r in range(2)]
                    for ph in ("first", "again"))
    assert sorted(first[0]["seen"]["0"] + first[1]["seen"]["0"]) == list(range(256))   # epoch 0, all of it
    epoch1 = [i for run in (first, again) for r in run for i in r["seen"].get("1", [])]
    assert sorted(epoch1) == list(range(256)), "epoch 1 across the resume: not every sample exactly once"
    assert again[0]["first"]["epoch"] == 1 and again[0]["first"]["batch_idx"] == 3     # goes on at its step
    sizes = again[0]["first"]["sizes"]
    assert sizes == again[1]["first"]["sizes"] and sizes[1] < sizes[0]               # the estimate came back
