"""Outside stragglers: slowdowns the kernel or another process imposes on a rank, which hetero does not emulate
(docs/trainer.md, --straggler). Set up by the rank itself before its process group, torn down when it ends.

Grammar: items separated by ",", each `RANK:KIND=VALUE`.
  quota=Q[@Pms]    the rank's process runs in a child cgroup of its own with a CFS quota of Q cores per period of
                   P ms (default 100, the kernel's: cpu.cfs_quota_us = Q x cpu.cfs_period_us under cgroup v1,
                   cpu.max under v2); the shorter the period, the finer the bursts
  neighbour=busy   a busy-loop process pinned to the rank's cores competes with it for as long as it runs
  threads=N        the rank runs N torch threads, whatever --threads says

The cgroups are made below $HETERO_CGROUP (a cgroup folder; default `hetero` under the cpu controller's mount:
/sys/fs/cgroup/cpu under v1, /sys/fs/cgroup under v2). Each is named `r<rank>-p<pid>`; a run's teardown moves the
process back and removes its group (finally, atexit and SIGTERM through the trainer's own handler); a watcher process
removes it when the rank dies without its teardown (SIGKILL, or its launcher's death); and every start first removes
the groups of processes that are gone (a run whose watcher was killed too). A busy neighbour dies with its rank
(PR_SET_PDEATHSIG, and it polls its parent). Where a cgroup cannot be made or written: StragglerError, one line;
nothing is ever emulated instead.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_CGROUP = "HETERO_CGROUP"   # the cgroup folder hetero makes its groups in
PERIOD_US = 100_000            # the CFS period a quota is given in unless it says (the kernel's default)
MIN_QUOTA_US = 1000            # the kernel refuses a quota below 1 ms
MAX_PERIOD_US = 1_000_000      # and a period above 1 s
KINDS = ("quota", "neighbour", "threads")
NEIGHBOURS = ("busy",)
_ITEM = re.compile(r"^(\d{1,6}):(quota|neighbour|threads)=(.{1,40})$", re.ASCII)
_GROUP = re.compile(r"^r(\d+)-p(\d+)$", re.ASCII)
# The busy neighbour: spins until its parent (the rank) is gone, so a SIGKILLed rank leaves no spinner behind.
BUSY = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    pass\n"
# The group's watcher: waits, asleep, for its parent (the rank) to end however it ends (a SIGKILL of torchrun's agent
# kills the rank by PR_SET_PDEATHSIG, so no teardown of its own runs), then removes the group once it is empty. The
# rank's own children may outlive it a moment; any still in the group after ORPHANS_S are its orphans (a process the
# rank started that its death does not end) and are killed, so the group goes and nothing is left behind. The
# watcher itself is not in the group (it starts before the rank moves in). argv: the rank's pid, the group's folder.
WATCH = """import errno, os, select, sys, time
rank, group = int(sys.argv[1]), sys.argv[2]
try:
    fd = os.pidfd_open(rank)
    if os.getppid() == rank:
        select.select([fd], [], [])
except OSError:  # no pidfd (Linux < 5.3): poll
    while os.getppid() == rank:
        time.sleep(0.2)
start = time.monotonic()
while time.monotonic() < start + 60:
    try:
        os.rmdir(group)
        break
    except OSError as e:
        if e.errno == errno.ENOENT:
            break
    if time.monotonic() > start + ORPHANS_S:
        try:
            with open(os.path.join(group, 'cgroup.procs')) as procs:
                for pid in procs.read().split():
                    try:
                        os.kill(int(pid), 9)
                    except OSError:
                        pass
        except OSError:
            pass
    time.sleep(0.1)
""".replace("ORPHANS_S", "2.0")


class StragglerError(RuntimeError):
    """The machine does not allow an outside straggler (or the spec is bad): one line, nothing emulated instead."""


@dataclass(frozen=True)
class Straggler:
    """One rank's outside slowdowns: a CFS quota in cores (per `period_us`), a competing process, a thread count
    (None: not set)."""
    quota: float | None = None
    neighbour: str | None = None
    threads: int | None = None
    period_us: int = PERIOD_US


def quotas(text: str) -> dict[int, tuple[float, float]]:
    """{rank: (quota_s, period_s)} of the ranks a --straggler spec puts under a CFS quota (what each reads back)."""
    return {r: (s.quota * s.period_us / 1e6, s.period_us / 1e6)
            for r, s in parse_straggler(text).items() if s.quota is not None}


def parse_straggler(text: str) -> dict[int, Straggler]:
    """{rank: Straggler} of a --straggler spec ("" -> {}); ValueError naming the bad item."""
    out: dict[int, dict] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"item {item[:40]!r} is not RANK:quota=Q[@Pms], RANK:neighbour=busy or RANK:threads=N")
        rank, kind, value = int(m[1]), m[2], m[3]
        if kind in out.setdefault(rank, {}):
            raise ValueError(f"rank {rank} has {kind} twice")
        if kind == "quota":
            cores, _, period = value.partition("@")
            try:
                q = float(cores)
            except ValueError:
                raise ValueError(f"quota {value!r} is not a number of cores (Q or Q@Pms)") from None
            if not period:
                us = PERIOD_US
            elif m := re.fullmatch(r"([0-9]{1,4})ms", period):
                us = int(m[1]) * 1000
                if not MIN_QUOTA_US <= us <= MAX_PERIOD_US:
                    raise ValueError(f"quota period {period!r} must be between 1ms and {MAX_PERIOD_US // 1000}ms")
            else:
                raise ValueError(f"quota period {period!r} is not a whole number of ms, like @10ms")
            if not (q * us >= MIN_QUOTA_US and q <= 1024):
                raise ValueError(f"quota {value!r} must be between {MIN_QUOTA_US / us:g} and 1024 cores "
                                 f"(the kernel's least quota is 1 ms per period)")
            out[rank][kind], out[rank]["period_us"] = q, us
        elif kind == "neighbour":
            if value not in NEIGHBOURS:
                raise ValueError(f"neighbour {value!r}: choose {', '.join(NEIGHBOURS)}")
            out[rank][kind] = value
        else:
            if not re.fullmatch(r"[0-9]{1,4}", value) or int(value) < 1:
                raise ValueError(f"threads {value!r} must be a whole number of at least 1")
            out[rank][kind] = int(value)
    return {r: Straggler(**k) for r, k in out.items()}


# -- cgroups --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hierarchy:
    """Where hetero makes its cgroups: `base` (a cgroup folder) under cgroup `version` 1 or 2."""
    base: Path
    version: int


def _version(folder: Path) -> int | None:
    """1 or 2 if `folder` is a cgroup with the cpu controller's files, else None."""
    if (folder / "cgroup.controllers").is_file():
        return 2
    if (folder / "cgroup.procs").is_file() and (folder / "cpu.cfs_quota_us").is_file():
        return 1
    return None


def hierarchy(env: dict[str, str] | None = None) -> Hierarchy:
    """The cgroup folder hetero uses: $HETERO_CGROUP if set (it must exist and be a cgroup), else `hetero` under
    the cpu controller's v1 mount, else under the v2 root whose controllers include cpu."""
    given = (os.environ if env is None else env).get(ENV_CGROUP)
    if given:
        folder = Path(given)
        if not folder.is_dir():
            raise StragglerError(f"{ENV_CGROUP}={given} is not a folder")
        if (v := _version(folder)) is None:
            raise StragglerError(f"{ENV_CGROUP}={given} is not a cgroup with the cpu controller (no cgroup.procs "
                                 f"and cpu.cfs_quota_us, nor cgroup.controllers)")
        return Hierarchy(folder, v)
    for mount, v in ((Path("/sys/fs/cgroup/cpu"), 1), (Path("/sys/fs/cgroup/cpu,cpuacct"), 1),
                     (Path("/sys/fs/cgroup"), 2), (Path("/sys/fs/cgroup/unified"), 2)):
        if _version(mount) == v and (v == 1 or "cpu" in _read(mount / "cgroup.controllers").split()):
            return Hierarchy(mount / "hetero", v)
    raise StragglerError("no cgroup with the cpu controller is mounted (neither v1 /sys/fs/cgroup/cpu nor v2 "
                         "/sys/fs/cgroup with cpu in cgroup.controllers): a quota needs one")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, text: str, what: str) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as e:
        raise StragglerError(f"cannot {what}: writing {path} failed ({e.strerror or e})") from None


def _cannot(path: Path, e: OSError) -> str:
    return (f"cannot create the cgroup {path} ({e.strerror or e}): a quota needs write access to the cpu controller "
            f"(root, or {ENV_CGROUP} set to a writable cgroup)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(base: Path) -> list[Path]:
    """Remove the groups below `base` left by processes that are gone (SIGKILLed runs); the ones removed."""
    gone = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            m = _GROUP.match(entry.name)
            if entry.is_dir() and m and not _alive(int(m[2])) and not _read(Path(entry.path) / "cgroup.procs").strip():
                with contextlib.suppress(OSError):
                    os.rmdir(entry.path)
                    gone.append(Path(entry.path))
    return gone


def _own_cgroup(h: Hierarchy) -> Path | None:
    """The cgroup folder this process is in now, in h's hierarchy (to move back to at teardown)."""
    mount = h.base
    while mount.parent != mount and _version(mount.parent) == h.version:
        mount = mount.parent  # the hierarchy's root: the highest cgroup folder above base
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if (h.version == 2 and controllers == "") or (h.version == 1 and "cpu" in controllers.split(",")):
            folder = mount / path.lstrip("/")
            if (folder / "cgroup.procs").is_file():
                return folder
    return mount


def _make_base(h: Hierarchy) -> None:
    """The base folder, created if missing; under v2 the cpu controller enabled for its children."""
    if not h.base.is_dir():
        try:
            h.base.mkdir()
        except FileExistsError:
            pass
        except OSError as e:
            raise StragglerError(_cannot(h.base, e)) from None
    if h.version == 2:
        for folder in (h.base.parent, h.base):  # the parent only where it is a cgroup (base may be the root)
            if _version(folder) == 2 and "cpu" not in _read(folder / "cgroup.subtree_control").split():
                _write(folder / "cgroup.subtree_control", "+cpu", "enable the cpu controller")


class Group:
    """One rank's child cgroup with a CFS quota; the process moves in at start and out at close. A watcher process
    removes the group when the rank ends without closing it (SIGKILL, its launcher's death)."""

    def __init__(self, h: Hierarchy, rank: int, quota: float, period_us: int = PERIOD_US):
        self.h, self.path, self.back = h, h.base / f"r{rank}-p{os.getpid()}", _own_cgroup(h)
        self.watcher: subprocess.Popen | None = None
        _make_base(h)
        sweep(h.base)
        # the watcher first, then the group: a SIGKILL that lands between the two (a launcher's death kills the rank
        # by PR_SET_PDEATHSIG) must find a watcher, which removes the group if it was made and ends if it was not.
        # Started before the move, it stays outside the quota, in the rank's old group.
        self.watcher = _watch(self.path)
        try:
            self.path.mkdir()
        except OSError as e:  # not ours to remove (it may exist): the watcher goes, the folder stays
            stop_busy(self.watcher)
            self.watcher = None
            raise StragglerError(_cannot(self.path, e)) from None
        try:
            us = max(MIN_QUOTA_US, round(quota * period_us))
            if h.version == 1:
                if not (self.path / "cpu.cfs_quota_us").is_file():
                    raise StragglerError(f"{self.path} has no cpu.cfs_quota_us: {h.base} is not a cpu cgroup")
                _write(self.path / "cpu.cfs_period_us", str(period_us), "set the CFS period")
                _write(self.path / "cpu.cfs_quota_us", str(us), "set the CFS quota")
            else:
                if not (self.path / "cpu.max").is_file():
                    raise StragglerError(f"{self.path} has no cpu.max: the cpu controller is not enabled below "
                                         f"{h.base}")
                _write(self.path / "cpu.max", f"{us} {period_us}", "set the CFS quota")
            _write(self.path / "cgroup.procs", str(os.getpid()), "move the rank into its cgroup")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Move this process back where it was and remove the group (idempotent, never raises)."""
        if self.back is not None:
            with contextlib.suppress(OSError):
                (self.back / "cgroup.procs").write_text(str(os.getpid()))
        with contextlib.suppress(OSError):
            self.path.rmdir()
        if self.watcher is not None:
            stop_busy(self.watcher)  # the group is gone: nothing left to watch
            self.watcher = None


def _watch(group: Path) -> subprocess.Popen:
    """The watcher (WATCH) of this process's group: in a session of its own, so that a signal to the rank's process
    group (torchrun's, a shell's ^C) does not take it along, and without PR_SET_PDEATHSIG."""
    try:
        return subprocess.Popen([sys.executable, "-c", WATCH, str(os.getpid()), str(group)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        raise StragglerError(f"cannot start the watcher that removes {group} if the rank is killed ({e.strerror})") \
            from None


def check_cgroups(env: dict[str, str] | None = None) -> Hierarchy:
    """The cgroup hetero would use, proven writable by making and removing a probe group; StragglerError in one
    line otherwise (run by every rank before any process group)."""
    h = hierarchy(env)
    _make_base(h)
    sweep(h.base)
    probe = h.base / f"r0-p{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        pass
    except OSError as e:
        raise StragglerError(_cannot(probe, e)) from None
    try:
        quota = probe / ("cpu.cfs_quota_us" if h.version == 1 else "cpu.max")
        if not quota.is_file():
            raise StragglerError(f"{probe} has no {quota.name}: {h.base} is not a cpu cgroup")
        _write(quota, _read(quota).strip() or "max", "write a CFS quota")
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return h


# -- a competing process ----------------------------------------------------------------------------------------
def _child_setup(cores: set[int]) -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG), and pinned to
    `cores`, so that not even the interpreter's start runs on another rank's core (an error is left for the parent's
    own pinning to raise)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cores)


def start_busy(cores: set[int] | None = None, paused: bool = False) -> subprocess.Popen:
    """A busy-loop process pinned to `cores` (default: this process's own); it dies with this process. Paused, it
    starts up and stops itself before its loop, and spins from resume_busy() on: a neighbour that arrives at once."""
    cores = set(cores or os.sched_getaffinity(0))
    code = f"import os\nos.kill(os.getpid(), {int(signal.SIGSTOP)})\n{BUSY}" if paused else BUSY  # BUSY is in both
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=lambda: _child_setup(cores))
    try:
        os.sched_setaffinity(proc.pid, cores)
        if paused:
            _, status = os.waitpid(proc.pid, os.WUNTRACED)  # until it has stopped itself (or died)
            if not os.WIFSTOPPED(status):
                proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it
                raise StragglerError(f"the busy neighbour exited {proc.returncode} before it was resumed")
    except (OSError, StragglerError):
        stop_busy(proc)
        raise
    return proc


def resume_busy(proc: subprocess.Popen) -> None:
    """Let a paused busy process (start_busy(paused=True)) spin."""
    os.kill(proc.pid, signal.SIGCONT)


def stop_busy(proc: subprocess.Popen) -> None:
    """End the busy process and reap it."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# -- one rank's stragglers, set up and torn down ----------------------------------------------------------------
class Outside:
    """The outside stragglers of one rank, in force from construction until close() (also at exit)."""

    def __init__(self, spec: Straggler | None, rank: int, env: dict[str, str] | None = None):
        self.group: Group | None = None
        self.busy: subprocess.Popen | None = None
        if spec is None:
            return
        atexit.register(self.close)
        try:
            if spec.neighbour:  # before the cgroup: the neighbour competes from outside the rank's quota
                self.busy = start_busy()
            if spec.quota is not None:
                self.group = Group(hierarchy(env), rank, spec.quota, spec.period_us)
            if spec.threads is not None:
                import torch
                torch.set_num_threads(spec.threads)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.busy is not None:
            stop_busy(self.busy)
            self.busy = None
        if self.group is not None:
            self.group.close()
            self.group = None


def setup(text: str, rank: int, env: dict[str, str] | None = None) -> Outside:
    """This rank's outside stragglers of a --straggler spec (a no-op Outside for a rank it does not name)."""
    return Outside(parse_straggler(text).get(rank), rank, env)
