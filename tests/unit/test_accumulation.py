"""The micro-batch mode (--micro-batch m): a fixed micro-batch per rank and k_i micro-batches per rank and step,
accumulated under DDP's no_sync. Pure maths first, then gloo processes (torch.multiprocessing.spawn): the exact
global-batch gradient with counts [1, 2, 5], batch norm with unequal counts (one buffer broadcast per step on every
rank, no hang), coverage under mid-epoch rebalancing, and the built-in trainer moving counts off a slow rank.
Here the cases in one process; those that launch processes: tests/integration/test_accumulation_launch.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import hetero
from hetero.core.balancer import Balancer
from hetero.core.partition import affine_batch_sizes, batch_sizes, check_feasible, predicted_step_s
from hetero.trainer.config import Config, ConfigError

# pandas-based modules (analysis, simulator, helpers' run readers) are imported in the tests that use them: every
# spawned rank imports this module, and on a loaded 2-core machine pandas adds seconds to each


# -- pure: the granularity of the partition maths ----------------------------------------------------------------
@pytest.mark.parametrize("m,B,shares", [(8, 64, [0.1, 0.3, 0.6]), (4, 32, [1, 1, 1]), (16, 160, [0.97, 0.01, 0.02])])
def test_batch_sizes_are_whole_micro_batches_summing_to_the_global_batch(m, B, shares):
    b = batch_sizes(shares, B, 1, None, m)
    assert b.sum() == B and np.all(b % m == 0) and np.all(b >= m)       # every rank at least one micro-batch
    # the same split as the per-sample maths on the problem in units of m
    assert np.array_equal(b, m * batch_sizes(shares, B // m))


def test_bounds_are_rounded_to_whole_micro_batches():
    inf = float("inf")
    # min 9 -> 2 micro-batches (16) on every rank; max 40 -> 5 micro-batches (40)
    assert batch_sizes([0.98, 0.01, 0.01], 64, 9, [40, inf, inf], 8).tolist() == [32, 16, 16]
    assert batch_sizes([0.98, 0.01, 0.01], 96, 9, [40, inf, inf], 8).tolist() == [40, 32, 24]


def test_affine_in_micro_batches_is_the_exact_minimax_over_counts():
    rng = np.random.default_rng(0)
    for _ in range(30):
        a, c, m = rng.uniform(0, 0.05, 3), rng.uniform(1e-4, 4e-3, 3), int(rng.choice([2, 4, 8]))
        B = m * int(rng.integers(3, 12))
        b = affine_batch_sizes(a, c, B, 1, None, False, m)
        assert b.sum() == B and np.all(b % m == 0) and np.all(b >= m)
        best = min(predicted_step_s(a, c, m * np.array(k)) for k in itertools.product(range(1, B // m + 1),
                                                                                            repeat=3)
                   if sum(k) == B // m)
        assert predicted_step_s(a, c, b) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("args,match", [
    ((2, 60, 1, None, 8), "global batch 60 is not a multiple of the micro-batch 8: use 56 or 64"),
    ((2, 4, 1, None, 8), "use 8"),
    ((2, 64, 1, [4, None], 8), "rank 0's batch bounds .* hold no whole micro-batch of 8"),
    ((2, 64, 1, [16, 16], 8), "exceeds the ranks' max batch in whole micro-batches of 8 \\(32\\)"),
    ((3, 16, 1, None, 8), "smaller than the ranks' min batch in whole micro-batches of 8 \\(24\\)"),
])
def test_infeasible_micro_batch_splits_raise_one_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        check_feasible(*args)
    with pytest.raises(ValueError, match=match):
        batch_sizes(np.ones(args[0]), *args[1:])


def test_the_balancer_decides_counts_for_each_rule():
    for rule in ("proportional", "affine"):
        bal = Balancer(rule, 2, 64, granularity=8, probe_steps=4)
        seen = set()
        for _ in range(3):  # rank 1 takes 3x longer per sample
            sizes = np.stack([bal.sizes_for_step(s) for s in range(8)])
            seen |= {tuple(r) for r in sizes}
            bal.observe(sizes, 0.01 + sizes * np.array([1e-3, 3e-3]))
            bal.decide()
        assert all(b % 8 == 0 for s in seen for b in s)
        assert bal.sizes.tolist() == [48, 16]                           # the counts [6, 2] balance 1:3


def test_config_refuses_a_global_batch_the_micro_batch_does_not_divide():
    with pytest.raises(ConfigError, match="--global-batch 250 is not a multiple of --micro-batch 32: use "
                                          "--global-batch 224 or 256"):
        Config(global_batch=250, micro_batch=32)
    with pytest.raises(ConfigError, match="--micro-batch 32 exceeds --max-batch 16"):
        Config(global_batch=256, micro_batch=32, max_batch="16")
    with pytest.raises(ConfigError, match="--sit-out does not combine"):
        Config(global_batch=256, micro_batch=32, scheme="affine", sit_out=True)
    Config(global_batch=256, micro_batch=32, max_batch="32").check_world(8)  # 8 ranks x 1 micro-batch: fine
    with pytest.raises(ConfigError, match="smaller than the ranks' min batch"):
        Config(global_batch=256, micro_batch=32).check_world(9)


@pytest.mark.parametrize("args,text", [
    (["--global-batch", "250", "--micro-batch", "32"], "use --global-batch 224 or 256"),
    (["--micro-batch", "-1"], "--micro-batch must be non-negative"),
    (["--micro-batch", "32", "--max-batch", "16"], "--micro-batch 32 exceeds --max-batch 16"),
    (["--micro-batch", "64"], "global batch 128 is smaller than the ranks' min batch in whole micro-batches of 64"),
])
def test_the_command_line_refuses_bad_micro_batches_in_one_line(args, text, monkeypatch, capsys):
    from helpers import SMALL, assert_one_line, check

    assert_one_line(*check([*SMALL, *args], monkeypatch, capsys, world=3), text)


def test_the_simulator_moves_counts_to_the_fast_rank():
    from hetero.lab.simulator import Scenario, simulate

    r = simulate(Scenario.uniform(2, hetero="1:slowdown=3"), "edp", 64, 3, 20, micro_batch=8)
    assert np.all(r.sizes % 8 == 0) and np.all(r.sizes.sum(1) == 64)
    assert r.sizes[0].tolist() == [32, 32] and r.sizes[-1, 0] > 3 * r.sizes[-1, 1] - 8
    assert r.epochs_frame()["ratio"].iloc[-1] == pytest.approx(1.0)    # the oracle in units of m, reached


def test_the_bench_ideal_is_in_whole_micro_batches():
    import pandas as pd

    from hetero.lab.bench import Suite
    from hetero.lab.efficiency import cost_model

    # rank 1 three times slower; each micro-batch of 8 costs a + 8c on rank 0
    rows = [{"epoch": 1, "step": s, "rank": r, "batch_size": b, "compute_s": (1 + 2 * r) * b / 8 * (0.01 + 8e-3),
             "wait_s": 0.001} for s in range(4) for r, b in enumerate([32, 32])]
    m = cost_model(pd.DataFrame(rows), (0.01, 1e-3), 64, 1, micro_batch=8)
    assert m["ideal_sizes"] == [48, 16] and m["scale"] == pytest.approx([1, 3])
    with pytest.raises(ValueError, match="micro_batch"):
        Suite(micro_batch=48)                                          # does not divide batch_per_rank 128


@pytest.mark.parametrize("rank", [0, 1])
def test_a_micro_batch_step_without_an_attached_model_is_refused_on_every_rank(monkeypatch, rank):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=16, micro_batch=4)  # counts [1, 3]
    bal.replay({0: np.array([[4, 12]])})
    bal.batch_sampler(16)  # the epoch's length
    bal.set_epoch(0)
    with pytest.raises(RuntimeError, match="attach the model first"):  # rank 0 too, though it needs no no_sync
        with bal.step():
            pass


M, COUNTS = 4, [1, 2, 5]
B = M * sum(COUNTS)


def test_lightning_refuses_micro_batches(monkeypatch):
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    callback = hetero.BalanceCallback(hetero.Balance(global_batch=16, micro_batch=4))
    with pytest.raises(ValueError, match="micro_batch is not supported with Lightning"):
        callback.on_fit_start(SimpleNamespace(accumulate_grad_batches=1), None)


def test_micro_batches_asked_before_an_epoch_s_first_batch_is_that_step_s_count(monkeypatch):
    """#48 item 8: a loop that reads bal.micro_batches after set_epoch and before iterating its loader (an
    Accelerate loop sizing its progress) had the loader refuse with "call bal.set_epoch", which it had called."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetero.lab.launch import free_port

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        bal = hetero.Balance(global_batch=8, micro_batch=2)
        ddp = DDP(torch.nn.Linear(2, 1))
        bal.attach(ddp)
        loader = bal.batch_sampler(16)
        for epoch in (0, 1):
            bal.set_epoch(epoch)
            k = bal.micro_batches  # before the epoch's first batch: the count of its first step
            seen = []
            for idx in loader:
                with bal.step(len(idx)):
                    ddp(torch.randn(len(idx), 2)).sum().backward()
                seen += idx
            assert k == 4 and len(seen) == 16 and sorted(seen) == list(range(16))
        with pytest.raises(hetero.HeteroError, match="iterated again: call bal.set_epoch"):
            next(iter(loader))  # the refusal it is meant for still stands: an epoch run twice
    finally:
        dist.destroy_process_group()
