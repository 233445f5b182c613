"""Experiment grids: the product of parameter lists, each cell one torchrun launch of `hetero.train`.

    from hetero.grid import plan_grid, run_grid
    g = plan_grid(grid="demo", model="tiny", scheme=["sync", "dp", "edp"], hetero="1:slowdown=3", seed=[0, 1],
             epochs=4, data="synthetic", subset=2048, nproc=2)
    table = run_grid(g)          # one row per run, also written to runs/demo/grid.csv

Any Config field may be given a list: the grid is the product of the lists. `hetero` may also map each model to
its own list (the paper delays VGG16 by 0.01/0.02 s and ResNet50 by 0.1/0.2 s). Every run's Config is validated
before anything is launched; runs already completed are skipped, interrupted ones resumed from their checkpoint,
and a failed or timed-out run is recorded in grid.csv while the grid carries on.
"""
from __future__ import annotations

import difflib
import itertools
import json
import os
import re
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd

from .config import CliParser, Config, ConfigError, type_problem
from .launch import from_root, run_logged, torchrun_cmd
from .runlog import status as run_status

GRID_KEYS = ("grid", "nproc", "runs_root", "run_timeout_s")  # grid-level parameters; the rest are Config fields
CONFIG_KEYS = tuple(f.name for f in fields(Config))
_TYPES = {f.name: {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type)) for f in fields(Config)}
PARAMETERS = GRID_KEYS + CONFIG_KEYS
_MANAGED = ("run_dir", "resume", "overwrite")  # the grid decides these per run
_IGNORED_IN_COMPARISON = set(_MANAGED) | {"data_dir"}
COLUMNS = ["run", "model", "scheme", "hetero", "seed", "status", "error", "returncode", "wall_s", "launched",
           "run_dir", "log"]


class GridError(ValueError):
    """A grid that cannot start: every problem found, one per line."""


@dataclass(frozen=True)
class Run:
    name: str          # <model>-<scheme>-<hetero slug>-s<seed>[-<field><value> for other swept fields]
    run_dir: Path
    config: Config


@dataclass(frozen=True)
class Grid:
    name: str
    root: Path         # runs_root/name: the run folders, grid.csv, grid.json and logs/
    runs: tuple[Run, ...]
    nproc: int         # ranks per run (the world size)
    run_timeout_s: float
    params: dict[str, Any]


def slug(spec: str) -> str:
    """A folder-safe name for a heterogeneity spec: "1:delay=0.01" -> "1-delay0.01", "" -> "none"."""
    if not spec:
        return "none"
    text = spec.replace(":", "-").replace("=", "").replace(",", "+").replace("/", "_").replace("@", "_at")
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", text)


def _coerce(name: str, value: Any) -> Any:
    """YAML's reading of a value into the field's type: `threads: 4` is the string "4", `lr: 1` the float 1.0."""
    kind = _TYPES.get(name)
    if kind is str and not isinstance(value, str):
        return str(value).lower() if isinstance(value, bool) else str(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def plan_grid(grid: str, nproc: int = 2, runs_root: str | Path = "runs", run_timeout_s: float = 3600.0,
         **config: Any) -> Grid:
    """Expand and validate a grid; raises GridError listing every bad run. Nothing is launched or written."""
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    managed = sorted(set(config) & set(_MANAGED))
    problems = [_unknown(k) for k in unknown]
    problems += [f"parameter {k!r} is set by the grid per run; leave it out" for k in managed]
    if not isinstance(grid, str) or not grid or slug(grid) != grid:
        problems.append(f"grid name {grid!r} must be a non-empty folder name of letters, digits, '.', '_', '-'")
    if not (isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
        problems.append(f"nproc must be a positive whole number (got {nproc!r})")
    if not (isinstance(run_timeout_s, (int, float)) and not isinstance(run_timeout_s, bool) and run_timeout_s > 0):
        problems.append(f"run_timeout_s must be a positive number of seconds (got {run_timeout_s!r})")
    problems += _type_problems({k: v for k, v in config.items() if k in CONFIG_KEYS and k not in _MANAGED})
    if problems:
        raise GridError("\n".join(problems))
    models = _as_list(config.pop("model", Config.model))
    hetero = config.pop("hetero", Config.hetero)
    if isinstance(hetero, dict):
        missing = [m for m in models if m not in hetero]
        if missing:
            raise GridError(f"hetero gives no heterogeneity for model(s) {', '.join(missing)}")
        per_model = {m: _as_list(hetero[m]) for m in models}
    else:
        per_model = {m: _as_list(hetero) for m in models}
    schemes = _as_list(config.pop("scheme", Config.scheme))
    seeds = _as_list(config.pop("seed", Config.seed))
    extra_axes = {k: v for k, v in config.items() if isinstance(v, (list, tuple))}
    fixed = {k: v for k, v in config.items() if k not in extra_axes}
    root = Path(runs_root) / grid
    runs, seen, host_problems = [], {}, set()
    for seed, model, scheme, *extra in itertools.product(seeds, models, schemes, *extra_axes.values()):
        for spec in per_model[model]:
            swept = dict(zip(extra_axes, extra))
            name = f"{model}-{scheme}-{slug(str(spec))}-s{seed}" + "".join(
                f"-{k}{slug(str(v))}" for k, v in swept.items() if len(extra_axes[k]) > 1)
            if name in seen:
                problems.append(f"{name}: two runs would share this folder (hetero specs {seen[name]!r} and "
                                f"{spec!r})")
                continue
            seen[name] = spec
            run_dir = root / name
            try:
                values = {**fixed, **swept, "model": model, "scheme": scheme, "hetero": spec, "seed": seed}
                cfg = Config(**{k: _coerce(k, v) for k, v in values.items()}, run_dir=str(run_dir))
                cfg.check_world(nproc)
            except (ConfigError, TypeError) as e:
                problems.append(f"{name}: {e}")
                continue
            try:
                cfg.check_host(range(nproc), nproc)  # the grid launches every run on this host
            except ConfigError as e:  # the same for many runs: said once
                if str(e) not in host_problems:
                    host_problems.add(str(e))
                    problems.append(f"{name}: {e}")
                continue
            problems += _conflict(run_dir, cfg)
            runs.append(Run(name, run_dir, cfg))
    if problems:
        raise GridError("\n".join(problems))
    params = {"grid": grid, "nproc": nproc, "runs_root": str(runs_root), "run_timeout_s": run_timeout_s,
              "model": models, "hetero": hetero, "scheme": schemes, "seed": seeds, **config}
    return Grid(grid, root, tuple(runs), nproc, float(run_timeout_s), params)


def _unknown(name: str) -> str:
    near = difflib.get_close_matches(name, PARAMETERS, n=1)
    return (f"unknown parameter {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
            + f": not a Config field nor one of {', '.join(GRID_KEYS)}")


def _type_problems(config: dict[str, Any]) -> list[str]:
    """One line per field holding a value of the wrong type (in a list: the first such value), named."""
    problems = []
    for name, value in config.items():
        values = [v for vs in value.values() for v in _as_list(vs)] if name == "hetero" and isinstance(value, dict) \
            else _as_list(value)
        for v in values:
            if problem := type_problem(name, _coerce(name, v)):
                problems.append(problem)
                break
    return problems


def _conflict(run_dir: Path, cfg: Config) -> list[str]:
    """A folder holding a run of another configuration is never reused silently."""
    path = run_dir / "config.json"
    if not path.exists() or path.stat().st_size == 0:
        return []
    saved = json.loads(path.read_text()).get("config", {})
    planned = cfg.to_dict()
    defaults = {f.name: f.default for f in fields(Config)}  # a field added since the run holds its default
    diff = [f"{k} {saved.get(k, defaults[k])!r} != {planned[k]!r}" for k in planned
            if k not in _IGNORED_IN_COMPARISON and saved.get(k, defaults[k]) != planned[k]]
    if not diff:
        return []
    return [f"{run_dir} holds a run with another configuration ({'; '.join(diff[:3])}): delete it or choose "
            f"another grid name"]


def state(run_dir: Path) -> str:
    """running (a job holds the folder's lock), completed, failed, interrupted (its job died), started or new."""
    return run_status(run_dir)


def train_args(cfg: Config) -> list[str]:
    """The hetero.train flags for a Config: every field that differs from its default, plus --run-dir."""
    args = []
    for f in fields(Config):
        value = getattr(cfg, f.name)
        if f.name in _MANAGED or value == f.default:
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

    (grid.root / "logs").mkdir(parents=True, exist_ok=True)
    (grid.root / "grid.json").write_text(json.dumps(grid.params, indent=2, default=str) + "\n")
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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # two grids at once each write their own
    pd.DataFrame(rows, columns=COLUMNS).to_csv(tmp, index=False)
    os.replace(tmp, path)


def plan_grid_from(namespace: dict[str, Any]) -> Grid:
    """plan_grid() from a notebook's variables (those named like a grid parameter or a Config field); a relative
    runs_root is relative to the repository root, wherever the kernel started."""
    params = {k: v for k, v in namespace.items() if k in PARAMETERS}
    # A notebook holds other variables too, so only a near miss of a parameter's name (papermill's `-p epochz 3`,
    # a typo in the parameters cell) can be told from them.
    near = [_unknown(k) for k, v in namespace.items() if k not in PARAMETERS and not k.startswith("_")
            and isinstance(v, (bool, int, float, str, list, tuple, dict))
            and difflib.get_close_matches(k, PARAMETERS, 1, cutoff=0.75)]
    if near:
        raise GridError("\n".join(near))
    params["runs_root"] = from_root(params.get("runs_root", "runs"))
    return plan_grid(**params)


def failures(table: pd.DataFrame) -> pd.DataFrame:
    """The runs of a grid table that did not complete, with their errors."""
    return table.loc[table["status"] != "completed", ["run", "status", "error", "log"]]


def read_parameters(files: list[str], yamls: list[str], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Papermill's parameters from its -f files, -y texts and -p pairs, merged in papermill's order (so `make grid`
    checks exactly what the notebook will get)."""
    import yaml
    from papermill.cli import _resolve_type
    from papermill.iorw import NoDatesSafeLoader

    params: dict[str, Any] = {}
    for source, text in [*[(f, None) for f in files], *[("-y", y) for y in yamls]]:
        try:
            loaded = yaml.load(Path(source).read_text() if text is None else text, Loader=NoDatesSafeLoader)
        except OSError as e:
            raise GridError(f"cannot read the parameter file {source} ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise GridError(f"{source}: not YAML ({' '.join(str(e).split())})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise GridError(f"{source}: expected name: value lines, got a {type(loaded).__name__}")
        params.update(loaded or {})
    params.update({name: _resolve_type(value) for name, value in pairs})
    return params


def main(argv: list[str] | None = None) -> int:
    """`python -m hetero.grid --check -f PARAMS.yaml [-y YAML] [-p NAME VALUE]`: plan the grid papermill would run
    and print its problems as plain lines (exit 2), or its size (exit 0). Launches and writes nothing."""
    p = CliParser(prog="python -m hetero.grid", allow_abbrev=False,
                  description="Check a grid's parameters (as papermill would pass them to grid.ipynb).")
    p.add_argument("--check", action="store_true", required=True, help="plan and validate only (the only mode)")
    p.add_argument("-f", dest="files", action="append", default=[], help="a YAML parameter file")
    p.add_argument("-y", dest="yamls", action="append", default=[], help="YAML text of parameters")
    p.add_argument("-p", dest="pairs", action="append", nargs=2, default=[], metavar=("NAME", "VALUE"))
    ns = p.parse_args(argv)
    try:
        params = read_parameters(ns.files, ns.yamls, ns.pairs)
        params["runs_root"] = from_root(params.get("runs_root", "runs"))
        g = plan_grid(**{"grid": "grid", **params})
    except GridError as e:
        for line in str(e).splitlines():
            print(f"hetero: error: {line}", file=sys.stderr)
        return 2
    print(f"grid {g.name}: {len(g.runs)} runs of {g.nproc} ranks in {g.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
