"""Benchmarks without processes: the simulated balancers against the optimum for 2, 16 and 1024 workers, and the
time of one rebalancing decision for up to 4096 workers (also part 3 of `make bench`).

    python -m hetero.lab.simbench [--noise 0.02]     # = make sim-bench [NOISE=0.02]; seconds, deterministic at noise 0
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd

from ..core.balancer import Balancer
from ..core.partition import SCHEMES
from ..trainer.cli import CliParser
from .measure import markdown_table
from .simulator import Scenario, compare


def benchmark(worlds=(2, 16, 1024), epochs: int = 40, steps_per_epoch: int = 50, per_rank_batch: int = 512,
              noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """One row per world size: step time over the optimum, epochs to within 2% (docs/balancers.md: sim-bench)."""
    rows = []
    for n in worlds:
        if n == 2:
            sc, B = Scenario.uniform(2, hetero="1:delay=0.01", noise=noise), 256
        else:
            sc, B = Scenario.mixed(n, seed=seed, noise=noise), per_rank_batch * n
        t0 = time.perf_counter()
        runs = compare(sc, ("sync", "dp", "affine"), global_batch=B, epochs=epochs, steps_per_epoch=steps_per_epoch,
                       seed=seed)
        wall = time.perf_counter() - t0
        dp, af = runs["dp"], runs["affine"]
        rows.append({"workers": n, "global_batch": B, "optimum_ms": 1e3 * af.optimum_s.mean(),
                     "sync_over_opt": runs["sync"].ratio.mean(),
                     "affine_after_first": af.after_first_rebalance(),
                     "affine_epochs_to_2pct": af.epochs_to_within(0.02),
                     "dp_epochs_to_2pct": dp.epochs_to_within(0.02),
                     "dp_epoch2_over_opt": dp.epochs_frame()["ratio"].iloc[1],
                     "dp_final_over_opt": dp.epochs_frame()["ratio"].iloc[-1],
                     "sim_wall_s": wall})
    return pd.DataFrame(rows)


def decision_times(rule: str, workers: int, steps: int = 16, repeats: tuple[int, int] = (3, 50),
                   budget_s: float = 0.3) -> list[float]:
    """Wall times (s) of one decision (observe a [steps, workers] window of noisy affine costs, then decide):
    repeats[0] of them, and more up to repeats[1] while their sum is under budget_s."""
    rng = np.random.default_rng(workers)
    fixed, per = rng.uniform(2e-3, 8e-3, workers), rng.uniform(1e-4, 4e-4, workers)
    times: list[float] = []
    while len(times) < repeats[0] or (sum(times) < budget_s and len(times) < repeats[1]):
        bal = Balancer(rule, workers, 32 * workers)
        sizes = np.stack([bal.sizes_for_step(s) for s in range(steps)])  # affine probes two sizes
        compute = (fixed + per * sizes) * rng.lognormal(0, 0.05, sizes.shape)
        t0 = time.perf_counter()
        bal.observe(sizes, compute)
        bal.decide()
        times.append(time.perf_counter() - t0)
    return times


def balancer_cost(workers: tuple[int, ...]) -> list[dict]:
    """Median time (ms) of one decision per rule and number of workers (32 samples per worker)."""
    rows = []
    for rule in ("proportional", "affine"):
        for n in workers:
            times = decision_times(rule, n)
            rows.append({"rule": rule, "schemes": [s for s, v in SCHEMES.items() if v.rule == rule],
                         "workers": n, "global_batch": 32 * n, "decision_ms": 1e3 * float(np.median(times)),
                         "min_ms": 1e3 * min(times), "repeats": len(times)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog="python -m hetero.lab.simbench", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--steps-per-epoch", type=int, default=50)
    p.add_argument("--noise", type=float, default=0.0, help="relative std of each rank's compute time per step")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    if not (2 <= ns.epochs <= 10**6 and 1 <= ns.steps_per_epoch <= 10**6 and 0 <= ns.noise <= 10):  # nan fails too
        p.error("need 2 <= --epochs <= 10**6, 1 <= --steps-per-epoch <= 10**6 and 0 <= --noise <= 10 (a relative "
                "standard deviation)")
    df = benchmark(epochs=ns.epochs, steps_per_epoch=ns.steps_per_epoch, noise=ns.noise, seed=ns.seed)
    ep = lambda v: f">{ns.epochs}" if v is None or pd.isna(v) else str(int(v))  # noqa: E731
    print(f"Simulated {ns.epochs} epochs of {ns.steps_per_epoch} steps, noise {ns.noise:g}; step times relative "
          f"to the optimum (1.000 = optimal).")
    print("\n".join(markdown_table(
        ["workers", "global batch", "optimum step", "sync", "affine after 1st rebalance", "affine epochs to 2%",
         "dp epochs to 2%", "dp epoch 2", "dp last epoch", "sim wall"],
        [[r.workers, r.global_batch, f"{r.optimum_ms:.2f} ms", f"{r.sync_over_opt:.3f}", f"{r.affine_after_first:.3f}",
          ep(r.affine_epochs_to_2pct), ep(r.dp_epochs_to_2pct), f"{r.dp_epoch2_over_opt:.3f}",
          f"{r.dp_final_over_opt:.3f}", f"{r.sim_wall_s:.2f} s"] for r in df.itertuples()])))
    d = {rule: min(decision_times(rule, 4096, steps=50, repeats=(7, 7))) for rule in ("affine", "proportional")}
    t0 = time.perf_counter()
    big = compare(Scenario.mixed(4096, seed=ns.seed, noise=ns.noise), ("sync", "dp", "affine"),
                  global_batch=128 * 4096, epochs=10, steps_per_epoch=ns.steps_per_epoch, seed=ns.seed)
    wall = time.perf_counter() - t0
    print(f"\n4096 workers: one observe+decide of a 50-step window takes {1e3 * d['affine']:.1f} ms (affine), "
          f"{1e3 * d['proportional']:.1f} ms (proportional), fastest of 7; three schemes x 10 epochs x "
          f"{ns.steps_per_epoch} steps simulate in {wall:.1f} s (affine after its first rebalance: "
          f"{big['affine'].after_first_rebalance():.3f} x optimum).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
