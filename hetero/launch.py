"""Starting trainer runs from Python (grids, benchmarks, the GPU check): the torchrun command line, a clean
environment, and a launch in its own process group that a timeout stops as a whole (torchrun and its workers)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
# torchrun sets these for its workers; a launch from inside a worker (or a test) must not inherit them
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_cmd(nproc: int, args: list[str], module: str = "hetero.train") -> list[str]:
    """`torchrun --standalone` (a free port per launch, so concurrent launches never collide)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *args]


def clean_env(extra_path: list[str] | None = None, threads: str | None = None) -> dict[str, str]:
    """This environment without torchrun's worker variables, with this checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([*(extra_path or []), str(ROOT), env.get("PYTHONPATH", "")])
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, set so that it prints no banner about it
    return env


def run_logged(cmd: list[str], log: IO, timeout_s: float, env: dict[str, str] | None = None) -> int | None:
    """Run cmd with its output into the open file `log`; its exit status, or None when it ran past timeout_s and
    its whole process group was stopped (SIGTERM, then SIGKILL). An interrupt stops the group too."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        return None
    except BaseException:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM the launch's process group, SIGKILL it after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
