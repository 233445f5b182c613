"""Recovery under torchrun's elastic agent (part "recovery" of `make bench`): two agents on 127.0.0.1 (c10d
rendezvous, one worker each, named by HETERO_WORKER_ID; the store in this process), the second SIGKILLed after a step
checkpoint; the seconds from the kill to the survivor's first step in its new world of one, and where they went.

    python -m hetero.lab.recovery [--kills 3] [--out DIR]     # also `make bench` (its recovery part)

The agent settings are AGENT (docs/elastic.md says why each): the rendezvous notices a dead node after
keep_alive_interval x keep_alive_max_attempt seconds without its heartbeat, then waits last_call_timeout for more
nodes before the new round completes; the agent looks at its workers every monitor_interval. The tests reuse the
two-agent launch (tests/trainer/test_elastic.py); they assert what the survivor does, never the seconds.
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from ..core import safeio
from ..trainer.cli import CliParser
from .launch import ROOT, clean_env, free_port


@dataclass(frozen=True)
class AgentSettings:
    """torchrun's knobs that decide how fast a lost node's world re-forms (seconds; the rendezvous takes whole ones)."""
    monitor_interval: float = 0.1   # the agent polls its workers' exit this often (torchrun's default)
    keep_alive_interval: int = 1    # each agent's heartbeat to the rendezvous (torch's default 5)
    keep_alive_max_attempt: int = 2  # heartbeats missed before a node counts as dead (default 3: 15 s)
    last_call_timeout: int = 2      # a round that has its minimum waits this long for more nodes (default 30)
    join_timeout: int = 600         # how long a round waits for its minimum (torch's default)
    close_timeout: int = 10         # how long a finished job waits for the rendezvous to close (default 30)

    def rdzv_conf(self) -> str:
        return ",".join(f"{k}={getattr(self, k)}" for k in ("join_timeout", "last_call_timeout", "close_timeout",
                                                            "keep_alive_interval", "keep_alive_max_attempt"))

    def torchrun_args(self) -> list[str]:
        """The flags hetero passes torchrun for several nodes (the Makefile's TORCHRUN_ARGS say the same)."""
        return [f"--rdzv-conf={self.rdzv_conf()}", f"--monitor-interval={self.monitor_interval:g}"]


AGENT = AgentSettings()
TORCH_DEFAULTS = AgentSettings(monitor_interval=0.1, keep_alive_interval=5, keep_alive_max_attempt=3,
                               last_call_timeout=30, join_timeout=600, close_timeout=30)


# The worker's own start, in the order it happens (timed_worker): the interpreter is up; `import torch`; DDP's
# constructor imports torch._dynamo (done first here, so that its seconds are its own); the trainer's modules; the
# arguments, the run folder's files and rank 0's checkpoint read (its digest verified); the data; the rest of the
# checks before the process group (the checkpoint tried against the config, the folder claimed); the process group;
# the Trainer (model, Balance, DDP, attach); the checkpoint loaded into it; the start line.
WORKER_PHASES = ("exec", "import_torch", "import_dynamo", "import_trainer", "read_checkpoint", "data", "prepare",
                 "process_group", "build", "load_checkpoint", "start")
PHASE = "hetero-phase"  # a timed worker's line: `hetero-phase NAME UNIX_TIME`


def timed_worker(t_exec: float, argv: list[str]) -> None:
    """`python -m hetero.trainer ARGV`, printing the wall time at each of WORKER_PHASES (for the recovery bench).
    The trainer's own functions run unchanged; each is wrapped to print when it returns."""
    def mark(name: str) -> None:
        print(f"{PHASE} {name} {time.time():.3f}", flush=True)
    print(f"{PHASE} exec {t_exec:.3f}", flush=True)
    import torch
    mark("import_torch")
    import torch._dynamo  # noqa: F401 - DistributedDataParallel's constructor imports it
    mark("import_dynamo")
    from ..trainer import run
    mark("import_trainer")

    def timed(fn, name):
        def call(*a, **k):
            out = fn(*a, **k)
            mark(name)
            return out
        return call
    run.RunFolder.load_trainer_checkpoint = timed(run.RunFolder.load_trainer_checkpoint, "read_checkpoint")
    run.load_data = timed(run.load_data, "data")
    run.prepare = timed(run.prepare, "prepare")
    run.setup = timed(run.setup, "process_group")
    run.Trainer = timed(run.Trainer, "build")
    from ..trainer.loop import Trainer
    Trainer.load_state_dict = timed(Trainer.load_state_dict, "load_checkpoint")
    run.start_folder = timed(run.start_folder, "start")
    code = run.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as hetero.trainer's __main__ does


def agent_cmd(args: list[str], port: int, nnodes: str = "1:2", settings: AgentSettings = AGENT,
              max_restarts: int = 3, rdzv_id: str = "hetero-elastic", timed: bool = False) -> list[str]:
    """One node's torchrun agent of an elastic job on 127.0.0.1 (one worker), its rendezvous store at `port`
    hosted by the caller (is_host=false). timed: the worker is timed_worker (the trainer, printing its phases)."""
    flags = settings.torchrun_args()
    flags[0] += ",is_host=false"
    worker = ["-m", "hetero.trainer", *args]
    if timed:  # the clock read before any import: the interpreter's own start is the only thing before it
        worker = ["--no-python", sys.executable, "-c", "import sys, time; t = time.time(); from hetero.lab.recovery "
                  "import timed_worker; timed_worker(t, sys.argv[1:])", *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
            f"--max-restarts={max_restarts}", *flags, f"--log-dir={os.devnull}", *worker]


class Agent:
    """A torchrun agent in a session of its own, its output lines kept with the wall time each arrived at."""

    def __init__(self, cmd: list[str], name: str, env: dict[str, str] | None = None):
        env = {**(env or clean_env()), "HETERO_WORKER_ID": name, "LOGLEVEL": "INFO"}  # INFO: the agent's events
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str, after: float) -> float | None:
        """When the first line matching `pattern` arrived after `after` (None: none did)."""
        return next((t for t, line in self.lines if t >= after and re.search(pattern, line)), None)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        """SIGKILL the agent's process group; its workers follow (they die with their launcher)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def wait_for_checkpoint(run: Path, proc: subprocess.Popen, epochs: int, step: int, limit: float = 600) -> None:
    """Until summary.json reports `epochs` completed and a step checkpoint at >= `step` of the next (a state the run
    reached, not a time). AssertionError when the launch exits or the run passes the point."""
    t0 = time.time()
    while time.time() - t0 < limit:
        try:
            s = json.loads((run / "summary.json").read_text())
            if s["epochs_completed"] == epochs and s["checkpoint_step"] >= step:
                return
            assert s["epochs_completed"] <= epochs, "the run passed the kill point (too fast a host?)"
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None, f"the launch exited ({proc.returncode}) before the kill point"
        time.sleep(0.05)
    raise AssertionError(f"{run} never reached a checkpoint at step {step} after epoch {epochs}")


@contextmanager
def rendezvous_store():
    """A c10d store on a free loopback port, for the agents' rendezvous, alive until the block ends: a store that
    outlives either agent (as a head node's does when a worker node is lost)."""
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    try:
        yield port
    finally:
        del store


def start_pair(args: list[str], port: int, settings: AgentSettings = AGENT,
               names: tuple[str, str] = ("agent-a", "agent-b"), max_restarts: int = 3,
               timed: bool = False) -> tuple[Agent, Agent]:
    """Agents a (--nnodes=1:2: it stays, and goes on alone) and b (--nnodes=2:2) of one job. b starts first and a
    once b is in the first round, which b cannot finish alone: so both are in it whatever the load. (Started alike,
    the first to join would finish the round alone after last_call_timeout if the other's start is slower, and take
    it in by a growth restart, which torch 2.14's agent does not finish on one machine: docs/elastic.md.)"""
    b = Agent(agent_cmd(args, port, "2:2", settings, max_restarts, timed=timed), names[1])
    t0 = time.time()
    while b.first(r"Rendezvous'ing worker group", 0) is None and b.proc.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    return Agent(agent_cmd(args, port, "1:2", settings, max_restarts, timed=timed), names[0]), b


# The recovery's phases, in order, as seconds after the SIGKILL: the survivor's worker fails (its error line), its
# agent notices (`Worker group FAILED`), the new rendezvous round completes, the agent starts the new worker, the
# worker's own WORKER_PHASES (timed_worker), and the new world's first step ends (summary.json's first_step_time).
AGENT_MARKS = {"worker_fails": r"^hetero: rank \d+: error",
               "notice": r"Worker group (FAILED|UNHEALTHY)|failed \(exitcode",
               "rendezvous": r"Rendezvous complete for workers",
               "agent_starts": r"\] \[default\] Starting worker group"}
PHASES = (*AGENT_MARKS, *WORKER_PHASES, "first_step")


def lose_a_node(run: Path, args: list[str], settings: AgentSettings = AGENT, epochs: int = 1, step: int = 4,
                timeout: float = 400, timed: bool = False) -> dict:
    """Two agents train `args` into `run`; agent b is SIGKILLed once a checkpoint at >= `step` after `epochs`
    epochs exists; agent a's worker goes on alone. Its exit status, output, and the recovery's times (s after the
    kill) of each of PHASES seen (timed: the workers are timed_worker, which prints WORKER_PHASES); `start` is
    the worker's start line (imports, data, process group, checkpoint), `first_step` the new world's first step."""
    with rendezvous_store() as port:
        a, b = start_pair(args, port, settings, timed=timed)
        try:
            wait_for_checkpoint(run, b.proc, epochs, step)
            t_kill = time.time()
            b.kill()
            rc = a.wait(timeout)
        finally:
            for x in (a, b):
                x.kill()
    summary = json.loads((run / "summary.json").read_text())
    marks = {k: a.first(pattern, t_kill) for k, pattern in AGENT_MARKS.items()}
    for _, line in a.lines:  # the worker's own clock at each phase (the restarted worker's lines: after the kill)
        if line.startswith(PHASE + " ") and (t := float(line.split()[2])) >= t_kill:
            marks[line.split()[1]] = t  # the last: the checks before the process group also try the checkpoint
    marks["start"] = marks.get("start") or a.first(r"^hetero: .* on 1 rank", t_kill)
    first = summary.get("first_step_time")
    marks["first_step"] = first if first is not None and first >= t_kill else None
    times = {k: None if marks.get(k) is None else marks[k] - t_kill for k in PHASES}
    return {"returncode": rc, "output": a.output(), "times": times, "kill_time": t_kill}


def phase_table(phases: dict) -> list[tuple[str, float, float]]:
    """(phase, seconds after the kill, seconds since the phase before) for the phases seen, in order."""
    rows, before = [], 0.0
    for k in PHASES:
        if phases.get(k) is not None:
            rows.append((k, phases[k], phases[k] - before))
            before = phases[k]
    return rows


PHASE_NAMES = {
    "worker_fails": "the survivor's worker fails (its peer's socket reset)",
    "notice": "its agent sees the worker fail (`--monitor-interval`)",
    "rendezvous": "the new rendezvous round completes (dead node dropped, last call)",
    "agent_starts": "the agent starts the new worker",
    "exec": "the worker's interpreter is up",
    "import_torch": "`import torch`",
    "import_dynamo": "`import torch._dynamo` (DDP's constructor needs it)",
    "import_trainer": "hetero's trainer modules",
    "read_checkpoint": "arguments, run folder, checkpoint read and its digest checked (rank 0)",
    "data": "the data set",
    "prepare": "the rest of the checks before the process group",
    "process_group": "the process group",
    "build": "model, Balance, DDP, attach",
    "load_checkpoint": "the checkpoint loaded into the Trainer",
    "start": "the start line (metadata gathered, run folder written)",
    "first_step": "the new world's first step ends",
}


def phase_lines(rec: dict) -> list[str]:
    """The phase breakdown as a markdown table (medians over the runs; a phase's seconds are its end minus the end
    of the phase before)."""
    rows = phase_table(rec.get("phases_s", {}))
    if not rows:
        return []
    return (["| phase | ends (s after the kill) | takes (s) |", "|---|---|---|"]
            + [f"| {PHASE_NAMES.get(k, k)} | {at:.2f} | {took:.2f} |" for k, at, took in rows] + [""])


def import_seconds() -> float:
    """Seconds a fresh interpreter takes to import torch and torch._dynamo (DDP's constructor imports the latter):
    the floor of a restarted worker's start on this host, measured right after each recovery (same load)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torch._dynamo"], env=clean_env(), check=True)
    return time.perf_counter() - t0


def measure(out: Path, kills: int = 3, settings: AgentSettings = AGENT, notes: list[str] | None = None) -> dict:
    """`kills` runs of lose_a_node (TINY model, 2 epochs, a checkpoint every 4 steps, rank 1 delayed 0.1 s a step
    so that the kill lands mid-epoch); the median seconds to the first new step, and each run's times."""
    rows = []
    for i in range(kills):
        run = out / f"recovery-{i}"
        args = ["--model", "tiny", "--data", "synthetic", "--subset", "2048", "--test-subset", "256",
                "--global-batch", "128", "--epochs", "2", "--scheme", "edp", "--hetero", "1:delay=0.1",
                "--checkpoint-every", "4", "--timeout-s", "20", "--threads", "1", "--run-dir", str(run)]
        print(f"bench: recovery {i + 1}/{kills}", flush=True)
        try:
            r = lose_a_node(run, args, settings, timed=True)
        except (AssertionError, subprocess.TimeoutExpired) as e:  # the kill point missed, or a hang: noted
            (notes if notes is not None else []).append(f"recovery run {i}: {str(e).splitlines()[0][:200]}")
            continue
        safeio.write_text(out / f"recovery-{i}.log", r["output"] + "\n")
        if r["returncode"] != 0 or r["times"]["first_step"] is None:
            (notes if notes is not None else []).append(f"recovery run {i} failed (exit {r['returncode']}, log "
                                                         f"recovery-{i}.log)")
            continue
        rows.append({**r["times"], "import_s": import_seconds(), "load_avg": os.getloadavg()[0]})
    firsts = [r["first_step"] for r in rows]
    return {"settings": asdict(settings), "torchrun_args": settings.torchrun_args(), "kills": kills, "runs": rows,
            "first_step_s": statistics.median(firsts) if firsts else None,
            "phases_s": {k: statistics.median(r[k] for r in rows if r.get(k) is not None)
                         for k in (*PHASES, "import_s") if any(r.get(k) is not None for r in rows)},
            "load_avg": [r["load_avg"] for r in rows]}


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog="python -m hetero.lab.recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="runs, each losing a node once")
    p.add_argument("--torch-defaults", action="store_true", help="torchrun's own settings instead of hetero's")
    p.add_argument("--out", default="", help="output folder (default runs/bench/recovery-<time>)")
    ns = p.parse_args(argv)
    if ns.kills < 1:
        p.error("--kills must be at least 1")
    out = Path(ns.out or ROOT / "runs" / "bench" / f"recovery-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    res = measure(out, ns.kills, TORCH_DEFAULTS if ns.torch_defaults else AGENT)
    safeio.write_text(out / "recovery.json", json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("runs", "phases_s")}, indent=1))
    print("phase (median of the runs)  s after the kill  s in the phase")
    for k, at, took in phase_table(res["phases_s"]):
        print(f"{k:27s} {at:16.2f} {took:15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
