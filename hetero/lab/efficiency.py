"""Part 1 of `make bench`: balance efficiency. Each scheme with the last rank slowed (x F) or delayed (a constant
sleep per step), repeated; each run's steady epoch time over the ideal computed from its own steps.csv
(docs/benchmarks.md, for the method).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from ..core.emulator import mean_effects, parse_hetero
from ..core.partition import batch_sizes
from . import noisefit
from .coupled import coupled_batch_sizes, finish_s, fit_scale, unshare
from .launch import clean_env, torchrun_cmd
from .measure import add_speedup_vs_sync, launch, steady_epochs
from .suite import Suite


def affinity(world: int, pin: bool) -> str:
    """The trainer's --affinity for `world` one-thread ranks here: "" when every rank has a core of its own, else
    contiguous blocks (4 ranks on 2 cores: 0,0,1,1), so each core is shared by the same ranks throughout."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or world <= len(cores):
        return ""
    return ",".join(str(cores[r * len(cores) // world]) for r in range(world))


def train(suite: Suite, out: Path, name: str, world: int, scheme: str, hetero: str, notes: list[str]) -> Path:
    """One trainer run under torchrun (tiny model, synthetic data, one thread per rank); its run folder."""
    run_dir = out / "runs" / name
    launch(torchrun_cmd(world, [
        "--model", "tiny", "--data", "synthetic", "--subset", str(suite.subset(world)), "--test-subset", "256",
        "--global-batch", str(suite.global_batch(world)), "--epochs", str(suite.epochs), "--scheme", scheme,
        "--hetero", hetero, "--threads", "1", "--affinity", affinity(world, suite.pin), "--augment", "false",
        "--micro-batch", str(suite.micro_batch), "--run-dir", str(run_dir)]), out / "logs" / f"{name}.log", 900,
        clean_env(threads="1"), done=run_dir / "summary.json", notes=notes)
    return run_dir


def calibrate(global_batch: int, rounds: int = 10) -> tuple[float, float]:
    """(fixed_s, per_sample_s) of one tiny-model training step measured alone (this process, one thread): sizes
    B/16..B in turn, the fastest of `rounds` per size, a least-squares line; fixed_s >= 0."""
    import torch
    import torch.nn.functional as F

    from ..trainer.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sizes = sorted({max(1, global_batch // k) for k in (16, 8, 4, 2, 1)})
    x_all = torch.randint(0, 256, (global_batch, 3, 32, 32), dtype=torch.uint8)
    y_all = torch.arange(global_batch) % 10
    best = dict.fromkeys(sizes, float("inf"))
    for r in range(rounds + 1):
        for b in sizes:
            t0 = time.perf_counter()
            loss = F.cross_entropy(model((x_all[:b].float() - 128) / 64), y_all[:b])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r:  # the first round warms up
                best[b] = min(best[b], time.perf_counter() - t0)
    per, fixed = np.polyfit(sizes, [best[b] for b in sizes], 1)
    return max(float(fixed), 0.0), float(per)


def effects(suite: Suite, world: int, calib: tuple[float, float]) -> list[tuple[str, str, str]]:
    """(kind, label, --hetero) of each heterogeneity the suite runs on the last rank: slowdowns, then constant
    delays of F x the calibrated step at an equal share."""
    last, equal_s = world - 1, calib[0] + calib[1] * suite.batch_per_rank
    return ([("slowdown", f"{f:g}x slower", f"{last}:slowdown={f:g}") for f in suite.slowdowns]
            + [("delay", f"+{f * equal_s * 1e3:.0f} ms ({f:g}x)", f"{last}:delay={f * equal_s:.4f}")
               for f in suite.delays])


def cost_model(steps, calib: tuple[float, float], global_batch: int, steady_from: int, hetero: str = "",
               cores=None, micro_batch: int = 0, quota: dict[int, tuple[float, float]] | None = None) -> dict:
    """One run's cost model from its steps.csv (steady-state steps; docs/benchmarks.md). Rank i's CPU work for a
    batch b is s_i x (a + c x b) core-seconds; ranks sharing a core (`cores`, a label per rank; None: a core each)
    share it fairly (hetero.lab.coupled), and a rank's step ends at F_i x its compute wall + d_i: F_i its emulated
    slowdown (from `hetero`), d_i its mean measured sleep beyond that. s_i is fitted from the measured compute walls
    (compute_s - delay_s) with the sharing undone. Gives the ideal and equal-share step times, the all-reduce time,
    the jitter, and the balancer's own misallocation. With micro-batches of m a rank runs b/m of them, each
    a + c x m: s_i x b x (a/m + c), and the ideal is in whole micro-batches. quota: {rank: (quota_s, period_s)} of
    ranks under a CFS quota: such a rank's step is fitted at the rate its quota sustains the CPU it was charged
    (partition.sustained_s, less the all-reduce), not at its measured compute, which the quota's bursts make a
    staircase (docs/benchmarks.md). epoch_optimum_s, lagged_optimum_s and pooled_optimum_s: the misallocation of
    each steady epoch sized at the optimum of its own steps, of the epoch's before it, and of every epoch's before it
    (how far the optimum itself moves); cost_move, cost_move_z: how far each rank's own cost moved between epochs."""
    a, c = calib
    unit = max(micro_batch, 1)
    if micro_batch:
        a, c = 0.0, c + a / unit
    world = steps["rank"].nunique()
    cores = list(range(world)) if cores is None else list(cores)
    seen = steps[steps.epoch >= steady_from - 1]  # the epoch before the steady ones too: its optimum sizes the first
    if "delay_s" not in seen:
        seen = seen.assign(delay_s=0.0)
    steady = seen[seen.epoch >= steady_from]
    per_step = steady.groupby(["epoch", "step"])
    grid = lambda col, f=None: (steady if f is None else f).pivot_table(  # noqa: E731
        index=["epoch", "step"], columns="rank", values=col).to_numpy()
    sizes, compute, slept = grid("batch_size"), grid("compute_s"), grid("delay_s")
    allreduce_s = float(per_step.wait_s.min().mean())
    if quota:  # the quota'd ranks' steps at the rate their quota sustains their CPU, as the balancer reads them
        seen = noisefit.sustained_steps(seen, quota, allreduce_s)  # row by row: the steady rows are its own
        steady = seen[seen.epoch >= steady_from]
        compute = grid("compute_s")
    walls = compute - slept
    on = sizes > 0
    scale = fit_scale(walls, np.where(on, a + c * sizes, 0.0), cores)
    factor, delay = _sleeps(hetero, walls, slept, on)
    fixed, per = scale * a, scale * c
    best = coupled_batch_sizes(fixed, per, global_batch, cores, factor, delay, granularity=unit)
    equal = batch_sizes(np.ones(world), global_batch, granularity=unit)
    T = lambda b: finish_s(fixed, per, b, cores, factor, delay).max(-1)  # noqa: E731
    ideal_s = float(T(best))

    def scale_of(f) -> np.ndarray:  # each rank's scale of the same model fitted to these steps alone
        b = grid("batch_size", f)
        return fit_scale(grid("compute_s", f) - grid("delay_s", f), np.where(b > 0, a + c * b, 0.0), cores)

    def optimum(f) -> np.ndarray:  # the best sizes of that model
        s = scale_of(f)
        return coupled_batch_sizes(s * a, s * c, global_batch, cores, factor, delay, granularity=unit)

    # How far the optimum itself moves from epoch to epoch, scored by this model as the misallocation is: each steady
    # epoch sized at its own optimum (known in advance), at the optimum of the epoch before it (what a rule that
    # decides at epoch ends from that epoch, with no estimation noise, would choose), and at the optimum of every
    # epoch seen before it pooled (such a rule with unbounded memory). Steps-weighted means.
    counts = steady.groupby("epoch").step.nunique()
    epoch = lambda e: seen[seen.epoch == e]  # noqa: E731
    had = {int(e) for e in seen.epoch.unique()}
    epoch_best = {e: optimum(epoch(e)) for e in sorted(had)}  # each epoch's own best sizes, fitted once
    own = {int(e): float(T(epoch_best[int(e)])) - ideal_s for e in counts.index}
    lagged = {e: float(T(epoch_best[e - 1])) - ideal_s for e in own if e - 1 in had}
    pooled = {e: float(T(optimum(seen[seen.epoch < e]))) - ideal_s for e in own if min(had) < e}
    mean = lambda d: float(sum(counts[e] * v for e, v in d.items()) / sum(counts[e] for e in d)) if d else None  # noqa
    move, move_z = _cost_moves(seen, a, c, cores, grid, scale_of, sorted(had))
    return {"scale": scale.tolist(), "fixed_s": fixed.tolist(), "per_sample_s": per.tolist(),
            "factor": factor.tolist(), "delay_s": delay.tolist(), "cores": cores,
            "ideal_sizes": best.tolist(), "ideal_step_s": ideal_s, "sync_step_s": float(T(equal)),
            "allreduce_s": allreduce_s, "quota": {str(r): list(v) for r, v in (quota or {}).items()},
            # per-step variation no per-rank share removes: mean of the per-step slowest minus slowest mean
            "jitter_s": float(compute.max(1).mean() - compute.mean(0).max()),
            # the balancer's part: the model's slowest step at the sizes it chose over T*, and how often they moved
            "misallocation_s": float(T(sizes).mean() - ideal_s),
            "epoch_optimum_s": mean(own), "lagged_optimum_s": mean(lagged), "pooled_optimum_s": mean(pooled),
            # each rank's largest move of its cost between consecutive epochs (relative), and that move in standard
            # errors of the two epochs' means (indicative: it takes the steps as independent, which bursts are not)
            "cost_move": move, "cost_move_z": move_z,
            "epoch_best": {str(e): v.tolist() for e, v in epoch_best.items()},
            "size_changes": int((np.diff(sizes, axis=0) != 0).any(1).sum())}


def _cost_moves(seen, a: float, c: float, cores, grid, scale_of, epochs: list[int]) -> tuple[list, list]:
    """[world] each rank's largest relative change of its fitted scale between consecutive epochs, and [world] that
    change over the standard error of the difference (from each epoch's per-step scatter of its walls over the
    model's work, the sharing of a core undone step by step); grid and scale_of: cost_model's own; empty lists with
    fewer than two epochs."""
    if len(epochs) < 2:
        return [], []
    scales, ses = [], []
    for e in epochs:
        f = seen[seen.epoch == e]
        b, w = grid("batch_size", f), grid("compute_s", f) - grid("delay_s", f)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.where(b > 0, unshare(w, cores) / np.where(b > 0, a + c * b, 1.0), np.nan)
            n = np.sum(b > 0, axis=0)
            ses.append(np.where(n > 1, np.nanstd(r, axis=0, ddof=1) / np.sqrt(np.maximum(n, 1)), np.nan))
        scales.append(scale_of(f))
    s, se = np.array(scales), np.array(ses)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(s[1:] / s[:-1] - 1)
        z = np.abs(s[1:] - s[:-1]) / np.sqrt(se[1:] ** 2 + se[:-1] ** 2)
    at = np.nanargmax(np.where(np.isfinite(rel), rel, -1), axis=0)
    pick = lambda x: [None if not np.isfinite(v) else float(v) for v in x[at, np.arange(x.shape[1])]]  # noqa: E731
    return pick(rel), pick(z)


def _sleeps(hetero: str, walls: np.ndarray, slept: np.ndarray, on: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n] each: F_i and d_i as the run slept them ([T, n] walls, sleeps and steps taken part in). A rank with a
    slowdown in `hetero` sleeps (F - 1) x its own compute (F measured: sleeps over walls, less its constant
    delays); every other sleep is a delay (measured: its mean per step, oversleeping included)."""
    factor = np.ones(walls.shape[1])
    for r, effects in parse_hetero(hetero).items():
        if r < len(factor) and any(e.kind == "slowdown" for e in effects):
            fixed = float(mean_effects(effects)[1].sum())  # its constant and random delays' means
            over = ((slept[:, r] - fixed) * on[:, r]).sum() / max((walls[:, r] * on[:, r]).sum(), 1e-12)
            factor[r] = 1 + max(float(over), 0.0)
    delay = np.maximum(((slept - (factor - 1) * walls) * on).sum(0) / np.maximum(on.sum(0), 1), 0.0)
    return factor, delay


def measure_row(suite: Suite, out: Path, calib, world: int, effect: tuple[str, str, str], scheme: str, repeat: int,
                notes: list[str]) -> dict:
    """One run of one row: its steady epoch time against its own ideal and slowest-rank bound."""
    name = f"balance-w{world}-{effect[2].split(':')[1].replace('=', '')}-{scheme}-r{repeat}" + (
        f"-m{suite.micro_batch}" if suite.micro_batch else "")
    print(f"bench: {name}", flush=True)
    d = train(suite, out, name, world, scheme, effect[2], notes)
    return read_row(suite, d, calib, world, effect, scheme, repeat)


def read_row(suite: Suite, d: Path, calib, world: int, effect: tuple[str, str, str], scheme: str,
             repeat: int, quota: dict[int, tuple[float, float]] | None = None) -> dict:
    """A finished run folder's row (measure_row's figures; also for re-reading a bench whose report was lost)."""
    import pandas as pd

    kind, label, hetero = effect
    ranks, steps = (pd.read_csv(d / f"{t}.csv") for t in ("ranks", "steps"))
    pinned = json.loads((d / "config.json").read_text())["config"].get("affinity") or ""
    one = pinned.split(",")  # one core per rank: ranks pinned to the same core are coupled (a core set is not)
    cores = one if len(one) == world and all(x.strip().isdigit() for x in one) else None
    m = cost_model(steps, calib, suite.global_batch(world), suite.steady_from, hetero, cores, suite.micro_batch,
                   quota)
    steady = steady_epochs(d, suite.steady_from)
    n = int(steady[0]["steps"])
    ideal_s, bound_s = n * (m["ideal_step_s"] + m["allreduce_s"]), n * (m["sync_step_s"] + m["allreduce_s"])
    epoch_s = float(np.median([float(r["epoch_time_s"]) for r in steady]))
    sim = noisefit.replay(d, m, suite.steady_from)  # the run replayed in the simulator with its own jitter
    return {"world": world, "kind": kind, "effect": label, "hetero": hetero, "scheme": scheme, "repeat": repeat,
            "affinity": affinity(world, suite.pin), "global_batch": suite.global_batch(world),
            "micro_batch": suite.micro_batch, "steps": n,
            "epoch_s": epoch_s, "ideal_s": ideal_s, "over_ideal": epoch_s / ideal_s, "sync_bound_s": bound_s,
            "over_sync_bound": epoch_s / bound_s, "predicted_speedup": bound_s / ideal_s,
            "jitter": n * m["jitter_s"] / ideal_s, "misallocation": n * m["misallocation_s"] / ideal_s,
            "size_changes": m["size_changes"],
            **{k: None if m[f"{k}_s"] is None else n * m[f"{k}_s"] / ideal_s
               for k in ("epoch_optimum", "lagged_optimum", "pooled_optimum")},
            "cost_move": m["cost_move"], "cost_move_z": m["cost_move_z"],
            "balance_eff": float(np.mean([float(r["balance_eff"]) for r in steady])),
            "shares": ranks[ranks.epoch == ranks.epoch.max()].share.round(3).tolist(), "cost_model": m,
            "simulated": sim["simulated"], "replay": sim, "run_dir": str(d)}


def balance(suite: Suite, out: Path, calib: tuple[float, float], notes: list[str]) -> list[dict]:
    """Every row (world x heterogeneity x scheme), `suite.repeats` times; a repeat runs the whole suite once, so
    the host's drift falls on every row alike."""
    rows = []
    for repeat in range(suite.repeats):
        for world in suite.worlds:
            for effect in effects(suite, world, calib):
                found = [measure_row(suite, out, calib, world, effect, scheme, repeat, notes)
                         for scheme in suite.schemes]
                add_speedup_vs_sync(found)
                rows += found
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per row (world, heterogeneity, scheme): epoch / ideal over the repeats (median, min, max) and the median
    of the other figures."""
    keys = list(dict.fromkeys((r["world"], r["effect"], r["scheme"]) for r in rows))
    out = []
    for world, effect, scheme in keys:
        rs = [r for r in rows if (r["world"], r["effect"], r["scheme"]) == (world, effect, scheme)]
        med = lambda k: float(np.median([r[k] for r in rs if r.get(k) is not None])) if any(  # noqa: E731
            r.get(k) is not None for r in rs) else None
        ratios = [r["over_ideal"] for r in rs]
        out.append({"world": world, "effect": effect, "kind": rs[0]["kind"], "scheme": scheme, "repeats": len(rs),
                    "global_batch": rs[0]["global_batch"], "over_ideal": med("over_ideal"), "min": min(ratios),
                    "max": max(ratios), "over_sync_bound": med("over_sync_bound"),
                    "speedup_vs_sync": med("speedup_vs_sync"), "predicted_speedup": med("predicted_speedup"),
                    "jitter": med("jitter"), "misallocation": med("misallocation"),
                    "epoch_optimum": med("epoch_optimum"), "lagged_optimum": med("lagged_optimum"),
                    "pooled_optimum": med("pooled_optimum"), "cost_move": _med_ranks(rs, "cost_move"),
                    "cost_move_z": _med_ranks(rs, "cost_move_z"),
                    "size_changes": med("size_changes"), "simulated": med("simulated"),
                    "simulated_sd": float(np.median([r["replay"]["simulated_sd"] for r in rs if r.get("replay")]
                                                    or [0])),
                    "shares": rs[-1]["shares"], "affinity": rs[0]["affinity"]})
    return out


def _med_ranks(rows: list[dict], key: str) -> list:
    """The per-rank median of a per-rank figure over the repeats that have it ([] where none has)."""
    got = [r[key] for r in rows if r.get(key)]
    return [] if not got else [float(np.median([float(v) for v in col if v is not None]))
                               if any(v is not None for v in col) else None for col in zip(*got)]


def affine_vs_dp(summ: list[dict]) -> list[dict]:
    """Per (world, heterogeneity): affine's and dp's median epoch / ideal, dp's run-to-run spread (max - min over
    its repeats), and whether affine is within it (affine <= dp + spread) or ahead (affine < dp)."""
    out = []
    for world, effect in dict.fromkeys((r["world"], r["effect"]) for r in summ):
        by = {r["scheme"]: r for r in summ if (r["world"], r["effect"]) == (world, effect)}
        if "dp" in by and "affine" in by:
            dp, af = by["dp"], by["affine"]
            spread = dp["max"] - dp["min"]
            out.append({"world": world, "effect": effect, "kind": dp["kind"], "dp": dp["over_ideal"],
                        "affine": af["over_ideal"], "dp_spread": spread, "affine_spread": af["max"] - af["min"],
                        "within": af["over_ideal"] <= dp["over_ideal"] + spread,
                        "ahead": af["over_ideal"] < dp["over_ideal"]})
    return out
