"""Elastic membership in one process: the balancer's estimates carried by worker identity to another world size,
and a Balance's mid-epoch state. The launches: tests/integration/test_elastic_launch.py."""
import numpy as np
import pytest

from hetero.core.agree import remap_identities as remap
from hetero.core.balance import Balance
from hetero.core.balancer import Balancer

B = 120


def _measured(world: int, slow: int) -> Balancer:
    """A balancer that has decided from steps where rank `slow` takes 4x as long per sample."""
    b = Balancer("proportional", world, B, significance=0)
    per = np.where(np.arange(world) == slow, 4e-3, 1e-3)
    b.observe(np.tile(b.sizes, (8, 1)), np.tile(b.sizes * per, (8, 1)))
    b.decide()
    return b


def test_remap_by_identity_else_by_rank():
    assert remap(["a", "b"], 2, ["b", "c", "a"], 3) == [1, None, 0]
    assert remap(["a", "b", "c"], 3, ["c", "a"], 2) == [2, 0]
    assert remap(None, 2, ["x", "y", "z"], 3) == [0, 1, None]   # no identities saved: rank r keeps rank r
    assert remap(["a", "b"], 2, None, 1) == [0]


def test_a_known_worker_keeps_its_estimate_and_a_new_one_starts_from_the_median():
    old = _measured(2, slow=1)
    assert old.shares[1] < 0.25  # 1/5 without noise
    new = Balancer("proportional", 3, B)
    new.load_remapped(old.state_dict(), [0, 1, None])
    fast, slow = old.shares
    np.testing.assert_allclose(new.shares, np.array([fast, slow, (fast + slow) / 2]) / (1.5 * (fast + slow)))
    assert new.sizes.sum() == B and new.sizes[1] < new.sizes[2] < new.sizes[0]
    assert new.decisions == old.decisions and not new._pending and len(new._windows) == 0  # windows restart
    small = Balancer("proportional", 2, B)  # and back to two: the slow worker, now rank 0, stays slow
    small.load_remapped(new.state_dict(), [1, 0])
    assert small.sizes.sum() == B and small.shares[0] == pytest.approx(slow / (fast + slow))
    with pytest.raises(ValueError, match="names a rank twice"):
        small.load_remapped(new.state_dict(), [1, 1])


def test_balance_loads_a_state_from_another_world_under_the_identity_rules():
    saved = Balance(global_batch=B, scheme="edp")
    saved.set_world(0, 2)
    state = {**saved.state_dict(), "balancer": _measured(2, slow=1).state_dict(),
             "identities": ["host/gpu A", "host/gpu B"]}
    bal = Balance(global_batch=B, scheme="edp")
    bal.set_world(0, 3)
    bal.load_state_dict(state, identities=["host/gpu B", "host/gpu C", "host/gpu A"])  # B (the slow one) is rank 0
    sizes = bal.sizes_at(0, 0)
    assert sizes.sum() == B and sizes[0] < sizes[1] < sizes[2]


def test_a_mid_epoch_state_goes_on_at_its_step():
    bal = Balance(global_batch=B, scheme="edp")  # decides at the epoch end only
    bal.set_world(0, 1)
    bal.batch_sampler(10 * B)
    bal.set_epoch(1)
    for _ in range(3):
        bal.begin_step()
        bal.end_step()
    state = bal.state_dict()  # alone: no other call before it
    assert state["step"] == 3 and state["epoch"] == 1 and state["global_step"] == 3
    assert len(state["balancer"]["pending"]) == 1  # the three steps, in the saved balancer state
    again = Balance(global_batch=B, scheme="edp")  # decides at the epoch end only
    again.set_world(0, 1)
    again.batch_sampler(10 * B)
    again.load_state_dict(state)
    again.set_epoch(1)  # the loop's own call at the epoch's start: the epoch goes on where it was
    again.begin_step()
    assert again.engine.running().index == 3
    again.end_step()
    assert again.state_dict()["global_step"] == 4 and again.state_dict()["step"] == 4


def test_the_sampler_of_a_resumed_epoch_starts_at_its_step():
    bal = Balance(global_batch=B, scheme="sync")
    bal.set_world(0, 1)
    sampler = bal.batch_sampler(10 * B)
    bal.set_epoch(1)
    every = list(sampler)
    assert len(every) == 10
    again = Balance(global_batch=B, scheme="sync")
    again.set_world(0, 1)
    rest = again.batch_sampler(10 * B)
    again.load_state_dict({**bal.state_dict(), "epoch": 1, "step": 4, "global_step": 4})
    again.set_epoch(1)
    assert list(rest) == every[4:]  # the steps not yet trained, each once


def test_default_identity_is_the_given_name_else_host_and_device(monkeypatch):
    import socket

    import torch

    from hetero.core.agree import default_identity

    monkeypatch.setenv("HETERO_WORKER_ID", "spot-7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_identity(torch.device("cpu")) == "spot-7"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the same name on another local rank is the same worker
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_identity(torch.device("cpu")) == "spot-7"
    monkeypatch.delenv("HETERO_WORKER_ID")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert default_identity(torch.device("cpu")) == f"{socket.gethostname()}/cpu cores 0"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert default_identity(torch.device("cpu")) == f"{socket.gethostname()}/cpu local rank 1"  # unpinned


def test_one_agent_names_its_workers_by_a_list_or_a_template():
    from hetero.core.agree import HeteroError, named_identity

    assert named_identity("spot-7", 3, 4) == "spot-7"  # as written, whatever the local rank
    assert [named_identity("a100, v100 ,t4", r, 3) for r in range(3)] == ["a100", "v100", "t4"]
    assert [named_identity("node7/gpu{local_rank}", r, 2) for r in range(2)] == ["node7/gpu0", "node7/gpu1"]
    assert named_identity("  ", 0, 1) is None
    for value, why in (("a,b", "lists 2 names for the 3 worker"), ("a,,c", "an empty name"),
                       ("a,a,b", "a name twice"), ("n{rank}", "the only field")):
        with pytest.raises(HeteroError, match=why) as e:
            named_identity(value, 0, 3)
        assert str(e.value).startswith("hetero: ") and "\n" not in str(e.value)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (a Balance's attach gathers identities over it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_balance_takes_its_worker_id_over_the_environment_and_the_environment_over_the_device(monkeypatch):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetero.core.agree import HeteroError

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("HETERO_WORKER_ID", "fast,slow")

    def attached(**kw) -> Balance:
        bal = Balance(global_batch=8, scheme="edp", **kw)
        bal.attach(DDP(torch.nn.Linear(2, 2)))
        return bal
    assert attached().workers == ["slow"]                      # the environment's name for local rank 1
    assert attached(worker_id="mine").workers == ["mine"]      # the library's argument comes first
    monkeypatch.setenv("HETERO_WORKER_ID", "slow")                # a name of its own (srun sets it per process)
    assert attached().workers == ["slow"]
    monkeypatch.setenv("HETERO_WORKER_ID", "a,b,c")
    with pytest.raises(HeteroError, match="lists 3 names for the 2 worker"):
        attached()


def test_torchrun_run_ids_that_share_a_prefix_get_folders_of_their_own(monkeypatch):
    from hetero.trainer.cli import parse_args
    from hetero.trainer.runfolder import resolve, run_id_folder

    cfg, _ = parse_args(["--model", "tiny", "--data", "synthetic"])
    folders = set()
    for run_id in ("experiment-2026-12-01-a", "experiment-2026-12-01-b"):  # the first 12 characters alike
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        got, resume = resolve(cfg)
        assert not resume and got.run_dir == f"runs/tiny-edp-{run_id}"
        folders.add(got.run_dir)
    assert len(folders) == 2
    odd = [run_id_folder(r) for r in ("a/b", "a_b", "../..", "x" * 300, "x" * 301)]
    assert len(set(odd)) == len(odd) and not any("/" in f or f.startswith(".") or len(f) > 100 for f in odd)


def test_a_malformed_or_duplicate_worker_name_is_one_line_before_the_process_group(monkeypatch, capsys):
    from hetero.trainer.dist import Place, duplicate_worker

    from helpers import SMALL, assert_one_line, check

    monkeypatch.setenv("HETERO_WORKER_ID", "a,b")  # two names, one worker on this node
    rc, err = check(SMALL, monkeypatch, capsys)
    assert_one_line(rc, err, "HETERO_WORKER_ID=\"a,b\" lists 2 names for the 1 worker(s) of this node")
    places = [Place("h1", "cpu", "", 0, "spot"), Place("h2", "cpu", "", 0, ""), Place("h3", "cpu", "", 0, "spot")]
    assert "ranks 0 and 2 are both worker 'spot' (HETERO_WORKER_ID on h1 and h3)" in duplicate_worker(places)
    assert duplicate_worker(places[:2]) == "" and duplicate_worker([Place("h", "cpu", "", 0)] * 2) == ""


def test_make_experiment_passes_the_agent_settings_the_bench_measures():
    from hetero.lab.launch import ROOT
    from hetero.lab.recovery import AGENT

    make = (ROOT / "Makefile").read_text()
    conf, monitor = AGENT.torchrun_args()
    assert f"RDZV_CONF := {conf.removeprefix('--rdzv-conf=')}\n" in make
    assert f"--rdzv-conf=$(RDZV_CONF) {monitor}\n" in make
