"""The GPU path, tested on the CPU (issue 16): emulated delays that really delay (with a fake GPU whose queued work
finishes after the host moves on), the backend chosen from every rank's physical GPU, the probe's reading of
cuDNN/cuBLAS allocation failures, and batches that reach the model in its memory format without extra copies.
Here the cases that launch processes; those in one process: tests/unit/test_gpu_path.py."""
from __future__ import annotations

import numpy as np
import pytest

from hetero.core.seeding import EMULATOR, epoch_seed

from helpers import TINY, read_run, run_train


@pytest.mark.slow
def test_delayed_rank_records_its_delay_as_compute_in_a_real_run(tmp_path):
    run = tmp_path / "run"
    run_train([*TINY, "--epochs", "1", "--scheme", "sync", "--threads", "1", "--hetero", "1:exp=0.03",
               "--run-dir", str(run)], nproc=2)
    steps = read_run(run)["steps"]
    slow = steps[steps["rank"] == 1].sort_values("step")
    rng = np.random.default_rng(epoch_seed(0, 1, EMULATOR + 1))  # the default --seed is 0
    assert np.allclose(slow.delay_s, [rng.exponential(0.03) for _ in range(len(slow))])
    assert (slow.compute_s >= slow.delay_s).all() and (steps[steps["rank"] == 0].delay_s == 0).all()
