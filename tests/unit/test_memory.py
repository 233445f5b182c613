"""Memory-aware limits: the largest-batch search, the probe's bookkeeping (on the CPU, with a model that raises
CUDA's out-of-memory error above a size), `--max-batch probe` in the config and in a real run.
Here the cases in one process; those that launch processes: tests/integration/test_memory_launch.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from hetero.core.memory import fitting_batch, largest_fitting, probe_max_batch, shared_gpus
from hetero.trainer.config import Config, ConfigError


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 64), (3, 100), (1, 1000), (16, 17)])
def test_largest_fitting_matches_brute_force_in_few_calls(lo, hi):
    for limit in sorted({0, lo - 1, lo, lo + 1, hi - 1, hi, hi + 5, (lo + hi) // 2, 37, 2 * lo + 1}):
        calls = []

        def fits(b):
            assert lo <= b <= hi, b          # never tries outside the range
            calls.append(b)
            return b <= limit

        want = max((b for b in range(lo, hi + 1) if b <= limit), default=0)
        assert largest_fitting(fits, lo, hi) == want, (lo, hi, limit)
        assert len(calls) <= 2 * math.ceil(math.log2(hi / lo + 1)) + 2, (lo, hi, limit, calls)


def test_largest_fitting_rejects_an_empty_range():
    with pytest.raises(ValueError):
        largest_fitting(lambda b: True, 5, 4)


class OomAbove(nn.Module):
    """A small batch-norm CNN that raises CUDA's out-of-memory error for batches above `limit`, as a GPU would."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.tried = limit, []
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 10))

    def forward(self, x):
        self.tried.append(len(x))
        if len(x) > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (batch {len(x)})")
        return self.body(x)


@pytest.mark.parametrize("limit,hi,want", [(1000, 256, 256),    # all of the global batch fits
                                           (200, 256, 180),     # 200 fits, 201 does not: 0.9 x 200
                                           (283, 256, 254),     # headroom applies below hi as well
                                           (1, 256, 1)])        # never below the smallest allowed batch
def test_probe_search_headroom_and_a_model_left_as_found(limit, hi, want):
    torch.manual_seed(0)
    model = OomAbove(limit)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    got = fitting_batch(model, (3, 8, 8), 10, torch.device("cpu"), lo=1, hi=hi)
    assert got == want
    assert max(b for b in model.tried if b <= limit) == min(limit, math.ceil(hi / 0.9))  # found the real edge
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # BN statistics restored
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)  # dropout in the trials did not move the run's RNG


def test_probe_fails_clearly_when_nothing_fits_and_skips_cpu_ranks():
    with pytest.raises(RuntimeError, match="not even 4 sample"):
        fitting_batch(OomAbove(3), (3, 8, 8), 10, torch.device("cpu"), lo=4, hi=64)
    assert probe_max_batch(OomAbove(3), (3, 8, 8), 10, torch.device("cpu"), lo=1, hi=64) == math.inf


def test_config_takes_probe_per_rank():
    cfg = Config(max_batch="probe,40", data="synthetic")
    cfg.check_world(2)
    assert cfg.probes(0, 2) and not cfg.probes(1, 2)
    assert cfg.max_batches(2) == [math.inf, 40] and cfg.max_batches(2, probed=[90.0, math.inf]) == [90.0, 40]
    for bad in ("prob", "probe;4", "-1"):
        with pytest.raises(ConfigError, match="expected whole numbers >= 0 .*or probe"):
            Config(max_batch=bad)


def test_probe_refuses_ranks_that_share_a_gpu():
    places = [("a", "cuda:0", "uuid A"), ("a", "cuda:0", "uuid A"), ("b", "cuda:0", "uuid B"), ("a", "cpu", ""),
              ("a", "cpu", "")]
    assert shared_gpus(places, [True] * 5) == [[0, 1]]           # same host and GPU; CPU ranks may share
    assert shared_gpus(places, [False, True, True, True, True]) == [[0, 1]]
    assert shared_gpus(places, [False, False, True, True, True]) == []  # given limits for both: nothing probed there
    assert shared_gpus([("a", "cuda:0", "uuid A"), ("a", "cuda:1", "uuid B")], [True, True]) == []
    # one GPU visible per rank (SLURM --gpus-per-task): every rank's is cuda:0, but they are different GPUs
    assert shared_gpus([("a", "cuda:0", "uuid A"), ("a", "cuda:0", "uuid B")], [True, True]) == []
    # and the same GPU under two names (cuda:0 and cuda:1 with different CUDA_VISIBLE_DEVICES) is shared
    assert shared_gpus([("a", "cuda:0", "uuid A"), ("a", "cuda:1", "uuid A")], [True, True]) == [[0, 1]]
