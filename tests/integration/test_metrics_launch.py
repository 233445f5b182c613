"""The hetero/ scalars where users look: the built-in trainer's --tensorboard event files read back against its own
steps.csv, ranks.csv and epochs.csv; the Hugging Face example with report_to tensorboard and the Lightning example
with a CSVLogger, each on 2 CPU ranks (gloo) with rank 1 emulated slower."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from hetero.lab.launch import ROOT, clean_env

from helpers import TINY, read_run, run_train

pytestmark = pytest.mark.slow
tensorboard = pytest.importorskip("tensorboard")


def scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar tag in the event files under `folder`: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert files, f"no event files under {folder}"
    out: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_trainer_event_files_hold_the_tables_numbers(tmp_path):
    run = tmp_path / "run"
    # 3x slower and 0.1 s a step more: a signal no busy host hides (rank 1's smaller batch below rests on it)
    run_train([*TINY, "--scheme", "edp", "--hetero", "1:slowdown=3,1:delay=0.1", "--rebalance-every", "4",
               "--threads", "1", "--tensorboard", "--run-dir", str(run)], nproc=2)
    r, tb = read_run(run), scalars(run / "tensorboard")
    steps_per_epoch = int(r["steps"]["step"].max()) + 1
    for key in ("batch_size", "compute_s", "wait_s"):
        for rank, rows in r["steps"].groupby("rank"):
            want = {int((e - 1) * steps_per_epoch + s): v for e, s, v in zip(rows["epoch"], rows["step"], rows[key])}
            got = tb[f"hetero/rank{rank}/{key}"]
            assert sorted(got) == sorted(want)
            assert np.allclose([got[k] for k in sorted(want)], [want[k] for k in sorted(want)], rtol=1e-6)
    for rank, rows in r["ranks"].groupby("rank"):
        got = tb[f"hetero/rank{rank}/share"]
        assert np.allclose([got[e * steps_per_epoch] for e in rows["epoch"]], rows["share"], rtol=1e-6)
    ends = [e * steps_per_epoch for e in r["epochs"]["epoch"]]
    assert np.allclose([tb["test/top1"][x] for x in ends], r["epochs"]["test_top1"], rtol=1e-6)
    assert np.allclose([tb["train/loss"][x] for x in ends], r["epochs"]["train_loss"], rtol=1e-6)
    # the slow rank 1 got less work by the end; the cost model's predicted speedup is written at every epoch's end,
    # 1 unless the gain it sees beats its noise (a verdict on the host: a busy core's noise held it at 1 in a .ci/run
    # on 2026-12-05; the rule is tested on recorded steps in tests/unit/test_metrics.py)
    speedup = [tb["hetero/predicted_speedup"][x] for x in ends]
    last = r["steps"][r["steps"]["epoch"] == r["epochs"]["epoch"].max()]
    assert last[last["rank"] == 1]["batch_size"].iloc[-1] < last[last["rank"] == 0]["batch_size"].iloc[-1]
    assert len(speedup) == len(ends) and all(np.isfinite(speedup)) and min(speedup) >= 1, speedup
    assert "hetero/misallocation" in tb and all(v > 0 for v in tb["hetero/misallocation"].values())
    assert tb["hetero/decisions"][ends[-1]] == len(r["epochs"]) * (steps_per_epoch // 4 + (steps_per_epoch % 4 > 0))


def _launch(script: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--log-dir=/dev/null",
           str(ROOT / "examples" / script), *args]
    env = {**clean_env(threads="1"), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-20000:]}"
    return p


def test_hf_trainer_reports_the_hetero_scalars_to_tensorboard(tmp_path):
    out = tmp_path / "hf"
    _launch("hf_trainer.py", ["--text", str(ROOT / "docs" / "trainer.md"), "--subset", "192", "--global-batch", "16",
                              "--epochs", "1", "--log-every", "2", "--rebalance-every", "3", "--hetero",
                              "1:slowdown=3,1:delay=0.05", "--out", str(out), "--report-to", "tensorboard"])
    tb = scalars(out)
    logged = sorted(tb["train/loss"])  # the Trainer's own scalar: the hetero/ ones come at the same logging steps
    assert logged == [2, 4, 6, 8, 10, 12]
    for tag in ("hetero/rank0/share", "hetero/rank1/share", "hetero/batch_size", "hetero/decisions"):
        assert sorted(tb[f"train/{tag}"]) == logged, tag
    shares = tb["train/hetero/rank0/share"], tb["train/hetero/rank1/share"]
    assert all(abs(shares[0][s] + shares[1][s] - 1) < 1e-6 for s in logged)
    assert shares[1][logged[-1]] < 0.5  # the 3x slower rank was given less
    assert tb["train/hetero/predicted_speedup"][logged[-1]] > 1


def test_lightning_logs_the_hetero_scalars_through_its_logger(tmp_path):
    data = tmp_path / "images"
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in range(2):
        (data / f"c{c}").mkdir(parents=True)
        for i in range(64):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(data / f"c{c}" / f"{i}.png")
    logs = tmp_path / "logs"
    _launch("lightning_example.py", ["--data", str(data), "--epochs", "2", "--global-batch", "32", "--size", "16",
                                     "--workers", "0", "--cpu", "--rebalance-every", "2",
                                     "--hetero", "1:slowdown=3,1:delay=0.05",
                                     "--log-dir", str(logs)])
    csvs = sorted(logs.rglob("metrics.csv"))
    assert len(csvs) == 1, csvs  # rank 0 only
    m = pd.read_csv(csvs[0])
    rows = m.dropna(subset=["hetero/rank0/share"])
    # batch norm needs 2 samples a rank: the example's min_batch=2, however far a busy host moves the shares
    assert len(rows) >= 4 and np.allclose(rows["hetero/rank0/share"] + rows["hetero/rank1/share"], 1)
    assert rows["hetero/rank1/share"].iloc[-1] < 0.5
    assert rows["hetero/decisions"].max() == 4  # 4 steps per epoch, a decision every 2 steps, 2 epochs
    assert (rows.dropna(subset=["hetero/predicted_speedup"])["hetero/predicted_speedup"] > 1).any()
