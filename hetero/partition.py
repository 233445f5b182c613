"""Pure partition maths: measured step times in, per-rank shares and integer batch sizes out.

No torch.distributed here (no torch at all): every rank runs the same functions on the same gathered numbers,
so every rank reaches the same decision without another collective. Invariants: shares sum to 1; batch sizes
are integers in [min_batch, max_batch] that sum exactly to the global batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Scheme:
    rule: str        # how shares are re-decided: "static", "proportional" or "affine"
    weighted: bool   # gradients weighted by b_i/B (exact global-batch gradient) instead of an equal-weight mean


SCHEMES: dict[str, Scheme] = {
    "sync": Scheme("static", weighted=False),        # paper's Sync-SGD
    "dp": Scheme("proportional", weighted=False),    # paper's DP-SGD
    "edp": Scheme("proportional", weighted=True),    # paper's EDP-SGD
    "affine": Scheme("affine", weighted=True),       # model-based: step time = fixed + per-sample cost
}


def _as_bounds(n: int, bound: int | np.ndarray | None, default: float) -> np.ndarray:
    if bound is None:
        return np.full(n, default, dtype=float)
    return np.broadcast_to(np.asarray(bound, dtype=float), (n,)).copy()


def check_feasible(n: int, global_batch: int, min_batch, max_batch=None) -> None:
    """Raise ValueError unless n ranks can split global_batch within the bounds."""
    lo, hi = _as_bounds(n, min_batch, 0), _as_bounds(n, max_batch, np.inf)
    if np.any(lo < 0) or np.any(hi < lo):
        raise ValueError(f"batch bounds must satisfy 0 <= min_batch <= max_batch (got {min_batch}, {max_batch})")
    if lo.sum() > global_batch:
        raise ValueError(f"global batch {global_batch} is smaller than {n} ranks x min batch ({int(lo.sum())})")
    if hi.sum() < global_batch:
        raise ValueError(f"global batch {global_batch} exceeds the sum of the ranks' max batch ({hi.sum():g})")


def batch_sizes(shares, global_batch: int, min_batch=1, max_batch=None) -> np.ndarray:
    """Integer batch sizes as close to shares*global_batch as the bounds allow; they sum to global_batch."""
    s = np.asarray(shares, dtype=float)
    n = len(s)
    check_feasible(n, global_batch, min_batch, max_batch)
    if np.any(~np.isfinite(s)) or np.any(s < 0) or s.sum() <= 0:
        raise ValueError(f"shares must be finite, non-negative and not all zero (got {s.tolist()})")
    lo, hi = _as_bounds(n, min_batch, 0), _as_bounds(n, max_batch, np.inf)
    # Bounded proportional allocation: ranks pinned at a bound leave the rest to be split by share.
    x = np.clip(s / s.sum() * global_batch, lo, hi)
    free = np.ones(n, dtype=bool)
    for _ in range(n + 1):
        pinned = ~free
        rest = global_batch - x[pinned].sum()
        w = s * free
        x = np.where(free, rest * w / w.sum() if w.sum() > 0 else rest / free.sum(), x)
        low, high = free & (x < lo), free & (x > hi)
        if not (low.any() or high.any()):
            break
        x = np.clip(x, lo, hi)
        free &= ~(low | high)
        if not free.any():
            break
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


def proportional_shares(samples, compute_s) -> np.ndarray:
    """The paper's rule: new shares proportional to measured throughput samples_i / compute_s_i (sum to 1)."""
    samples, compute_s = np.asarray(samples, float), np.asarray(compute_s, float)
    rate = samples / np.maximum(compute_s, 1e-12)
    return rate / rate.sum()


def fit_affine(batch, step_s) -> tuple[float, float]:
    """Fit step_s = fixed_s + per_sample_s * batch for one rank, robust to outliers (medians per batch size).

    With a single distinct batch size the fixed part cannot be told apart: fall back to fixed_s = 0.
    """
    batch, step_s = np.asarray(batch, float), np.asarray(step_s, float)
    sizes = np.unique(batch[batch > 0])
    if len(sizes) == 0:
        return 0.0, float("nan")
    med = np.array([np.median(step_s[batch == b]) for b in sizes])
    if len(sizes) == 1:
        return 0.0, float(med[0] / sizes[0])
    counts = np.array([np.sum(batch == b) for b in sizes], float)
    w = np.sqrt(counts)
    A = np.stack([np.ones_like(sizes), sizes], 1) * w[:, None]
    (fixed, per_sample), *_ = np.linalg.lstsq(A, med * w, rcond=None)
    if per_sample <= 0:  # noise swamped the slope: treat the time as all per-sample
        return 0.0, float(np.median(med / sizes))
    return float(max(fixed, 0.0)), float(per_sample)


def affine_batch_sizes(fixed_s, per_sample_s, global_batch: int, min_batch=1, max_batch=None) -> np.ndarray:
    """Integer batch sizes minimising the slowest predicted step time max_i(fixed_i + per_sample_i * b_i).

    A rank whose fixed cost alone exceeds the balanced step time gets min_batch.
    """
    a, c = np.asarray(fixed_s, float), np.asarray(per_sample_s, float)
    n = len(a)
    check_feasible(n, global_batch, min_batch, max_batch)
    c = np.maximum(c, 1e-12)
    lo, hi = _as_bounds(n, min_batch, 0), _as_bounds(n, max_batch, np.inf)
    hi_f = np.minimum(hi, global_batch)

    def fill(T: float) -> np.ndarray:
        return np.clip((T - a) / c, lo, hi_f)

    t_lo, t_hi = float(np.min(a + c * lo)), float(np.max(a + c * hi_f))
    for _ in range(100):  # bisection on the common step time T: sum(fill(T)) is monotone in T
        mid = 0.5 * (t_lo + t_hi)
        if fill(mid).sum() < global_batch:
            t_lo = mid
        else:
            t_hi = mid
    x = fill(t_hi)
    b = np.clip(np.floor(x), lo, hi).astype(np.int64)
    short = global_batch - int(b.sum())
    while short > 0:  # hand out the remainder where it lengthens the slowest step least
        nxt = a + c * (b + 1) + np.where(b < hi, 0, np.inf)
        k = min(short, n)
        take = np.argpartition(nxt, k - 1)[:k]
        b[take] += 1
        short -= k
    while short < 0:
        cur = a + c * b + np.where(b > lo, 0, -np.inf)
        k = min(-short, n)
        take = np.argpartition(-cur, k - 1)[:k]
        b[take] -= 1
        short += k
    return b


def predicted_step_s(fixed_s, per_sample_s, batch) -> float:
    """The slowest rank's predicted step time (s) for these batch sizes."""
    return float(np.max(np.asarray(fixed_s) + np.asarray(per_sample_s) * np.asarray(batch)))


@dataclass
class Balancer:
    """Per-rank shares and batch sizes, re-decided from measured compute times by the scheme's rule.

    smoothing: weight of the previous estimate in an exponential moving average (0 = use the latest only).
    deadband: keep the current batch sizes unless the predicted slowest step shrinks by more than this fraction.
    """
    rule: str
    world: int
    global_batch: int
    min_batch: int | list[int] = 1
    max_batch: int | list[int] | None = None
    smoothing: float = 0.0
    deadband: float = 0.0
    probe: bool = True
    shares: np.ndarray = field(default=None)
    sizes: np.ndarray = field(default=None)
    fixed_s: np.ndarray = field(default=None)
    per_sample_s: np.ndarray = field(default=None)
    history: list = field(default_factory=list)
    decisions: int = 0

    def __post_init__(self):
        if self.rule not in ("static", "proportional", "affine"):
            raise ValueError(f"unknown rule {self.rule!r}")
        if self.shares is None:
            self.shares = np.full(self.world, 1.0 / self.world)
        self.shares = np.asarray(self.shares, float)
        if self.sizes is None:
            self.sizes = batch_sizes(self.shares, self.global_batch, self.min_batch, self.max_batch)

    @property
    def probing(self) -> bool:
        """Affine needs two distinct batch sizes per rank: it alternates sizes until its first decision."""
        return self.rule == "affine" and self.probe and self.decisions == 0 and self.world > 1

    def sizes_for_step(self, step: int) -> np.ndarray:
        """Batch sizes for one step (they sum to global_batch)."""
        if not self.probing:
            return self.sizes
        sign = np.where(np.arange(self.world) % 2 == step % 2, 1.0, -1.0)
        if self.world % 2:  # odd world: the last rank keeps its size so the perturbation stays balanced
            sign[-1] = 0.0
        return batch_sizes(self.shares * (1 + 0.3 * sign), self.global_batch, self.min_batch, self.max_batch)

    def observe(self, batch, compute_s) -> None:
        """Record steps: batch and compute_s are [steps, world] arrays of sizes and local compute times (s)."""
        batch, compute_s = np.atleast_2d(batch).astype(float), np.atleast_2d(compute_s).astype(float)
        self.history.append((batch, compute_s))
        self.history = self.history[-8:]  # recent windows only: speeds change

    def decide(self) -> bool:
        """Re-decide shares and batch sizes from the observations since the last decision; True if they changed."""
        if self.rule == "static" or not self.history:
            self.history.clear()
            return False
        batch, compute_s = self.history[-1]
        if self.rule == "proportional":
            new_shares = proportional_shares(batch.sum(0), compute_s.sum(0))
            if self.shares is not None and self.smoothing > 0 and self.decisions > 0:
                new_shares = self.smoothing * self.shares + (1 - self.smoothing) * new_shares
            fixed = np.zeros(self.world)
            per = compute_s.sum(0) / np.maximum(batch.sum(0), 1)
            new_sizes = batch_sizes(new_shares, self.global_batch, self.min_batch, self.max_batch)
        else:
            all_b = np.concatenate([h[0] for h in self.history])
            all_t = np.concatenate([h[1] for h in self.history])
            fits = np.array([fit_affine(all_b[:, i], all_t[:, i]) for i in range(self.world)])
            fixed, per = fits[:, 0], fits[:, 1]
            if self.fixed_s is not None and self.smoothing > 0:
                fixed = self.smoothing * self.fixed_s + (1 - self.smoothing) * fixed
                per = self.smoothing * self.per_sample_s + (1 - self.smoothing) * per
            new_sizes = affine_batch_sizes(fixed, per, self.global_batch, self.min_batch, self.max_batch)
            new_shares = new_sizes / self.global_batch
        self.fixed_s, self.per_sample_s = fixed, per
        self.decisions += 1
        if self.rule == "affine":
            self.history = self.history[-2:]  # keep some older sizes: the fit needs two distinct batch sizes
        else:
            self.history.clear()
        now, new = predicted_step_s(fixed, per, self.sizes), predicted_step_s(fixed, per, new_sizes)
        if self.deadband > 0 and now - new <= self.deadband * now:
            return False
        changed = not np.array_equal(new_sizes, self.sizes)
        self.shares, self.sizes = np.asarray(new_shares, float), new_sizes
        return changed

    def state_dict(self) -> dict:
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in
                dict(shares=self.shares, sizes=self.sizes, fixed_s=self.fixed_s, per_sample_s=self.per_sample_s,
                     decisions=self.decisions,
                     history=[(b.tolist(), t.tolist()) for b, t in self.history]).items()}

    def load_state_dict(self, d: dict) -> None:
        self.shares, self.sizes = np.asarray(d["shares"], float), np.asarray(d["sizes"], np.int64)
        self.fixed_s = None if d["fixed_s"] is None else np.asarray(d["fixed_s"], float)
        self.per_sample_s = None if d["per_sample_s"] is None else np.asarray(d["per_sample_s"], float)
        self.decisions = int(d["decisions"])
        self.history = [(np.asarray(b, float), np.asarray(t, float)) for b, t in d["history"]]
