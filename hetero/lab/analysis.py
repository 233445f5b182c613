"""Run folders into tidy pandas frames (one observation per row) and the grid's summary table.

    frames = load("runs/demo")                     # a grid folder, or a list of run folders
    table = summary_table(frames)                  # one row per (model, heterogeneity, scheme)
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..core import safeio
from ..core.emulator import parse_hetero
from ..core.partition import SCHEMES, affine_batch_sizes, batch_sizes, fit_affine, predicted_step_s
from ..trainer.runfolder import status as run_status
from .launch import from_root

RUN_KEYS = ["run", "model", "hetero", "setting", "scheme", "scheme_label", "seed"]


def scheme_label(scheme: str) -> str:
    """The scheme's name in tables and figures ("edp" -> "EDP-SGD"); an unknown one as given."""
    return SCHEMES[scheme].label if scheme in SCHEMES else scheme


OUTSIDE = " + outside "  # a run's heterogeneity key: the emulated spec, then the outside straggler (--straggler)


def heterogeneity(hetero: str, straggler: str = "") -> str:
    """A run's heterogeneity as one key (the tables group by it): "1:slowdown=3", " + outside 1:quota=0.33", ..."""
    return f"{hetero}{OUTSIDE}{straggler}" if straggler else hetero


def slowed_ranks(spec: str) -> dict[int, str]:
    """{rank: "slowed" (by the emulator) or "outside" (an outside straggler)} of a heterogeneity key."""
    from ..trainer.straggler import parse_straggler

    emulated, _, outside = spec.partition(OUTSIDE)
    return {**{r: "slowed" for r in parse_hetero(emulated)}, **{r: "outside" for r in parse_straggler(outside)}}


def hetero_label(spec: str) -> str:
    """A heterogeneity key in words: "1:delay=0.01" -> "rank 1 +10 ms/step", "1:slowdown=3" -> "rank 1 3x slower",
    " + outside 1:quota=0.33" -> "rank 1 under a quota of 0.33 core (outside)"."""
    if OUTSIDE in spec:
        emulated, outside = spec.split(OUTSIDE, 1)
        words = [_outside_label(outside)]
        return ", ".join([hetero_label(emulated), *words] if emulated else words)
    if not spec:
        return "homogeneous"
    try:
        ranks = parse_hetero(spec)
    except ValueError:
        return spec
    words = []
    for rank, effects in sorted(ranks.items()):
        for e in effects:
            what = {"delay": lambda p: f"+{_ms(p[0])}/step", "exp": lambda p: f"+random {_ms(p[0])}/step (exp.)",
                    "gamma": lambda p: f"+random {_ms(p[0] * p[1])}/step (gamma)",
                    "slowdown": lambda p: f"{p[0]:g}\u00d7 slower"}[e.kind](e.params)
            if e.window is not None:
                kind, a, b = e.window
                what += f" (every {a} steps, {b} on)" if kind == "cycle" else \
                    f" ({kind}s {a}\u2013{'' if b is None else b})"
            words.append(f"rank {rank} {what}")
    return ", ".join(words)


def _outside_label(spec: str) -> str:
    from ..trainer.straggler import PERIOD_US, parse_straggler

    try:
        ranks = parse_straggler(spec)
    except ValueError:
        return f"outside {spec}"
    words = []
    for rank, st in sorted(ranks.items()):
        if st.quota is not None:
            period = "" if st.period_us == PERIOD_US else f" per {st.period_us / 1000:g} ms"
            words.append(f"rank {rank} under a quota of {st.quota:g} core{period} (outside)")
        if st.neighbour is not None:
            words.append(f"rank {rank} beside a {st.neighbour} neighbour (outside)")
        if st.threads is not None:
            words.append(f"rank {rank} on {st.threads} thread(s) (outside)")
    return ", ".join(words)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:g} ms"


def find_runs(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """The run folders: a grid folder's subfolders holding config.json, or the given folders themselves."""
    if isinstance(source, (str, Path)):
        source = from_root(source)
        if (source / "config.json").exists():
            return [source]
        found = sorted(p.parent for p in source.glob("*/config.json"))
        if not found:
            raise FileNotFoundError(f"{source} holds no run folders (no */config.json)")
        return found
    return [from_root(p) for p in source]


@dataclass
class Frames:
    runs: pd.DataFrame     # one row per run: identity, status, summary numbers
    epochs: pd.DataFrame   # one row per run and epoch (epochs.csv)
    ranks: pd.DataFrame    # one row per run, epoch and rank (ranks.csv)
    steps: pd.DataFrame    # one row per run, epoch, step and rank (steps.csv)
    # one row per run and change of world size: the position (in epochs) where the new world started
    changes: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["setting", "at_epoch", "old_world",
                                                                                "world"]))


def load(source: str | Path | Sequence[str | Path]) -> Frames:
    """Every run's tables with its identity columns (RUN_KEYS) in front; failed or unfinished runs are kept in
    `runs` (status) but left out of the other frames."""
    runs, tables = [], {"epochs": [], "ranks": [], "steps": []}
    for path in find_runs(source):
        meta = json.loads((path / "config.json").read_text())
        cfg = meta["config"]
        summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
        kind = heterogeneity(cfg["hetero"], cfg.get("straggler", ""))
        ident = {"run": path.name, "model": cfg["model"], "hetero": kind,
                 "setting": f"{cfg['model']}, {hetero_label(kind)}", "scheme": cfg["scheme"],
                 "scheme_label": scheme_label(cfg["scheme"]), "seed": cfg["seed"]}
        status = run_status(path)  # a dead job's "running" reads "interrupted" (its folder lock is free)
        runs.append({**ident, "status": status, "error": summary.get("error", ""),
                     "world_size": meta.get("world_size"), "global_batch": cfg["global_batch"],
                     "micro_batch": cfg.get("micro_batch", 0),
                     "epochs": cfg["epochs"], "epochs_completed": summary.get("epochs_completed", 0),
                     "train_time_s": summary.get("train_time_s"), "final_test_top1": summary.get("final_test_top1"),
                     "final_test_loss": summary.get("final_test_loss"),
                     "mean_balance_eff": summary.get("mean_balance_eff"), "run_dir": str(path)})
        if status != "completed":
            continue
        for name in tables:
            df = pd.read_csv(path / f"{name}.csv")
            tables[name].append(df.assign(**ident)[RUN_KEYS + list(df.columns)])
    runs += _unlaunched(source, {r["run"] for r in runs})
    frames = [pd.DataFrame(runs)] + [pd.concat(t, ignore_index=True) if t else pd.DataFrame(columns=RUN_KEYS)
                                     for t in tables.values()]
    out = Frames(*(_in_order(df) for df in frames))
    changes = [membership_changes(Path(r["run_dir"]), r["setting"], out.epochs[out.epochs.run == r["run"]])
               for r in runs if r.get("status") == "completed"]
    if changes := [c for c in changes if len(c)]:
        out.changes = pd.concat(changes, ignore_index=True)
    return out


def membership_changes(path: Path, setting: str, epochs: pd.DataFrame) -> pd.DataFrame:
    """A run's changes of world size (membership.csv): where each new world started, in epochs (epoch e done and
    s of the next's steps: e + s / steps), with the old and new world."""
    if not (path / "membership.csv").exists():
        return pd.DataFrame()
    m = pd.read_csv(path / "membership.csv").drop_duplicates("time")
    m = m[(m.old_world > 0) & (m.old_world != m.world)]
    steps = epochs.set_index("epoch")["steps"] if len(epochs) else pd.Series(dtype=float)
    return pd.DataFrame({"setting": setting, "at_epoch": [e + s / steps.get(e + 1, np.inf) for e, s in
                                                          zip(m.epoch, m.step)],
                         "old_world": m.old_world.to_numpy(), "world": m.world.to_numpy()})


def _in_order(df: pd.DataFrame) -> pd.DataFrame:
    """Sorted by model, heterogeneity, scheme (Sync-SGD, DP-SGD, EDP-SGD, others) and seed; stable within a run."""
    if df.empty:
        return df
    rank = df["scheme"].map(lambda s: list(SCHEMES).index(s) if s in SCHEMES else len(SCHEMES))
    keys = df[["model", "hetero", "seed"]].assign(scheme_rank=rank)
    order = keys.sort_values(["model", "hetero", "scheme_rank", "seed"], kind="stable").index
    return df.loc[order].reset_index(drop=True)


def _unlaunched(source, seen: set[str]) -> list[dict]:
    """Runs a grid recorded (grid.csv) that left no run folder, e.g. failed before training started."""
    if not isinstance(source, (str, Path)) or not (from_root(source) / "grid.csv").exists():
        return []
    table = pd.read_csv(from_root(source) / "grid.csv", keep_default_na=False)
    rows = []
    for _, r in table.iterrows():
        if r["run"] not in seen:
            kind = heterogeneity(r["hetero"], r.get("straggler", ""))
            rows.append({"run": r["run"], "model": r["model"], "hetero": kind,
                         "setting": f"{r['model']}, {hetero_label(kind)}", "scheme": r["scheme"],
                         "scheme_label": scheme_label(r["scheme"]), "seed": r["seed"], "status": r["status"],
                         "error": r["error"]})
    return rows


def completed(frames: Frames) -> pd.DataFrame:
    return frames.runs[frames.runs["status"] == "completed"]


def time_to_target(epochs: pd.DataFrame, target: float) -> pd.Series:
    """Per run: training wall time (s) at the end of the first epoch with test top-1 >= target (NaN if never)."""
    hit = epochs[epochs["test_top1"] >= target]
    return hit.groupby("run")["train_time_s"].min().reindex(epochs["run"].unique())


def auto_target(runs: pd.DataFrame) -> float:
    """A top-1 every scheme reaches on average: 95% of the worst scheme's mean final top-1, floored to a percent."""
    worst = runs.groupby("scheme")["final_test_top1"].mean().min()
    return float(np.floor(95 * worst) / 100)


def predicted_speedup(frames: Frames, runs: pd.DataFrame) -> float:
    """The cost model's speedup over equal shares for one setting's runs (same model and heterogeneity): each
    rank's step time fitted as fixed + per-sample x batch (hetero.core.partition.fit_affine, stalls clipped) from
    the steps of every one of these runs after its first epoch, pooled (the schemes' different sizes give the
    slope), then (slowest rank at equal sizes + all-reduce) / (slowest rank at the model's best sizes +
    all-reduce), the all-reduce being the median over steps of the least wait of any rank. A rank under a CFS quota
    (--straggler) is fitted at the rate its quota sustains its steps' CPU, as the balancer and the bench read it
    (noisefit.sustained_steps). NaN without steps or with a changing world."""
    from ..trainer.straggler import quotas
    from .noisefit import sustained_steps

    st = frames.steps[frames.steps["run"].isin(runs["run"])]
    if len(st) and st["epoch"].max() > 1:
        st = st[st["epoch"] > 1]
    keys = runs["hetero"].dropna().unique()  # one setting: one heterogeneity key (hetero + outside straggler)
    outside = str(keys[0]).split(OUTSIDE, 1)[1] if len(keys) == 1 and OUTSIDE in str(keys[0]) else ""
    quota = quotas(outside)
    if quota and len(st):
        st = sustained_steps(st, quota, float(st.groupby(["run", "epoch", "step"])["wait_s"].min().mean()))
    worlds = runs["world_size"].dropna().unique()
    if not len(st) or len(worlds) != 1 or st.groupby("run")["rank"].nunique().ne(int(worlds[0])).any():
        return float("nan")
    grid = lambda col: st.pivot_table(index=["run", "epoch", "step"], columns="rank", values=col)  # noqa: E731
    sizes, times = grid("batch_size"), grid("compute_s")
    if sizes.isna().any().any():
        return float("nan")
    a, c = fit_affine(sizes.to_numpy(), times.to_numpy())
    if not (np.isfinite(a).all() and np.isfinite(c).all()):
        return float("nan")
    g, m = int(runs["global_batch"].iloc[0]), int(runs["micro_batch"].fillna(0).iloc[0]) or 1
    best = affine_batch_sizes(a, c, g, granularity=m)
    equal = batch_sizes(np.ones(len(a)), g, granularity=m)
    allreduce = float(st.groupby(["run", "epoch", "step"])["wait_s"].min().median())
    return (predicted_step_s(a, c, equal) + allreduce) / (predicted_step_s(a, c, best) + allreduce)


def summary_table(frames: Frames, target_top1: float = 0.0) -> pd.DataFrame:
    """One row per (model, hetero, scheme) over completed runs (seeds): times in s, accuracies as fractions.

    speedup_vs_sync = Sync-SGD's mean training time / this scheme's (same model and heterogeneity);
    steady_speedup = the same over the epochs after the first (the first runs at equal shares, before any decision);
    predicted_speedup = the cost model's (predicted_speedup: 1 for Sync-SGD, the best sizes' for the others), and
    of_predicted = steady_speedup / predicted_speedup; target_top1 <= 0 picks a target per setting (auto_target)."""
    runs = completed(frames)
    per_run = frames.epochs.sort_values(["run", "epoch"]).groupby("run")
    trained = per_run["train_time_s"]  # training time of epochs 2.. (NaN for a one-epoch run):
    after_first = (trained.last() - trained.first()).where(per_run["epoch"].nunique() > 1)
    rows = []
    for (model, hetero), setting in runs.groupby(["model", "hetero"], sort=False):
        target = target_top1 if target_top1 > 0 else auto_target(setting)
        sync_s = setting.loc[setting["scheme"] == "sync", "train_time_s"].mean()
        sync_steady = after_first.reindex(setting.loc[setting["scheme"] == "sync", "run"]).mean()
        model_speedup = predicted_speedup(frames, setting)
        for scheme, g in setting.groupby("scheme", sort=False):
            predicted = 1.0 if scheme == "sync" else model_speedup
            steady = sync_steady / after_first.reindex(g["run"]).mean()
            ttt = time_to_target(frames.epochs[frames.epochs["run"].isin(g["run"])], target)
            rows.append({"model": model, "hetero": hetero, "heterogeneity": hetero_label(hetero), "scheme": scheme,
                         "scheme_label": scheme_label(scheme), "seeds": len(g),
                         "train_time_s_mean": g["train_time_s"].mean(), "train_time_s_sd": g["train_time_s"].std(),
                         "speedup_vs_sync": sync_s / g["train_time_s"].mean(), "steady_speedup": steady,
                         "predicted_speedup": predicted, "of_predicted": steady / predicted, "target_top1": target,
                         "time_to_target_s_mean": ttt.mean(), "reached_target": int(ttt.notna().sum()),
                         "final_test_top1_mean": g["final_test_top1"].mean(),
                         "final_test_top1_sd": g["final_test_top1"].std(),
                         "balance_eff_mean": g["mean_balance_eff"].mean()})
    return pd.DataFrame(rows)


def format_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The summary table for reading: units in the headers, spread over seeds as +/- one standard deviation."""
    def pm(mean: float, sd: float, fmt: str) -> str:
        return format(mean, fmt) + ("" if np.isnan(sd) else f" \u00b1 {format(sd, fmt)}")
    out = pd.DataFrame({
        "model": table["model"], "heterogeneity": table["heterogeneity"], "scheme": table["scheme_label"],
        "seeds": table["seeds"],
        "training time (s)": [pm(m, s, ".1f") for m, s in zip(table["train_time_s_mean"], table["train_time_s_sd"])],
        "speedup vs Sync-SGD": table["speedup_vs_sync"].map(lambda v: "" if np.isnan(v) else f"{v:.2f}\u00d7"),
        "after epoch 1": table["steady_speedup"].map(lambda v: "" if np.isnan(v) else f"{v:.2f}\u00d7"),
        "cost model's speedup": table["predicted_speedup"].map(lambda v: "" if np.isnan(v) else f"{v:.2f}\u00d7"),
        "after epoch 1 / model's": table["of_predicted"].map(lambda v: "" if np.isnan(v) else f"{v:.2f}"),
        "time to target (s)": [("not reached" if n == 0 else f"{t:.1f}" + (f" ({n}/{k} seeds)" if n < k else ""))
                               + f" [top-1 \u2265 {100 * g:.0f}%]" for t, n, k, g in
                               zip(table["time_to_target_s_mean"], table["reached_target"], table["seeds"],
                                   table["target_top1"])],
        "final test top-1 (%)": [pm(100 * m, 100 * s, ".1f")
                                 for m, s in zip(table["final_test_top1_mean"], table["final_test_top1_sd"])],
        "balance efficiency": table["balance_eff_mean"].map(lambda v: f"{v:.2f}"),
    })
    return out


def time_breakdown(frames: Frames) -> pd.DataFrame:
    """Per (setting, scheme, rank), mean over seeds of the run's total seconds in each part: the rank's own
    compute, the emulated slowdown, waiting for the other ranks, and evaluation (tidy: one part per row)."""
    r = frames.ranks.groupby(RUN_KEYS + ["rank"], sort=False, as_index=False)[["compute_s", "delay_s", "wait_s"]].sum()
    ev = frames.epochs.groupby("run")["eval_time_s"].sum()
    r["own compute"] = r["compute_s"] - r["delay_s"]
    r["emulated slowdown"] = r["delay_s"]
    r["waiting for other ranks"] = r["wait_s"]
    r["evaluation"] = r["run"].map(ev)
    parts = ["own compute", "emulated slowdown", "waiting for other ranks", "evaluation"]
    long = r.melt(id_vars=RUN_KEYS + ["rank"], value_vars=parts, var_name="part", value_name="seconds")
    keys = ["model", "hetero", "setting", "scheme", "scheme_label", "rank", "part"]
    out = long.groupby(keys, sort=False, as_index=False)["seconds"].mean()
    out["part"] = pd.Categorical(out["part"], parts, ordered=True)
    return out


def micro_batches(frames: Frames) -> pd.DataFrame:
    """Per run, epoch and rank of the runs with --micro-batch: the share beside the micro-batches per step (the
    epoch's mean and its last step's); empty when no run used micro-batches."""
    m = frames.runs.set_index("run")["micro_batch"] if "micro_batch" in frames.runs else pd.Series(dtype=int)
    r = frames.ranks[frames.ranks["run"].map(m).fillna(0) > 0] if len(frames.ranks) else frames.ranks
    cols = RUN_KEYS + ["epoch", "rank", "share", "micro_batch", "micro_batches_mean", "micro_batches_last"]
    if r.empty:
        return pd.DataFrame(columns=cols)
    r = r.assign(micro_batch=r["run"].map(m).astype(int))
    r = r.assign(micro_batches_mean=r["samples"] / r["steps"] / r["micro_batch"],
                 micro_batches_last=(r["batch_size"] // r["micro_batch"]).astype(int))
    return r[cols].reset_index(drop=True)


def describe(frames: Frames) -> str:
    """A Markdown paragraph: what the runs are, and which did not complete (with their errors)."""
    runs, done = frames.runs, completed(frames)

    def values(col: str) -> str:
        return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in dict.fromkeys(runs[col].dropna()))
    text = (f"**{len(runs)} runs**, {len(done)} completed: model {values('model')}; scheme "
            f"{', '.join(scheme_label(s) for s in dict.fromkeys(runs['scheme']))}; heterogeneity "
            f"{'; '.join(hetero_label(h) for h in dict.fromkeys(runs['hetero']))}; seeds {values('seed')}; "
            f"{values('world_size')} ranks; {values('epochs')} epochs of global batch {values('global_batch')}.")
    missing = runs[runs["status"] != "completed"]
    if len(missing):
        text += "\n\nLeft out (not completed):\n\n" + "\n".join(
            f"* `{r.run}`: {r.status}" + (f", {r.error}" if r.error else "") for r in missing.itertuples())
    return text


def save_table(table: pd.DataFrame, path: str | Path) -> None:
    """A table as CSV, written through safeio (a link planted at it is replaced, its target untouched)."""
    safeio.write_text(Path(path), table.to_csv(index=False))


def main(argv: list[str] | None = None) -> int:
    """`python -m hetero.lab.analysis --check GRID_DIR OUT_DIR [RUN_DIR ...]`: what make report checks before papermill
    runs the report: runs to report on, and no symbolic link where the report is written. One line, exit 2."""
    import sys

    from ..trainer.cli import CliParser
    from .gridplan import REPORT_FILES, GridError, no_links

    p = CliParser(prog="python -m hetero.lab.analysis", description="Check a report's inputs (make report).")
    p.add_argument("--check", action="store_true", required=True, help="check only (the only mode)")
    p.add_argument("grid_dir")
    p.add_argument("out_dir")
    p.add_argument("run_dirs", nargs="*")
    ns = p.parse_args(argv)
    try:
        runs = find_runs(ns.run_dirs or ns.grid_dir)
        if missing := [r for r in runs if not (r / "config.json").is_file()]:
            raise FileNotFoundError(f"{missing[0]} is not a run folder (no config.json)")
        no_links(from_root(ns.out_dir), REPORT_FILES)
    except (FileNotFoundError, GridError) as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
