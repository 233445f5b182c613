"""Variable-length steps in simulation (issue 49): how each way of splitting a step's samples fares when a rank's time
follows the tokens it draws. No processes, no torch: the ranks' true costs are known, so the ideal is too.

Rank i takes fixed_s_i + per_unit_s_i x work(its rows) seconds a step (hetero.core.tokens.Cost: padded or packed, with
an attention term), times lognormal noise (mean 1). Each step's B samples are the next B of one shared permutation
(the same for every policy); a step lasts as long as its slowest rank. Policies:
- equal: B / W samples a rank in the order drawn (DistributedSampler);
- batch_rebalance: equal cost per rank by transformers' fixed formula (rows x longest + 0.001 x rows x longest²),
  blind to the ranks' speeds (BatchRebalanceSampler, one micro-batch a rank);
- samples: hetero by counts (today's): the affine balancer's counts, in the order drawn, re-decided every K steps;
- tokens: hetero by cost: tokens.split with each rank's cost model fitted online (tokens.CostModel) every K steps;
- ideal: tokens.split with the true coefficients, under the same noise (the denominator).

    python -m hetero.lab.tokensim                # the table for equal ranks and rank 1 three times slower
    python -m hetero.lab.tokensim --split-cost   # what one split costs on this host (ms, median), by size and ranks
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from ..core.balancer import Balancer
from ..core.settings import Settings
from ..core.tokens import Cost, CostModel, split, times

POLICIES = ("equal", "batch_rebalance", "samples", "tokens")
HF_COST = Cost("padded", attention=0.001)  # BatchRebalanceSampler's QUADRATIC_COST_COEF


@dataclass
class TokenScenario:
    """True per-rank costs, the collator's cost, the lengths' distribution and the noise."""
    fixed_s: np.ndarray
    per_unit_s: np.ndarray
    cost: Cost = Cost("padded", attention=0.001)
    median: float = 64.0      # lognormal lengths: median, log-space sigma, capped
    sigma: float = 1.0
    cap: int = 1024
    noise: float = 0.05

    def __post_init__(self):
        self.fixed_s = np.asarray(self.fixed_s, float)
        self.per_unit_s = np.broadcast_to(np.asarray(self.per_unit_s, float), self.fixed_s.shape).copy()

    @property
    def world(self) -> int:
        return self.fixed_s.size

    def lengths(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.round(rng.lognormal(np.log(self.median), self.sigma, n)).astype(np.int64) + 1, self.cap)


def _rows(policy: str, lengths: np.ndarray, world: int, model: CostModel, counts: np.ndarray,
          cost: Cost) -> list[np.ndarray]:
    """Each rank's positions in the step for one policy."""
    if policy == "equal":
        return np.array_split(np.arange(lengths.size), world)
    if policy == "samples":
        return np.split(np.arange(lengths.size), np.cumsum(counts)[:-1])
    if policy == "batch_rebalance":
        return split(lengths, np.zeros(world), np.ones(world), HF_COST)
    return split(lengths, *model.coefficients(), cost)


def _play(steps: list[np.ndarray], fixed_s: np.ndarray, per_unit_s: np.ndarray, cost: Cost, policy: str,
          rebalance_every: int, noise: np.ndarray, counts_rule: str = "affine") -> tuple[np.ndarray, ...]:
    """One policy over the given steps (each step's lengths), rank i's compute fixed_s_i + per_unit_s_i x work times
    noise[s, i]: every step's ranks' times [steps, world], the ideal split's [steps, world] under the same noise, and
    each rank's tokens [world]. The policy learns as hetero does: from the ranks' times every rebalance_every steps
    (by counts: a Balancer of `counts_rule` with a Balance's default settings)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    W = fixed_s.size
    model = CostModel(W)
    d = Settings(global_batch=len(steps[0]))
    counts_bal = Balancer(counts_rule, W, d.global_batch, d.min_batch, smoothing=d.smoothing, deadband=d.deadband,
                          significance=d.significance)
    work_w, time_w, size_w = [], [], []
    took, best, tokens = [], [], np.zeros(W)
    for s, L in enumerate(steps):
        rows = _rows(policy, L, W, model, counts_bal.sizes_for_step(s), cost)
        work = np.array([cost.work(L[p]) for p in rows])
        t = np.where([len(p) > 0 for p in rows], fixed_s + per_unit_s * work, 0.0) * noise[s]
        took.append(t)
        best.append(times(L, split(L, fixed_s, per_unit_s, cost), fixed_s, per_unit_s, cost) * noise[s])
        tokens += [L[p].sum() for p in rows]
        work_w.append(work)
        time_w.append(t)
        size_w.append([len(p) for p in rows])
        if (s + 1) % rebalance_every == 0:
            if policy == "tokens":
                model.observe(np.array(work_w), np.array(time_w))
            if policy == "samples":
                counts_bal.observe(np.array(size_w), np.array(time_w))
                counts_bal.decide()
            work_w, time_w, size_w = [], [], []
    return np.array(took), np.array(best), tokens


def simulate(sc: TokenScenario, policy: str, global_batch: int, steps: int, rebalance_every: int = 10,
             seed: int = 0) -> dict:
    """One policy over `steps` steps; the same seed draws the same lengths and noise for every policy. Returns the
    total time, the ideal's, the mean wait per step (the slowest rank's time less the mean) and each rank's mean
    share of the tokens."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
    rng = np.random.default_rng(seed)
    W = sc.world
    lengths = sc.lengths(rng, steps * global_batch)
    noise = np.exp(sc.noise * rng.standard_normal((steps, W)) - sc.noise ** 2 / 2)
    took, best, tokens = _play([lengths[s * global_batch:(s + 1) * global_batch] for s in range(steps)], sc.fixed_s,
                               sc.per_unit_s, sc.cost, policy, rebalance_every, noise)
    total, ideal = took.max(1).sum(), best.max(1).sum()
    return {"policy": policy, "over_ideal": total / ideal, "step_s": total / steps, "ideal_step_s": ideal / steps,
            "wait_s": float((took.max(1) - took.mean(1)).mean()), "token_shares": (tokens / tokens.sum()).tolist()}


def replay(steps: list, fixed_s, per_unit_s, cost: Cost, policy: str, rebalance_every: int, overhead_s: float,
           noise: float, timed_from: int = 0, seeds: int = 32, counts_rule: str = "proportional") -> dict:
    """A measured run replayed in simulation: its own steps (each step's lengths as the run drew them), every rank's
    cost as calibrated, the step's overhead outside the ranks' compute, and lognormal noise of `noise` (log sd, mean
    1) on each rank's compute per step, under the run's policy, learning as it did. The figure is the bench's: the
    steps from `timed_from` on, time over the ideal (the best split of each step's samples under the calibrated costs,
    no noise, plus the overhead), as the mean over `seeds` draws of the noise, with their sd."""
    steps = [np.asarray(L, np.int64) for L in steps]
    fixed_s, per_unit_s = np.asarray(fixed_s, float), np.asarray(per_unit_s, float)
    calm = np.ones((len(steps), fixed_s.size))
    ideal = (_play(steps, fixed_s, per_unit_s, cost, "tokens", rebalance_every, calm)[1].max(1) + overhead_s)
    ideal = ideal[timed_from:].sum()
    out = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        draw = np.exp(noise * rng.standard_normal(calm.shape) - noise ** 2 / 2)
        took = _play(steps, fixed_s, per_unit_s, cost, policy, rebalance_every, draw, counts_rule)[0]
        out.append((took.max(1) + overhead_s)[timed_from:].sum() / ideal)
    return {"simulated": float(np.mean(out)), "simulated_sd": float(np.std(out)), "seeds": seeds}


def table(global_batch: int = 64, steps: int = 400, seed: int = 0) -> list[dict]:
    """Equal ranks and rank 1 three times slower, padded and packed: every policy on the same draws."""
    rows = []
    for collator in ("padded", "packed"):
        for label, per_unit in (("equal", [1e-6, 1e-6]), ("rank 1 3x slower", [1e-6, 3e-6])):
            sc = TokenScenario([2e-3, 2e-3], per_unit, cost=Cost(collator, attention=0.001))
            for policy in POLICIES:
                rows.append({"collator": collator, "ranks": label,
                             **simulate(sc, policy, global_batch, steps, seed=seed)})
    return rows


def split_cost(sizes=(32, 128, 512), worlds=(2, 4, 8), repeats: int = 21, seed: int = 0) -> list[dict]:
    """The host time of one tokens.split (ms: median and the fastest of `repeats`) for steps of lognormal lengths
    (median 64, capped at 1024), padded and packed (attention 0.001), ranks of random fixed and per-token costs, some
    3x slower: what every rank spends on a step's split when it is first handed out."""
    rng, rows = np.random.default_rng(seed), []
    for collator in ("padded", "packed"):
        for n in sizes:
            for w in worlds:
                L = np.minimum(np.exp(rng.normal(np.log(64), 1.0, n)).astype(int) + 1, 1024)
                a, c = rng.uniform(0, 0.01, w), rng.uniform(1e-5, 3e-5, w) * rng.choice([1, 3], w)
                spent = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    split(L, a, c, Cost(collator, attention=0.001))
                    spent.append(time.perf_counter() - t0)
                rows.append({"collator": collator, "samples": n, "ranks": w, "median_ms": 1e3 * float(np.median(spent)),
                             "fastest_ms": 1e3 * min(spent)})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split-cost", action="store_true", help="time one split instead (ms per step, by size and ranks)")
    a = p.parse_args(argv)
    if a.split_cost:
        print("| collator | samples | ranks | ms, median | ms, fastest |")
        print("|---|---|---|---|---|")
        for r in split_cost(seed=a.seed):
            print(f"| {r['collator']} | {r['samples']} | {r['ranks']} | {r['median_ms']:.2f} | {r['fastest_ms']:.2f} |")
        return
    print("| collator | ranks | policy | time / ideal | wait per step (ms) | rank 1's token share |")
    print("|---|---|---|---|---|---|")
    for r in table(a.global_batch, a.steps, a.seed):
        print(f"| {r['collator']} | {r['ranks']} | {r['policy']} | {r['over_ideal']:.3f} | {1e3 * r['wait_s']:.2f} | "
              f"{r['token_shares'][1]:.3f} |")


if __name__ == "__main__":
    main()
