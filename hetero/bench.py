"""The benchmark suite on CPU ranks, measured side by side in one run (README: benchmarks, for the method):
balance efficiency against each run's own ideal, the trainer's overhead over a plain DDP loop, and the time of
one rebalancing decision for 2 to 4096 workers.

    make bench [QUICK=1]             # = python -m hetero.bench [--quick]; runs/bench/<time>/bench.json, table.md
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from . import overhead, simbench
from .config import CliParser
from .launch import ROOT, clean_env, torchrun_cmd
from .measure import LaunchError, add_speedup_vs_sync, launch, markdown_table, run_meta, steady_epochs
from .partition import SCHEMES, affine_batch_sizes, batch_sizes, predicted_step_s

PARTS = ("balance", "overhead", "balancer")


@dataclass(frozen=True, kw_only=True)
class Suite:
    """What one benchmark run measures (the full suite; --quick shrinks it)."""
    worlds: tuple[int, ...] = (2, 4)            # CPU ranks, gloo, one torch thread each
    slowdowns: tuple[float, ...] = (2.0, 4.0)   # the last rank computes this many times slower
    schemes: tuple[str, ...] = tuple(SCHEMES)
    epochs: int = 6
    steady_from: int = 3                        # first steady-state epoch (1-based)
    batch_per_rank: int = 128                   # global batch = this x ranks: steps long against host noise
    steps: int = 16                             # steps per epoch (synthetic samples = steps x global batch)
    repeats: int = 2                            # overhead launches
    overhead_epochs: int = 12                   # trainer and plain epochs per launch, in turn; the first warm up
    workers: tuple[int, ...] = tuple(2 ** k for k in range(1, 13))  # balancer sizes, 2..4096
    pin: bool = True                            # more ranks than cores: pin them in blocks (see affinity())
    micro_batch: int = 0                        # the trainer's --micro-batch (0: per-rank batch sizes)
    parts: tuple[str, ...] = PARTS

    def global_batch(self, world: int) -> int:
        return self.batch_per_rank * world

    def subset(self, world: int) -> int:
        return self.steps * self.global_batch(world)

    def __post_init__(self):
        if not 1 <= self.steady_from <= self.epochs or self.overhead_epochs < 2:
            raise ValueError("need 1 <= steady_from <= epochs and overhead_epochs >= 2")
        if self.batch_per_rank < 4 or self.steps < 1 or self.repeats < 1:
            raise ValueError("need batch_per_rank >= 4, steps >= 1 and repeats >= 1")
        if not self.worlds or min(self.worlds) < 2 or not self.slowdowns or min(self.slowdowns) < 1:
            raise ValueError("need worlds of at least 2 ranks and slowdowns of at least 1")
        if bad := [s for s in self.schemes if s not in SCHEMES]:
            raise ValueError(f"unknown scheme {bad[0]!r}: choose from {', '.join(SCHEMES)}")
        if self.micro_batch < 0 or (self.micro_batch and self.batch_per_rank % self.micro_batch):
            raise ValueError("need micro_batch >= 0 dividing batch_per_rank")
        if bad := [p for p in self.parts if p not in PARTS]:
            raise ValueError(f"unknown part {bad[0]!r}: choose from {', '.join(PARTS)}")


QUICK = dict(worlds=(2,), schemes=("sync", "dp", "edp"), epochs=4, repeats=1, overhead_epochs=8)


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


# -- 1. balance efficiency ------------------------------------------------------------------------------------
def calibrate(global_batch: int, rounds: int = 10) -> tuple[float, float]:
    """(fixed_s, per_sample_s) of one tiny-model training step measured alone (this process, one thread): sizes
    B/16..B in turn, the fastest of `rounds` per size, a least-squares line; fixed_s >= 0."""
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


def cost_model(steps, calib: tuple[float, float], global_batch: int, steady_from: int, micro_batch: int = 0) -> dict:
    """One run's cost model from its steps.csv (steady-state steps): rank i costs s_i x (a + c x b) seconds, the ideal
    and equal-share step times, the all-reduce time and the jitter (README: benchmarks). With micro-batches of m a
    rank runs b/m of them, each a + c x m: s_i x b x (a/m + c), and the ideal is in whole micro-batches."""
    a, c = calib
    m = max(micro_batch, 1)
    if micro_batch:
        a, c = 0.0, c + a / m
    world = steps["rank"].nunique()
    steady = steps[steps.epoch >= steady_from]
    by_rank, per_step = steady.groupby("rank"), steady.groupby(["epoch", "step"])
    scale = (by_rank.compute_s.sum() / by_rank.batch_size.apply(lambda b: (a + c * b).sum())).to_numpy()
    fixed, per = scale * a, scale * c
    best = affine_batch_sizes(fixed, per, global_batch, granularity=m)
    equal = batch_sizes(np.ones(world), global_batch, granularity=m)
    return {"scale": scale.tolist(), "fixed_s": fixed.tolist(), "per_sample_s": per.tolist(),
            "ideal_sizes": best.tolist(), "ideal_step_s": predicted_step_s(fixed, per, best),
            "sync_step_s": predicted_step_s(fixed, per, equal),
            "allreduce_s": float(per_step.wait_s.min().mean()),
            # per-step variation no per-rank share removes: mean of the per-step slowest minus slowest mean
            "jitter_s": float(per_step.compute_s.max().mean() - by_rank.compute_s.mean().max())}


def balance(suite: Suite, out: Path, calib: tuple[float, float], notes: list[str]) -> list[dict]:
    """Every scheme with the last rank slowed, per world size and slowdown: epoch time against the run's ideal."""
    import pandas as pd

    rows = []
    for world in suite.worlds:
        for slow in suite.slowdowns:
            found = []
            for scheme in suite.schemes:
                name = f"balance-w{world}-x{slow:g}-{scheme}" + (f"-m{suite.micro_batch}" if suite.micro_batch else "")
                print(f"bench: {name}", flush=True)
                d = train(suite, out, name, world, scheme, f"{world - 1}:slowdown={slow:g}", notes)
                ranks, steps = (pd.read_csv(d / f"{t}.csv") for t in ("ranks", "steps"))
                m = cost_model(steps, calib, suite.global_batch(world), suite.steady_from, suite.micro_batch)
                steady = steady_epochs(d, suite.steady_from)
                n = int(steady[0]["steps"])
                ideal_s, bound_s = n * (m["ideal_step_s"] + m["allreduce_s"]), n * (m["sync_step_s"] + m["allreduce_s"])
                epoch_s = float(np.median([float(r["epoch_time_s"]) for r in steady]))
                found.append({"world": world, "slowdown": slow, "scheme": scheme, "affinity": affinity(world, suite.pin),
                              "global_batch": suite.global_batch(world), "micro_batch": suite.micro_batch,
                              "steps": n, "epoch_s": epoch_s,
                              "ideal_s": ideal_s, "over_ideal": epoch_s / ideal_s, "sync_bound_s": bound_s,
                              "over_sync_bound": epoch_s / bound_s, "predicted_speedup": bound_s / ideal_s,
                              "jitter": n * m["jitter_s"] / ideal_s,
                              "balance_eff": float(np.mean([float(r["balance_eff"]) for r in steady])),
                              "shares": ranks[ranks.epoch == ranks.epoch.max()].share.round(3).tolist(),
                              "cost_model": m, "run_dir": str(d)})
            add_speedup_vs_sync(found)
            rows += found
    return rows


# -- the report -----------------------------------------------------------------------------------------------
def checks(res: dict) -> list[dict]:
    """The suite's targets (README: benchmarks), each with the measured value and whether it passes."""
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
        out.append({"target": "api step <= 1.01 x plain DDP step (same DataLoader)", "value": ov["api_ratio"],
                    "pass": ov["api_ratio"] <= 1.01})
    for r in res.get("balancer", []):
        if r["workers"] == 4096:
            out.append({"target": f"one {r['rule']} decision for 4096 workers < 10 ms", "value": r["decision_ms"],
                        "pass": r["decision_ms"] < 10})
    return out


def table(res: dict) -> str:
    """The markdown report of one benchmark run."""
    m = res["meta"]
    lines = [f"# hetero benchmarks, {m['date']}, {m['host']} ({m['cpu']}, {m['cores']} cores, load average "
             f"{m['load_avg_start'][0]:.1f} at start, {m['load_avg_end'][0]:.1f} at end)", "", f"`{m['command']}`", ""]
    if res.get("balance"):
        lines += ["## Balance efficiency (steady-state epoch time; ideal = steps x (T* + all-reduce))", ""]
        lines += markdown_table(
            ["ranks", "B", "slowdown", "scheme", "epoch s", "ideal s", "/ ideal", "/ sync bound", "speedup vs sync",
             "predicted", "jitter", "shares"],
            [[r["world"], r["global_batch"], f"{r['slowdown']:g}x", r["scheme"], f"{r['epoch_s']:.3f}",
              f"{r['ideal_s']:.3f}", f"{r['over_ideal']:.3f}", f"{r['over_sync_bound']:.3f}",
              "" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x", f"{r['predicted_speedup']:.2f}x",
              f"{r['jitter']:.3f}", "/".join(f"{s:.2f}" for s in r["shares"])] for r in res["balance"]])
        pinned = sorted({(r["world"], r["affinity"]) for r in res["balance"] if r["affinity"]})
        lines += [""] + [f"{w} ranks pinned to cores {a} (--affinity)." for w, a in pinned] + [""]
    if ov := res.get("overhead"):
        lines += ["## Overhead (no heterogeneity, 2 ranks)", "",
                  f"trainer {1e3 * ov['trainer_step_s']:.2f} ms/step, plain DDP {1e3 * ov['plain_step_s']:.2f} "
                  f"ms/step: ratio {ov['ratio']:.3f} (median of {len(ov['pair_ratios'])} back-to-back epoch pairs; "
                  f"of medians {ov['ratio_of_medians']:.3f}, of minima {ov['ratio_of_minima']:.3f}), "
                  f"{ov['extra_ms_per_step']:+.2f} ms per step", "",
                  f"API (hetero.Balance, edp, rebalancing every {ov['api_rebalance_every']} steps) "
                  f"{1e3 * ov['api_step_s']:.2f} ms/step, plain DDP through the same DataLoader "
                  f"{1e3 * ov['ddp_loader_step_s']:.2f} ms/step: ratio {ov['api_ratio']:.3f} (median of "
                  f"{len(ov['api_pair_ratios'])} pairs; of medians {ov['api_ratio_of_medians']:.3f}), "
                  f"{ov['api_extra_ms_per_step']:+.2f} ms per step", ""]
    if res.get("balancer"):
        rules = ("proportional", "affine")
        lines += ["## One rebalancing decision (median ms)", ""] + markdown_table(
            ["workers"] + [str(r["workers"]) for r in res["balancer"] if r["rule"] == rules[0]],
            [[rule] + [f"{r['decision_ms']:.2f}" for r in res["balancer"] if r["rule"] == rule] for rule in rules])
        lines.append("")
    if res.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    if res.get("checks"):
        lines += ["## Targets", ""] + [f"- {'PASS' if c['pass'] else 'FAIL'} {c['target']}: {c['value']:.3f}"
                                       for c in res["checks"]]
    return "\n".join(lines) + "\n"


def run(suite: Suite, out: Path, command: str) -> dict:
    """Every part of the suite, then bench.json and table.md in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"meta": {**run_meta(command), "suite": asdict(suite)}, "notes": []}
    t0 = time.perf_counter()
    if "balance" in suite.parts:
        calib = calibrate(suite.global_batch(max(suite.worlds)))
        res["calibration"] = {"fixed_s": calib[0], "per_sample_s": calib[1]}
        res["balance"] = balance(suite, out, calib, res["notes"])
    if "overhead" in suite.parts:
        res["overhead"] = overhead.measure(out, suite.repeats, suite.subset(2), suite.global_batch(2),
                                           suite.overhead_epochs, res["notes"])
    if "balancer" in suite.parts:
        print("bench: balancer decisions", flush=True)
        res["balancer"] = simbench.balancer_cost(suite.workers)
    res["meta"].update(wall_s=time.perf_counter() - t0, load_avg_end=os.getloadavg())
    res["checks"] = checks(res)
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    (out / "table.md").write_text(table(res))
    return res


def listed(kind: type):
    """An argparse type for comma-separated values of `kind`: "2,4" -> (2, 4)."""
    def parse(text: str) -> tuple:
        return tuple(kind(v) for v in text.split(",") if v)
    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog="python -m hetero.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 ranks only, sync/dp/edp, shorter runs, one overhead pair")
    p.add_argument("--out", default="", help="output folder (default runs/bench/<time>)")
    p.add_argument("--worlds", type=listed(int), help="rank counts, e.g. 2,4")
    p.add_argument("--slowdowns", type=listed(float), help="e.g. 2,4")
    p.add_argument("--schemes", type=listed(str), help="e.g. sync,dp,edp,affine")
    p.add_argument("--parts", type=listed(str), help=",".join(PARTS))
    p.add_argument("--epochs", type=int)
    p.add_argument("--steady-from", type=int)
    p.add_argument("--batch-per-rank", type=int, help="global batch = this x ranks")
    p.add_argument("--steps", type=int, help="steps per epoch")
    p.add_argument("--repeats", type=int, help="overhead launches")
    p.add_argument("--overhead-epochs", type=int)
    p.add_argument("--micro-batch", type=int, help="the trainer's --micro-batch in the balance part (0: off)")
    p.add_argument("--max-workers", type=int, help="largest balancer size (powers of two from 2)")
    p.add_argument("--no-pin", dest="pin", action="store_false", default=None,
                   help="leave ranks unpinned even when there are more ranks than cores")
    ns = p.parse_args(argv)
    over = {k: getattr(ns, k) for k in ("worlds", "slowdowns", "schemes", "parts", "epochs", "steady_from",
                                        "batch_per_rank", "steps", "repeats", "overhead_epochs", "pin", "micro_batch")
            if getattr(ns, k) is not None}
    if ns.max_workers:
        over["workers"] = tuple(2 ** k for k in range(1, 13) if 2 ** k <= ns.max_workers)
    try:
        base = Suite(**QUICK) if ns.quick else Suite()
        if "epochs" in over and "steady_from" not in over:
            over["steady_from"] = min(base.steady_from, over["epochs"])
        suite = replace(base, **over)
    except ValueError as e:
        p.error(str(e))
    out = Path(ns.out or ROOT / "runs" / "bench" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    try:
        res = run(suite, out, "python -m hetero.bench " + " ".join(sys.argv[1:] if argv is None else argv))
    except LaunchError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1
    print(table(res), end="")
    print(f"bench: {out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
