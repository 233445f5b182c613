"""The micro-batch mode (--micro-batch m): a fixed micro-batch per rank and k_i micro-batches per rank and step,
accumulated under DDP's no_sync. Pure maths first, then gloo processes (torch.multiprocessing.spawn): the exact
global-batch gradient with counts [1, 2, 5], batch norm with unequal counts (one buffer broadcast per step on every
rank, no hang), coverage under mid-epoch rebalancing, and the built-in trainer moving counts off a slow rank."""
from __future__ import annotations

import datetime
import itertools
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetero
from hetero.core.balancer import Balancer
from hetero.core.partition import affine_batch_sizes, batch_sizes, check_feasible, predicted_step_s
from hetero.core.sampler import EpochPlan
from hetero.trainer.config import Config, ConfigError

from helpers import Indexed, max_diff, sgd_step, spawned

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

    from helpers import free_port

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


# the cases that launch processes
# -- gloo processes ----------------------------------------------------------------------------------------------
def _spawn(fn, tmp_path, world: int, *args) -> list[dict]:
    return spawned(fn, tmp_path, world, (world, *args))


def _join(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # a collective that one rank never joins fails after 30 s instead of hanging the test
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))


DATA = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
                     torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2)))


def _net(bn: bool = False) -> torch.nn.Module:
    torch.manual_seed(5)
    norm = [torch.nn.BatchNorm1d(16)] if bn else []
    return torch.nn.Sequential(torch.nn.Linear(8, 16), *norm, torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _steps(bal: hetero.Balance, ddp: DDP, steps: int) -> tuple[list[int], list[int]]:
    """The user's loop of the README: micro-batches from the sampler, opt.step where bal.sync_now (with
    weighting="loss", bal.backward(loss) in place of loss.backward())."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    loader = DataLoader(DATA, batch_sampler=bal.batch_sampler(len(DATA), seed=3))
    bal.set_epoch(0)
    micro, syncs = [], 0
    for x, y in itertools.islice(loader, steps * COUNTS[bal.rank]):
        with bal.step(batch_size=len(y)):
            bal.backward(F.cross_entropy(ddp(x), y))
            if bal.sync_now:
                opt.step()
                opt.zero_grad()
                syncs += 1
        micro.append(len(y))
    return micro, syncs


def _exact_worker(rank: int, out: str, world: int) -> None:
    _join(rank, world)
    result = {}
    for name in ("edp", "sync", "bn", "edp_loss", "sync_loss"):
        # replayed counts [1, 2, 5] (sizes 4, 8, 20): the loop below runs the real sampler and hook on them (_loss:
        # the weight on the loss, DDP's own all-reduce: a mean over 3 ranks, which the factor 3 undoes)
        bal = hetero.Balance(scheme="sync" if name.startswith("sync") else "edp", global_batch=B, micro_batch=M,
                             weighting="loss" if name.endswith("_loss") else "hook")
        bal.replay({0: np.array([[M * k for k in COUNTS]] * 2)})
        model = _net(bn=name == "bn")
        ddp = DDP(model)
        bal.attach(ddp)
        broadcasts = []
        sync_buffers = ddp._sync_buffers
        ddp._sync_buffers = lambda: (broadcasts.append(1), sync_buffers())[1]
        micro, syncs = _steps(bal, ddp, steps=2 if name == "bn" else 1)
        result[name] = {"params": [p.detach().flatten().tolist() for p in model.parameters()],
                        "buffers": [b.detach().flatten().tolist() for b in model.buffers()],
                        "micro": micro, "syncs": syncs, "broadcasts": len(broadcasts)}
    # weighting="loss" and a plain loss.backward() on every rank: an unweighted gradient, refused at the optimizer
    # step on every rank (the one refusal of this launch: it closes the group)
    bal = hetero.Balance(global_batch=B, micro_batch=M, weighting="loss")
    bal.replay({0: np.array([[M * k for k in COUNTS]] * 2)})
    model = _net()
    ddp = DDP(model)
    bal.attach(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(DATA, batch_sampler=bal.batch_sampler(len(DATA), seed=3))
    bal.set_epoch(0)
    try:
        for x, y in itertools.islice(loader, COUNTS[rank]):
            with bal.step():
                F.cross_entropy(ddp(x), y).backward()
                if bal.sync_now:
                    opt.step()
        result["bypassed"] = ""
    except RuntimeError as e:
        result["bypassed"] = str(e)
    result["stepped"] = model[0].bias.detach().tolist() != _net()[0].bias.detach().tolist()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def _reference(weighted: bool) -> list[torch.Tensor]:
    """Single-process SGD on the global batch (weighted), or the equal-weight mean of the ranks' mean gradients."""
    window = EpochPlan(64, B, 3, 0).perm[:B]
    x, y = DATA.tensors[0][window], DATA.tensors[1][window]
    model = _net()
    if weighted:
        F.cross_entropy(model(x), y).backward()
    else:
        cut = np.cumsum([0, *[M * k for k in COUNTS]])
        sum(F.cross_entropy(model(x[lo:hi]), y[lo:hi]) / len(COUNTS) for lo, hi in zip(cut, cut[1:])).backward()
    return sgd_step(model)


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory) -> list[dict]:
    return _spawn(_exact_worker, tmp_path_factory.mktemp("exact"), 3)


@pytest.mark.launch
def test_unequal_accumulation_gives_the_exact_global_batch_gradient(exact_runs):
    exact, mean = _reference(weighted=True), _reference(weighted=False)
    assert max_diff([p.tolist() for p in exact], mean) > 1e-3             # the test tells the two apart
    for rank, r in enumerate(exact_runs):
        for by in ("", "_loss"):  # the weight in the comm hook, and on the loss (weighting="loss", bal.backward)
            assert r["edp" + by]["micro"] == [M] * COUNTS[rank] and r["edp" + by]["syncs"] == 1
            assert max_diff(r["edp" + by]["params"], exact) < 1e-5
            assert max_diff(r["sync" + by]["params"], mean) < 1e-5         # unweighted: the mean of rank means


@pytest.mark.launch
def test_a_backward_that_bypasses_the_loss_weighting_is_refused_on_every_rank_before_the_step(exact_runs):
    """weighting="loss" with loss.backward() instead of bal.backward(loss): the gradient hook on the first parameter
    sees it under real DDP (before its reducer takes the gradient), and the optimizer step is refused."""
    for rank, r in enumerate(exact_runs):
        assert f"a backward ran outside bal.backward(loss) in step 0 of epoch 0 on rank {rank}" in r["bypassed"]
        assert not r["stepped"]


@pytest.mark.launch
def test_batch_norm_with_unequal_counts_broadcasts_once_per_step_on_every_rank(exact_runs):
    for rank, r in enumerate(exact_runs):
        assert r["bn"]["micro"] == [M] * (2 * COUNTS[rank]) and r["bn"]["syncs"] == 2
        assert r["bn"]["broadcasts"] == 2                                # one per step, whatever k_i
        assert r["bn"]["params"] == exact_runs[0]["bn"]["params"]


def _coverage_worker(rank: int, out: str, world: int) -> None:
    """Two epochs of 10 steps, micro-batch 4, 2 loader workers, rank 1 delayed 0.1 s per step, decisions every 2."""
    _join(rank, world)
    bal = hetero.Balance(scheme="edp", global_batch=24, micro_batch=4, rebalance_every=2)
    bal.emulate("1:delay=0.1")
    ddp = DDP(torch.nn.Linear(8, 3))
    bal.attach(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = DataLoader(Indexed(240), batch_sampler=bal.batch_sampler(240, seed=1), num_workers=2,
                        persistent_workers=True)
    seen, lens, sizes = {}, set(), {}
    for epoch in range(2):
        bal.set_epoch(epoch)
        seen[epoch] = []
        for x, y, idx in loader:
            with bal.step():
                F.cross_entropy(ddp(x), y).backward()
                if bal.sync_now:
                    opt.step()
                    opt.zero_grad()
                    sizes[bal.position.global_step] = bal.last_sizes
            seen[epoch] += idx.tolist()
            lens.add(len(y))
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"seen": seen, "lens": sorted(lens), "sizes": sizes,
                   "decisions": [d.__dict__ for d in bal.decisions]}, f)
    dist.destroy_process_group()


@pytest.mark.launch
def test_every_sample_once_per_epoch_while_counts_change_mid_epoch(tmp_path):
    r = _spawn(_coverage_worker, tmp_path, 2)
    assert r[0]["sizes"] == r[1]["sizes"] and r[0]["decisions"] == r[1]["decisions"]
    for epoch in ("0", "1"):
        assert sorted(r[0]["seen"][epoch] + r[1]["seen"][epoch]) == list(range(240))
    assert r[0]["lens"] == r[1]["lens"] == [4]                           # every batch a micro-batch of 4
    sizes = [r[0]["sizes"][str(s)] for s in range(20)]
    assert all(sum(s) == 24 and s[0] % 4 == 0 for s in sizes)
    first_epoch = {tuple(s) for s in sizes[:10]}
    assert len(first_epoch) > 1                                          # the counts changed within epoch 0
    assert sizes[-1][0] > sizes[-1][1]                                   # toward the fast rank


# -- the built-in trainer (torchrun, 2 CPU ranks) ----------------------------------------------------------------
@pytest.mark.launch
@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
def test_the_trainer_moves_micro_batches_to_the_fast_rank(tmp_path):
    from hetero.lab import analysis

    from helpers import TINY, read_run, run_train

    run = tmp_path / "run"
    run_train([*TINY, "--subset", "1024", "--global-batch", "64", "--micro-batch", "8", "--scheme", "edp",
               "--hetero", "1:slowdown=3,1:delay=0.05", "--rebalance-every", "4", "--run-dir", str(run)], nproc=2)
    r = read_run(run)
    assert (r["steps"]["batch_size"] % 8 == 0).all() and (r["steps"]["batch_size"] >= 8).all()
    last = r["ranks"][r["ranks"]["epoch"] == r["ranks"]["epoch"].max()].set_index("rank")
    assert last.loc[0, "batch_size"] > last.loc[1, "batch_size"]       # direction only: no timing asserted
    counts = analysis.micro_batches(analysis.load([run]))
    # each epoch's last step against that epoch's sizes (a decision late in epoch 1 may move them from epoch 0's)
    both = counts.merge(r["ranks"][["epoch", "rank", "batch_size"]], on=["epoch", "rank"])
    assert len(counts) == len(both) == 2 * 2 and (both["micro_batches_last"] * 8 == both["batch_size"]).all()
