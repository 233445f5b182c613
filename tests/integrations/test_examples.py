"""The examples under torchrun on 2 CPU ranks (gloo), real images, 2 DataLoader workers, rank 1 emulated 3x slower
and rebalancing every 2 steps mid-epoch: every sample of each epoch is consumed exactly once across the ranks, and
the shares move to the fast rank. (The exact EDP gradient is proved in tests/core/test_balance.py.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import CIFAR_JPG, ROOT, clean_env

pytestmark = pytest.mark.slow  # the examples under torchrun and under Lightning's own launcher

needs_images = pytest.mark.skipif(
    not (CIFAR_JPG / "train").is_dir(),
    reason=f"the CIFAR-10 JPEG images are not at {CIFAR_JPG} (see docs/getting-started.md, Tests)")
SUBSET, B = 192, 32
ARGS = ["--data", str(CIFAR_JPG / "train"), "--subset", str(SUBSET), "--size", "16", "--global-batch", str(B),
        "--epochs", "2", "--workers", "2", "--hetero", "1:slowdown=3,1:delay=0.05", "--rebalance-every", "2"]


def _launch(script: str, tmp_path, own_launcher: bool = False) -> list[dict]:
    """Under torchrun, or (own_launcher) as `python script --devices 2 --cpu`: Lightning's own launcher."""
    run = [str(ROOT / "examples" / script), "--devices", "2", "--cpu"] if own_launcher else [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ROOT / "examples" / script)]
    cmd = [sys.executable, *run, *ARGS, "--record", str(tmp_path / "rec")]
    p = subprocess.run(cmd, cwd=ROOT, env=clean_env(threads="1"), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{script} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [json.loads((tmp_path / f"rec.rank{r}.json").read_text()) for r in range(2)]


def _check(ranks: list[dict]) -> None:
    for epoch in ("0", "1"):
        seen = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(seen) == list(range(SUBSET)), f"epoch {epoch}: not every sample exactly once"
    d = ranks[0]["decisions"]
    assert d == ranks[1]["decisions"] and len(d) >= 4          # mid-epoch decisions, the same on both ranks
    # the fast rank 0 gets more once the loader workers have started (their start-up, on the same cores, may
    # hide the slowdown from the first window), and about 3/4 at the end (1/2 at the start)
    assert all(x["sizes"][0] > x["sizes"][1] for x in d[len(d) // 2:])
    assert d[-1]["shares"][0] > 0.6


@needs_images
def test_plain_example_covers_every_sample_and_moves_shares(tmp_path):
    _check(_launch("plain_torch.py", tmp_path))


@needs_images
def test_lightning_example_covers_every_sample_and_moves_shares(tmp_path):
    pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    _check(_launch("lightning_example.py", tmp_path))


@needs_images
def test_lightning_example_under_lightnings_own_launcher(tmp_path):
    pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    _check(_launch("lightning_example.py", tmp_path, own_launcher=True))


def test_bad_setting_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "plain_torch.py"), "--data", str(tmp_path),
                        "--scheme", "fast"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "hetero: error: unknown scheme 'fast' (choose from sync, dp, edp, affine)"]


@pytest.mark.parametrize("args, line", [  # every count's line: tests/integrations/test_ray.py, in one process
    (["--workers", "2", "--min-workers", "3"], "hetero: error: --min-workers 3 exceeds --workers 2"),
])
def test_ray_example_refuses_a_bad_count_in_one_line_before_ray_starts(tmp_path, args, line):
    pytest.importorskip("ray.train", reason="the [ray] extra is not installed")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_train.py"), *args, "--storage", str(tmp_path)],
                       cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [line], p.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # Ray never started: nothing written
