"""Starting trainer runs from Python (grids, benchmarks, the GPU check): the torchrun command line, a clean
environment, and a launch that a timeout or an interrupt stops as a whole.

Each launch carries a marker of its own in its environment (HETERO_LAUNCH_ID), which torchrun passes on to its
workers. torchrun starts workers in sessions of their own, so signalling torchrun's process group misses them; the
marker finds every process of the launch, wherever it sits, and SIGKILL ends even a stopped (SIGSTOP) one.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO

SOURCE = Path(__file__).resolve().parents[2]  # the folder holding this hetero package: a checkout or site-packages
ROOT_VAR = "HETERO_ROOT"  # an explicit root folder for runs/ (and notebooks/), wherever python starts
# torchrun sets these for its workers; a launch from inside a worker (or a test) must not inherit them
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MARKER = "HETERO_LAUNCH_ID"


class NoRoot(SystemExit):
    """No folder to hold runs/: one line and exit status 1 wherever it is raised (a SystemExit prints no traceback,
    and no `except Exception` swallows it)."""


def _is_checkout(folder: Path) -> bool:
    """A hetero checkout: its pyproject.toml names the project hetero and the package sits beside it."""
    try:
        text = (folder / "pyproject.toml").read_text(errors="replace") if (folder / "pyproject.toml").is_file() else ""
    except OSError:
        return False
    return 'name = "hetero"' in text and (folder / "hetero" / "__init__.py").is_file()


def root() -> Path:
    """The folder that runs/, notebooks/ and relative grid paths start from: $HETERO_ROOT if set, else the checkout
    holding the current folder, else the checkout this package was imported from (not an installed copy's
    site-packages); NoRoot in one line if there is none."""
    if given := os.environ.get(ROOT_VAR):
        if not Path(given).is_dir():
            raise NoRoot(f"hetero: error: {ROOT_VAR}={given} is not a folder")
        return Path(given).resolve()
    here = Path.cwd().resolve()
    for folder in (here, *here.parents, SOURCE):
        if _is_checkout(folder):
            return folder
    raise NoRoot(f"hetero: error: no hetero checkout holds {here} (nor the package, installed in {SOURCE}): run "
                 f"from inside a checkout, or set {ROOT_VAR} to the folder that runs/ goes into")


def __getattr__(name: str) -> Path:
    if name == "ROOT":  # the name scripts and notebooks import: resolved when read, not at import
        return root()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_root(path: str | Path) -> Path:
    """A path as notebooks and grids take it: a relative one is relative to root(), wherever python started."""
    return Path(path) if Path(path).is_absolute() else root() / path


def free_port() -> int:
    """A TCP port free on the loopback now (for MASTER_PORT); another process may take it before it is bound."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, args: list[str], module: str = "hetero.trainer") -> list[str]:
    """`torchrun --standalone` (a free port per launch, so concurrent launches never collide). torchrun's log
    folder goes to /dev/null: by default it leaves a torchelastic_* folder in the temp directory per launch."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--log-dir={os.devnull}", "-m", module, *args]


def clean_env(extra_path: list[str] | None = None, threads: str | None = None) -> dict[str, str]:
    """This environment without torchrun's worker variables, with this package's folder first on PYTHONPATH (the
    workers import the same hetero)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != MARKER}
    env["PYTHONPATH"] = os.pathsep.join([*(extra_path or []), str(SOURCE), env.get("PYTHONPATH", "")])
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, set so that it prints no banner about it
    return env


def run_logged(cmd: list[str], log: IO, timeout_s: float, env: dict[str, str] | None = None) -> int | None:
    """Run cmd with its output into the open file `log`; its exit status, or None when it ran past timeout_s and
    every process of the launch was stopped (stop_launch). An interrupt stops them too."""
    marker = uuid.uuid4().hex
    env = {**(env or clean_env()), MARKER: marker}
    proc = subprocess.Popen(cmd, cwd=root(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_launch(proc, marker)
        return None
    except BaseException:
        stop_launch(proc, marker)
        raise
    stop_launch(proc, marker, grace_s=0)  # a worker torchrun left behind (it gives up on stuck ones) ends too
    return rc


def launch_pids(marker: str) -> list[int]:
    """Live processes whose environment carries MARKER=marker (zombies have none, so they are not counted)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _signal_all(proc: subprocess.Popen, marker: str, sig: int) -> list[int]:
    pids = launch_pids(marker) if os.path.isdir("/proc") else []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if proc.poll() is None:  # once torchrun is reaped its group id may be reused: signal it only while it lives
        try:
            os.killpg(proc.pid, sig)  # also reaches helpers that dropped the marker from their environment
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def start_time(pid: int) -> str | None:
    """pid's start time (what tells it from a later process given the same pid) while it lives; None once it is a
    zombie or gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def stop_launch(proc: subprocess.Popen, marker: str, grace_s: float = 10, kill_wait_s: float = 30) -> None:
    """End every process of the launch: SIGTERM (a chance to record the run as failed), then after grace_s SIGKILL
    to whatever is left, stopped processes included; wait (up to kill_wait_s) until none is left. A dying process
    loses its environment (and so its marker) before it is gone, while its memory is torn down: each one found is
    signalled and waited for by its pid and start time until it is a zombie or gone."""
    signalled: dict[int, str | None] = {}  # every process of the launch ever found: pid -> start time

    def signal_all(sig: int) -> bool:  # True while any of them lives
        found = _signal_all(proc, marker, sig)
        for pid in found:
            signalled.setdefault(pid, start_time(pid))
        left = [pid for pid, t in signalled.items() if t is not None and start_time(pid) == t]
        for pid in set(left) - set(found):  # found before, its marker gone since (dying, or it dropped it)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return proc.poll() is None or bool(left)

    if grace_s > 0:
        signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (proc.poll() is None or launch_pids(marker)):
            time.sleep(0.2)
    deadline = time.monotonic() + kill_wait_s
    while signal_all(signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
