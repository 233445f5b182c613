"""Ranks that share a CPU core: their step times are coupled, and the optimum that takes that into account.

The bench runs 4 one-thread ranks on 2 cores (pinned 0,0,1,1). Ranks on one core share it fairly (processor
sharing): while both compute, each runs at half speed; when one finishes its compute (or sleeps: an emulated delay or
slowdown), the other has the core alone. With CPU work w_i (core-seconds at a full core) and a simultaneous start,
rank i's compute ends after sum over its core-mates j (itself included) of min(w_i, w_j) seconds. A rank that then
sleeps (factor F_i: the emulated slowdown waits (F_i - 1) x its own measured compute; delay d_i seconds) ends its step
at F_i x that + d_i. A per-rank affine model cannot express this (a rank's time depends on its core-mate's batch),
so the bench's ideal and the simulator's replay use this model when ranks share cores (docs/benchmarks.md).
Pure numpy; a rank with batch 0 sits the step out (no work, no delay).
"""
from __future__ import annotations

import numpy as np

from ..core.partition import _as_bounds, _in_units, check_feasible


def groups(cores) -> list[np.ndarray]:
    """The ranks of each core, in order of first appearance: cores[i] is rank i's core label."""
    cores = np.asarray(cores)
    return [np.flatnonzero(cores == c) for c in dict.fromkeys(cores.tolist())]


def shared_walls(work, cores) -> np.ndarray:
    """[..., n] wall time (s) of each rank's compute, given its CPU work [..., n] (core-seconds) under processor
    sharing with its core-mates: sum over the core of min(w_i, w_j)."""
    w = np.asarray(work, float)
    out = np.empty_like(w)
    for g in groups(cores):
        x = w[..., g]
        out[..., g] = np.minimum(x[..., :, None], x[..., None, :]).sum(-1)
    return out


def unshare(walls, cores) -> np.ndarray:
    """[..., n] CPU work (core-seconds) from the measured compute walls [..., n]: the inverse of shared_walls. On a
    core of k ranks sorted by wall, the m-th (0-based) ran alongside k - m ranks since the previous one finished."""
    t = np.asarray(walls, float)
    out = np.empty_like(t)
    for g in groups(cores):
        x = t[..., g]
        order = np.argsort(x, axis=-1)
        s = np.take_along_axis(x, order, -1)
        w, done = np.empty_like(s), np.zeros(s.shape[:-1])
        for m in range(len(g)):
            w[..., m] = np.maximum(s[..., m] - done, 0.0) / (len(g) - m)
            done = done + w[..., m]
        np.put_along_axis(x, order, w, -1)
        out[..., g] = x
    return out


def fit_scale(walls, unit_work, cores, rounds: int = 200) -> np.ndarray:
    """[n] each rank's speed factor s_i such that its measured compute walls [T, n] sum to those of
    shared_walls(s x unit_work) over the same steps (unit_work [T, n]: each step's work at s = 1, 0 for batch 0).
    A fixed point, reached from the walls unshared step by step (which alone would be biased upwards by noise: a
    noisy pair of equal ranks unshares into one small and one large work)."""
    t, u = np.asarray(walls, float), np.asarray(unit_work, float)
    on = u > 0
    total_t, total_u = (t * on).sum(0), u.sum(0)
    s = np.where(total_u > 0, (unshare(t, cores) * on).sum(0) / np.where(total_u > 0, total_u, 1), 1.0)
    for _ in range(rounds):
        got = (shared_walls(s * u, cores) * on).sum(0)
        s = np.where(got > 0, s * total_t / np.where(got > 0, got, 1), s)
    return s


def finish_s(fixed_s, per_sample_s, sizes, cores, factor=1.0, delay_s=0.0) -> np.ndarray:
    """[..., n] predicted step time of each rank (s): F_i x its shared compute wall + d_i; 0 for batch 0."""
    b = np.asarray(sizes, float)
    work = np.where(b > 0, np.asarray(fixed_s, float) + np.asarray(per_sample_s, float) * b, 0.0)
    return np.where(b > 0, np.asarray(factor, float) * shared_walls(work, cores) + np.asarray(delay_s, float), 0.0)


def coupled_batch_sizes(fixed_s, per_sample_s, global_batch: int, cores, factor=1.0, delay_s=0.0, min_batch=1,
                        max_batch=None, sit_out: bool = False, granularity: int = 1) -> np.ndarray:
    """Integer batch sizes (sum global_batch, multiples of granularity) minimising the slowest finish_s; exact, for
    at most two ranks per core: each core's best split of every total, then the cores' totals (min-max convolution).
    O(cores x (global_batch / granularity)^2) time and memory."""
    a, c = np.asarray(fixed_s, float), np.asarray(per_sample_s, float)
    n, m = len(a), max(int(granularity), 1)
    f, d = np.broadcast_to(np.asarray(factor, float), (n,)), np.broadcast_to(np.asarray(delay_s, float), (n,))
    if m > 1:
        units, lo, hi = _in_units(n, global_batch, min_batch, max_batch, m)
    else:
        check_feasible(n, global_batch, min_batch, max_batch)
        units, lo, hi = global_batch, _as_bounds(n, min_batch, 0), _as_bounds(n, max_batch, np.inf)
    u = np.arange(units + 1)
    allowed = ((u[None, :] >= lo[:, None]) & (u[None, :] <= hi[:, None])) | ((u[None, :] == 0) & sit_out)
    best, splits = None, []  # best[t]: the slowest finish of the cores so far with t units among them
    for g in groups(cores):
        if len(g) > 2:
            raise ValueError(f"the shared-core model takes at most 2 ranks per core, not {len(g)}")
        work = np.where(u > 0, a[g, None] + c[g, None] * m * u, 0.0)  # [k, units+1]
        if len(g) == 1:
            t = np.where(u > 0, f[g[0]] * work[0] + d[g[0]], 0.0)
            core, split = np.where(allowed[g[0]], t, np.inf), u[:, None]
        else:
            p, q = g
            wp, wq = work[0][:, None], work[1][None, :]
            both = np.minimum(wp, wq)
            tp = np.where(u[:, None] > 0, f[p] * (wp + both) + d[p], 0.0)
            tq = np.where(u[None, :] > 0, f[q] * (wq + both) + d[q], 0.0)
            grid = np.where(allowed[p][:, None] & allowed[q][None, :], np.maximum(tp, tq), np.inf)
            core, arg = _antidiagonal_min(grid, units)
            split = np.stack([arg, u - arg], 1)
        if best is None:
            best, arg = core, None
        else:
            best, arg = _antidiagonal_min(np.maximum(best[:, None], core[None, :]), units)
        splits.append((g, split, arg))
    if not np.isfinite(best[units]):
        raise ValueError(f"no split of {global_batch} fits the batch bounds")
    out, left = np.zeros(n, np.int64), units
    for g, split, arg in reversed(splits):
        mine = left - (arg[left] if arg is not None else 0)
        out[g] = split[mine] * m
        left -= mine
    return out


def _antidiagonal_min(grid: np.ndarray, units: int) -> tuple[np.ndarray, np.ndarray]:
    """For a square grid[i, j] (i, j = 0..units): per total t = i + j <= units, the smallest value and its i."""
    i, j = np.indices(grid.shape)
    total = (i + j).ravel()
    keep = total <= units
    val, ii, tt = grid.ravel()[keep], i.ravel()[keep], total[keep]
    order = np.lexsort((ii, val, tt))  # by total, then value, then the smaller i
    tt, first = tt[order], np.r_[True, tt[order][1:] != tt[order][:-1]]
    return val[order][first], ii[order][first]
