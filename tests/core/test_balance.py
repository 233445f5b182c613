"""The public API (hetero.Balance): the batch sampler's cut, the decision schedule under DataLoader workers, the
exact EDP gradient (also with GradScaler and clipping), refusals, and checkpoints. Two-rank cases run as two gloo
processes started by torch.multiprocessing.spawn."""
from __future__ import annotations

import io
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


def _balance(monkeypatch, rank: int, world: int = 2, emulate: str = "", replay=None, **kw) -> hetero.Balance:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    bal = hetero.Balance(**kw)
    bal.emulate(emulate)
    if replay is not None:
        bal.replay(replay)
    return bal


# -- one process: the sampler's cut ----------------------------------------------------------------------------
def test_a_loader_built_before_the_world_is_bound_reads_that_world(monkeypatch):
    """Lightning's own launcher: the script builds the Balance, its emulation and the loader's sampler in a process
    with no world yet, and the callback binds rank 1 of 2 later. The sampler then hands out rank 1's slices of a
    2-rank plan (a sampler that bound a 1-rank world at construction refused "1:slowdown=3" outright)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    bal = hetero.Balance(global_batch=32)
    bal.emulate("1:slowdown=3")
    sampler = bal.batch_sampler(100, seed=4)
    with pytest.raises(ValueError, match="exceeds the 16 samples"):
        bal.batch_sampler(16)  # the length is still checked at once
    bal.set_world(1, 2)
    bal.set_epoch(0)
    batches = list(sampler)
    assert len(sampler) == len(batches) == 3 and bal.world == 2
    assert batches[0] == EpochPlan(100, 32, 4, 0).perm[16:32].tolist()  # rank 1's half of step 0's window


@pytest.mark.parametrize("n, B, limits", [(100, 32, [5, None]), (97, 10, [None, 3]), (64, 64, None)])
def test_sampler_slices_are_disjoint_complete_and_equal_in_steps(monkeypatch, n, B, limits):
    per_rank = []
    for r in range(2):
        bal = _balance(monkeypatch, r, global_batch=B, max_batch=limits)
        sampler = bal.batch_sampler(n, seed=4)
        bal.set_epoch(3)
        per_rank.append(list(sampler))
    assert len(per_rank[0]) == len(per_rank[1]) == n // B                    # equal steps on every rank
    for s, (a, b) in enumerate(zip(*per_rank)):
        assert len(a) + len(b) == B and not set(a) & set(b)                  # the step's window, split
        assert sorted(a + b) == sorted(EpochPlan(n, B, 4, 3).perm[s * B:(s + 1) * B].tolist())
    seen = [i for rank in per_rank for batch in rank for i in batch]
    assert len(seen) == len(set(seen)) == (n // B) * B                      # each sample at most once
    if limits == [5, None]:
        assert [len(b) for b in per_rank[0]] == [5] * (n // B)               # the bound holds


def test_sampler_refuses_an_epoch_handed_out_twice(monkeypatch):
    bal = _balance(monkeypatch, 0, global_batch=8)
    sampler = bal.batch_sampler(32)
    bal.set_epoch(0)
    list(sampler)
    with pytest.raises(RuntimeError, match="iterated twice in epoch 0"):
        list(sampler)
    bal.set_epoch(1)
    assert len(list(sampler)) == 4


@pytest.mark.parametrize("kw, match", [({"scheme": "fast"}, "unknown scheme"), ({"max_batch": [3, 3]}, "exceeds"),
                                       ({"min_batch": 0}, "min_batch"), ({"max_batch": [1, 2, 3]}, "entries"),
                                       ({"emulate": "1:slow=3"}, "EFFECT"), ({"lag": -1}, "lag")])
def test_bad_settings_raise_one_clear_error(monkeypatch, kw, match):
    with pytest.raises(ValueError, match=match):
        _balance(monkeypatch, 0, global_batch=16, **kw)


def _window_sizes(bal, row) -> torch.Tensor:
    """The sizes of the steps a fake gather's row covers ([compute x n, cpu x n, 4 more]): the last n records."""
    n = (len(row) - 4) // 2
    return torch.tensor(np.stack([r.sizes for r in bal.epoch_records()[-n:]]), dtype=torch.float64)


def _two_epochs_of_a_3x_slower_rank_1(monkeypatch, bal, sampler) -> None:
    """One process plays rank 0 of two through two epochs; the gather is faked with injected compute times: 1 ms per
    sample on rank 0, 3 ms on rank 1 (the tail as this rank measured it: no quota, the pace, the sampler's position)."""
    def fake_gather(row, device):
        sizes, tail = _window_sizes(bal, row), row[-4:]
        t0, t1 = 1e-3 * sizes[:, 0], 3e-3 * sizes[:, 1]
        return torch.stack([torch.cat([t0, t0, tail]), torch.cat([t1, t1, tail])])
    monkeypatch.setattr(hetero.core.plan, "gather_rows", fake_gather)
    for epoch in range(2):
        bal.set_epoch(epoch)
        for batch in sampler:
            with bal.step(batch_size=len(batch)):
                pass


def test_state_dict_loads_with_weights_only(monkeypatch):
    bal = _balance(monkeypatch, 0, global_batch=32, scheme="dp")
    _two_epochs_of_a_3x_slower_rank_1(monkeypatch, bal, bal.batch_sampler(64))
    buf = io.BytesIO()
    torch.save(bal.state_dict(), buf)
    buf.seek(0)
    other = _balance(monkeypatch, 1, global_batch=32, scheme="dp")
    other.batch_sampler(64)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.position == bal.position == hetero.Position(1, 2, 2, 4)
    other.set_epoch(2)
    assert other.sizes_at(2, 0).tolist() == [24, 8] and other.position.global_step == 4


def _steps(monkeypatch, bal, sampler, epoch: int, stop: int | None = None, cold: float = 0.0) -> list:
    """Rank 0 of two runs `epoch` (its first `stop` steps, or to its end); the faked gather gives 1 ms per sample on
    rank 0 and 3 ms on rank 1, and rank 0 `cold` s more at the first step this call runs (a resumed process's
    warm-up). The gathered row covers the window's last n records. Returns every rank's sizes at each step run."""
    start = bal.position.step if bal.position.epoch == epoch else 0

    def fake_gather(row, device):
        n = (len(row) - 4) // 2
        recs = bal.epoch_records()[-n:] if n else []
        t0 = torch.tensor([1e-3 * r.sizes[0] + cold * (r.step == start) for r in recs], dtype=torch.float64)
        t1 = torch.tensor([3e-3 * r.sizes[1] for r in recs], dtype=torch.float64)
        return torch.stack([torch.cat([t0, t0, row[-4:]]), torch.cat([t1, t1, row[-4:]])])
    monkeypatch.setattr(hetero.core.plan, "gather_rows", fake_gather)
    bal.set_epoch(epoch)
    sizes = []
    for i, batch in enumerate(sampler):
        with bal.step(batch_size=len(batch)):
            sizes.append(bal.last_sizes)
        if stop is not None and i + 1 == stop:
            break
    return sizes


@pytest.mark.parametrize("every", [0, 2])
def test_a_resumed_runs_first_step_is_kept_out_of_its_window(monkeypatch, every):
    """#48 item 2: a run resumed mid-epoch (rebalance_every=2, stopped after 3 steps of epoch 1) decided at its first
    step from that step alone, its process's warm-up: rank 0 looked slowest and the shares flipped. The resumed run
    now decides as the run that never stopped: the same sizes at every step after the resume."""
    kw = {"global_batch": 32, "scheme": "dp", "rebalance_every": every}
    fresh = _balance(monkeypatch, 0, **kw)
    sampler = fresh.batch_sampler(256)
    want = [_steps(monkeypatch, fresh, sampler, epoch) for epoch in (0, 1)][1][3:]
    stopped = _balance(monkeypatch, 0, **kw)
    sampler = stopped.batch_sampler(256)
    _steps(monkeypatch, stopped, sampler, 0)
    _steps(monkeypatch, stopped, sampler, 1, stop=3)
    state = stopped.state_dict()
    resumed = _balance(monkeypatch, 0, **kw)
    sampler = resumed.batch_sampler(256)
    resumed.load_state_dict(state)
    got = _steps(monkeypatch, resumed, sampler, 1, cold=0.2)  # 0.2 s: 40 times rank 0's step
    assert resumed.position == fresh.position == hetero.Position(1, 8, 8, 16)
    assert want == [[24, 8]] * 5 and got == want
    assert [d.step for d in resumed.decisions] == ([5, 7] if every else [7])  # not from the warm-up alone
    assert resumed.decisions[-1].sizes == fresh.decisions[-1].sizes == [24, 8]


@pytest.mark.parametrize("scheme", ["sync", "dp", "edp", "affine"])
def test_every_scheme_decides_through_the_one_path(monkeypatch, scheme):
    """One process plays rank 0 of two; the gather is faked with injected times (rank 1 3x slower per sample)."""
    bal = _balance(monkeypatch, 0, global_batch=32, scheme=scheme, rebalance_every=3, smoothing=0.2)
    _two_epochs_of_a_3x_slower_rank_1(monkeypatch, bal, bal.batch_sampler(320))
    if scheme == "sync":
        assert bal.decisions == [] and bal.last_sizes == [16, 16]
        return
    assert len(bal.decisions) == 8                   # steps 2, 5, 8 and the epoch's last (9), twice
    assert all(d.effective == d.epoch * 10 + d.step + 1 for d in bal.decisions)  # no prefetch: the next step
    assert bal.last_sizes == [24, 8]                 # 3x slower rank 1: a quarter


def test_probe_on_cpu_ranks_sets_no_limit_and_attach_needs_it(monkeypatch):
    bal = _balance(monkeypatch, 0, global_batch=32, max_batch=["probe", 8])
    with pytest.raises(ValueError, match="call bal.probe"):
        bal.attach(torch.nn.Linear(2, 2))  # refused before anything touches the model
    monkeypatch.setattr(hetero.core.engine.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(hetero.core.probe.dist, "is_initialized", lambda: True)  # rank 1, not probing, answers:
    monkeypatch.setattr(hetero.core.probe, "gather_json", lambda row, device: [row, {**row, "limit": None}])
    limits = bal.probe(torch.nn.Linear(2, 2), (2,), 2, torch.device("cpu"))
    assert limits == [float("inf"), 8]                     # a CPU rank is not probed; rank 1 keeps its 8
    bal.batch_sampler(64)
    bal.set_epoch(0)
    assert bal.sizes_at(0, 0).tolist() == [24, 8]


# -- what the built-in trainer uses: replay, affine's probe sizes and sit-out, per-step records -----------------
def test_replay_gives_the_recorded_sizes_and_decides_nothing(monkeypatch):
    recorded = {1: np.array([[3, 5], [6, 2], [4, 4]]), 2: np.array([[1, 7], [7, 1], [2, 6]])}
    bal = _balance(monkeypatch, 1, global_batch=8, scheme="edp", rebalance_every=1, replay=recorded)
    monkeypatch.setattr(hetero.core.plan, "gather_rows", lambda *a: pytest.fail("a replay gathers nothing"))
    bal.batch_sampler(24)
    assert bal.position.steps_per_epoch == 3
    for epoch in (1, 2):
        bal.set_epoch(epoch)
        for step in range(3):
            assert bal.begin_step(step).tolist() == recorded[epoch][step].tolist()
            assert bal.engine.running().weight == recorded[epoch][step][1] / 8  # this rank's b_i / B
            bal.end_step()
        assert [r.sizes.tolist() for r in bal.epoch_records()] == recorded[epoch].tolist()
    assert bal.decisions == []


def test_affine_probes_two_sizes_in_its_first_window_then_decides(monkeypatch):
    bal = _balance(monkeypatch, 0, global_batch=40, scheme="affine", rebalance_every=4)
    bal.batch_sampler(400)  # the epoch's length
    monkeypatch.setattr(hetero.core.plan, "gather_rows", lambda row, dev: torch.stack([row, row]))
    bal.set_epoch(1)
    seen = []
    for step in range(4):
        seen.append(tuple(bal.begin_step(step).tolist()))
        bal.end_step()
    assert len(set(seen)) == 2 and all(sum(s) == 40 for s in seen)       # +-30% alternating, sum exact
    assert len(bal.decisions) == 1 and bal.decisions[0].effective == 1 * 10 + 3 + 1


def test_a_regimes_steps_share_one_read_only_array_and_each_decision_cuts_its_own(monkeypatch):
    """Issue 51: a regime's sizes are made, checked and summed once, not every step. Its steps share one read-only
    array (no holder can write into another step's sizes), a decision's regime gets its own, and the sampler's
    slices and the step's weight follow each regime exactly as a cut from a fresh list of the sizes would."""
    bal = _balance(monkeypatch, 0, global_batch=40, scheme="edp", rebalance_every=5)
    sampler = bal.batch_sampler(400)

    def fake_gather(row, device):  # rank 1 three times slower per sample: the decision moves samples to rank 0
        sizes, tail = _window_sizes(bal, row), row[-4:]
        t0, t1 = 1e-3 * sizes[:, 0], 3e-3 * sizes[:, 1]
        return torch.stack([torch.cat([t0, t0, tail]), torch.cat([t1, t1, tail])])
    monkeypatch.setattr(hetero.core.plan, "gather_rows", fake_gather)
    bal.set_epoch(0)
    cut, held = sampler.plan(0), []
    for step, batch in enumerate(sampler):
        with bal.step(batch_size=len(batch)):
            sizes = bal.sizes_at(0, step)
            assert bal.engine.running().weight == sizes[0] / 40
            assert batch == cut.indices(step, [int(b) for b in sizes], 0).tolist()  # no memo: a fresh list
            held.append(sizes)
    assert all(a is held[0] for a in held[:5]) and all(a is held[5] for a in held[5:10])
    assert held[5] is not held[0] and held[5][0] > held[0][0] == 20  # the decision's regime, its own array
    with pytest.raises(ValueError, match="read-only"):
        held[0][0] += 1
    plan, writable = EpochPlan(400, 40, seed=0, epoch=0), np.array([20, 20])  # negative control: a writable array
    assert len(plan.index_list(0, writable, 0)) == 20                    # is cut afresh each time, never memoised
    writable[:] = [30, 10]
    assert plan.index_list(0, writable, 0) == plan.perm[:30].tolist()


def test_a_rank_sitting_out_has_weight_zero_and_no_delay(monkeypatch):
    bal = _balance(monkeypatch, 1, global_batch=8, scheme="affine", sit_out=True, emulate="1:delay=5",
                   replay={0: np.array([[8, 0], [4, 4]])})
    bal.batch_sampler(16)  # the epoch's length
    bal.set_epoch(0)
    slept = []
    monkeypatch.setattr(hetero.core.engine.time, "sleep", slept.append)
    for step in range(2):
        bal.begin_step(step)
        weight = bal.engine.running().weight
        bal.engine.gradients_ready()                                    # what the hook does when gradients are ready
        bal.mark_backward()
        bal.end_step()
        assert weight == (0.0 if step == 0 else 0.5)
    recs = bal.epoch_records()
    assert slept == [5.0] and [r.delay_s for r in recs] == [0.0, 5.0]   # only the step it computed is delayed
    assert all(r.compute_s >= 0 and r.wait_s >= 0 for r in recs)


@pytest.mark.parametrize("quota", [True, False])
def test_a_rank_under_a_cfs_quota_is_decided_on_at_the_rate_its_quota_sustains(monkeypatch, quota):
    """The gathered row carries each rank's quota and the CPU of its steps (one process plays rank 0 of two; the
    gather is faked): rank 1 computes as fast as rank 0 (its steps start with quota banked), but its CPU at a third
    of a core takes 3x as long. With the quota in its row its share falls to a quarter; without, it stays a half."""
    bal = _balance(monkeypatch, 0, global_batch=32, scheme="dp", rebalance_every=4)
    sampler = bal.batch_sampler(320)

    def fake_gather(row, device):  # [compute x n, cpu x n, quota_s, period_s, pace, handed] per rank
        sizes = _window_sizes(bal, row)
        t0, t1 = 1e-3 * sizes[:, 0], 1e-3 * sizes[:, 1]
        q = torch.tensor([0.1 / 3, 0.1] if quota else [float("inf")] * 2, dtype=torch.float64)
        none = torch.tensor([float("inf")] * 2, dtype=torch.float64)
        return torch.stack([torch.cat([t0, t0, none, row[-2:]]), torch.cat([t1, t1, q, row[-2:]])])
    monkeypatch.setattr(hetero.core.plan, "gather_rows", fake_gather)
    bal.set_epoch(0)
    for batch in sampler:
        with bal.step(batch_size=len(batch)):
            pass
    state = bal.state_dict()["balancer"]
    if quota:
        assert bal.last_sizes == [24, 8] and state["quota_s"] == [None, pytest.approx(0.1 / 3)]
    else:
        assert bal.last_sizes == [16, 16] and state["quota_s"] is None


def test_position_says_where_training_is_and_a_resume_loads_it_as_saved(monkeypatch):
    """bal.position is the one place a host reads where training is: (epoch e, step 0) before the epoch's first step
    and (e, steps_per_epoch) once it is complete are told apart, also after a state_dict round trip."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    bal = hetero.Balance(global_batch=8)
    sampler = bal.batch_sampler(30)  # 3 steps of 8 (6 samples left out)
    assert bal.position == hetero.Position(0, 0, 3, 0) and not bal.position.epoch_complete
    bal.set_epoch(0)
    for i, batch in enumerate(sampler):
        with bal.step(batch_size=len(batch)):
            pass
        assert (bal.position.step, bal.position.global_step) == (i + 1, i + 1)
    done = bal.position
    assert done.epoch_complete and done.next_epoch == 1 and done.steps_per_epoch == 3
    again = hetero.Balance(global_batch=8)
    again.batch_sampler(30)
    again.load_state_dict(bal.state_dict())
    assert again.position == done  # complete: not "epoch 0, nothing run"
    again.set_epoch(again.position.next_epoch)
    assert again.position == hetero.Position(1, 0, 3, 3)
    again.begin_step(0)
    again.end_step()
    mid = hetero.Balance(global_batch=8)
    mid.batch_sampler(30)
    mid.load_state_dict(again.state_dict())
    assert mid.position == hetero.Position(1, 1, 3, 4) and mid.position.next_epoch == 1
    mid.set_epoch(1)  # the epoch goes on at step 1
    assert [len(b) for b in mid.batch_sampler(30)] == [8, 8]


def test_the_front_carries_what_hosts_need(monkeypatch):
    """set_weight and mark_backward on the front (no `bal.engine`), world beside rank, workers after attach only."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    bal = hetero.Balance(global_batch=4, rebalance_every=2)
    assert (bal.rank, bal.world, bal.workers) == (0, 1, None)
    with pytest.raises(hetero.HeteroError, match="outside `with bal.step"):
        bal.set_weight(0.5)
    bal.begin_step()
    bal.set_weight(0.5)
    bal.mark_backward()
    bal.end_step()
    assert bal.position.global_step == 1


# the cases that launch processes
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


@pytest.mark.launch
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


@pytest.mark.launch
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


@pytest.mark.launch
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
