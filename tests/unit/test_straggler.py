"""The --straggler grammar, its checks in the Config, and the cgroup plumbing on folders that are not cgroups (the
stale-group sweep, the refusal of a folder that is no cpu cgroup). Real cgroups, kills and the read-only refusal:
tests/integration/test_straggler_launch.py."""
from __future__ import annotations

import os

import pytest

from hetero.trainer import straggler
from hetero.trainer.config import Config, ConfigError
from hetero.trainer.straggler import Straggler, parse_straggler


def test_grammar_reads_each_kind_per_rank():
    assert parse_straggler("") == {}
    assert parse_straggler("1:quota=0.33, 1:neighbour=busy,0:threads=2") == {
        1: Straggler(quota=0.33, neighbour="busy"), 0: Straggler(threads=2)}
    assert parse_straggler("1:quota=0.33@10ms") == {1: Straggler(quota=0.33, period_us=10_000)}
    # what each rank reads back from its cgroup (hetero.core.cpuquota): CPU seconds per period
    assert straggler.quotas("1:quota=0.33@10ms,0:neighbour=busy") == {1: pytest.approx((0.0033, 0.01))}


@pytest.mark.parametrize("text, says", [
    ("1:quota=abc", "not a number"), ("1:quota=0.001", "between"), ("1:quota=2000", "between"),
    ("1:neighbour=idle", "choose busy"), ("1:threads=0", "at least 1"), ("1:threads=x", "whole number"),
    ("1:speed=2", "is not RANK"), ("quota=0.5", "is not RANK"), ("1:quota=0.5,1:quota=0.2", "quota twice"),
    ("1:quota=0.33@10", "whole number of ms"), ("1:quota=0.33@2000ms", "between 1ms and 1000ms"),
    ("1:quota=0.05@10ms", "between 0.1 and 1024")])
def test_bad_items_are_named(text, says):
    with pytest.raises(ValueError, match=says):
        parse_straggler(text)
    with pytest.raises(ConfigError, match=f"bad --straggler .*{says}"):  # the trainer's one line
        Config(straggler=text)


def test_a_rank_past_the_world_is_refused():
    with pytest.raises(ConfigError, match="rank 2 is not below the world size 2"):
        Config(straggler="2:neighbour=busy").check_world(2)


def test_a_folder_that_is_no_cgroup_is_refused_never_emulated(tmp_path):
    env = {straggler.ENV_CGROUP: str(tmp_path)}
    with pytest.raises(straggler.StragglerError, match="is not a cgroup with the cpu controller"):
        straggler.check_cgroups(env)
    with pytest.raises(straggler.StragglerError, match="is not a folder"):
        straggler.hierarchy({straggler.ENV_CGROUP: str(tmp_path / "missing")})
    # a folder that looks like one (its files planted) but whose children the kernel does not fill: refused too
    (tmp_path / "cgroup.procs").write_text("")
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    with pytest.raises(straggler.StragglerError, match="has no cpu.cfs_quota_us"):
        straggler.check_cgroups(env)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # the probe group is gone again


def test_a_cgroup_v2_folder_is_read_as_v2_and_its_controller_enabled_for_the_children(tmp_path):
    """cgroup v2 (cgroup.controllers, cpu.max): this machine's cpu controller is bound to v1, so the v2 path runs
    on a planted folder here. It is read as v2, hetero enables +cpu below it, and without the kernel filling the
    probe's cpu.max it is refused in one line, never emulated."""
    base = tmp_path / "delegated"
    base.mkdir()
    for f, text in (("cgroup.controllers", "cpu io memory\n"), ("cgroup.subtree_control", ""), ("cgroup.procs", "")):
        (base / f).write_text(text)
    env = {straggler.ENV_CGROUP: str(base)}
    assert straggler.hierarchy(env) == straggler.Hierarchy(base, 2)
    with pytest.raises(straggler.StragglerError, match="has no cpu.max: .* is not a cpu cgroup"):
        straggler.check_cgroups(env)
    assert (base / "cgroup.subtree_control").read_text() == "+cpu"  # children get the cpu controller
    assert not [p for p in base.iterdir() if p.is_dir()]
    assert not (tmp_path / "cgroup.subtree_control").exists()  # the folder above is no cgroup: left alone


def test_sweep_removes_only_the_groups_of_processes_that_are_gone(tmp_path):
    dead = 2 ** 22 + 7  # above the default pid_max: no such process
    for name in (f"r1-p{dead}", f"r0-p{os.getpid()}", "bench-p1", f"x-p{dead}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").write_text("")
    os.remove(tmp_path / f"r1-p{dead}" / "cgroup.procs")  # a real cgroup folder's files go with it on rmdir
    assert straggler.sweep(tmp_path) == [tmp_path / f"r1-p{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"r0-p{os.getpid()}", "bench-p1", f"x-p{dead}"])


def test_a_rank_without_a_straggler_sets_nothing_up():
    out = straggler.setup("1:quota=0.5", rank=0)
    assert out.group is None and out.busy is None
    out.close()


def _stat(pid: int) -> tuple[str, int, int]:
    """A process's state, user CPU ticks and the core it last ran on (/proc/PID/stat)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return f[0], int(f[11]), int(f[36])


def test_a_paused_neighbour_runs_only_on_its_core_and_spins_from_its_resume(monkeypatch):
    """The come-and-go neighbour is started paused: it is pinned in the child before its interpreter starts (the
    parent's own pinning is switched off here, so only that can pin it), takes no CPU until resumed, then spins;
    stopped, it is reaped and the bench's leftover scan finds none."""
    import time

    from hetero.lab import outside

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: a process pinned to it cannot be told from one that is not")
    real, parent, core = os.sched_setaffinity, os.getpid(), max(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: None if os.getpid() == parent else real(pid, cores))
    monkeypatch.setenv(outside.TAG, "mine")  # what the bench's outside part sets: its neighbours carry it
    p = straggler.start_busy({core}, paused=True)
    try:
        state, ticks, last = _stat(p.pid)
        assert state == "T" and last == core and os.sched_getaffinity(p.pid) == {core}
        assert p.pid in outside.leftovers(None)["busy_left"] and p.pid in outside.leftovers(None, "mine")["busy_left"]
        assert p.pid not in outside.leftovers(None, "another")["busy_left"]  # another job's count leaves it out
        time.sleep(0.2)
        assert _stat(p.pid)[:2] == ("T", ticks)  # paused: no CPU at all
        straggler.resume_busy(p)
        deadline = time.monotonic() + 30  # a hang guard, not a timing assertion
        while _stat(p.pid)[1] == ticks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stat(p.pid)[1] > ticks and _stat(p.pid)[2] == core
    finally:
        straggler.stop_busy(p)
    assert p.returncode is not None and p.pid not in outside.leftovers(None)["busy_left"]
