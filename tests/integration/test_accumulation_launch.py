"""The micro-batch mode (--micro-batch m): a fixed micro-batch per rank and k_i micro-batches per rank and step,
accumulated under DDP's no_sync. Pure maths first, then gloo processes (torch.multiprocessing.spawn): the exact
global-batch gradient with counts [1, 2, 5], batch norm with unequal counts (one buffer broadcast per step on every
rank, no hang), coverage under mid-epoch rebalancing, and the built-in trainer moving counts off a slow rank.
Here the cases that launch processes; those in one process: tests/unit/test_accumulation.py."""
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
from hetero.core.sampler import EpochPlan

from helpers import Indexed, max_diff, sgd_step, spawned


# -- gloo processes ----------------------------------------------------------------------------------------------
def _spawn(fn, tmp_path, world: int, *args) -> list[dict]:
    return spawned(fn, tmp_path, world, (world, *args))


def _join(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # a collective that one rank never joins fails after 30 s instead of hanging the test
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))


M, COUNTS = 4, [1, 2, 5]
B = M * sum(COUNTS)
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


def test_unequal_accumulation_gives_the_exact_global_batch_gradient(exact_runs):
    exact, mean = _reference(weighted=True), _reference(weighted=False)
    assert max_diff([p.tolist() for p in exact], mean) > 1e-3             # the test tells the two apart
    for rank, r in enumerate(exact_runs):
        for by in ("", "_loss"):  # the weight in the comm hook, and on the loss (weighting="loss", bal.backward)
            assert r["edp" + by]["micro"] == [M] * COUNTS[rank] and r["edp" + by]["syncs"] == 1
            assert max_diff(r["edp" + by]["params"], exact) < 1e-5
            assert max_diff(r["sync" + by]["params"], mean) < 1e-5         # unweighted: the mean of rank means


def test_a_backward_that_bypasses_the_loss_weighting_is_refused_on_every_rank_before_the_step(exact_runs):
    """weighting="loss" with loss.backward() instead of bal.backward(loss): the gradient hook on the first parameter
    sees it under real DDP (before its reducer takes the gradient), and the optimizer step is refused."""
    for rank, r in enumerate(exact_runs):
        assert f"a backward ran outside bal.backward(loss) in step 0 of epoch 0 on rank {rank}" in r["bypassed"]
        assert not r["stepped"]


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


@pytest.mark.slow
def test_the_trainer_accumulates_the_exact_global_batch_gradient(tmp_path):
    """The built-in trainer's step (replayed counts [1, 2, 5] of m = 4) against single-process SGD."""
    from test_exactness import LR, SEED, _max_diff, _reference, _replay_folder

    from helpers import run_train

    sizes = [M * k for k in COUNTS]
    run = tmp_path / "run"
    run_train(["--model", "tiny_nobn", "--data", "synthetic", "--subset", str(B), "--test-subset", "64",
               "--global-batch", str(B), "--micro-batch", str(M), "--epochs", "1", "--lr", str(LR), "--momentum", "0",
               "--weight-decay", "0", "--augment", "false", "--seed", str(SEED), "--scheme", "edp",
               "--replay", str(_replay_folder(tmp_path / "record", sizes)), "--run-dir", str(run)], nproc=3)
    got = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    assert _max_diff(got, _reference(sizes, weighted=True)) < 1e-5
    assert _max_diff(got, _reference(sizes, weighted=False)) > 1e-3
