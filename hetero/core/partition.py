"""Pure partition maths: measured step times in, per-rank shares and integer batch sizes out.

No torch.distributed here (no torch at all): every rank runs the same functions on the same gathered numbers,
so every rank reaches the same decision without another collective. Invariants: shares sum to 1; batch sizes
are integers in [min_batch, max_batch] (or 0 for a rank allowed to sit out) that sum exactly to the global batch.
Everything is vectorised over ranks: one decision for 4096 ranks takes a few milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Scheme:
    rule: str        # how shares are re-decided: "static", "proportional" or "affine"
    weighted: bool   # gradients weighted by b_i/B (exact global-batch gradient) instead of an equal-weight mean
    label: str       # the name in tables and figures


# The schemes in the order of tables and figures (the paper's three, then the model-based one).
SCHEMES: dict[str, Scheme] = {
    "sync": Scheme("static", weighted=False, label="Sync-SGD"),
    "dp": Scheme("proportional", weighted=False, label="DP-SGD"),
    "edp": Scheme("proportional", weighted=True, label="EDP-SGD"),
    "affine": Scheme("affine", weighted=True, label="Affine"),  # step time = fixed + per-sample cost
}


def _as_bounds(n: int, bound: int | np.ndarray | None, default: float) -> np.ndarray:
    if bound is None:
        return np.full(n, default, dtype=float)
    return np.broadcast_to(np.asarray(bound, dtype=float), (n,)).copy()


def check_feasible(n: int, global_batch: int, min_batch, max_batch=None, granularity: int = 1) -> None:
    """Raise ValueError unless n ranks can split global_batch within the bounds, in multiples of granularity."""
    lo, hi = _as_bounds(n, min_batch, 0), _as_bounds(n, max_batch, np.inf)
    if granularity > 1:
        _check_bounds(lo, hi, None, min_batch, max_batch)
        _in_units(n, global_batch, min_batch, max_batch, granularity)
        return
    _check_bounds(lo, hi, global_batch, min_batch, max_batch)


def _check_bounds(lo: np.ndarray, hi: np.ndarray, global_batch: int | None, min_batch, max_batch) -> None:
    """check_feasible on bounds already made (batch_sizes makes them once per call; issue 51); global_batch None:
    the bounds alone."""
    n = len(lo)
    if np.any(lo < 0) or np.any(hi < lo):
        raise ValueError(f"batch bounds must satisfy 0 <= min_batch <= max_batch (got {min_batch}, {max_batch})")
    if global_batch is None:
        return
    if lo.sum() > global_batch:
        raise ValueError(f"global batch {global_batch} is smaller than {n} ranks x min batch ({int(lo.sum())})")
    if hi.sum() < global_batch:
        raise ValueError(f"global batch {global_batch} exceeds the sum of the ranks' max batch ({hi.sum():g})")


def _in_units(n: int, global_batch: int, min_batch, max_batch, m: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The problem in units of m samples (micro-batches): (total, lo, hi), bounds rounded inwards; checked."""
    if global_batch % m:
        down, up = global_batch - global_batch % m, global_batch - global_batch % m + m
        near = f"{down} or {up}" if down else f"{up}"
        raise ValueError(f"global batch {global_batch} is not a multiple of the micro-batch {m}: use {near}")
    lo = np.ceil(_as_bounds(n, min_batch, 0) / m)
    hi = np.floor(_as_bounds(n, max_batch, np.inf) / m)
    if np.any(bad := hi < np.maximum(lo, 1)):
        r = int(np.argmax(bad))
        raise ValueError(f"rank {r}'s batch bounds [{_as_bounds(n, min_batch, 0)[r]:g}, "
                         f"{_as_bounds(n, max_batch, np.inf)[r]:g}] hold no whole micro-batch of {m}")
    if lo.sum() * m > global_batch:
        raise ValueError(f"global batch {global_batch} is smaller than the ranks' min batch in whole micro-batches "
                         f"of {m} ({int(lo.sum() * m)})")
    if hi.sum() * m < global_batch:
        raise ValueError(f"global batch {global_batch} exceeds the ranks' max batch in whole micro-batches of {m} "
                         f"({hi.sum() * m:g})")
    return global_batch // m, lo, hi


def batch_sizes(shares, global_batch: int, min_batch=1, max_batch=None, granularity: int = 1) -> np.ndarray:
    """Integer batch sizes as close to shares*global_batch as the bounds allow; they sum to global_batch and are
    multiples of granularity (the micro-batch: the split is solved in its units, bounds rounded inwards)."""
    s = np.asarray(shares, dtype=float)
    n = len(s)
    if granularity > 1:
        units, lo, hi = _in_units(n, global_batch, min_batch, max_batch, granularity)
        return granularity * batch_sizes(s, units, lo, hi)
    lo, hi = _as_bounds(n, min_batch, 0), _as_bounds(n, max_batch, np.inf)
    _check_bounds(lo, hi, global_batch, min_batch, max_batch)
    if not (np.isfinite(s).all() and (s >= 0).all() and s.sum() > 0):
        raise ValueError(f"shares must be finite, non-negative and not all zero (got {s.tolist()})")
    x = _water_fill(s, global_batch, lo, np.minimum(hi, global_batch))
    # Largest-remainder rounding keeps the sum exact and every size within its bounds.
    b = np.clip(np.floor(x + 1e-9), lo, hi).astype(np.int64)
    short = global_batch - int(b.sum())
    if short > 0:
        room = b < hi
        order = np.argsort(-(x - b) + np.where(room, 0, np.inf), kind="stable")
        b[order[:short]] += 1
    elif short < 0:
        room = b > lo
        order = np.argsort((x - b) + np.where(room, 0, np.inf), kind="stable")
        b[order[:-short]] -= 1
    assert b.sum() == global_batch and np.all(b >= lo) and np.all(b <= hi)
    return b


SMALL_FILL = 4096  # _water_fill sums every kink at once while kinks x ranks is at most this (else it bisects)


def _water_fill(w: np.ndarray, total: float, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Real sizes clip(lam*w, lo, hi) summing to total; zero-weight ranks take lo, or what the others cannot."""
    pos = w > 0
    if hi[pos].sum() + lo[~pos].sum() < total:  # the weighted ranks are all full: the others share the rest
        x = np.where(pos, hi, 0.0)
        x[~pos] = _water_fill(np.ones(int((~pos).sum())), total - hi[pos].sum(), lo[~pos], hi[~pos])
        return x
    # sum(clip(lam*w, lo, hi)) is continuous, monotone and piecewise linear in lam, with its kinks where a rank
    # meets a bound (lo/w, hi/w): find the kinks' segment holding `total` by bisection over them (log2 of 2n
    # sums, not a bisection on lam to rounding error: a decision's cost, issue 51), then solve it on that line
    fill = lambda lam: float(np.clip(lam * w, lo, hi).sum())  # noqa: E731
    kinks = np.unique(np.concatenate([[0.0], lo[pos] / w[pos], hi[pos] / w[pos]]))
    if len(kinks) * len(w) <= SMALL_FILL:  # every kink's sum at once (a few ranks): the same sums, one numpy call
        fills = np.clip(kinks[:, None] * w, lo, hi).sum(1)
        b = int(np.argmax(fills >= total)) if fills[-1] >= total else len(kinks) - 1
        a = max(b - 1, 0)
        fa, fb = float(fills[a]), float(fills[b])
    else:
        a, b = 0, len(kinks) - 1
        if fill(kinks[0]) >= total:
            b = 0
        while b - a > 1:
            mid = (a + b) // 2
            if fill(kinks[mid]) < total:
                a = mid
            else:
                b = mid
        fa, fb = fill(kinks[a]), fill(kinks[b])
    lam_hi = kinks[b] if not fb > fa else kinks[a] + (total - fa) * (kinks[b] - kinks[a]) / (fb - fa)
    x = np.clip(lam_hi * w, lo, hi)
    free = pos & (x > lo) & (x < hi)
    if free.any():  # solve the free ranks' multiplier exactly, so the sum is total to rounding error
        x[free] = w[free] * (total - x[~free].sum()) / w[free].sum()
    return x


def proportional_shares(samples, compute_s) -> np.ndarray:
    """The paper's rule: new shares proportional to measured throughput samples_i / compute_s_i (sum to 1)."""
    samples, compute_s = np.asarray(samples, float), np.asarray(compute_s, float)
    rate = samples / np.maximum(compute_s, 1e-12)
    return rate / rate.sum()


# -- the affine model: step_s = fixed_s + per_sample_s * batch, per rank ---------------------------------------

STALL = 10.0  # a step beyond its rank's median + max(median, STALL x MAD) is a stall: clipped for the slope
N_STATS = 7    # per rank and window: count, sum b, sum t, sum b², and with stalls clipped: sum b·t, sum t², sum t


def window_stats(batch, step_s) -> np.ndarray:
    """Sufficient statistics [N_STATS, world] of one window of steps; batch and step_s are [steps, world].

    Steps a rank sat out (batch 0) or did not time are left out. The mean time keeps every step: random delays
    are part of a rank's cost, at their mean. The slope sees stalls (beyond median + max(median, STALL x MAD))
    clipped, so a rare hiccup or a heavy-tailed delay that falls on one batch size cannot tilt it; the probe's
    two sizes (at most 1.86x apart in time) pass untouched.
    """
    b, t = np.atleast_2d(np.asarray(batch, float)), np.atleast_2d(np.asarray(step_s, float))
    ok = (b > 0) & np.isfinite(t)
    every = ok.all()
    if not every:
        b, t = np.where(ok, b, 0.0), np.where(ok, t, np.inf)
    # Median and MAD of at most 17 spread-out steps: plenty for a threshold, and cheap for 4096 ranks (a window of
    # at most 17 steps is all of them: no index arithmetic, on a decision's path; issue 51)
    rows = t if len(t) <= 17 else t[np.unique(np.linspace(0, len(t) - 1, 17).astype(int))]
    k = (len(rows) - 1) // 2
    tc = t
    if len(rows):
        with np.errstate(invalid="ignore"):  # inf - inf where a rank sat out: NaN, sorted last
            med = np.partition(rows, k, axis=0)[k]
            mad = np.partition(np.abs(rows - med), k, axis=0)[k]
            tc = np.minimum(t, med + np.maximum(med, STALL * mad))
    if not every:
        t, tc = np.where(ok, t, 0.0), np.where(ok, tc, 0.0)
    dot = lambda x, y: np.einsum("ij,ij->j", x, y)  # noqa: E731 - column sums of products, no temporaries
    return np.stack([ok.sum(0), b.sum(0), t.sum(0), dot(b, b), dot(b, tc), dot(tc, tc), tc.sum(0)]).astype(float)


def _moments(stats: np.ndarray):
    """Mean size, mean time (all steps), and centred sums: b·b, b·t and t·t (stalls clipped), per rank."""
    n, sb, st, sbb, sbt, stt, stc = stats
    with np.errstate(invalid="ignore", divide="ignore"):
        mb, mt, mtc = sb / n, st / n, stc / n
        vbb = np.maximum(sbb - n * mb * mb, 0.0)
        spread = vbb > 1e-9 * n * mb * mb  # below this the sizes differ only by float rounding: no slope at all
        vbb, vbt = np.where(spread, vbb, 0.0), np.where(spread, sbt - n * mb * mtc, 0.0)
        vtt = np.maximum(stt - n * mtc * mtc, 0.0)
    return n, mb, mt, vbb, vbt, vtt


def fit_stats(stats: np.ndarray, prior_per_sample_s=None, prior_rel: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares fixed_s, per_sample_s [world] from pooled window statistics [N_STATS, world].

    With a prior slope the fit is its Bayesian update (prior std prior_rel x prior): precise data overrule it,
    a window with one batch size (no slope information) keeps it. Without a prior and without two distinct
    batch sizes, the time is taken as all per-sample (the proportional model). Fixed parts are >= 0 and
    per-sample costs > 0; ranks without observations come back as NaN.
    """
    n, mb, mt, vbb, vbt, vtt = _moments(stats)
    with np.errstate(invalid="ignore", divide="ignore"):
        resid = np.maximum(vtt - np.where(vbb > 0, vbt * vbt / vbb, 0.0), 0.0) / np.maximum(n - 2, 1)
        origin = mt / mb
        if prior_per_sample_s is None:
            c = np.where(vbb > 0, vbt / vbb, origin)
            c = np.where(c > 0, c, origin)  # noise swamped the slope: fall back to the proportional model
        else:
            c0 = np.where(np.isfinite(prior_per_sample_s) & (prior_per_sample_s > 0), prior_per_sample_s, origin)
            kappa = resid / (prior_rel * c0) ** 2
            c = np.where(vbb + kappa > 0, (vbt + kappa * c0) / (vbb + kappa), c0)
            c = np.where(c > 0, c, c0)
        c = np.minimum(c, origin)  # keeps the fixed part non-negative at the observed mean
        a = mt - c * mb
    return a, c


def fit_affine(batch, step_s) -> tuple:
    """Fit step_s = fixed_s + per_sample_s * batch: floats for one rank's [steps], arrays for [steps, world]."""
    b, t = np.asarray(batch, float), np.asarray(step_s, float)
    a, c = fit_stats(window_stats(b.reshape(len(b), -1), t.reshape(len(t), -1)))
    return (float(a[0]), float(c[0])) if b.ndim == 1 else (a, c)


def step_times(fixed_s, per_sample_s, batch) -> np.ndarray:
    """Predicted step time of each rank (s); a rank with batch 0 sits the step out and takes no time."""
    b = np.asarray(batch, float)
    return np.where(b > 0, np.asarray(fixed_s) + np.asarray(per_sample_s) * b, 0.0)


def predicted_step_s(fixed_s, per_sample_s, batch) -> float:
    """The slowest rank's predicted step time (s) for these batch sizes."""
    return float(np.max(step_times(fixed_s, per_sample_s, batch)))


def affine_batch_sizes(fixed_s, per_sample_s, global_batch: int, min_batch=1, max_batch=None,
                       sit_out: bool = False, granularity: int = 1) -> np.ndarray:
    """Integer batch sizes minimising the slowest predicted step max_i(fixed_i + per_sample_i * b_i); exact.

    A rank whose fixed part alone exceeds the balanced step time gets min_batch, or 0 (it sits the step out,
    its gradient weight is zero) when sit_out is allowed. Sizes sum to global_batch. With granularity m > 1 the
    sizes are multiples of m: a step is a fixed cost plus a cost per micro-batch (per_sample_s x m).
    """
    a, c = np.asarray(fixed_s, float), np.asarray(per_sample_s, float)
    n = len(a)
    if granularity > 1:
        units, lo, hi = _in_units(n, global_batch, min_batch, max_batch, granularity)
        return granularity * affine_batch_sizes(a, c * granularity, units, lo, hi, sit_out)
    check_feasible(n, global_batch, min_batch, max_batch)
    if np.any(~np.isfinite(a)) or np.any(~np.isfinite(c)):
        raise ValueError("fixed_s and per_sample_s must be finite")
    c = np.maximum(c, 1e-15)
    lo, hi = _as_bounds(n, min_batch, 0), np.minimum(_as_bounds(n, max_batch, np.inf), global_batch)
    entry = np.maximum(lo, 1)  # the smallest batch of a rank that takes part
    can = hi >= entry          # a rank whose max_batch is 0 never takes part, whatever its speed

    def caps(T: float) -> np.ndarray:
        """Largest sizes whose predicted time is <= T: monotone in T, so bisection finds the minimax T."""
        k = np.clip(np.floor((T - a) / c), lo, hi)
        return np.where(can & (a + c * entry <= T), np.maximum(k, entry), 0.0) if sit_out else k

    t_lo = float(np.min(np.where(can, a + c * entry, np.inf))) * (1 - 1e-12) - 1e-300
    t_hi = float(np.max(a + c * hi)) * (1 + 1e-9) + 1e-300  # a margin: (t - a) / c must not round below hi
    if caps(t_lo).sum() >= global_batch:  # everyone at the minimum already fills the global batch
        return lo.astype(np.int64)
    for _ in range(200):  # the jump of sum(caps) sits at one of the values a_i + c_i*k: find it to the last bit
        mid = 0.5 * (t_lo + t_hi)
        if not t_lo < mid < t_hi:
            break
        if caps(mid).sum() < global_batch:
            t_lo = mid
        else:
            t_hi = mid
    b, top = caps(t_lo), caps(t_hi)
    short = global_batch - int(b.sum())
    # Ranks that jump between t_lo and t_hi are tied at the optimum: any of them may take the remainder.
    jump = np.flatnonzero(top > b)
    gain = np.cumsum((top - b)[jump])
    take = jump[:int(np.searchsorted(gain, short)) + 1]
    short -= int((top - b)[take].sum())
    b[take] = top[take]
    # A rank joining from a sit-out may overshoot: take the surplus back from the slowest ranks above their floor.
    floor = np.where(b > 0, lo if not sit_out else entry, 0)
    while short < 0:
        t = np.where(b > floor, a + c * b, -np.inf)
        i = int(np.argmax(t))
        if not np.isfinite(t[i]):
            break
        b[i] -= 1
        short += 1
    if short != 0:  # no sit-out plan fits the bounds exactly: everyone takes part
        if sit_out:
            return affine_batch_sizes(a, c, global_batch, min_batch, max_batch, sit_out=False)
        raise RuntimeError(f"no exact split of {global_batch} found (a bug): {b.tolist()}")
    return b.astype(np.int64)


# -- a CFS quota: its bursts, and the rate it sustains ---------------------------------------------------------

def sustained_s(compute_s, cpu_s, quota_s, period_s, overhead_s: float = 0.0) -> np.ndarray:
    """[steps, world] step times as a CFS quota sustains them: a rank under a quota (quota_s of CPU per period_s;
    inf or None: none) takes at least cpu_s x period_s / quota_s per step, less overhead_s (the step's time beyond
    its slowest compute, which the quota'd rank spends on the same clock), whatever its compute took.

    Under a quota a rank runs at full speed until the period's quota is spent, then waits for the next period: a
    step that starts with quota banked (the rank waited at the last all-reduce) looks fast, at a size the quota
    cannot sustain step after step. The CPU the step was charged is what the quota bounds: over many steps the rank
    gets quota_s / period_s of a core, so its steps cost their CPU at that rate. Ranks without a quota, and steps
    whose CPU was not measured (NaN), keep their measured times.
    """
    compute_s = np.atleast_2d(np.asarray(compute_s, float))
    if cpu_s is None or quota_s is None or period_s is None:
        return compute_s
    q, p = np.asarray(quota_s, float), np.asarray(period_s, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        fluid = np.atleast_2d(np.asarray(cpu_s, float)) * (p / q) - overhead_s
        on = np.isfinite(q) & np.isfinite(p) & (q > 0) & np.isfinite(fluid)
        return np.where(on, np.fmax(compute_s, fluid), compute_s)
