"""The public API (hetero.Balance): the batch sampler's cut, the decision schedule under DataLoader workers, the
exact EDP gradient (also with GradScaler and clipping), refusals, and checkpoints. Two-rank cases run as two gloo
processes started by torch.multiprocessing.spawn.
Here the cases that launch processes; those in one process: tests/unit/test_balance.py."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetero
from hetero.core.sampler import EpochPlan

from helpers import Indexed, max_diff, sgd_step, spawned


# -- two processes ------------------------------------------------------------------------------------------------
def _spawn(fn, tmp_path, *args) -> list[dict]:
    return spawned(fn, tmp_path, 2, args)


def _join(rank: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _schedule_worker(rank: int, out: str) -> None:
    _join(rank)
    results = [_two_epochs(None), _two_epochs(1)]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _two_epochs(lag: int | None, workers: int = 2) -> dict:
    """Two epochs with 2 DataLoader workers, rank 1 delayed 0.1 s per step, decisions every 2 steps."""
    result = {"error": ""}
    try:
        bal = hetero.Balance(scheme="dp", global_batch=24, rebalance_every=2, lag=lag)
        bal.emulate("1:delay=0.1")
        ddp = DDP(torch.nn.Linear(8, 3))
        bal.attach(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        loader = DataLoader(Indexed(240), batch_sampler=bal.batch_sampler(240, seed=1), num_workers=workers,
                            persistent_workers=workers > 0)
        seen, sizes = {}, {}
        for epoch in range(2):
            bal.set_epoch(epoch)
            seen[epoch] = []
            for step, (x, y, idx) in enumerate(loader):
                with bal.step(batch_size=len(y)):  # the loader's batch is the scheduled size, on every rank
                    F.cross_entropy(ddp(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                seen[epoch] += idx.tolist()
                sizes[epoch * 10 + step] = bal.last_sizes
        result.update(seen=seen, sizes=sizes, decisions=[d.__dict__ for d in bal.decisions])
    except RuntimeError as e:
        result["error"] = str(e)
    return result


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory) -> list[list[dict]]:
    """[rank][run]: run 0 with the default lag, run 1 with lag=1 (shorter than the workers' prefetch)."""
    return _spawn(_schedule_worker, tmp_path_factory.mktemp("schedule"))


@pytest.mark.slow
def test_decisions_reach_every_rank_at_the_same_step_with_loader_workers(schedule_runs):
    r = [rank[0] for rank in schedule_runs]
    assert not r[0]["error"] and not r[1]["error"]
    assert r[0]["sizes"] == r[1]["sizes"]                       # every step cut alike on both ranks
    for epoch in ("0", "1"):
        seen = r[0]["seen"][epoch] + r[1]["seen"][epoch]
        assert sorted(seen) == list(range(240))                  # every sample exactly once per epoch
    d = r[0]["decisions"]
    assert d == r[1]["decisions"] and len(d) == 10
    # workers run ahead: a decision after step s is cut from a later step than s + 1, never an earlier one
    assert all(x["effective"] >= x["epoch"] * 10 + x["step"] + 1 for x in d)
    assert d[0]["effective"] > 2
    # every step is cut with the sizes of the latest decision in effect there (an even split before the first);
    # the first decision may itself be an even split when host noise hits its window, so none is assumed to change
    for pos in range(20):
        in_effect = [x["sizes"] for x in d if x["effective"] <= pos]
        assert r[0]["sizes"][str(pos)] == (in_effect[-1] if in_effect else [12, 12]), pos
    assert r[0]["sizes"]["19"][0] > 18                          # the fast rank took most of the work


@pytest.mark.slow
def test_a_fixed_lag_shorter_than_the_prefetch_stops_every_rank(schedule_runs):
    r = [rank[1] for rank in schedule_runs]
    assert "ahead of training, beyond lag=1" in r[0]["error"] and r[0]["error"] == r[1]["error"]


def _net() -> torch.nn.Module:
    torch.manual_seed(5)  # no batch norm: every sample's gradient is independent of the others
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


DATA = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
                     torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2)))


def _exact_worker(rank: int, out: str) -> None:
    """One step of each variant with batch sizes 5 and 27 (rank 0 bounded to 5)."""
    _join(rank)
    result = {}
    for name in ("edp", "sync", "scaler_clip", "edp_loss", "sync_loss", "scaler_clip_loss"):
        bal = hetero.Balance(scheme="sync" if name.startswith("sync") else "edp", global_batch=32,
                             max_batch=[5, None], weighting="loss" if name.endswith("_loss") else "hook")
        model = _net()
        ddp = DDP(model)
        bal.attach(ddp)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=name.startswith("scaler_clip"))
        loader = DataLoader(DATA, batch_sampler=bal.batch_sampler(len(DATA), seed=3))
        bal.set_epoch(0)
        x, y = next(iter(loader))
        with bal.step():
            bal.backward(scaler.scale(F.cross_entropy(ddp(x), y)))
            if name.startswith("scaler_clip"):
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
        result[name] = [p.detach().flatten().tolist() for p in model.parameters()]
        result["sizes"] = bal.last_sizes
    # gradient accumulation (two forwards, one under no_sync) is refused on every rank
    bal = hetero.Balance(global_batch=32)
    ddp = DDP(_net())
    bal.attach(ddp)
    bal.batch_sampler(len(DATA))
    bal.set_epoch(0)
    bal.sizes_at(0, 0)  # a loop cutting its own batches asks for the step's sizes
    try:
        with bal.step():
            with ddp.no_sync():
                F.cross_entropy(ddp(DATA.tensors[0][:8]), DATA.tensors[1][:8]).backward()
            F.cross_entropy(ddp(DATA.tensors[0][8:16]), DATA.tensors[1][8:16]).backward()
        result["accumulation"] = ""
    except RuntimeError as e:
        result["accumulation"] = str(e)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():  # a refusal one rank may see alone posts its line and closes the group
        dist.destroy_process_group()


def _reference(weighted: bool, clip: float | None = None) -> list[torch.Tensor]:
    """Single-process SGD on the global batch (weighted) or the equal-weight mean of the two ranks' means."""
    window = EpochPlan(64, 32, 3, 0).perm[:32]
    x, y = DATA.tensors[0][window], DATA.tensors[1][window]
    model = _net()
    if weighted:
        F.cross_entropy(model(x), y).backward()
    else:
        (0.5 * F.cross_entropy(model(x[:5]), y[:5]) + 0.5 * F.cross_entropy(model(x[5:]), y[5:])).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return sgd_step(model)


def test_edp_step_equals_single_process_sgd_and_scaler_and_clipping_keep_it(tmp_path):
    r = _spawn(_exact_worker, tmp_path)
    assert r[0]["sizes"] == [5, 27]
    exact, mean = _reference(weighted=True), _reference(weighted=False)
    assert max_diff([p.tolist() for p in exact], mean) > 1e-3      # the test tells the two apart
    for rank in r:
        for by in ("", "_loss"):  # the weight in the comm hook, and on the loss (weighting="loss", bal.backward)
            assert max_diff(rank["edp" + by], exact) < 1e-5
            assert max_diff(rank["sync" + by], mean) < 1e-5
            assert max_diff(rank["scaler_clip" + by], _reference(weighted=True, clip=0.05)) < 1e-5
        assert "ran 2 forwards in step 0 of epoch 0, where its count is 1" in rank["accumulation"]
