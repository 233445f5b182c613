"""The library as users misuse it: ranks whose Balances disagree, a loop counting its own micro-batches, an optimizer
step on gradients that were not all-reduced, a step without attach, a loader peeked at, bad arguments. Each stops
every rank with the same one line (never a socket error, a hang or a silently wrong run). Two-rank cases run as gloo
processes started by torch.multiprocessing.spawn; each rank writes what it saw to a JSON file.
Here the cases in one process; those that launch processes: tests/integration/test_misuse_launch.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hetero
import hetero.core.settle

from helpers import Indexed


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

    from hetero.lab.launch import free_port

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
