"""Every door against every misuse: one set of step checks (hetero/core/engine.py) for all the ways a loop drives a
Balance, so a new door cannot forget one. Doors: `with bal.step()` and begin_step/end_step, each on a DDP model and
an FSDP2 model; the Lightning callback (hetero.BalanceCallback) and the Hugging Face Trainer (HeteroTrainer, whose
callback brackets its steps), each in a launch of its own per misuse (FRAMEWORK_CELLS, below). Misuses:
- fewer: a rank runs fewer micro-batches than its planned count before it syncs and steps;
- more: a rank runs more than its planned count;
- no_epoch: a loop that never calls bal.set_epoch iterates a second epoch;
- plain_loader: the loop's batches come from a plain DataLoader, not hetero's sampler (the `with bal.step()`
  door; a begin_step loop cuts its own batches from the sizes begin_step returns, by contract).
Each must stop both ranks with the same one `hetero:` line (never a socket error or a hang). Two gloo ranks per
door, every case in the same two processes, each with a fresh process group (a refusal posts its line and destroys
the group). A framework's cells run the framework's own launch path (the trainer builds the process group from the
environment) in two processes of their own, each of which must exit non-zero with the line; a misuse the framework
makes impossible is listed in IMPOSSIBLE with the reason.

A rank that refuses alone while its peer waits in DDP's all-reduce (the held cells, HELD): the peer must raise the
same line within seconds, not at the group's timeout (300 s there), and both processes exit non-zero. (The loop
doors' cases above keep a 15 s group timeout: FSDP2's own collectives still wait it out where one rank stops.)"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetero

if __name__ != "__main__":  # under pytest; each rank runs this file as its own script, where tests/ is off the path
    from helpers import clean_env, free_port

pytestmark = pytest.mark.slow  # four two-rank launches of the loop doors, one per framework cell, one held cell

N, B, M = 64, 16, 4  # samples, global batch, micro-batch (counts [3, 1] or [1, 3] of 4)
MISUSES = ("fewer", "more", "no_epoch", "plain_loader")
DOORS = [("step", "ddp"), ("step", "fsdp"), ("begin_end", "ddp"), ("begin_end", "fsdp")]


def _net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


BUILT: list[torch.nn.Module] = []  # every model built, kept alive as a script's global model is


def _model(kind: str) -> torch.nn.Module:
    net = _net()
    if kind == "ddp":
        BUILT.append(DDP(net))
        return BUILT[-1]
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
        # a rank whose peer stopped alone learns the posted line within a second in a DDP all-reduce or hetero's
        # gathers (docs/reliability.md); FSDP2's own collectives end at the group's timeout
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
    from helpers import spawned  # here: the framework cells run this file as a script, without tests/ on the path

    return request.param, spawned(_worker, out, 2, (*request.param, ports))


@pytest.mark.parametrize("misuse", MISUSES)
def test_every_door_refuses_every_misuse_alike_on_every_rank(door, misuse):
    (name, kind), ranks = door
    if misuse == "plain_loader" and name != "step":
        pytest.skip("a begin_step loop cuts its own batches from the sizes begin_step returns")
    r = [ranks[0][misuse], ranks[1][misuse]]
    assert not r[0]["other"] and not r[1]["other"], r                       # no socket error, no traceback
    assert r[0]["error"] and r[0]["error"] == r[1]["error"], r              # the same line on both ranks
    assert r[0]["error"].startswith("hetero: ") and "\n" not in r[0]["error"]


# -- the framework doors: Lightning and the Hugging Face Trainer ------------------------------------------------
# A cell's misuse as the framework lets a user express it. Lightning and HeteroTrainer run each rank's micro-batches
# themselves, so "fewer" and "more" are the settings that would make them run one fixed count on every rank, which
# hetero refuses at the start of the fit on every rank alike (a per-rank count k_i needs hetero's own schedule).
FRAMEWORK_CELLS = {
    ("lightning", "fewer"): "Balance(micro_batch=4): Lightning would run one count of micro-batches on every rank",
    ("lightning", "more"): "accumulate_grad_batches=2: a fixed count of 2 on every rank, whatever the planned k_i",
    ("lightning", "plain_loader"): "a plain DataLoader(batch_size=8) instead of hetero's batch sampler",
    ("hf", "fewer"): "gradient_accumulation_steps=2 without Balance(micro_batch=...): the Trainer's fixed G per rank",
    ("hf", "more"): "Balance(micro_batch=2) with per_device_train_batch_size=4: micro-batches bigger than planned",
    ("hf", "plain_loader"): "get_train_dataloader returning a plain DataLoader instead of hetero's sampler",
}
IMPOSSIBLE = {  # (door, misuse): why the framework cannot express it
    ("lightning", "no_epoch"): "BalanceCallback.on_train_epoch_start calls bal.set_epoch(trainer.current_epoch) "
                               "before every epoch (and Lightning calls the sampler's set_epoch): a fit cannot skip it",
    ("hf", "no_epoch"): "HeteroTrainer's callback calls bal.set_epoch at every on_epoch_begin, before the Trainer "
                        "iterates the loader: a train() cannot skip it",
}
FRAMEWORKS = [(d, m) for d in ("lightning", "hf") for m in MISUSES]


def _lightning_cell(misuse: str) -> None:
    import lightning as L

    data = TensorDataset(torch.randn(N, 8, generator=torch.Generator().manual_seed(1)),
                         torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2)))

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)
    bal = hetero.Balance(global_batch=B, scheme="edp", micro_batch=M if misuse == "fewer" else 0)
    loader = (DataLoader(data, batch_size=B // 2) if misuse == "plain_loader" else
              DataLoader(data, batch_sampler=bal.batch_sampler(N)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, use_distributed_sampler=False,
                        accumulate_grad_batches=2 if misuse == "more" else 1, callbacks=[hetero.BalanceCallback(bal)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), loader)


def _hf_cell(misuse: str, out: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import TrainingArguments

    from hetero.integrations.hf import HeteroTrainer

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randn(N, 8, generator=torch.Generator().manual_seed(1))
            self.y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))

        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x, labels):
            return {"loss": F.cross_entropy(self.net(x), labels)}

    class PlainLoader(HeteroTrainer):
        def get_train_dataloader(self):
            self.balance.batch_sampler(len(self.train_dataset))  # the epoch's length; the loader is not hetero's
            return DataLoader(self.train_dataset, batch_size=B // 2)
    micro = {"more": 2}.get(misuse, 0)
    bal = hetero.Balance(global_batch=B, scheme="edp", micro_batch=micro)
    accumulate = 2 if misuse == "fewer" else 1
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=B // 2 // accumulate,
                             gradient_accumulation_steps=accumulate, num_train_epochs=2, optim="sgd",
                             learning_rate=0.5, use_cpu=True, save_strategy="no", logging_strategy="no", report_to=[],
                             disable_tqdm=True, ddp_find_unused_parameters=False)
    cls = PlainLoader if misuse == "plain_loader" else HeteroTrainer
    cls(model=Net(), args=args, train_dataset=Rows(), balance=bal).train()


def _held_cell(door: str, misuse: str) -> None:
    """A DDP loop where rank 0 refuses alone while rank 1 waits in the step's all-reduce (the group's timeout:
    300 s): with `step`, rank 0 steps its optimizer after 2 of its 3 micro-batches; with `begin_end`, it syncs at
    its 2nd."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    _case(door, "ddp", misuse)


def main(door: str, misuse: str, out: str) -> int:
    """One rank of one cell (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment): writes what it raised
    to OUT/rankR.json; exit status 1 when it raised, 0 when the cell ran through."""
    torch.set_num_threads(1)
    rank, t0, result = int(os.environ["RANK"]), time.monotonic(), {"error": "", "type": ""}
    try:
        if door == "lightning":
            _lightning_cell(misuse)
        elif door == "hf":
            _hf_cell(misuse, out)
        else:
            _held_cell(door, misuse)
    except Exception as e:  # noqa: BLE001 - the line, whatever class carries it, is what the test checks
        result = {"error": str(e), "type": type(e).__name__}
    result.update(seconds=time.monotonic() - t0, pid=os.getpid())
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    print(f"{result['type']}: {result['error']}" if result["error"] else "ran through", file=sys.stderr, flush=True)
    if door in ("step", "begin_end") and rank == 0:  # held cells: the refusing rank (and the store) stays until the
        _outlive(Path(out, "rank1.json"))             # peer is gone, so the peer cannot owe its line to this exit
    return 1 if result["error"] else 0


def _outlive(peer: Path, limit_s: float = 200) -> None:
    """Until the peer's process (its pid in its result file) has exited (a zombie counts as exited), at most
    limit_s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{json.loads(peer.read_text())['pid']}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            if peer.exists():  # the result is there and its process is gone
                return
        except ValueError:  # the result half written
            pass
        time.sleep(0.1)


def _launch(tmp_path: Path, door: str, misuse: str, timeout_s: float = 150) -> list[dict]:
    """Two processes of one cell, as a launcher starts them (rank 0 hosts the store); each rank's exit status and
    what it raised. The timeout is far below the held cells' group timeout: a wait there fails the test."""
    env = {**clean_env(threads="1"), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, __file__, door, misuse, str(tmp_path)], cwd=tmp_path,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errs = [p.communicate(timeout=timeout_s)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [{**json.loads((tmp_path / f"rank{r}.json").read_text()), "returncode": p.returncode, "stderr": e}
            for r, (p, e) in enumerate(zip(procs, errs))]


@pytest.mark.parametrize("door, misuse", FRAMEWORKS, ids=[f"{d}-{m}" for d, m in FRAMEWORKS])
def test_every_framework_door_refuses_every_misuse_it_can_express_on_every_rank(tmp_path, door, misuse):
    if (door, misuse) in IMPOSSIBLE:
        pytest.skip(f"impossible through {door}: {IMPOSSIBLE[door, misuse]}")
    pytest.importorskip("lightning" if door == "lightning" else "transformers")
    r = _launch(tmp_path, door, misuse)
    assert all(x["returncode"] != 0 for x in r), r                           # every rank exits non-zero
    assert r[0]["error"] and r[0]["error"] == r[1]["error"], r              # the same line on both ranks
    assert r[0]["error"].startswith("hetero: ") and "\n" not in r[0]["error"], (FRAMEWORK_CELLS[door, misuse], r)


# rank 0 refuses at its optimizer step (the guard); a refusal inside the hook (begin_end's early sync) reaches the
# same watcher, and the matrix's begin_end-ddp "fewer" case has it (its peer no longer waits out the 15 s there)
HELD = [("step", "fewer")]


@pytest.mark.parametrize("door, misuse", HELD, ids=[f"{d}-{m}" for d, m in HELD])
def test_a_refusal_does_not_leave_the_peer_in_ddps_all_reduce(tmp_path, door, misuse):
    """Rank 0 refuses (its optimizer step after 2 of its 3 micro-batches) while rank 1 is inside DDP's all-reduce,
    which destroying the group does not end while the DDP model lives (here in BUILT, as a script's global model).
    Rank 0's process (which hosts the store) stays until rank 1 has exited, as a script that catches the error or
    a notebook would: rank 1 must raise rank 0's line without rank 0's exit closing the sockets, long before the
    group's 300 s timeout (the launch's own limit is 150 s; before #36 it waited for the timeout), and both ranks
    exit non-zero."""
    r = _launch(tmp_path, door, misuse)
    assert all(x["returncode"] == 1 for x in r), r
    assert r[0]["error"].startswith("hetero: rank 0 ") and r[0]["error"] == r[1]["error"], r
    assert r[1]["type"] == "HeteroError" and "\n" not in r[1]["error"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's hetero
    sys.exit(main(*sys.argv[1:4]))
