"""Experiment grids: the product of parameter lists, each cell one torchrun launch of `python -m hetero.trainer`.

    from hetero.lab.grid import plan_grid, run_grid
    g = plan_grid(grid="demo", model="tiny", scheme=["sync", "dp", "edp"], hetero="1:slowdown=3", seed=[0, 1],
             epochs=4, data="synthetic", subset=2048, nproc=2)
    table = run_grid(g)          # one row per run, also written to runs/demo/grid.csv

Any Config field may be given a list: the grid is the product of the lists. `hetero` may also map each model to
its own list (the paper delays VGG16 by 0.01/0.02 s and ResNet50 by 0.1/0.2 s). Every run's Config is validated
before anything is launched; runs already completed are skipped, interrupted ones resumed from their checkpoint,
and a failed or timed-out run is recorded in grid.csv while the grid carries on.
"""
from __future__ import annotations

import itertools
import json
import re
import sys
import time
from dataclasses import fields
from pathlib import Path

import pandas as pd

from ..core import safeio
from ..trainer.cli import CliParser
from ..trainer.config import Config
from ..trainer.runfolder import status as run_status
from .gridplan import (  # noqa: F401
    COLUMNS,
    GRID_FILES,
    GRID_KEYS,
    MANAGED,
    PARAMETERS,
    Grid,
    GridError,
    Run,
    no_links,
    plan_grid,
    plan_grid_from,
    read_parameters,
    runs_root,
    slug,
)
from .launch import from_root, run_logged, torchrun_cmd  # noqa: F401 - from_root: part of this API


def state(run_dir: Path) -> str:
    """running (a job holds the folder's lock), completed, failed, interrupted (its job died), started or new."""
    return run_status(run_dir)


def train_args(cfg: Config) -> list[str]:
    """The `python -m hetero.trainer` flags for a Config: every field that differs from its default, plus --run-dir."""
    args = []
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if f.name in MANAGED or value == f.default:
            continue
        args += [f"--{f.name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args + ["--run-dir", cfg.run_dir]


def command(run: Run, nproc: int) -> list[str]:
    """torchrun --standalone (a free port per run, so two grids at once never collide), resuming if it can."""
    st = state(run.run_dir)
    if st in ("interrupted", "failed", "started") and (run.run_dir / "checkpoint.pt").exists():
        args = ["--resume", str(run.run_dir)]
    else:
        args = train_args(run.config) + (["--overwrite"] if st != "new" else [])
    return torchrun_cmd(nproc, args)


def launch(cmd: list[str], log: Path, timeout_s: float) -> int | None:
    """Run cmd with its output in log (a new file: never another launch's); its exit status, or None when it ran
    past timeout_s and every process of it was stopped."""
    with open(log, "x") as fh:
        return run_logged(cmd, fh, timeout_s)


def fresh_log(logs: Path, name: str) -> Path:
    """logs/<name>.log, or <name>.2.log, <name>.3.log ... when taken: each launch keeps its own log, so a re-run or
    a second grid at once never overwrites one."""
    for i in itertools.count(1):
        path = logs / (f"{name}.log" if i == 1 else f"{name}.{i}.log")
        if not path.exists():
            return path
    raise AssertionError("unreachable")


def _busy(log: Path) -> bool:
    """Whether the launch was refused because another job holds the run folder."""
    return log.exists() and "is in use by another job" in log.read_text(errors="replace")


def _error(run_dir: Path, log: Path, returncode: int | None, timeout_s: float) -> str:
    """One line: the trainer's recorded error, else its last error line in the log, else the exit status."""
    if returncode is None:
        return f"timed out after {timeout_s:g} s (run_timeout_s) and was stopped"
    summary = run_dir / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("error"):
        return json.loads(summary.read_text())["error"].splitlines()[0][:300]
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    marked = [ln for ln in lines if re.match(r"hetero: (rank \d+: )?error:", ln)]
    # else the root cause: the first exception line of a worker's traceback, not torchrun's own ChildFailedError
    raised = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b:?", ln) and "ChildFailed" not in ln]
    line = marked[-1] if marked else raised[0] if raised else f"exited with status {returncode}"
    return line[:300]


def run_grid(grid: Grid, progress: bool = True) -> pd.DataFrame:
    """Launch every run not yet completed, one after another; returns (and keeps writing) grid.csv."""
    from tqdm import tqdm

    no_links(grid.root, GRID_FILES)
    (grid.root / "logs").mkdir(parents=True, exist_ok=True)
    safeio.write_text(grid.root / "grid.json", json.dumps(grid.params, indent=2, default=str) + "\n")
    rows = [{"run": r.name, "model": r.config.model, "scheme": r.config.scheme, "hetero": r.config.hetero,
             "seed": r.config.seed, "status": "pending", "error": "", "returncode": None, "wall_s": None,
             "launched": False, "run_dir": str(r.run_dir), "log": ""}
            for r in grid.runs]
    bar = tqdm(total=len(rows), desc=f"grid {grid.name}", unit="run", disable=not progress, file=sys.stdout)
    try:
        for run, row in zip(grid.runs, rows):
            st = state(run.run_dir)
            if st in ("completed", "running"):  # running: another job (a second grid) has it; it is not ours
                row.update(status="completed" if st == "completed" else "busy", log="",
                           error="" if st == "completed" else "run folder in use by another job: skipped")
            else:
                t0 = time.perf_counter()
                while True:  # two grids at once may pick the same free name: the loser ("x") takes the next
                    row["log"] = str(fresh_log(grid.root / "logs", run.name))
                    try:
                        rc = launch(command(run, grid.nproc), Path(row["log"]), grid.run_timeout_s)
                        break
                    except FileExistsError:
                        continue
                row.update(launched=True, returncode=rc, wall_s=round(time.perf_counter() - t0, 1))
                done = state(run.run_dir) == "completed"
                # refused (torchrun turns the trainer's 2 into 1) because another job had it: trained elsewhere
                if rc not in (0, None) and (_busy(Path(row["log"])) or done):
                    row["status"], row["error"] = ("completed", "") if done else \
                        ("busy", "run folder in use by another job: skipped")
                else:
                    done = done and rc == 0
                    row["status"] = "completed" if done else ("timeout" if rc is None else "failed")
                    row["error"] = "" if done else _error(run.run_dir, Path(row["log"]), rc, grid.run_timeout_s)
                bar.write(f"{run.name}: {row['status']} in {row['wall_s']:.0f} s"
                          + (f" - {row['error']}" if row["error"] else ""))
            _write_table(grid.root / "grid.csv", rows)
            bar.update(1)
    finally:
        bar.close()
        _write_table(grid.root / "grid.csv", rows)
    table = pd.DataFrame(rows, columns=COLUMNS)
    counts = table["status"].value_counts()
    print(f"grid {grid.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({grid.root / 'grid.csv'})")
    return table


def _write_table(path: Path, rows: list[dict]) -> None:
    # a fresh temporary name per write: two grids at once each write their own, and a planted link is replaced
    safeio.write_text(path, pd.DataFrame(rows, columns=COLUMNS).to_csv(index=False))


def failures(table: pd.DataFrame) -> pd.DataFrame:
    """The runs of a grid table that did not complete, with their errors."""
    return table.loc[table["status"] != "completed", ["run", "status", "error", "log"]]


def main(argv: list[str] | None = None) -> int:
    """`python -m hetero.lab.grid --check -f PARAMS.yaml [-y YAML] [-p NAME VALUE]`: plan the grid papermill would run
    and print its problems as plain lines (exit 2), or its size (exit 0). Launches and writes nothing."""
    p = CliParser(prog="python -m hetero.lab.grid", allow_abbrev=False,
                  description="Check a grid's parameters (as papermill would pass them to grid.ipynb).")
    p.add_argument("--check", action="store_true", required=True, help="plan and validate only (the only mode)")
    p.add_argument("-f", dest="files", action="append", default=[], help="a YAML parameter file")
    p.add_argument("-y", dest="yamls", action="append", default=[], help="YAML text of parameters")
    p.add_argument("-p", dest="pairs", action="append", nargs=2, default=[], metavar=("NAME", "VALUE"))
    ns = p.parse_args(argv)
    try:
        params = read_parameters(ns.files, ns.yamls, ns.pairs)
        params["runs_root"] = runs_root(params.get("runs_root", "runs"))
        g = plan_grid(**{"grid": "grid", **params})
        no_links(g.root, GRID_FILES)
    except GridError as e:
        lines = str(e).splitlines()
        for line in lines[:50]:  # every line a problem, each shortened: never a screenful of one value
            print(f"hetero: error: {line[:500]}", file=sys.stderr)
        if len(lines) > 50:
            print(f"hetero: error: ... and {len(lines) - 50} more problems", file=sys.stderr)
        return 2
    print(f"grid {g.name}: {len(g.runs)} runs of {g.nproc} ranks in {g.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
