"""Memory-aware limits: the largest-batch search, the probe's bookkeeping (on the CPU, with a model that raises
CUDA's out-of-memory error above a size), `--max-batch probe` in the config and in a real run.
Here the cases that launch processes; those in one process: tests/unit/test_memory.py."""
from __future__ import annotations

import json

import pytest

from helpers import TINY, read_run, run_train


@pytest.mark.slow
def test_probe_on_cpu_ranks_means_no_limit_and_limits_still_hold(tmp_path):
    run = tmp_path / "run"
    # epoch 0 measures, epoch 1 runs the decision: rank 1 would take about 3/4 of 128, and its limit of 40 holds
    p = run_train([*TINY, "--epochs", "2", "--scheme", "dp", "--hetero", "0:slowdown=3", "--threads", "1",
                   "--max-batch", "probe,40", "--run-dir", str(run)], nproc=2)
    assert "largest batch per rank (--max-batch probe,40): -,40" in p.stdout
    r = read_run(run)
    assert r["config"]["max_batches"] == [None, 40]
    assert r["steps"][r["steps"]["rank"] == 1].batch_size.max() == 40  # rank 1 would take more: the limit holds
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
