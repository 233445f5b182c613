"""Every door against every misuse: one set of step checks (hetero/core/engine.py) for all the ways a loop drives a
Balance, so a new door cannot forget one. Doors: `with bal.step()` and begin_step/end_step, each on a DDP model and
an FSDP2 model; the Lightning and Hugging Face callbacks drive begin_step/end_step (their own launches are in
test_lightning_launch.py and test_hf.py). Misuses:
- fewer: a rank runs fewer micro-batches than its planned count before it syncs and steps;
- more: a rank runs more than its planned count;
- no_epoch: a loop that never calls bal.set_epoch iterates a second epoch;
- plain_loader: the loop's batches come from a plain DataLoader, not hetero's sampler (the `with bal.step()`
  door; a begin_step loop cuts its own batches from the sizes begin_step returns, by contract).
Each must stop both ranks with the same one `hetero:` line (never a socket error or a hang). Two gloo ranks per
door, every case in the same two processes, each with a fresh process group (a refusal that posts its line closes
the group). The Lightning door also refuses a plain DataLoader (test_lightning_launch.py)."""
from __future__ import annotations

import datetime
import json
import os
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetero
from hetero.lab.launch import free_port

pytestmark = pytest.mark.slow  # four two-rank launches, each waiting out a peer's group timeout in two cases

N, B, M = 64, 16, 4  # samples, global batch, micro-batch (counts [3, 1] or [1, 3] of 4)
MISUSES = ("fewer", "more", "no_epoch", "plain_loader")
DOORS = [("step", "ddp"), ("step", "fsdp"), ("begin_end", "ddp"), ("begin_end", "fsdp")]


def _net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _model(kind: str) -> torch.nn.Module:
    net = _net()
    if kind == "ddp":
        return DDP(net)
    for layer in (net[0], net[2]):
        fully_shard(layer)
    return fully_shard(net)


def _no_sync(model, last: bool):
    if last:
        return nullcontext()
    if isinstance(model, DDP):
        return model.no_sync()
    model.set_requires_gradient_sync(False)  # FSDP2's own form
    return nullcontext()


def _case(door: str, kind: str, misuse: str) -> None:
    """One misuse through one door; raises whatever the Balance raises."""
    data = TensorDataset(torch.randn(N, 8, generator=torch.Generator().manual_seed(1)),
                         torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2)))
    rank = dist.get_rank()
    counts = {"fewer": [3, 1], "more": [1, 3]}.get(misuse)  # per-rank micro-batch counts, replayed
    bal = hetero.Balance(global_batch=B, scheme="edp", micro_batch=M if counts else 0)
    if counts:
        bal.replay({0: np.array([[M * k for k in counts]] * (N // B))})
    model = _model(kind)
    bal.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if misuse == "plain_loader":
        bal.batch_sampler(N)  # the epoch's length, but the loader below is not hetero's
        loader = DataLoader(data, batch_size=B // 2)
        bal.set_epoch(0)
        for x, y in loader:
            with bal.step():
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return
    if misuse == "no_epoch":  # two passes over the epochs, set_epoch never called
        sampler = bal.batch_sampler(N)
        for _ in range(2):
            for idx in sampler:
                x, y = data[idx]
                with bal.step():
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        return
    # fewer / more: a nanoGPT-style loop without epochs (no sampler) that runs its own fixed count of 2
    # micro-batches per step, where rank 0's planned count is 3 (fewer) or 1 (more); rank 1 runs its own count
    for _ in range(N // B):
        ran = 2 if rank == 0 else counts[1]
        if door == "step":
            for _ in range(ran):
                x, y = data[torch.randint(0, N, (M,))]
                with bal.step():
                    F.cross_entropy(model(x), y).backward()
            opt.step()  # the loop steps after its own count, whatever bal.sync_now says
            opt.zero_grad()
        else:
            bal.begin_step()
            for i in range(ran):
                x, y = data[torch.randint(0, N, (M,))]
                with _no_sync(model, i == ran - 1):
                    F.cross_entropy(model(x), y).backward()
            if not isinstance(model, DDP):
                model.set_requires_gradient_sync(True)
            opt.step()
            opt.zero_grad()
            bal.end_step()


def _worker(rank: int, out: str, door: str, kind: str, ports: list[int]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    results = {}
    for misuse, port in zip(MISUSES, ports):
        if misuse == "plain_loader" and door != "step":
            continue
        # a rank whose peer stopped learns the posted line when its collective fails: at the latest the group's
        # timeout, since a DDP model keeps the stopped peer's sockets open (docs/reliability.md)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=15))
        result = results[misuse] = {"error": "", "other": ""}
        try:
            _case(door, kind, misuse)
        except hetero.HeteroError as e:
            result["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - anything but the hetero line fails the test
            result["other"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if dist.is_initialized():
            dist.destroy_process_group()
        del store
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module", params=DOORS, ids=[f"{d}-{k}" for d, k in DOORS])
def door(request, tmp_path_factory) -> tuple[str, list[dict]]:
    out = tmp_path_factory.mktemp("doors")
    ports = [free_port() for _ in MISUSES]
    mp.spawn(_worker, args=(str(out), *request.param, ports), nprocs=2, join=True)
    return request.param, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("misuse", MISUSES)
def test_every_door_refuses_every_misuse_alike_on_every_rank(door, misuse):
    (name, kind), ranks = door
    if misuse == "plain_loader" and name != "step":
        pytest.skip("a begin_step loop cuts its own batches from the sizes begin_step returns")
    r = [ranks[0][misuse], ranks[1][misuse]]
    assert not r[0]["other"] and not r[1]["other"], r                       # no socket error, no traceback
    assert r[0]["error"] and r[0]["error"] == r[1]["error"], r              # the same line on both ranks
    assert r[0]["error"].startswith("hetero: ") and "\n" not in r[0]["error"]
