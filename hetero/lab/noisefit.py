"""The noise a real run saw, fitted from its steps.csv, and the run replayed in the simulator with that noise.

A rank's jitter at a step is its measured compute wall (compute_s less the emulator's sleep) over its expected one,
fixed_s + per_sample_s x b shared with its core-mates (the bench's cost model: hetero.lab.efficiency.cost_model, and
hetero.lab.coupled); the replay puts the emulated slowdown (a factor on the jittered wall) and delay back on top.
Fitted per rank: the spread and skew of log jitter, its lag-1 autocorrelation within an epoch, and the correlation
across ranks at one step (ranks sharing a core). The replay draws the jitter by a circular block bootstrap of whole
steps (every rank at once), so the tail, the time correlation within a block and the cross-rank correlation are the
run's own; `NoiseFit.ar1` is the parametric alternative (correlated Gaussian AR(1) on log jitter: no skew).
docs/balancers.md: "Replaying a bench run".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.partition import sustained_s
from .coupled import coupled_batch_sizes, finish_s, shared_walls
from .simulator import Scenario, simulate


@dataclass(frozen=True)
class NoiseFit:
    """Multiplicative jitter of each rank's compute time (mean 1), fitted from steps in their order."""
    jitter: np.ndarray   # [T, n] compute_s / expected cost, steady steps, epoch-major; mean 1 per rank
    epoch: np.ndarray    # [T] the epoch of each row (lags never cross an epoch's end)
    sigma: np.ndarray    # [n] std of log jitter
    skew: np.ndarray     # [n] skewness of log jitter (> 0: the slow tail a preemption makes)
    phi: np.ndarray      # [n] lag-1 autocorrelation of log jitter within epochs
    corr: np.ndarray     # [n, n] correlation of log jitter across ranks at the same step

    @property
    def world(self) -> int:
        return self.jitter.shape[1]

    def sample(self, rng: np.random.Generator, steps: int, block: int = 4, epoch_steps: int = 0) -> np.ndarray:
        """[steps, n] jitter by a circular block bootstrap within epochs: blocks of `block` consecutive steps of one
        epoch (wrapping at its end, so every step is drawn as often), every rank from the same step: the tail, the
        short-range time correlation and the cross-rank correlation are kept. epoch_steps > 0: each run of that
        many steps draws its blocks from one measured epoch, picked at random, so the host's load drifting from
        epoch to epoch is kept too (and a median over epochs sees it as the bench's does)."""
        starts = np.flatnonzero(np.r_[True, self.epoch[1:] != self.epoch[:-1]])
        lengths = np.diff(np.r_[starts, len(self.epoch)])
        out, t = [], 0
        while t < steps:
            e = rng.integers(len(starts))
            left = min(epoch_steps or steps - t, steps - t)
            while left > 0:
                if not epoch_steps:
                    e = rng.integers(len(starts))
                take = min(block, left)
                out.append(self.jitter[starts[e] + (rng.integers(lengths[e]) + np.arange(take)) % lengths[e]])
                t, left = t + take, left - take
        return np.concatenate(out)[:steps]

    def ar1(self, rng: np.random.Generator, steps: int) -> np.ndarray:
        """[steps, n] jitter from the parametric fit: log jitter a Gaussian AR(1) per rank with coefficient phi,
        std sigma and innovations correlated as `corr`; mean 1 (no skew, no tail)."""
        phi = np.clip(self.phi, -0.99, 0.99)
        chol = np.linalg.cholesky(_nearest_corr(self.corr))
        e = rng.standard_normal((steps, self.world)) @ chol.T
        z = np.empty_like(e)
        z[0] = e[0]
        for t in range(1, steps):
            z[t] = phi * z[t - 1] + np.sqrt(1 - phi ** 2) * e[t]
        return np.exp(self.sigma * z - self.sigma ** 2 / 2)

    def summary(self) -> dict:
        """The fitted parameters as plain lists (for bench.json); epoch_drift: the largest std over ranks of a
        rank's mean jitter per epoch (the host's load changing between epochs)."""
        off = self.corr[~np.eye(self.world, dtype=bool)]
        per_epoch = pd.DataFrame(self.jitter).groupby(self.epoch).mean()
        return {"epoch_drift": float(per_epoch.std(ddof=0).max()) if len(per_epoch) > 1 else 0.0,
                "sigma": self.sigma.round(4).tolist(), "skew": self.skew.round(3).tolist(),
                "phi": self.phi.round(3).tolist(), "corr": self.corr.round(3).tolist(),
                "mean_cross_corr": float(off.mean()) if off.size else 0.0, "steps": int(len(self.epoch))}


def fit_jitter(jitter: np.ndarray, epoch: np.ndarray) -> NoiseFit:
    """Fit a [T, n] matrix of multiplicative jitter (steps in order; epoch [T] marks where lags stop)."""
    jitter, epoch = np.asarray(jitter, float), np.asarray(epoch)
    if jitter.ndim != 2 or not len(jitter) or len(epoch) != len(jitter) or not np.all(jitter > 0):
        raise ValueError("need at least one step of positive jitter, one epoch number per step")
    jitter = jitter / jitter.mean(0)  # mean 1: the mean cost lives in the cost model, not in the noise
    x = np.log(jitter)
    d = x - x.mean(0)
    sd = d.std(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        skew = np.where(sd > 0, (d ** 3).mean(0) / sd ** 3, 0.0)
        same = epoch[1:] == epoch[:-1]
        phi = np.where(sd > 0, (d[1:][same] * d[:-1][same]).mean(0) / sd ** 2, 0.0) if same.any() else 0 * sd
        corr = np.corrcoef(d.T) if jitter.shape[1] > 1 and len(d) > 1 else np.eye(jitter.shape[1])
    corr = np.where(np.isfinite(corr), corr, np.eye(len(corr)))
    return NoiseFit(jitter, epoch, sd, skew, phi, np.atleast_2d(corr))


def sustained_steps(steps: pd.DataFrame, quota: dict, allreduce_s: float) -> pd.DataFrame:
    """steps.csv with the compute_s of each rank under a CFS quota ({rank: (quota_s, period_s)}) at the rate the quota
    sustains the CPU it was charged (hetero.core.partition.sustained_s, less the all-reduce): the step model the
    bench's ideal, its misallocation and the replay use for such a rank. Unchanged without a cpu_s column."""
    if not quota or "cpu_s" not in steps:
        return steps
    q = steps["rank"].map(lambda r: float(quota.get(r, quota.get(str(r), (np.inf, np.inf)))[0]))
    p = steps["rank"].map(lambda r: float(quota.get(r, quota.get(str(r), (np.inf, np.inf)))[1]))
    compute = sustained_s(steps.compute_s.to_numpy()[None], steps.cpu_s.to_numpy()[None], q.to_numpy(),
                          p.to_numpy(), allreduce_s)[0]
    return steps.assign(compute_s=compute)


def fit_steps(steps: pd.DataFrame, fixed_s, per_sample_s, steady_from: int = 1, cores=None) -> NoiseFit:
    """The jitter of a run's steps.csv (epochs >= steady_from): each rank's measured compute wall (compute_s less the
    emulator's sleep, delay_s) over its expected one, fixed_s + per_sample_s x b shared with its core-mates (cores:
    a label per rank, hetero.lab.coupled; None: a core each)."""
    s = steps[steps.epoch >= steady_from].sort_values(["epoch", "step", "rank"])
    world = s["rank"].nunique()
    if s.empty or len(s) % world:
        raise ValueError("steps.csv has no steady steps, or a step without every rank")
    wall = (s.compute_s - (s.delay_s if "delay_s" in s else 0.0)).to_numpy().reshape(-1, world)
    batch = s.batch_size.to_numpy().reshape(-1, world)
    expected = np.asarray(fixed_s, float) + np.asarray(per_sample_s, float) * batch
    if cores is not None:
        expected = shared_walls(np.where(batch > 0, expected, 0.0), cores)
    sat = batch == 0  # a rank sitting out computes two borrowed samples: no use for its jitter
    jitter = np.where(sat, 1.0, np.maximum(wall, 1e-9) / np.where(sat, 1.0, np.maximum(expected, 1e-12)))
    return fit_jitter(jitter, s.epoch.to_numpy()[::world])


class _Replayed:
    """A noise process for the simulator: a NoiseFit sampled by block bootstrap (each simulated epoch from one
    measured epoch) or by its AR(1) fit."""
    def __init__(self, fit: NoiseFit, method: str, block: int, epoch_steps: int):
        self.fit, self.method, self.block, self.epoch_steps = fit, method, block, epoch_steps

    def sample(self, rng: np.random.Generator, steps: int) -> np.ndarray:
        if self.method == "ar1":
            return self.fit.ar1(rng, steps)
        return self.fit.sample(rng, steps, self.block, self.epoch_steps)


def ideal_costs(fixed_s, per_sample_s, global_batch: int, allreduce_s: float = 0.0, cores=None) -> dict:
    """A cost model as hetero.lab.efficiency.cost_model gives one, for known per-rank costs (s) and no emulated
    effects: T* without any noise (cores: ranks sharing a CPU core, hetero.lab.coupled)."""
    fixed, per = np.asarray(fixed_s, float), np.asarray(per_sample_s, float)
    cores = list(range(len(fixed))) if cores is None else list(cores)
    best = coupled_batch_sizes(fixed, per, global_batch, cores)
    return {"fixed_s": fixed.tolist(), "per_sample_s": per.tolist(), "factor": [1.0] * len(fixed),
            "delay_s": [0.0] * len(fixed), "cores": cores, "allreduce_s": float(allreduce_s),
            "ideal_sizes": best.tolist(), "ideal_step_s": float(finish_s(fixed, per, best, cores).max())}


def scenario(cost_model: dict, noise=0.0) -> Scenario:
    """The simulator's Scenario of a cost model: its costs, its shared cores, its slowdowns and delays as effects."""
    world = len(cost_model["fixed_s"])
    factor, delay = cost_model.get("factor", [1.0] * world), cost_model.get("delay_s", [0.0] * world)
    spec = ",".join([f"{i}:slowdown={f:.9g}" for i, f in enumerate(factor) if f != 1]
                    + [f"{i}:delay={d:.9g}" for i, d in enumerate(delay) if d > 0])
    return Scenario(np.asarray(cost_model["fixed_s"], float), np.asarray(cost_model["per_sample_s"], float),
                    noise=noise, hetero=spec, cores=cost_model.get("cores"))


def over_ideal(scheme: str, global_batch: int, epochs: int, steps_per_epoch: int, cost_model: dict, noise,
               steady_from: int, *, seeds: int = 16, rest_s: float = 0.0, **kw) -> np.ndarray:
    """[seeds] simulated steady epoch time over the ideal, the bench's definitions: per seed, the median over
    epochs >= steady_from of sum(slowest compute + A + rest_s), over steps x (T* + A). noise: a float (lognormal
    sigma) or a process with .sample(rng, steps); kw: simulate()'s balancer settings."""
    A = cost_model["allreduce_s"]
    ideal_s = steps_per_epoch * (cost_model["ideal_step_s"] + A)
    sc = scenario(cost_model, noise)
    out = []
    for seed in range(seeds):
        r = simulate(sc, scheme, global_batch, epochs, steps_per_epoch, seed=seed, **kw)
        per_epoch = pd.Series(r.step_s).groupby(r.epoch).sum()
        epoch_s = float(np.median(per_epoch[per_epoch.index >= steady_from])) + steps_per_epoch * (A + rest_s)
        out.append(epoch_s / ideal_s)
    return np.array(out)


def replay(run_dir: Path, cost_model: dict, steady_from: int, *, seeds: int = 64, method: str = "bootstrap",
           block: int = 4, noise: NoiseFit | None = None, scheme: str | None = None) -> dict:
    """Replay the run in `run_dir` in the simulator (its config, its costs and all-reduce A from the bench's
    cost_model, its own jitter or `noise`): measured and simulated steady epoch time over the ideal. scheme: replay
    the run under another scheme instead (a prediction from this run of what that scheme would measure)."""
    run_dir = Path(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())["config"]
    steps, epochs = pd.read_csv(run_dir / "steps.csv"), pd.read_csv(run_dir / "epochs.csv")
    steps = sustained_steps(steps, cost_model.get("quota") or {}, cost_model["allreduce_s"])
    fit = noise or fit_steps(steps, cost_model["fixed_s"], cost_model["per_sample_s"], steady_from,
                             cost_model.get("cores"))
    n_steps = int(epochs.steps.iloc[-1])
    steady = epochs[epochs.epoch >= steady_from]
    # What the step model (slowest compute + A) leaves out of the measured epoch: the step loop's own bookkeeping
    # and the end-of-epoch gather. Measured, not predicted: per step, the median over the steady epochs.
    st = steps[steps.epoch >= steady_from].groupby(["epoch", "step"])
    modelled = (st.compute_s.max() + st.wait_s.min()).groupby("epoch").sum().to_numpy()
    rest = float(np.median(steady.epoch_time_s.to_numpy() - modelled)) / n_steps
    kw = {k: cfg[k] for k in ("rebalance_every", "smoothing", "deadband", "min_batch", "sit_out") if k in cfg}
    bal = {k: cfg[k] for k in ("probe_steps", "windows_kept") if k in cfg}  # balancer knobs, when the config has them
    sims = over_ideal(scheme or cfg["scheme"], int(cfg["global_batch"]), int(cfg["epochs"]), n_steps, cost_model,
                      _Replayed(fit, method, block, n_steps), steady_from, seeds=seeds, rest_s=rest, balancer=bal, **kw)
    ideal_s = n_steps * (cost_model["ideal_step_s"] + cost_model["allreduce_s"])
    return {"scheme": scheme or cfg["scheme"], "run_scheme": cfg["scheme"],
            "measured": float(np.median(steady.epoch_time_s)) / ideal_s, "simulated": float(sims.mean()),
            "simulated_sd": float(sims.std()), "rest_per_step_s": rest, "method": method, "noise": fit.summary()}


def _nearest_corr(c: np.ndarray) -> np.ndarray:
    """A positive definite correlation matrix close to c (eigenvalues floored), for a Cholesky factor."""
    w, v = np.linalg.eigh((c + c.T) / 2)
    m = (v * np.maximum(w, 1e-6)) @ v.T
    d = np.sqrt(np.diag(m))
    return m / np.outer(d, d)

