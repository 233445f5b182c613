"""Experiment grids, planned: a grid's parameters expanded into runs and validated before anything is launched
(hetero.lab.grid runs them). Any Config field may be given a list; `hetero` may map each model to its own list.
"""
from __future__ import annotations

import difflib
import itertools
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..core import safeio
from ..trainer.config import Config, ConfigError, shown, type_problem
from .launch import from_root

GRID_KEYS = ("grid", "nproc", "runs_root", "run_timeout_s")  # grid-level parameters; the rest are Config fields
CONFIG_KEYS = tuple(f.name for f in fields(Config))
_TYPES = {f.name: {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type)) for f in fields(Config)}
PARAMETERS = GRID_KEYS + CONFIG_KEYS
MANAGED = ("run_dir", "resume", "overwrite")  # the grid decides these per run
_IGNORED_IN_COMPARISON = set(MANAGED) | {"data_dir"}
# A parameter file's aliases may not expand past this many values (a 600-byte "billion laughs" expands to 10**9);
# the largest real grid is a few hundred runs of a few dozen fields.
MAX_VALUES = 100_000
# What the grid writes in its folder besides the run folders, and the report in its own (papermill, nbconvert):
# none may be a symbolic link (the grid's own writers replace links; papermill's and nbconvert's would follow them).
GRID_FILES = ("grid.json", "grid.csv", "grid.ipynb", "logs")
REPORT_FILES = ("report.ipynb", "report.html", "summary.csv")
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
    managed = sorted(set(config) & set(MANAGED))
    problems = [_unknown(k) for k in unknown]
    problems += [f"parameter {k!r} is set by the grid per run; leave it out" for k in managed]
    if not isinstance(grid, str) or not grid or slug(grid) != grid or grid in (".", "..") or len(grid) > 100:
        problems.append(f"grid name {shown(grid)} must be a plain folder name (not . or .., at most 100 characters) "
                        f"of letters, digits, '.', '_', '-'")
    if not isinstance(runs_root, (str, Path)) or safeio.path_problem(str(runs_root)):
        problems.append(f"runs_root must be a folder path (got {shown(runs_root)})")
    empty = [k for k, v in config.items() if isinstance(v, (list, tuple)) and not v or k == "hetero" and
             isinstance(v, dict) and (not v or any(isinstance(x, (list, tuple)) and not x for x in v.values()))]
    problems += [f"parameter {k!r} is an empty list: a grid axis needs at least one value" for k in empty]
    if not (isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
        problems.append(f"nproc must be a positive whole number (got {nproc!r})")
    if not (isinstance(run_timeout_s, (int, float)) and not isinstance(run_timeout_s, bool) and run_timeout_s > 0):
        problems.append(f"run_timeout_s must be a positive number of seconds (got {run_timeout_s!r})")
    problems += _type_problems({k: v for k, v in config.items() if k in CONFIG_KEYS and k not in MANAGED})
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
            if problem := safeio.path_problem(str(root / name)):
                problems.append(f"{shown(name, 80)[1:-1]}: its run folder {problem}: shorten its hetero spec")
                continue
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
    near = difflib.get_close_matches(str(name)[:100], PARAMETERS, n=1)
    return (f"unknown parameter {shown(name)}" + (f" (did you mean {near[0]!r}?)" if near else "")
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
    try:  # safeio: a FIFO there is refused without being opened (the check would block on it)
        saved = json.loads(safeio.read_bytes(path, "config file")).get("config", {})
        if not isinstance(saved, dict):
            raise ValueError("no config record")
    except (OSError, ValueError, AttributeError) as e:
        return [f"{run_dir} holds an unreadable config.json ({type(e).__name__}): delete the folder or choose another "
                f"grid name"]
    planned = cfg.to_dict()
    defaults = {f.name: f.default for f in fields(Config)}  # a field added since the run holds its default
    diff = [f"{k} {saved.get(k, defaults[k])!r} != {planned[k]!r}" for k in planned
            if k not in _IGNORED_IN_COMPARISON and saved.get(k, defaults[k]) != planned[k]]
    if not diff:
        return []
    return [f"{run_dir} holds a run with another configuration ({'; '.join(diff[:3])}): delete it or choose "
            f"another grid name"]


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
    params["runs_root"] = runs_root(params.get("runs_root", "runs"))
    return plan_grid(**params)


def runs_root(value: Any) -> Path:
    """A grid's runs_root as a path from the checkout's root (GridError for a value that is no path: `5`)."""
    if not isinstance(value, (str, Path)) or safeio.path_problem(str(value)):
        raise GridError(f"runs_root must be a folder path (got {shown(value)})")
    return from_root(value)


def no_links(folder: Path, names: tuple[str, ...]) -> None:
    """GridError when any of folder/NAME is a symbolic link: papermill and nbconvert write through links."""
    links = [folder / n for n in names if (folder / n).is_symlink()]
    if links:
        raise GridError(f"{links[0]} is a symbolic link: hetero does not write through links it did not create "
                        f"(remove it)")


def _loader():
    """papermill's YAML loader (no dates), refusing duplicate keys (YAML keeps the last one silently)."""
    import yaml
    from papermill.iorw import NoDatesSafeLoader

    class StrictLoader(NoDatesSafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    try:
                        duplicate = key in seen
                    except TypeError:  # an unhashable key: the base class says so
                        continue
                    if duplicate:
                        raise yaml.constructor.ConstructorError(None, None, f"duplicate key {shown(key, 40)}",
                                                                key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep)
    return StrictLoader


def _too_big(value: Any, budget: int = MAX_VALUES) -> bool:
    """Whether `value` holds more than `budget` values once its aliases are expanded (walked without a memo, as
    printing or iterating would; stops at the budget)."""
    left, stack = budget, [value]
    while stack:
        v = stack.pop()
        left -= 1
        if left < 0:
            return True
        if isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple)):
            stack += v
    return False


def read_parameters(files: list[str], yamls: list[str], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Papermill's parameters from its -f files, -y texts and -p pairs, merged in papermill's order (so `make grid`
    checks exactly what the notebook will get)."""
    import yaml
    from papermill.cli import _resolve_type

    params: dict[str, Any] = {}
    for source, text in [*[(f, None) for f in files], *[("-y", y) for y in yamls]]:
        try:
            if text is None:
                text = safeio.read_bytes(Path(source), "parameter file").decode()
            loaded = yaml.load(text, Loader=_loader())
        except UnicodeDecodeError as e:
            raise GridError(f"{source}: not UTF-8 text (byte {e.object[e.start]:#04x} at position {e.start})") \
                from None
        except OSError as e:
            raise GridError(f"cannot read the parameter file {source} ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise GridError(f"{source}: not YAML ({' '.join(str(e)[:2000].split())[:300]})") from None
        if _too_big(loaded):
            raise GridError(f"{source}: its aliases expand past {MAX_VALUES} values (a YAML alias bomb?)")
        if loaded is not None and not isinstance(loaded, dict):
            raise GridError(f"{source}: expected name: value lines, got a {type(loaded).__name__}")
        params.update(loaded or {})
    params.update({name: _resolve_type(value) for name, value in pairs})
    return params
