"""The benchmark suite (GitHub issue 5), measured side by side in one run:

    make bench                       # = python -m hetero.bench: 8-12 minutes on 2 shared cores
    python -m hetero.bench --quick   # 2 ranks only, sync/dp/edp, shorter runs, one overhead launch (~3 min)

1. balance: 2 and 4 CPU ranks (gloo, one thread each, tiny model, synthetic data, global batch 128 per rank,
   16 steps per epoch), the last rank 2x and 4x slower (--hetero R:slowdown=F: it sleeps (F-1)x its own measured compute in every step), every scheme.
2. overhead: no heterogeneity; the trainer's step time over that of a plain DDP loop written here (same model,
   data tensor, batch, optimiser, DDP options, gloo, torchrun).
3. balancer: the time of one rebalancing decision (Balancer.observe + decide) for 2 to 4096 workers.
Trainer runs are torchrun subprocesses. Output: runs/bench/<time>/bench.json, table.md (printed), the run
folders under runs/ and each launch's log under logs/.

The ideal epoch time of one trainer run is steps x (T* + A), everything measured in that run's steps.csv over
its steady-state epochs (from `steady_from` on; the first carry warm-up and the balancer's first decisions):
  - the cost shape t(b) = a + c*b (fixed + per-sample seconds of one tiny-model training step) is measured
    alone, in this process with one thread before the runs (calibrate(): sizes B/16..B in turn, fastest of 10);
  - rank i costs t_i(b) = s_i*(a + c*b), where s_i = its summed compute_s over what the shape predicts for its
    batch sizes. compute_s is the rank's own time up to the moment its gradients are ready (the emulated
    slowdown included) plus its optimiser step, before any waiting on other ranks; s_i carries its slowdown,
    its share of the cores and whatever else loaded the host during that very run;
  - T* = min over integer batch sizes summing to B of max_i t_i(b_i) (partition.affine_batch_sizes);
  - A = the measured all-reduce time per step: in each step the smallest wait_s over the ranks (the last rank
    to be ready waits for nothing but the all-reduce), averaged over the steps.
The slowest-rank bound (the best sync can do) is steps x (max_i t_i(B/n) + A); the predicted speedup of a
perfect balancer is bound / ideal. The epoch time is the trainer's epoch_time_s (rank 0's wall time of the step
loop, end-of-epoch gathers included), median over the steady-state epochs. `jitter` is the share of the ideal
lost to step-to-step variation that no per-rank share can remove: steps x (mean over steps of the slowest
rank's compute - the largest per-rank mean compute) / ideal.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from .launch import ROOT, clean_env, run_logged, torchrun_cmd
from .balancer import Balancer
from .partition import SCHEMES, affine_batch_sizes, batch_sizes, predicted_step_s



class BenchError(RuntimeError):
    """A launch failed: one line naming its log."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one benchmark run measures (the full suite; --quick shrinks it)."""
    worlds: tuple[int, ...] = (2, 4)            # CPU ranks, gloo, one torch thread each
    slowdowns: tuple[float, ...] = (2.0, 4.0)   # the last rank computes this many times slower
    schemes: tuple[str, ...] = tuple(SCHEMES)
    epochs: int = 6
    steady_from: int = 3                        # first steady-state epoch (1-based)
    batch_per_rank: int = 128                   # global batch = this x ranks (256 for 2, 512 for 4): long steps
                                                # (~0.1 s), so host noise and the scheduler's time slices matter less
    steps: int = 16                             # steps per epoch (synthetic samples = steps x global batch)
    repeats: int = 2                            # overhead launches
    overhead_epochs: int = 12                   # trainer and plain epochs per launch, in turn; the first warm up
    workers: tuple[int, ...] = tuple(2 ** k for k in range(1, 13))  # balancer sizes, 2..4096
    pin: bool = True                            # more ranks than cores: pin them in blocks (see affinity())
    parts: tuple[str, ...] = ("balance", "overhead", "balancer")

    def global_batch(self, world: int) -> int:
        return self.batch_per_rank * world

    def subset(self, world: int) -> int:
        return self.steps * self.global_batch(world)

    def __post_init__(self):
        if not 1 <= self.steady_from <= self.epochs or self.overhead_epochs < 2:
            raise ValueError("need 1 <= steady_from <= epochs and overhead_epochs >= 2")
        if self.batch_per_rank < 4 or self.steps < 1:
            raise ValueError("need batch_per_rank >= 4 and steps >= 1")
        if bad := [s for s in self.schemes if s not in SCHEMES]:
            raise ValueError(f"unknown scheme {bad[0]!r}: choose from {', '.join(SCHEMES)}")
        if bad := [p for p in self.parts if p not in ("balance", "overhead", "balancer")]:
            raise ValueError(f"unknown part {bad[0]!r}: choose from balance, overhead, balancer")


QUICK = dict(worlds=(2,), schemes=("sync", "dp", "edp"), epochs=4, repeats=1, overhead_epochs=8)


# -- launching ------------------------------------------------------------------------------------------------
def torchrun(nproc: int, module: str, args: list[str], log: Path, done: Path, notes: list[str],
             timeout_s: float = 900) -> None:
    """`torchrun --standalone --nproc-per-node=N -m MODULE ARGS`, its output into `log`. A launch that fails
    after writing `done` (a rank dying at exit) is kept, with a line in `notes`."""
    cmd = torchrun_cmd(nproc, args, module)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        rc = run_logged(cmd, fh, timeout_s, clean_env(threads="1"))
    if rc is None:
        raise BenchError(f"{' '.join(cmd[2:])} ran past {timeout_s:g} s and was stopped (log {log})")
    if rc and done.exists() and json.loads(done.read_text()).get("status", "completed") == "completed":
        notes.append(f"{log.stem}: exited {rc} after finishing its work (kept; see {log})")
    elif rc:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise BenchError(f"{' '.join(cmd[2:])} exited {rc} (log {log}):\n{tail}")


def affinity(world: int, pin: bool) -> str:
    """The trainer's --affinity for `world` one-thread ranks on this host: "" (unpinned) when every rank has a
    core of its own; otherwise contiguous blocks (4 ranks on 2 cores: 0,0,1,1), so that each core is shared by
    the same ranks throughout. Unpinned, the scheduler migrates the ranks and every step ends at a different
    rank's mercy: 4 ranks on 2 cores (dp, 2x, global batch 256) measured 1.24-1.29x the ideal unpinned, 1.05-1.08x
    pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or world <= len(cores):
        return ""
    return ",".join(str(cores[r * len(cores) // world]) for r in range(world))


def train(plan: Plan, out: Path, name: str, world: int, scheme: str, hetero: str, notes: list[str]) -> Path:
    run_dir = out / "runs" / name
    torchrun(world, "hetero.train", [
        "--model", "tiny", "--data", "synthetic", "--subset", str(plan.subset(world)), "--test-subset", "256",
        "--global-batch", str(plan.global_batch(world)), "--epochs", str(plan.epochs), "--scheme", scheme,
        "--hetero", hetero, "--threads", "1", "--affinity", affinity(world, plan.pin), "--augment", "false",
        "--run-dir", str(run_dir)], out / "logs" / f"{name}.log", run_dir / "summary.json", notes)
    return run_dir


# -- 1. balance efficiency ------------------------------------------------------------------------------------
def calibrate(global_batch: int, rounds: int = 10) -> tuple[float, float]:
    """(fixed_s, per_sample_s) of one tiny-model training step measured alone: this process, one thread, batch
    sizes from B/16 to B taken in turn, the fastest of the rounds per size (other load only adds time), then a
    least-squares line."""
    import torch
    import torch.nn.functional as F

    from .models import build_model

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


def cost_model(steps, calib: tuple[float, float], global_batch: int, steady_from: int) -> dict:
    """One run's cost model from its steps.csv: rank i costs s_i*(a + c*b), with (a, c) from calibrate() and
    s_i its mean measured compute over what that shape predicts for its batch sizes (steady-state steps)."""
    a, c = calib
    world = steps["rank"].nunique()
    steady = steps[steps.epoch >= steady_from]
    by_rank, per_step = steady.groupby("rank"), steady.groupby(["epoch", "step"])
    scale = (by_rank.compute_s.sum() / by_rank.batch_size.apply(lambda b: (a + c * b).sum())).to_numpy()
    fixed, per = scale * a, scale * c
    best = affine_batch_sizes(fixed, per, global_batch)
    equal = batch_sizes(np.ones(world), global_batch)
    return {"scale": scale.tolist(), "fixed_s": fixed.tolist(), "per_sample_s": per.tolist(),
            "ideal_sizes": best.tolist(), "ideal_step_s": predicted_step_s(fixed, per, best),
            "sync_step_s": predicted_step_s(fixed, per, equal),
            "allreduce_s": float(per_step.wait_s.min().mean()),
            # per-step variation no per-rank share removes: mean of the per-step slowest minus slowest mean
            "jitter_s": float(per_step.compute_s.max().mean() - by_rank.compute_s.mean().max())}


def balance(plan: Plan, out: Path, calib: tuple[float, float], notes: list[str]) -> list[dict]:
    import pandas as pd

    rows = []
    for world in plan.worlds:
        for slow in plan.slowdowns:
            found = []
            for scheme in plan.schemes:
                name = f"balance-w{world}-x{slow:g}-{scheme}"
                print(f"bench: {name}", flush=True)
                d = train(plan, out, name, world, scheme, f"{world - 1}:slowdown={slow:g}", notes)
                epochs, ranks, steps = (pd.read_csv(d / f"{t}.csv") for t in ("epochs", "ranks", "steps"))
                m = cost_model(steps, calib, plan.global_batch(world), plan.steady_from)
                steady = epochs[epochs.epoch >= plan.steady_from]
                n = int(epochs.steps.iloc[0])
                ideal_s, bound_s = n * (m["ideal_step_s"] + m["allreduce_s"]), n * (m["sync_step_s"] + m["allreduce_s"])
                epoch_s = float(steady.epoch_time_s.median())
                found.append({"world": world, "slowdown": slow, "scheme": scheme, "affinity": affinity(world, plan.pin),
                              "global_batch": plan.global_batch(world), "steps": n, "epoch_s": epoch_s,
                              "ideal_s": ideal_s, "over_ideal": epoch_s / ideal_s, "sync_bound_s": bound_s,
                              "over_sync_bound": epoch_s / bound_s, "predicted_speedup": bound_s / ideal_s,
                              "jitter": n * m["jitter_s"] / ideal_s,
                              "balance_eff": float(steady.balance_eff.mean()),
                              "shares": ranks[ranks.epoch == ranks.epoch.max()].share.round(3).tolist(),
                              "cost_model": m, "run_dir": str(d)})
            sync = next((r["epoch_s"] for r in found if r["scheme"] == "sync"), None)
            for r in found:
                r["speedup_vs_sync"] = None if sync is None else sync / r["epoch_s"]
            rows += found
    return rows


# -- 2. overhead over a plain DDP loop ------------------------------------------------------------------------
def overhead_worker(out: Path, subset: int, global_batch: int, epochs: int, seed: int = 0) -> None:
    """Run by torchrun: the trainer's own epoch loop (Trainer.train_epoch: step clocks, weighting hook, metric
    accumulation, progress bar, end-of-epoch gathers) and a plain DDP loop written here, over the same model,
    data tensor, batch, optimiser and DDP options (gloo, one thread, no augmentation), taking turns epoch by
    epoch in the same processes, so that load from elsewhere on the host falls on both alike."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from .config import Config
    from .data import load_data
    from .dist import setup, teardown, wrap_ddp
    from .models import build_model
    from .train import Trainer

    torch.set_num_threads(1)
    cfg = Config(model="tiny", data="synthetic", subset=subset, global_batch=global_batch, epochs=epochs,
                 scheme="sync", augment=False, threads="1", seed=seed, run_dir=str(out.with_suffix("")))
    world = setup(["cpu"] * int(os.environ.get("WORLD_SIZE", 1)), "gloo", cfg.timeout_s)
    ok = False
    try:
        data = load_data(cfg.data, cfg.data_dir, subset)
        trainer = Trainer(cfg, world, data, Path(cfg.run_dir), None)
        mean = torch.tensor(data.mean).view(1, -1, 1, 1) * 255
        std = torch.tensor(data.std).view(1, -1, 1, 1) * 255
        torch.manual_seed(seed)
        model = wrap_ddp(build_model(cfg.model, len(data.classes)), torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=True,
                              weight_decay=cfg.weight_decay)
        b, steps = global_batch // world.world, len(data.train_y) // global_batch

        def plain_epoch(epoch: int) -> float:
            perm = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(seed + epoch))
            t0 = time.perf_counter()
            for step in range(steps):
                idx = perm[step * global_batch + world.rank * b:][:b]
                loss = F.cross_entropy(model((data.train_x[idx].float() - mean) / std), data.train_y[idx])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        def trainer_epoch(epoch: int) -> float:
            bar = tqdm(total=steps, leave=False, file=sys.stderr) if world.is_main else None  # as Trainer.fit
            r = trainer.train_epoch(epoch, bar)
            if bar is not None:
                bar.close()
            return r["train_s"]

        epoch_s: dict[str, list[float]] = {"trainer": [], "plain": []}
        for epoch in range(1, epochs + 1):
            for kind in (("trainer", "plain") if epoch % 2 else ("plain", "trainer")):
                epoch_s[kind].append(trainer_epoch(epoch) if kind == "trainer" else plain_epoch(epoch))
        if world.is_main:
            out.write_text(json.dumps({"epoch_s": epoch_s, "steps": steps, "world": world.world}))
        ok = True
    finally:
        teardown(ok)


def overhead(plan: Plan, out: Path, notes: list[str]) -> dict:
    """Per-step time of the trainer over that of the plain loop: the median over the epochs after the first of
    each launch of the ratio of the two epochs run back to back (slow changes of load cancel)."""
    world, ratios, step_s = 2, [], {"trainer": [], "plain": []}
    for r in range(plan.repeats):
        name = f"overhead-{r}"
        print(f"bench: {name}", flush=True)
        res = out / "runs" / f"{name}.json"
        res.parent.mkdir(parents=True, exist_ok=True)
        torchrun(world, "hetero.bench", ["--overhead-worker", str(res), "--subset", str(plan.subset(world)),
                                         "--global-batch", str(plan.global_batch(world)),
                                         "--overhead-epochs", str(plan.overhead_epochs)],
                 out / "logs" / f"{name}.log", res, notes)
        d = json.loads(res.read_text())
        tr, pl = (np.array(d["epoch_s"][k][1:]) / d["steps"] for k in ("trainer", "plain"))
        ratios += (tr / pl).tolist()
        step_s["trainer"] += tr.tolist()
        step_s["plain"] += pl.tolist()
    med = {k: float(np.median(v)) for k, v in step_s.items()}
    return {"world": world, "global_batch": plan.global_batch(world), "ratio": float(np.median(ratios)),
            "ratio_of_medians": med["trainer"] / med["plain"],
            "ratio_of_minima": min(step_s["trainer"]) / min(step_s["plain"]), "trainer_step_s": med["trainer"],
            "plain_step_s": med["plain"], "extra_ms_per_step": 1e3 * (med["trainer"] - med["plain"]),
            "pair_ratios": ratios, "step_s": step_s}


# -- 3. balancer decision time --------------------------------------------------------------------------------
def balancer_cost(workers: tuple[int, ...], steps: int = 16, budget_s: float = 0.3) -> list[dict]:
    """Median time of one decision (observe one window of [steps, workers] times, then decide) per rule."""
    rows = []
    for rule in ("proportional", "affine"):
        for n in workers:
            rng = np.random.default_rng(n)
            fixed, per = rng.uniform(2e-3, 8e-3, n), rng.uniform(1e-4, 4e-4, n)
            times: list[float] = []
            while len(times) < 3 or (sum(times) < budget_s and len(times) < 50):
                bal = Balancer(rule, n, 32 * n)
                sizes = np.stack([bal.sizes_for_step(s) for s in range(steps)])  # affine probes two sizes
                compute = (fixed + per * sizes) * rng.lognormal(0, 0.05, sizes.shape)
                t0 = time.perf_counter()
                bal.observe(sizes, compute)
                bal.decide()
                times.append(time.perf_counter() - t0)
            rows.append({"rule": rule, "schemes": [s for s, v in SCHEMES.items() if v.rule == rule],
                         "workers": n, "global_batch": 32 * n, "decision_ms": 1e3 * float(np.median(times)),
                         "min_ms": 1e3 * min(times), "repeats": len(times)})
    return rows


# -- the report -----------------------------------------------------------------------------------------------
def checks(res: dict) -> list[dict]:
    """The issue's targets, each with the measured value."""
    out = []
    bal = res.get("balance", [])
    for world in sorted({r["world"] for r in bal}):
        if dp := [r["over_ideal"] for r in bal if r["scheme"] in ("dp", "edp") and r["world"] == world]:
            out.append({"target": f"dp/edp steady epoch time <= 1.10 x ideal, {world} ranks", "value": max(dp),
                        "pass": max(dp) <= 1.10})
    if sy := [r["over_sync_bound"] for r in bal if r["scheme"] == "sync"]:
        worst = max(sy, key=lambda v: abs(v - 1))
        out.append({"target": "sync epoch time within 10% of the slowest-rank bound", "value": worst,
                    "pass": abs(worst - 1) <= 0.10})
    if ov := res.get("overhead"):
        out.append({"target": "trainer step <= 1.03 x plain DDP step", "value": ov["ratio"], "pass": ov["ratio"] <= 1.03})
    for r in res.get("balancer", []):
        if r["workers"] == 4096:
            out.append({"target": f"one {r['rule']} decision for 4096 workers < 10 ms", "value": r["decision_ms"],
                        "pass": r["decision_ms"] < 10})
    return out


def table(res: dict) -> str:
    m = res["meta"]
    lines = [f"# hetero benchmarks, {m['date']}, {m['host']} ({m['cpu']}, {m['cores']} cores, load average "
             f"{m['load_avg_start'][0]:.1f} at start, {m['load_avg_end'][0]:.1f} at end)", "", f"`{m['command']}`", ""]
    if res.get("balance"):
        lines += ["## Balance efficiency (steady-state epoch time; ideal = steps x (T* + all-reduce))", "",
                  "| ranks | B | slowdown | scheme | epoch s | ideal s | / ideal | / sync bound | speedup vs sync | "
                  "predicted | jitter | shares |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["balance"]:
            sp = "" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
            lines.append(f"| {r['world']} | {r['global_batch']} | {r['slowdown']:g}x | {r['scheme']} | {r['epoch_s']:.3f} | "
                         f"{r['ideal_s']:.3f} | {r['over_ideal']:.3f} | {r['over_sync_bound']:.3f} | {sp} | "
                         f"{r['predicted_speedup']:.2f}x | {r['jitter']:.3f} | {'/'.join(f'{s:.2f}' for s in r['shares'])} |")
        pinned = sorted({(r["world"], r["affinity"]) for r in res["balance"] if r["affinity"]})
        lines += [""] + [f"{w} ranks pinned to cores {a} (--affinity)." for w, a in pinned] + [""]
    if ov := res.get("overhead"):
        lines += ["## Overhead (no heterogeneity, 2 ranks)", "",
                  f"trainer {1e3 * ov['trainer_step_s']:.2f} ms/step, plain DDP {1e3 * ov['plain_step_s']:.2f} "
                  f"ms/step: ratio {ov['ratio']:.3f} (median of {len(ov['pair_ratios'])} back-to-back epoch pairs; "
                  f"of medians {ov['ratio_of_medians']:.3f}, of minima {ov['ratio_of_minima']:.3f}), "
                  f"{ov['extra_ms_per_step']:+.2f} ms per step", ""]
    if res.get("balancer"):
        lines += ["## One rebalancing decision (median ms)", "", "| workers | " + " | ".join(
            str(r["workers"]) for r in res["balancer"] if r["rule"] == "proportional") + " |",
            "|---" * (1 + sum(r["rule"] == "proportional" for r in res["balancer"])) + "|"]
        for rule in ("proportional", "affine"):
            lines.append(f"| {rule} | " + " | ".join(f"{r['decision_ms']:.2f}" for r in res["balancer"]
                                                     if r["rule"] == rule) + " |")
        lines.append("")
    if res.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    if res.get("checks"):
        lines += ["## Targets", ""] + [f"- {'PASS' if c['pass'] else 'FAIL'} {c['target']}: {c['value']:.3f}"
                                       for c in res["checks"]]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def run(plan: Plan, out: Path, command: str) -> dict:
    """Every part of the plan, then bench.json and table.md in `out`."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    res: dict = {"meta": {"date": datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
                          "cpu": _cpu_name(), "cores": os.cpu_count(), "load_avg_start": os.getloadavg(),
                          "torch": torch.__version__, "python": platform.python_version(), "git_commit": commit,
                          "command": command, "plan": asdict(plan)}, "notes": []}
    t0 = time.perf_counter()
    if "balance" in plan.parts:
        calib = calibrate(plan.global_batch(max(plan.worlds)))
        res["calibration"] = {"fixed_s": calib[0], "per_sample_s": calib[1]}
        res["balance"] = balance(plan, out, calib, res["notes"])
    if "overhead" in plan.parts:
        res["overhead"] = overhead(plan, out, res["notes"])
    if "balancer" in plan.parts:
        print("bench: balancer decisions", flush=True)
        res["balancer"] = balancer_cost(plan.workers)
    res["meta"].update(wall_s=time.perf_counter() - t0, load_avg_end=os.getloadavg())
    res["checks"] = checks(res)
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    (out / "table.md").write_text(table(res))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hetero.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 ranks only, sync/dp/edp, shorter runs, one overhead pair")
    p.add_argument("--out", default="", help="output folder (default runs/bench/<time>)")
    ints = lambda s: tuple(int(v) for v in s.split(","))
    p.add_argument("--worlds", type=ints, help="rank counts, e.g. 2,4")
    p.add_argument("--slowdowns", type=lambda s: tuple(float(v) for v in s.split(",")), help="e.g. 2,4")
    p.add_argument("--schemes", type=lambda s: tuple(s.split(",")), help="e.g. sync,dp,edp,affine")
    p.add_argument("--parts", type=lambda s: tuple(s.split(",")), help="balance,overhead,balancer")
    p.add_argument("--epochs", type=int)
    p.add_argument("--steady-from", type=int)
    p.add_argument("--batch-per-rank", type=int, help="global batch = this x ranks")
    p.add_argument("--steps", type=int, help="steps per epoch")
    p.add_argument("--subset", type=int, help=argparse.SUPPRESS)        # the overhead worker's, from run()
    p.add_argument("--global-batch", type=int, help=argparse.SUPPRESS)  # likewise
    p.add_argument("--repeats", type=int)
    p.add_argument("--overhead-epochs", type=int)
    p.add_argument("--max-workers", type=int, help="largest balancer size (powers of two from 2)")
    p.add_argument("--no-pin", dest="pin", action="store_false", default=None,
                   help="leave ranks unpinned even when there are more ranks than cores")
    p.add_argument("--overhead-worker", metavar="FILE", help=argparse.SUPPRESS)  # run by torchrun
    ns = p.parse_args(argv)
    if ns.overhead_worker:
        overhead_worker(Path(ns.overhead_worker), ns.subset, ns.global_batch, ns.overhead_epochs)
        return 0
    over = {k: getattr(ns, k) for k in ("worlds", "slowdowns", "schemes", "parts", "epochs", "steady_from",
                                        "batch_per_rank", "steps", "repeats", "overhead_epochs", "pin")
            if getattr(ns, k) is not None}
    if ns.max_workers:
        over["workers"] = tuple(2 ** k for k in range(1, 13) if 2 ** k <= ns.max_workers)
    try:
        base = Plan(**QUICK) if ns.quick else Plan()
        if "epochs" in over and "steady_from" not in over:
            over["steady_from"] = min(base.steady_from, over["epochs"])
        plan = replace(base, **over)
    except ValueError as e:
        p.error(str(e))
    out = Path(ns.out or ROOT / "runs" / "bench" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    try:
        res = run(plan, out, "python -m hetero.bench " + " ".join(sys.argv[1:] if argv is None else argv))
    except (BenchError, subprocess.TimeoutExpired) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1
    print(table(res), end="")
    print(f"bench: {out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
