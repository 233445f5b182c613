"""The library as users misuse it: ranks whose Balances disagree, a loop counting its own micro-batches, an optimizer
step on gradients that were not all-reduced, a step without attach, a loader peeked at, bad arguments. Each stops
every rank with the same one line (never a socket error, a hang or a silently wrong run). Two-rank cases run as gloo
processes started by torch.multiprocessing.spawn; each rank writes what it saw to a JSON file.

The launches: the library as users misuse it: ranks whose Balances disagree, a loop counting its own micro-batches,
an optimizer step on gradients that were not all-reduced, a step without attach, a loader peeked at, bad arguments.
Each stops every rank with the same one line (never a socket error, a hang or a silently wrong run). Two-rank cases
run as gloo processes started by torch.multiprocessing.spawn; each rank writes what it saw to a JSON file. Three
launches: the disagreeing Balances, a rank leaving an epoch early (it waits out the group's timeout), and every other
case in turn in the same two processes (MANY, at the end), each on a process group of its own."""
from __future__ import annotations

import datetime
import json
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hetero
import hetero.core.probe
import hetero.core.settle

from helpers import Indexed, free_port, max_diff, sgd_step, spawned


# -- one process ----------------------------------------------------------------------------------------------------
def test_a_peek_at_the_loader_names_the_second_iteration(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    bal = hetero.Balance(global_batch=8)
    loader = torch.utils.data.DataLoader(Indexed(32), batch_sampler=bal.batch_sampler(32))
    next(iter(loader))  # the tutorial's peek, to learn a batch's size
    bal.set_epoch(0)
    with pytest.raises(hetero.HeteroError, match=r"the loader was iterated twice in epoch 0 \(a `next\(iter\("):
        list(loader)


def test_a_loop_without_epochs_decides_every_k_steps(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(hetero.core.plan, "gather_rows", lambda row, dev: torch.stack(  # times x 2, then the tail
        [torch.cat([torch.full((len(row) - 4,), 1e-3, dtype=torch.float64), row[-4:]]),
         torch.cat([torch.full((len(row) - 4,), 3e-3, dtype=torch.float64), row[-4:]])]))
    bal = hetero.Balance(global_batch=32, scheme="dp", rebalance_every=5)
    for _ in range(50):  # no batch_sampler, no set_epoch: one endless epoch
        with bal.step():
            pass
    assert len(bal.decisions) == 10 and [d.effective for d in bal.decisions[:2]] == [5, 10]
    assert bal.last_sizes[0] > bal.last_sizes[1] and bal.micro_batches == 1
    with pytest.raises(hetero.HeteroError, match="without an epoch length"):
        bal.set_epoch(1)
    with pytest.raises(hetero.HeteroError, match="rebalance_every > 0"):
        with hetero.Balance(global_batch=32, scheme="dp").step():
            pass


@pytest.mark.parametrize("kw, match", [
    ({"global_batch": 64.5}, "global_batch must be a whole number"), ({"global_batch": "256"}, "global_batch"),
    ({"global_batch": None}, "global_batch"), ({"rebalance_every": "3"}, "rebalance_every"),
    ({"rebalance_every": 1.5}, "rebalance_every"), ({"max_batch": "abc"}, "max_batch"),
    ({"seed": -1}, "seed must be a whole number >= 0"), ({"seed": "x"}, "seed"),
    ({"hetero": "5:delay=1"}, "hetero names rank 5, but the world has 2"), ({"sit_out": True}, "affine scheme only"),
    ({"micro_batch": True}, "micro_batch"), ({"smoothing": 1.0}, "smoothing"), ({"significance": -1}, "significance"),
    ({"hetero": 3}, "hetero must be a string")])
def test_bad_library_arguments_are_one_clear_line(monkeypatch, kw, match):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=match):
        args = {"global_batch": 32, **kw}
        spec = args.pop("hetero", "")  # the emulation grammar, plugged in with bal.emulate
        hetero.Balance(**args).emulate(spec)


def test_a_loop_that_never_calls_set_epoch_is_refused_at_its_second_epoch():
    """#36 item 3: it ran epoch 0's steps, then silently none in the epochs after."""
    bal = hetero.Balance(global_batch=8)
    sampler = bal.batch_sampler(32)
    assert len(list(sampler)) == 4
    for _ in range(4):
        with bal.step():
            pass
    with pytest.raises(hetero.HeteroError, match="iterated again: call bal.set_epoch"):
        list(sampler)


def test_a_plain_dataloader_is_refused_before_its_first_step():
    """#36 item 3: batches not handed out by hetero's sampler (the epoch length given, the loader a plain one)."""
    bal = hetero.Balance(global_batch=8)
    bal.batch_sampler(32)
    bal.set_epoch(0)
    with pytest.raises(hetero.HeteroError, match="not handed out by hetero's sampler"):
        with bal.step():
            pass
    assert bal.position.global_step == 0


def test_a_second_attach_is_refused_in_one_line(monkeypatch):
    """#36 item 7: a second bal.attach went on and the first step stopped with a misleading line."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        bal = hetero.Balance(global_batch=8)
        bal.attach(DDP(torch.nn.Linear(2, 2)))
        with pytest.raises(hetero.HeteroError, match="attached already"):
            bal.attach(DDP(torch.nn.Linear(2, 2)))
    finally:
        dist.destroy_process_group()


def test_a_replay_in_a_loop_without_epochs_needs_no_rebalance_interval(monkeypatch):
    """#36 item 7: rebalance_every=0 was refused under bal.replay, where no decision is ever made."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=8, scheme="edp")
    bal.replay({0: np.array([[6, 2]] * 5)})
    for _ in range(5):
        with bal.step():
            pass
    assert bal.last_sizes == [6, 2] and bal.decisions == []


# the cases that launch processes
PROBE = hetero.core.probe.probe_max_batch


def _spawn(fn, tmp_path, *args, world: int = 2) -> list[dict]:
    return spawned(fn, tmp_path, world, args)


def _join(rank: int, world: int = 2, timeout_s: float = 60) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # a rank left waiting fails at the timeout instead of hanging the test (the checks must answer in seconds)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _write(out: str, rank: int, result: dict) -> None:
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


# -- ranks that disagree ----------------------------------------------------------------------------------------
CASES = {  # name: (rank 0's Balance arguments, rank 1's); each must stop both ranks with the same line
    "seed": ({"seed": 0}, {"seed": 1}),
    "scheme": ({"scheme": "edp"}, {"scheme": "affine"}),
    "global_batch": ({"global_batch": 64}, {"global_batch": 32}),
    "rebalance_every": ({"rebalance_every": 2}, {"rebalance_every": 3}),
    "hetero": ({"hetero": "1:slowdown=3"}, {"hetero": ""}),
    "n_samples": ({}, {}),   # different data set lengths
    "epoch": ({}, {}),       # rank 1 calls set_epoch(epoch + 1)
}


def _disagree_worker(rank: int, out: str) -> None:
    """Every case in turn, in the same two processes (each refusal ends in a completed collective)."""
    _join(rank)
    results = {}
    for case, kws in CASES.items():
        result = results[case] = {"error": "", "steps": 0}
        try:
            args = {"global_batch": 32, **kws[rank]}
            spec = args.pop("hetero", "")  # an emulated slow rank, plugged in as the trainer does
            bal = hetero.Balance(**args)
            bal.emulate(spec)
            ddp = DDP(_net())
            bal.attach(ddp)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            n = 320 if case != "n_samples" or rank == 0 else 288
            sampler = bal.batch_sampler(n)
            ds = Indexed(n)
            bal.set_epoch(1 if case == "epoch" and rank == 1 else 0)
            for batch in sampler:
                x, y, _ = zip(*(ds[i] for i in batch))
                with bal.step():
                    F.cross_entropy(ddp(torch.stack(x)), torch.tensor(y)).backward()
                    opt.step()
                    opt.zero_grad()
                result["steps"] += 1
        except hetero.HeteroError as e:
            result["error"] = str(e)
    _write(out, rank, results)


@pytest.fixture(scope="module")
def disagreements(tmp_path_factory) -> list[dict]:
    return _spawn(_disagree_worker, tmp_path_factory.mktemp("disagree"))


@pytest.mark.launch
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_disagree_stop_alike_with_one_line_naming_the_field(disagreements, case):
    r = [rank[case] for rank in disagreements]
    assert r[0]["error"] and r[0]["error"] == r[1]["error"], r      # the same line on both ranks
    assert r[0]["error"].startswith("hetero: ") and "\n" not in r[0]["error"]
    assert f"disagree on {case}" in r[0]["error"]
    assert r[0]["steps"] == r[1]["steps"] == 0                     # caught before any step trained


def _early_worker(rank: int, out: str) -> None:
    """Rank 1 leaves epoch 0 after 3 of its 10 steps (a `break`), then starts epoch 1. Rank 0 is then left inside
    step 3 until the process group's timeout (10 s here): only then can a peer still in the epoch be told from a
    slow one."""
    _join(rank, timeout_s=10)
    result = {"error": ""}
    try:
        bal = hetero.Balance(global_batch=32)
        ddp = DDP(_net())
        bal.attach(ddp)
        sampler, ds = bal.batch_sampler(320), Indexed(320)
        for epoch in range(2):
            bal.set_epoch(epoch)
            for step, batch in enumerate(sampler):
                if rank == 1 and epoch == 0 and step == 3:
                    break
                x, y, _ = zip(*(ds[i] for i in batch))
                with bal.step():
                    F.cross_entropy(ddp(torch.stack(x)), torch.tensor(y)).backward()
    except hetero.HeteroError as e:
        result["error"] = str(e)
    _write(out, rank, result)


def _limited_worker(rank: int, out: str) -> None:
    """Every rank runs only 4 of each epoch's 10 steps (Lightning's limit_train_batches): a valid run."""
    _join(rank)
    bal = hetero.Balance(global_batch=32, scheme="dp", rebalance_every=2)
    ddp = DDP(_net())
    bal.attach(ddp)
    sampler, ds = bal.batch_sampler(320), Indexed(320)
    for epoch in range(3):
        bal.set_epoch(epoch)
        for step, batch in enumerate(sampler):
            if step == 4:
                break
            x, y, _ = zip(*(ds[i] for i in batch))
            with bal.step():
                F.cross_entropy(ddp(torch.stack(x)), torch.tensor(y)).backward()
    _write(out, rank, {"steps": bal.position.global_step})


@pytest.mark.launch
def test_every_rank_leaving_early_alike_is_a_valid_run(cases):
    assert [r["steps"] for r in cases["limited"]] == [12, 12]


@pytest.mark.launch
@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
def test_a_rank_leaving_an_epoch_early_is_named_on_every_rank(tmp_path):
    r = _spawn(_early_worker, tmp_path)
    assert r[0]["error"] == r[1]["error"], r
    assert r[0]["error"].startswith("hetero: rank 1 left epoch 0 after 3 of its 10 steps while another rank went on")


# -- a loop counting its own micro-batches (nanoGPT's) ----------------------------------------------------------
def _nanogpt_worker(rank: int, out: str, fixed: int) -> None:
    """`for micro_step in range(fixed)` inside bal.step(), counts [1, 3] of m = 4; fixed=0: bal.micro_batches."""
    _join(rank)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2))
    result = {"error": "", "stepped": False}
    model = _net()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        bal = hetero.Balance(global_batch=16, micro_batch=4)  # counts [1, 3]
        bal.replay({0: np.array([[4, 12]] * 4)})
        ddp = DDP(model)
        bal.attach(ddp)  # a loop without epochs, as nanoGPT's: no sampler, its own batches
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        counts = fixed or bal.micro_batches
        start = 0 if rank == 0 else int(bal.sizes_at(0, 0)[0])  # the loop cuts its own slice of the step
        for micro in range(counts):  # this rank's slice of the step's 16 samples, in micro-batches of 4
            lo = start + 4 * micro
            with bal.step():
                F.cross_entropy(ddp(x[lo:lo + 4]), y[lo:lo + 4]).backward()
        opt.step()
        result["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
        # what the exit waits for: gloo's threads have freed every callback of the hook (none left to free
        # while the interpreter shuts down)
        result["callbacks_freed"] = hetero.core.settle.settle.wait(timeout_s=10)
    except hetero.HeteroError as e:
        result["error"] = str(e)
    result["stepped"] = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    _write(out, rank, result)


@pytest.mark.launch
def test_a_fixed_accumulation_loop_with_unequal_counts_stops_every_rank_before_a_wrong_step(cases):
    r = cases["fixed_count"]
    assert r[0]["error"] == r[1]["error"], r          # one line on both ranks, not "Connection closed by peer"
    assert r[0]["error"].startswith("hetero: rank 1 stepped its optimizer after 2 of its 3 micro-batches")
    assert "bal.micro_batches" in r[0]["error"]
    assert not r[0]["stepped"] and not r[1]["stepped"]  # no optimizer step on gradients that were not all-reduced


@pytest.mark.launch
def test_a_loop_running_bal_micro_batches_is_exact(cases):
    r = cases["own_counts"]
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2))
    model = _net()
    F.cross_entropy(model(x[:16]), y[:16]).backward()  # the union of the ranks' micro-batches: one global batch
    want = sgd_step(model)
    for rank in r:
        assert not rank["error"] and max_diff(rank["params"], want) < 1e-6
        assert rank["callbacks_freed"]


def _extra_steps_worker(rank: int, out: str) -> None:
    """Counts [1, 1] and a fixed loop of 2: every micro-batch syncs, but two steps go into one optimizer step."""
    _join(rank)
    result = {"error": ""}
    try:
        bal = hetero.Balance(global_batch=8, micro_batch=4)
        bal.replay({0: np.array([[4, 4]] * 4)})
        ddp = DDP(_net())
        bal.attach(ddp)  # a loop without epochs, cutting its own batches
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for _ in range(2):
            with bal.step():
                F.cross_entropy(ddp(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
    except hetero.HeteroError as e:
        result["error"] = str(e)
    _write(out, rank, result)


@pytest.mark.launch
def test_two_steps_of_the_schedule_in_one_optimizer_step_are_refused_on_every_rank(cases):
    r = cases["extra_steps"]
    assert r[0]["error"].startswith("hetero: rank 0 ran 2 steps of the schedule")
    assert r[1]["error"].startswith("hetero: rank 1 ran 2 steps of the schedule")


# -- a step without attach; a Balance built on a guess -----------------------------------------------------------
def _no_attach_worker(rank: int, out: str) -> None:
    _join(rank)
    result = {"error": ""}
    try:
        bal = hetero.Balance(global_batch=32)
        ddp = DDP(_net())
        bal.batch_sampler(320)  # the epoch's length
        bal.set_epoch(0)
        with bal.step():
            F.cross_entropy(ddp(torch.randn(16, 8)), torch.zeros(16, dtype=torch.long)).backward()
    except hetero.HeteroError as e:
        result["error"] = str(e)
    _write(out, rank, result)


@pytest.mark.launch
def test_a_step_without_attach_is_refused(cases):
    r = cases["no_attach"]
    assert r[0]["error"] == r[1]["error"] and "call bal.attach(ddp) before the first step" in r[0]["error"]


def _guess_worker(rank: int, out: str) -> None:
    """Both ranks build their Balance before the process group, with no RANK in the environment (as under
    Lightning's launcher when it is built in the launched processes); one is told it is rank 0 of 1."""
    os.environ.pop("RANK", None)
    os.environ["WORLD_SIZE"] = "2"
    result = {"error": "", "build": ""}
    try:
        _ = hetero.Balance(global_batch=32).rank  # reading the rank is what refuses
    except hetero.HeteroError as e:
        result["build"] = str(e)  # WORLD_SIZE without RANK: refused, not guessed
    bal = hetero.Balance(global_batch=32)
    bal.set_world(0, 1)  # a wrong guess, made explicit
    _join(rank)
    try:
        bal.attach(DDP(_net()))
    except hetero.HeteroError as e:
        result["error"] = str(e)
    _write(out, rank, result)


@pytest.mark.launch
def test_a_balance_on_a_wrong_rank_is_refused_at_attach_on_every_rank(cases):
    r = cases["guess"]
    assert "WORLD_SIZE is set but neither RANK nor a process group" in r[0]["build"]
    assert r[0]["error"] == r[1]["error"]
    assert r[0]["error"].startswith("hetero: at attach, rank 0 of the process group's 2 holds a Balance for rank 0 "
                                    "of 1: it was built before its launcher set the rank and world")


# -- the largest-batch probe: one path (the trainer calls it too), a rank's failure stops every rank alike ----------
def _probe_worker(rank: int, out: str, case: str) -> None:
    _join(rank)
    result = {"error": "", "limits": None}
    try:
        bal = hetero.Balance(global_batch=32, max_batch="probe")
        if case == "fails" and rank == 1:  # this rank's probe fails (on a GPU: not even min_batch fits)
            def fails(*args, **kwargs):
                raise RuntimeError("not even 1 sample fits on cuda:0 (the model alone fills it)")
            hetero.core.probe.probe_max_batch = fails
        # "shared": both ranks say they are on one physical GPU of this host
        limits = bal.probe(_net(), (8,), 3, torch.device("cpu"), gpu="uuid GPU-same" if case == "shared" else "")
        result["limits"] = [None if v == float("inf") else v for v in limits]
    except hetero.HeteroError as e:
        result["error"] = str(e)
    finally:
        hetero.core.probe.probe_max_batch = PROBE  # the next case in this process probes for real
    _write(out, rank, result)


@pytest.mark.launch
@pytest.mark.parametrize("case, line", [
    ("fails", "hetero: the largest-batch probe failed on rank 1: not even 1 sample fits on cuda:0"),
    ("shared", 'hetero: max_batch "probe" needs a GPU of its own per rank: ranks 0, 1 share cpu on ')])
def test_a_probe_failing_on_one_rank_stops_every_rank_with_its_line(cases, case, line):
    r = cases[f"probe_{case}"]                     # returned at all: no rank left waiting in the gather
    assert r[0]["error"] == r[1]["error"], r       # the same line on every rank
    assert r[0]["error"].startswith(line), r
    assert r[0]["limits"] is None and r[1]["limits"] is None


@pytest.mark.launch
def test_a_probe_on_cpu_ranks_answers_no_limit_on_every_rank(cases):
    r = cases["probe_cpu"]
    assert r[0] == r[1] == {"error": "", "limits": [None, None]}


# -- every case above that needs no launch of its own, in one -----------------------------------------------------
def _loss_peer_worker(rank: int, out: str) -> None:
    """weighting="loss", counts [1, 3] of m = 4: rank 1 runs its first micro-batch's backward outside bal.backward
    and is refused at its second, while rank 0 waits inside DDP's C++ all-reduce, which no watcher can end. Rank 0
    is released when rank 1's process exits (this case is MANY's last, so it exits right after) and raises rank 1's
    line."""
    _join(rank)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2))
    result, t0 = {"error": "", "waited_s": 0.0}, time.monotonic()
    try:
        bal = hetero.Balance(global_batch=16, micro_batch=4, weighting="loss")
        bal.replay({0: np.array([[4, 12]] * 4)})
        ddp = DDP(_net())
        bal.attach(ddp)
        for micro in range(bal.micro_batches):
            with bal.step():
                loss = F.cross_entropy(ddp(x[4 * micro:4 * micro + 4]), y[4 * micro:4 * micro + 4])
                t0 = time.monotonic()
                loss.backward() if rank == 1 and micro == 0 else bal.backward(loss)
    except hetero.HeteroError as e:
        result.update(error=str(e), waited_s=time.monotonic() - t0)
    _write(out, rank, result)


@pytest.mark.launch
def test_a_refusal_with_the_weight_on_the_loss_reaches_a_peer_inside_ddps_own_all_reduce(cases):
    r = cases["loss_peer"]
    assert r[1]["error"].startswith("hetero: a backward ran outside bal.backward(loss) in step 0 of epoch 0 on rank 1")
    assert r[0]["error"] == r[1]["error"]                # the peer's line, not gloo's "Connection closed by peer"
    assert r[0]["waited_s"] < 40                         # at rank 1's exit, not at the group's timeout (60 s)


MANY = {  # name: (worker, its arguments); each case in the same two processes, with a process group of its own
    "limited": (_limited_worker, ()),
    "own_counts": (_nanogpt_worker, (0,)),  # before any refusal: it checks that every callback of the process is freed
    "fixed_count": (_nanogpt_worker, (2,)),
    "extra_steps": (_extra_steps_worker, ()),
    "no_attach": (_no_attach_worker, ()),
    "guess": (_guess_worker, ()),
    "probe_fails": (_probe_worker, ("fails",)),
    "probe_shared": (_probe_worker, ("shared",)),
    "probe_cpu": (_probe_worker, ("cpu",)),
    "loss_peer": (_loss_peer_worker, ()),  # last: rank 0 waits in DDP's all-reduce until rank 1's process exits
}


def _many_worker(rank: int, out: str, ports: list[int]) -> None:
    """Every case of MANY in turn, each on a port of its own (its worker forms the group and destroys it), writing
    OUT/NAME/rankR.json; then OUT/rankR.json, every case's result by name."""
    results = {}
    for (name, (worker, args)), port in zip(MANY.items(), ports):
        os.environ["MASTER_PORT"] = str(port)
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        worker(rank, folder, *args)
        with open(os.path.join(folder, f"rank{rank}.json")) as f:
            results[name] = json.load(f)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, list[dict]]:
    """The ranks' results of every case in MANY, by name: one launch."""
    ranks = _spawn(_many_worker, tmp_path_factory.mktemp("many"), [free_port() for _ in MANY])
    return {name: [rank[name] for rank in ranks] for name in MANY}
