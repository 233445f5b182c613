"""What the benchmarks share: a launch with its log (and the log's tail on failure), steady-state epochs from a
run folder, speedup against sync, run metadata and markdown tables. Standard library only at import, so any
python with torch can use it (the GPU check)."""
from __future__ import annotations

import csv
import json
import os
import platform
import statistics
from datetime import datetime
from pathlib import Path

from ..core import safeio
from ..trainer.provenance import git, provenance, versions  # noqa: F401 - part of this toolkit
from .launch import clean_env, run_logged


class LaunchError(RuntimeError):
    """A launch failed or ran out of time: the message names its log and ends with the log's tail."""


def launch(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None, *,
           done: Path | None = None, notes: list[str] | None = None, tail: int = 15) -> None:
    """Run cmd with its command line and output in `log`; raises LaunchError. A launch that exits non-zero after
    writing `done` (a JSON file without status, or with status "completed") is kept, with a line in `notes`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(safeio.open_nofollow(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as fh:  # no planted link
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        rc = run_logged(cmd, fh, max(timeout_s, 1), env or clean_env())
    what = " ".join(cmd[2:])
    if rc is None:
        raise LaunchError(f"{what} ran past {max(timeout_s, 1):g} s and was stopped (log {log})")
    if rc and done is not None and done.exists() and \
            json.loads(done.read_text()).get("status", "completed") == "completed":
        if notes is not None:
            notes.append(f"{log.stem}: exited {rc} after finishing its work (kept; see {log})")
    elif rc:
        last = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-tail:])
        raise LaunchError(f"{what} exited {rc} (log {log}):\n{last}")


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV file as dicts of strings (no pandas needed)."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def steady_epochs(run_dir: Path, steady_from: int = 2, table: str = "epochs") -> list[dict[str, str]]:
    """The rows of a run's TABLE.csv (epochs, ranks or steps) from epoch `steady_from` (1-based) on; all of them
    when the run is shorter."""
    rows = read_rows(Path(run_dir) / f"{table}.csv")
    return [r for r in rows if int(r["epoch"]) >= steady_from] or rows


def steady_epoch_s(run_dir: Path, steady_from: int = 2) -> float:
    """Median epoch_time_s (s) over a run's steady-state epochs."""
    return statistics.median(float(r["epoch_time_s"]) for r in steady_epochs(run_dir, steady_from))


def add_speedup_vs_sync(rows: list[dict], key: str = "epoch_s") -> None:
    """Sets row["speedup_vs_sync"] = sync's time / the row's time (> 1: faster than sync), None without either."""
    sync = next((r.get(key) for r in rows if r.get("scheme") == "sync"), None)
    for r in rows:
        r["speedup_vs_sync"] = sync / r[key] if sync and r.get(key) else None


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def run_meta(command: str = "") -> dict:
    """Where and with what a measurement ran: provenance(), date, CPU, cores, load average and the command."""
    return {"date": datetime.now().isoformat(timespec="seconds"), **provenance(), "cpu": cpu_name(),
            "cores": os.cpu_count(), "load_avg_start": os.getloadavg(), "command": command}


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table's lines: the header, the rule, one line per row (cells formatted with str)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def turns(loaders: dict, steps: int, step) -> dict[str, list[float]]:
    """Each loop's step times (s) over `steps` steps, the loops taking turns step by step (which goes first
    alternates), so load from elsewhere falls on all alike. loaders: {kind: an iterable of batches}, iterated
    afresh; step(kind, batch) runs one step of that loop, from the fetched batch to the optimizer step."""
    import time

    its, spent, kinds = {k: iter(v) for k, v in loaders.items()}, {k: [] for k in loaders}, list(loaders)
    for i in range(steps):
        for kind in (kinds if i % 2 else kinds[::-1]):
            t0 = time.perf_counter()
            step(kind, next(its[kind]))
            spent[kind].append(time.perf_counter() - t0)
    return spent


def pair_summary(step_s: list[dict[str, list[float]]], steps: int) -> dict:
    """Two interleaved loops' step times (per epoch, {"api": [...], "plain": [...]}) after the first epoch: the median
    ratio of back-to-back steps (slow changes of load cancel) and the ratio of the median step times."""
    import numpy as np

    per = {k: np.concatenate([e[k] for e in step_s[1:]]) for k in ("api", "plain")}
    ratios = (per["api"] / per["plain"]).tolist()
    return {"ratio": float(np.median(ratios)), "pair_ratios": ratios, "steps": steps,
            "ratio_of_medians": float(np.median(per["api"]) / np.median(per["plain"])),
            "api_step_s": float(np.median(per["api"])), "plain_step_s": float(np.median(per["plain"])),
            "extra_ms_per_step": 1e3 * float(np.median(per["api"]) - np.median(per["plain"]))}


def loop_pair_main(module: str, doc: str, worker, argv: list[str] | None = None) -> int:
    """The command line of an overhead worker (`python -m hetero.lab.overhead`, `hetero.lab.fsdp_overhead`): two loops'
    epoch times, measured in turn in the same processes, into --out."""
    from ..trainer.cli import CliParser
    p = CliParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the epoch times (rank 0 writes it)")
    p.add_argument("--subset", type=int, required=True, help="synthetic training samples")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True, help="epochs of each loop, taken in turn; the first warms up")
    ns = p.parse_args(argv)
    if ns.epochs < 2 or ns.global_batch < 2 or ns.subset < ns.global_batch:
        p.error("need --epochs >= 2, --global-batch >= 2 and --subset >= --global-batch")
    worker(Path(ns.out), ns.subset, ns.global_batch, ns.epochs)
    return 0
