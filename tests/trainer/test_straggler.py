"""The --straggler grammar, its checks in the Config, and the cgroup plumbing on folders that are not cgroups (the
stale-group sweep, the refusal of a folder that is no cpu cgroup).

The launches: outside stragglers on the real kernel (root and a writable cpu cgroup; skipped elsewhere): a quota is
in force while the rank runs and gone after, a SIGKILLed rank's group is swept at the next start and its busy
neighbour dies with it, and the trainer refuses in one line where the cgroup is read-only (a read-only bind mount of
a real cgroup in a mount namespace of its own)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hetero.trainer import straggler
from hetero.trainer.config import Config, ConfigError
from hetero.trainer.straggler import Straggler, parse_straggler

from helpers import clean_env, torchrun_cmd


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


# the cases that launch processes
try:
    BASE = straggler.check_cgroups({}).base
except straggler.StragglerError as e:
    BASE, WHY = None, str(e)


@pytest.fixture
def group():
    """A cgroup of this test's own below hetero's base, as $HETERO_CGROUP; removed (with what is below) after."""
    own = BASE / f"test-p{os.getpid()}"
    own.mkdir(exist_ok=True)
    yield own
    straggler.sweep(own)
    for p in own.iterdir():
        if p.is_dir():
            p.rmdir()
    own.rmdir()


CHILD = """import sys, time
from hetero.trainer import straggler
out = straggler.setup(sys.argv[1], rank=1)
where = out.group.path if out.group else '-'
print(where, out.busy.pid if out.busy else 0, out.group.watcher.pid if out.group else 0, flush=True)
if sys.argv[2] == 'wait':
    time.sleep(60)
out.close()
"""


def _child(spec: str, mode: str, group: Path) -> subprocess.Popen:
    env = {**clean_env(), straggler.ENV_CGROUP: str(group)}
    return subprocess.Popen([sys.executable, "-c", CHILD, spec, mode], env=env, stdout=subprocess.PIPE, text=True)


def _busy_pids() -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and straggler.BUSY.encode() in Path(entry.path, "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _gone(path: Path, limit_s: float = 60) -> bool:
    deadline = time.monotonic() + limit_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
def test_a_quota_is_in_force_while_the_rank_runs_and_gone_after(group):
    p = _child("1:quota=0.25", "wait", group)
    path, _, _ = p.stdout.readline().split()
    path = Path(path)
    assert path.parent == group
    quota = path / ("cpu.cfs_quota_us" if (path / "cpu.cfs_quota_us").exists() else "cpu.max")
    assert quota.read_text().split()[0] == "25000"
    assert str(p.pid) in (path / "cgroup.procs").read_text().split()
    p.send_signal(signal.SIGKILL)  # no teardown runs in the rank: its watcher removes the group
    p.wait()
    assert _gone(path)
    q = _child("1:quota=0.5", "exit", group)
    new, _, watcher = q.stdout.readline().split()
    assert q.wait() == 0 and not Path(new).exists()  # a rank removes its own at the end, and stops its watcher
    assert not psutil.pid_exists(int(watcher)) or psutil.Process(int(watcher)).status() == psutil.STATUS_ZOMBIE


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
def test_a_group_whose_watcher_was_killed_too_is_swept_at_the_next_start(group):
    p = _child("1:quota=0.25", "wait", group)
    path, _, watcher = p.stdout.readline().split()
    os.kill(int(watcher), signal.SIGKILL)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert Path(path).is_dir()  # nothing removed it
    q = _child("1:quota=0.5", "exit", group)  # the next start (the same rank) sweeps the dead one's group
    q.stdout.readline()
    assert q.wait() == 0 and not Path(path).exists()


# A rank SIGKILLed the moment its group exists (its launcher died in its set-up): mkdir is wrapped so that the process
# kills itself right after making the group, before anything else of the set-up runs.
KILLED_AT_MKDIR = """import os, pathlib, signal, sys
from hetero.trainer import straggler
made = pathlib.Path.mkdir
def mkdir(self, *a, **k):
    made(self, *a, **k)
    if self.name.startswith('r1-p'):
        print(self, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
pathlib.Path.mkdir = mkdir
straggler.setup(sys.argv[1], rank=1)
"""


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
def test_a_rank_killed_as_soon_as_its_group_exists_leaves_no_group(group):
    """The watcher is started before the group is made, so no moment of the set-up leaves a group without one (it
    was made after the group, and a SIGKILL between the two left the group behind: a .ci/run on 2026-12-05 caught
    it through the agent's SIGKILL in set-up, below)."""
    env = {**clean_env(), straggler.ENV_CGROUP: str(group)}
    p = subprocess.Popen([sys.executable, "-c", KILLED_AT_MKDIR, "1:quota=0.5"], env=env, stdout=subprocess.PIPE,
                         text=True)
    path = Path(p.stdout.readline().strip())
    assert p.wait() == -signal.SIGKILL and path.parent == group
    assert _gone(path), "the group of a rank killed in its set-up was left behind"


# A rank that starts a process its death does not end (in its own session, as a fork server or a compile worker may
# be), then is SIGKILLed: the orphan is in the rank's group, so the group could never be removed.
ORPHAN = """import subprocess, sys, time
from hetero.trainer import straggler
out = straggler.setup(sys.argv[1], rank=1)
orphan = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)
print(out.group.path, orphan.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
def test_a_killed_ranks_orphan_is_killed_and_its_group_removed(group):
    """What a fresh-clone .ci/run left on 2026-12-06 (the agent's SIGKILL in set-up under load): a process of the
    rank's that outlived it kept the group busy. The watcher kills what is still in the group ORPHANS_S after the
    rank's death, then removes the group."""
    env = {**clean_env(), straggler.ENV_CGROUP: str(group)}
    p = subprocess.Popen([sys.executable, "-c", ORPHAN, "1:quota=0.5"], env=env, stdout=subprocess.PIPE, text=True)
    path, orphan = p.stdout.readline().split()
    path, orphan = Path(path), int(orphan)
    try:
        assert str(orphan) in (path / "cgroup.procs").read_text().split()  # the orphan is in the rank's group
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert _gone(path, 30), "the group of a rank whose orphan lived on was left behind"
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


def _trainer_pids(agent: int) -> list[int]:
    return [c.pid for c in psutil.Process(agent).children(recursive=True)
            if "hetero.trainer" in " ".join(c.cmdline())]


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
@pytest.mark.slow
@pytest.mark.parametrize("when", ["set-up", "training"])
def test_a_sigkill_of_torchruns_agent_leaves_no_cgroup(group, tmp_path, when):
    """Issue 48.6: the agent's SIGKILL kills its workers by PR_SET_PDEATHSIG, so no teardown runs in rank 1; its
    group must go all the same (its watcher), during the set-up as during training."""
    run = tmp_path / "run"
    args = ["--model", "tiny", "--data", "synthetic", "--subset", "1024", "--test-subset", "256", "--global-batch",
            "128", "--epochs", "20", "--threads", "1", "--straggler", "1:quota=0.5", "--run-dir", str(run)]
    env = {**clean_env(), straggler.ENV_CGROUP: str(group)}
    agent = subprocess.Popen(torchrun_cmd(2, args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        # rank 1's group (r1-p<pid>), not the probe every rank makes and removes at once (check_cgroups: r0-p<pid>),
        # which a busy host let this scan see and then lose (a fresh-clone run with a core kept busy, 2026-12-06)
        while not (made := [p for p in group.iterdir() if p.is_dir() and p.name.startswith("r1-")]) \
                and time.monotonic() < deadline:
            assert agent.poll() is None
            time.sleep(0.02)
        assert made, "rank 1 never made its cgroup"
        while when == "training" and not (run / "summary.json").exists() and time.monotonic() < deadline:
            assert agent.poll() is None
            time.sleep(0.05)
        workers = _trainer_pids(agent.pid)
        assert workers and all(p.is_dir() for p in made)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        assert all(_gone(p) for p in made), [p for p in group.iterdir() if p.is_dir()]
        assert not [p for p in group.iterdir() if p.is_dir()]
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
def test_a_busy_neighbour_dies_with_its_rank(group):
    p = _child("1:neighbour=busy", "wait", group)
    _, busy, _ = p.stdout.readline().split()
    assert int(busy) in _busy_pids()
    assert os.sched_getaffinity(int(busy)) == os.sched_getaffinity(p.pid)  # on the rank's own cores
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 10
    while int(busy) in _busy_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(busy) not in _busy_pids()


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("mount") is None, reason="needs unshare, mount")
def test_a_read_only_cgroup_is_refused_in_one_line(group, tmp_path):
    ro = group / "ro"
    ro.mkdir()
    env = {**clean_env(), straggler.ENV_CGROUP: str(ro)}
    cmd = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && exec {sys.executable} -m hetero.trainer "
           f"--check --model tiny --data synthetic --subset 256 --global-batch 64 --epochs 1 "
           f"--straggler 0:quota=0.5 --run-dir {tmp_path / 'run'}")
    r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=300)
    if "mount:" in r.stderr:
        pytest.skip(f"no read-only bind mount here: {r.stderr.strip()}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hetero: error: --straggler '0:quota=0.5': cannot create the cgroup") and \
        "Read-only file system" in lines[0]
    assert not [p for p in ro.iterdir() if p.is_dir()] and not (tmp_path / "run").exists()


READ = """import sys
from hetero.core.cpuquota import own_quota
from hetero.trainer import straggler
out = straggler.setup(sys.argv[1], rank=1)
print(*own_quota(), flush=True)
out.close()
print(*own_quota(), flush=True)
"""


@pytest.mark.launch
@pytest.mark.skipif(BASE is None, reason="no writable cpu cgroup here")
def test_a_rank_reads_the_quota_it_runs_under_and_none_after(group):
    """What the balancer gathers from each rank (hetero.core.cpuquota): the tightest CFS quota over its cgroups."""
    env = {**clean_env(), straggler.ENV_CGROUP: str(group)}
    out = subprocess.run([sys.executable, "-c", READ, "1:quota=0.25@50ms"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    inside, after = ([float(x) for x in line.split()] for line in out.stdout.splitlines())
    assert inside == pytest.approx([0.0125, 0.05]) and after == [float("inf")] * 2
    off = subprocess.run([sys.executable, "-c", READ, "1:quota=0.25@50ms"], env={**env, "HETERO_CPU_QUOTA": "off"},
                         capture_output=True, text=True, timeout=60)
    assert off.stdout.split()[:2] == ["inf", "inf"]  # switched off: the balancer decides from times alone
