"""A step-level simulator of synchronous data-parallel training on heterogeneous workers (no processes, no torch).

Rank i computes a step of batch b in (fixed_s_i + per_sample_s_i * b) seconds (shared with its core-mates under
processor sharing when Scenario.cores says ranks share a CPU core: hetero.lab.coupled), times lognormal noise (mean 1),
plus the emulator's effects on that rank (`--hetero` grammar: delay, exp, gamma, slowdown, with epoch, step and
cycle windows). A step lasts as long as its slowest rank; the others idle. The scheme's Balancer, the very class
the trainer uses, sees each rank's own time and re-decides at the same points as the trainer: every
rebalance_every steps and at each epoch end. The optimum at each step is the step time of the oracle: the
minimax-optimal integer sizes for the ranks' true mean costs at that step, under the same noise and delay draws.
Vectorised over ranks and over the steps between decisions (docs/balancers.md; its benchmark: hetero.lab.simbench).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..core.balancer import Balancer
from ..core.emulator import active as emulator_windows
from ..core.emulator import mean_effects, parse_hetero, sample_effects
from ..core.partition import SCHEMES, affine_batch_sizes, step_times
from .coupled import coupled_batch_sizes, shared_walls

# Step costs (fixed s per step, s per sample) of CIFAR models: on one H200 (PAPER.md), and on the paper's GPUs as
# its logs imply (Sync-SGD time per step at 128 samples less the delay, and the delay over the settled DP shares'
# batch difference: VGG16 0.01 s over 148-108 samples, ResNet50 0.1 s over 161-95).
COSTS = {"vgg16-h200": (7.6e-3, 9e-6), "resnet50-h200": (22e-3, 58e-6),
         "vgg16-paper": (31e-3, 0.24e-3), "resnet50-paper": (0.15, 1.5e-3)}


@dataclass
class Scenario:
    """Simulated workers: per-rank costs, noise, and emulator effects (with their schedules)."""
    fixed_s: np.ndarray                  # [n] fixed cost per step (s)
    per_sample_s: np.ndarray             # [n] cost per sample (s)
    noise: float | np.ndarray | object = 0.0  # relative std of lognormal noise on each rank's compute time, or a
    # process with .sample(rng, steps) -> [steps, n] (mean 1), drawn once per run (noisefit: a real run's jitter)
    hetero: str = ""                     # emulator effects, the --hetero grammar, e.g. "1:delay=0.01@3-"
    name: str = ""
    cores: list | None = None            # a core label per rank: ranks with one label share a CPU core (their
    # compute times are coupled: hetero.lab.coupled); None: every rank has its own

    def __post_init__(self):
        self.fixed_s = np.asarray(self.fixed_s, float)
        self.per_sample_s = np.broadcast_to(np.asarray(self.per_sample_s, float), self.fixed_s.shape).copy()
        if not hasattr(self.noise, "sample"):
            self.noise = np.broadcast_to(np.asarray(self.noise, float), self.fixed_s.shape).copy()
        if np.any(self.fixed_s < 0) or np.any(self.per_sample_s <= 0) or np.any(np.asarray(self.sigma) < 0):
            raise ValueError("need fixed_s >= 0, per_sample_s > 0 and noise >= 0 on every rank")
        pairs = [(r, e) for r, es in sorted(parse_hetero(self.hetero).items()) for e in es]
        self.ranks, self.effects = [r for r, _ in pairs], [e for _, e in pairs]
        if any(r >= self.world for r in self.ranks):
            raise ValueError(f"hetero {self.hetero!r} names a rank outside the {self.world} workers")
        if self.cores is not None and len(self.cores) != self.world:
            raise ValueError(f"cores names {len(self.cores)} ranks, not {self.world}")

    @property
    def world(self) -> int:
        return len(self.fixed_s)

    @property
    def sigma(self) -> np.ndarray:
        """[n] the lognormal noise's relative std (0 where the noise is a process, drawn apart)."""
        return np.zeros(self.world) if hasattr(self.noise, "sample") else self.noise

    @classmethod
    def uniform(cls, n: int, cost: str = "vgg16-paper", **kw) -> Scenario:
        """n identical workers with one of COSTS; heterogeneity comes from `hetero`."""
        a, c = COSTS[cost]
        return cls(np.full(n, a), np.full(n, c), **kw)

    @classmethod
    def mixed(cls, n: int, cost: str = "vgg16-h200", seed: int = 0, **kw) -> Scenario:
        """n workers of mixed hardware: fixed costs 1-2x and per-sample costs 1-4x one of COSTS, and a quarter
        of them carrying a constant delay of half the fixed cost per step."""
        rng = np.random.default_rng(seed)
        a, c = COSTS[cost]
        fixed = a * rng.uniform(1, 2, n) + 0.5 * a * (rng.random(n) < 0.25)
        return cls(fixed, c * rng.uniform(1, 4, n), **kw)

    def mean_costs(self, on: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """True mean fixed and per-sample costs [n] (s) with the effects flagged in `on` [effects] (the oracle's)."""
        slow, delay = self.mean_effects(on)
        return self.fixed_s * slow + delay, self.per_sample_s * slow

    def mean_effects(self, on: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n] each, with the effects flagged in `on` [effects]: the factor on compute and the mean delay (s)."""
        factor, mean = mean_effects(self.effects)
        return 1 + self._per_rank((factor * on)[:, None])[0], self._per_rank((mean * on)[:, None])[0]

    def compute_s(self, sizes: np.ndarray) -> np.ndarray:
        """[steps, n] each rank's compute time (s) without noise or effects, shared cores taken into account."""
        t = step_times(self.fixed_s, self.per_sample_s, sizes)
        return t if self.cores is None else shared_walls(t, self.cores)

    def optimum_sizes(self, on: np.ndarray, global_batch: int, min_batch, max_batch, sit_out: bool,
                      unit: int) -> np.ndarray:
        """The oracle: minimax-optimal integer sizes for the true mean costs with the effects flagged in `on`."""
        if self.cores is None:
            return affine_batch_sizes(*self.mean_costs(on), global_batch, min_batch, max_batch, sit_out, unit)
        return coupled_batch_sizes(self.fixed_s, self.per_sample_s, global_batch, self.cores, *self.mean_effects(on),
                                   min_batch, max_batch, sit_out, unit)

    def draw(self, rng: np.random.Generator, on: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a block of steps, [steps, n] each: the noise on compute (mean 1), the factor on compute (1 + the
        slowdowns) and the delay (s); on: [effects, steps], the emulator's windows."""
        steps, sigma = on.shape[1], self.sigma
        noise = np.exp(sigma * rng.standard_normal((steps, self.world)) - sigma ** 2 / 2) if sigma.any() \
            else np.ones((steps, self.world))
        factor, _ = mean_effects(self.effects)
        delay = sample_effects(self.effects, on, np.zeros(steps), rng)  # no compute: the delays alone
        return noise, 1 + self._per_rank(factor[:, None] * on), self._per_rank(delay)

    def _per_rank(self, each: np.ndarray) -> np.ndarray:
        """[effects, steps] -> [steps, n]: the effects of each rank added up."""
        out = np.zeros((each.shape[1], self.world))
        for k, rank in enumerate(self.ranks):
            out[:, rank] += each[k]
        return out


@dataclass
class SimResult:
    """Per-step results of one simulated run (arrays indexed by global step)."""
    scheme: str
    global_batch: int
    steps_per_epoch: int
    epoch: np.ndarray            # [S] 1-based epoch of each step
    step_s: np.ndarray           # [S] step time: the slowest rank's time (s)
    optimum_s: np.ndarray        # [S] the oracle's step time under the same draws (s)
    idle_frac: np.ndarray        # [S] mean over ranks of the time spent waiting for the slowest, / step time
    sizes: np.ndarray            # [S, n] batch sizes (int32; with micro_batch m, k_i * m)
    decisions: list = field(default_factory=list)  # global steps at which a decision changed the sizes
    decide_s: list = field(default_factory=list)   # wall time of each observe+decide (s)

    @property
    def ratio(self) -> np.ndarray:
        return self.step_s / self.optimum_s

    def steps_frame(self) -> pd.DataFrame:
        """One row per step: epoch, step, step_s, optimum_s, ratio, idle_frac (tidy, for seaborn)."""
        return pd.DataFrame({"scheme": self.scheme, "epoch": self.epoch, "step": np.arange(len(self.step_s)),
                             "step_s": self.step_s, "optimum_s": self.optimum_s, "ratio": self.ratio,
                             "idle_frac": self.idle_frac})

    def epochs_frame(self) -> pd.DataFrame:
        """One row per epoch: total step time, the oracle's, their ratio and the mean idle fraction."""
        df = self.steps_frame().groupby("epoch").agg(step_s=("step_s", "sum"), optimum_s=("optimum_s", "sum"),
                                                     idle_frac=("idle_frac", "mean")).reset_index()
        df["ratio"] = df["step_s"] / df["optimum_s"]
        df.insert(0, "scheme", self.scheme)
        return df

    def shares_frame(self, ranks=None) -> pd.DataFrame:
        """One row per (epoch, rank): the rank's share of the epoch's samples (as ranks.csv of a real run)."""
        ranks = range(self.sizes.shape[1]) if ranks is None else ranks
        rows = [{"scheme": self.scheme, "epoch": int(e), "rank": int(r),
                 "share": float(self.sizes[self.epoch == e, r].sum() / (self.global_batch * (self.epoch == e).sum()))}
                for e in np.unique(self.epoch) for r in ranks]
        return pd.DataFrame(rows)

    def epochs_to_within(self, tol: float = 0.02) -> int | None:
        """The first epoch from which every epoch's time is within tol of the oracle's (None: never)."""
        r = self.epochs_frame()["ratio"].to_numpy()
        good = r <= 1 + tol
        for e in range(len(r)):
            if good[e:].all():
                return e + 1
        return None

    def after_first_rebalance(self) -> float:
        """Step time over the oracle's, from the first change of sizes to the next one (or the end)."""
        if not self.decisions:
            return float(self.ratio.mean())
        end = self.decisions[1] if len(self.decisions) > 1 else len(self.step_s)
        s = slice(self.decisions[0], end)
        return float(self.step_s[s].sum() / self.optimum_s[s].sum())


def simulate(scenario: Scenario, scheme: str, global_batch: int, epochs: int, steps_per_epoch: int, *,
             min_batch=1, max_batch=None, smoothing: float = 0.0, deadband: float = 0.0, significance: float = 1.0,
             rebalance_every: int = 0, sit_out: bool = False, seed: int = 0, micro_batch: int = 0,
             balancer: dict | None = None) -> SimResult:
    """Run one scheme for epochs x steps_per_epoch steps; the same seed gives every scheme the same draws.
    micro_batch m > 0: every rank runs k_i micro-batches of m per step (sizes k_i * m; the oracle too), a step of
    rank i costing fixed_s_i + per_sample_s_i * m * k_i. balancer: further Balancer settings (e.g. probe_steps)."""
    n, unit = scenario.world, max(micro_batch, 1)
    bal = Balancer(SCHEMES[scheme].rule, n, global_batch, min_batch, max_batch, smoothing, deadband, significance,
                   sit_out=sit_out, granularity=unit, **(balancer or {}))
    rng = np.random.default_rng(seed)
    oracle: dict[bytes, np.ndarray] = {}
    S = epochs * steps_per_epoch
    # a noise process is drawn for the whole run at once: its time correlation runs across decisions
    process = scenario.noise.sample(np.random.default_rng((seed, 1)), S) if hasattr(scenario.noise, "sample") else None
    res = SimResult(scheme, global_batch, steps_per_epoch, np.repeat(np.arange(1, epochs + 1), steps_per_epoch),
                    np.zeros(S), np.zeros(S), np.zeros(S), np.zeros((S, n), np.int32))
    cuts = [s for s in range(rebalance_every, steps_per_epoch, rebalance_every)] if rebalance_every else []
    for epoch in range(1, epochs + 1):
        for lo, hi in zip([0, *cuts], [*cuts, steps_per_epoch]):
            g0 = (epoch - 1) * steps_per_epoch + lo
            g = np.arange(g0, g0 + hi - lo)
            active = emulator_windows(scenario.effects, epoch, g)
            sizes = np.stack([bal.sizes_for_step(s) for s in range(lo, hi)])
            noise, slow, delay = scenario.draw(rng, active)
            if process is not None:
                noise = process[g]
            t = scenario.compute_s(sizes) * noise * slow + delay * (sizes > 0)
            res.sizes[g], res.step_s[g] = sizes, t.max(1)
            res.idle_frac[g] = 1 - t.mean(1) / res.step_s[g]
            for key in np.unique(active, axis=1).T:  # the oracle, once per distinct set of active effects
                cols = (active == key[:, None]).all(0)
                k = key.tobytes()
                if k not in oracle:
                    oracle[k] = scenario.optimum_sizes(key, global_batch, min_batch, max_batch, sit_out, unit)
                b = oracle[k]
                res.optimum_s[g[cols]] = (scenario.compute_s(b[None]) * noise[cols] * slow[cols]
                                          + delay[cols] * (b > 0)).max(1)
            if hi < steps_per_epoch or bal.rule != "static":  # as the trainer: mid-epoch cuts, then epoch ends
                t0 = time.perf_counter()
                bal.observe(sizes, t)
                changed = bal.decide()
                res.decide_s.append(time.perf_counter() - t0)
                if changed:
                    res.decisions.append(int(g[-1]) + 1)
    return res


def compare(scenario: Scenario, schemes=("sync", "dp", "affine"), **kw) -> dict[str, SimResult]:
    """Every scheme on one scenario with the same random draws."""
    return {s: simulate(scenario, s, **kw) for s in schemes}


def sweep(scenarios: dict[str, Scenario], schemes=("sync", "dp", "affine"), per: str = "epoch", *,
          variants: dict[str, dict] | None = None, rolling: int = 0, **kw) -> pd.DataFrame:
    """Every scheme on every named scenario: one tidy frame (per="epoch", "step" or "share"), column scenario;
    with variants {label: settings}, each set of settings over kw too (column variant); rolling: a rolling mean of
    the ratio over that many rows of each (scenario, scheme, variant)."""
    frames = []
    for label, extra in (variants or {"": {}}).items():
        for name, sc in scenarios.items():
            for res in compare(sc, schemes, **{**kw, **extra}).values():
                df = {"epoch": res.epochs_frame, "step": res.steps_frame, "share": res.shares_frame}[per]()
                frames.append(df.assign(scenario=name, **({"variant": label} if variants else {})))
    df = pd.concat(frames, ignore_index=True)
    if rolling:
        keys = ["scenario", "scheme"] + ["variant"] * bool(variants)
        df["ratio"] = df.groupby(keys)["ratio"].transform(lambda r: r.rolling(rolling, 1).mean())
    return df


def stability(scenario: Scenario, schemes=("dp", "affine"), smoothing=(0.0, 0.5), deadband=(0.0, 0.02),
              skip: int = 100, **kw) -> pd.DataFrame:
    """One row per (scheme, smoothing, deadband): how many decisions changed the sizes, and the mean step time
    over the optimum after the first `skip` steps."""
    rows = [{"scheme": scheme, "smoothing": sm, "deadband": db, "size changes": len(r.decisions),
             "step / optimum": round(float(r.ratio[skip:].mean()), 4)}
            for scheme in schemes for sm in smoothing for db in deadband
            for r in [simulate(scenario, scheme, smoothing=sm, deadband=db, **kw)]]
    return pd.DataFrame(rows)
