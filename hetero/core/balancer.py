"""The balancer: per-rank shares and batch sizes, re-decided from measured step times by a scheme's rule.

Stateful but pure (numpy only): the trainer and the simulator drive the same class; every rank feeds it the same
gathered numbers, so every rank reaches the same decision. The maths it calls lives in partition.py.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from .partition import (
    N_STATS,
    _as_bounds,
    _moments,
    affine_batch_sizes,
    batch_sizes,
    fit_stats,
    predicted_step_s,
    proportional_shares,
    sustained_s,
    window_stats,
)

MIN_GAIN = 0.125  # the smallest fraction of a decided change made after reversals


@dataclass
class Balancer:
    """Per-rank shares and batch sizes, re-decided from measured compute times by the scheme's rule.

    smoothing: weight of the previous estimate in an exponential moving average (0 = use the latest only); the
      shares for the proportional rule, the fitted fixed and per-sample costs for the affine rule.
    deadband: keep the current batch sizes unless the predicted slowest step shrinks by more than this fraction.
    significance: ... nor by less than this many standard errors of a difference of two ranks' mean step times in
      the window (their scatter about the fitted line): a gain the measurement noise could produce is not made.
    sit_out: the affine rule may give a rank whose fixed cost alone exceeds the balanced step time batch 0.
    probe_steps: before its first decision the affine rule alternates batch sizes by +-30% on this many first
      steps, so every rank is timed at two sizes (later decisions also learn from the sizes changing).
    granularity: the micro-batch mode's m: the maths decides whole micro-batches per rank (sizes are multiples
      of m); times are still fitted per sample, so a step is a fixed cost plus a cost per micro-batch.
    windows_kept: windows kept for the affine fit; a rank's older windows are dropped when its time jumps at an
      unchanged batch size (its speed changed), so a change is followed at the next decision. The proportional
      rule's held windows (those since the sizes last changed) are dropped the same way.
    quota_s, period_s: [world] each rank's CFS quota (CPU seconds per period; inf: none), set by the plan from every
      rank's cgroups (set_quota). A rank under one is timed by the CPU its steps cost (observe's cpu_s), at the rate
      its quota supplies it: cpu_s x period_s / quota_s, less the step's time beyond its slowest compute
      (overhead_s), whenever that is longer than its measured compute. The quota's bursts make its measured time a
      staircase: a step that starts with quota banked runs at full speed and looks fast, at a size the quota
      cannot sustain. The CPU it was charged can be sustained only at the quota's rate (docs/balancers.md).
    A change that undoes more than half of the one made at the decision before (the sizes swing back) is damped: it
    goes half as far, a quarter on a further reversal, down to MIN_GAIN; one in the same direction doubles the step
    again, up to the full one. A rank whose speed depends on its own batch (a CFS quota: a short step fits in the
    period's quota and looks fast, a long one is throttled and looks slow) would otherwise swing between two sizes
    at every decision; a real change of speed, or its end some decisions later, is followed at the full step.
    """
    rule: str
    world: int
    global_batch: int
    min_batch: int | list[int] = 1
    max_batch: int | list[int] | None = None
    smoothing: float = 0.0
    deadband: float = 0.0
    significance: float = 1.0
    sit_out: bool = False
    granularity: int = 1  # sizes are multiples of this (the micro-batch m; 1: any size)
    probe_steps: int = 16
    windows_kept: int = 4
    shares: np.ndarray = field(default=None)
    sizes: np.ndarray = field(default=None)
    fixed_s: np.ndarray = field(default=None)
    per_sample_s: np.ndarray = field(default=None)
    quota_s: np.ndarray = field(default=None)
    period_s: np.ndarray = field(default=None)
    overhead_s: float = 0.0  # the step's time beyond its slowest compute (the all-reduce, the loop), measured
    decisions: int = 0
    _pending: list = field(default_factory=list, repr=False)   # [N_STATS, world] per window since the decision
    _windows: np.ndarray = field(default=None, repr=False)     # [k, N_STATS, world] the kept windows
    _probe_sizes: tuple = field(default=None, repr=False)
    _held: list = field(default_factory=list, repr=False)    # proportional: windows since the sizes last changed
    _gain: float = field(default=1.0, repr=False)            # the fraction of a decided change that is made
    _last_move: np.ndarray = field(default=None, repr=False)  # the sizes' last change (new - old), for reversals
    _changed_at: int = field(default=-1, repr=False)         # the decision (its count) that made it
    # the latest decide()'s window, measured for its Decision (window_noise_s); not saved: the Decision keeps it
    window_noise_s: float | None = field(default=None, repr=False)
    _even_split: tuple = field(default=None, repr=False)  # (bounds, an even split within them): predicted()'s

    def __post_init__(self):
        if self.rule not in ("static", "proportional", "affine"):
            raise ValueError(f"unknown rule {self.rule!r}")
        if not (0 <= self.smoothing < 1 and 0 <= self.deadband < 1):
            raise ValueError("smoothing and deadband must lie in [0, 1)")
        if not 0 <= self.significance < np.inf:
            raise ValueError("significance must be >= 0 (standard errors; 0: off)")
        if self.shares is None:
            self.shares = np.full(self.world, 1.0 / self.world)
        self.shares = np.asarray(self.shares, float)
        if self.sizes is None:
            self.sizes = batch_sizes(self.shares, self.global_batch, self.min_batch, self.max_batch, self.granularity)
        if self._windows is None:
            self._windows = np.zeros((0, N_STATS, self.world))

    @property
    def probing(self) -> bool:
        """Affine needs two distinct batch sizes per rank: it probes until its first decision."""
        return self.rule == "affine" and self.probe_steps > 0 and self.decisions == 0 and self.world > 1

    def bound(self, max_batch: list[float] | None) -> None:
        """New per-rank largest batches (after a probe): the sizes recut within them, affine's probe sizes anew."""
        self.max_batch, self._probe_sizes = max_batch, None
        self.sizes = batch_sizes(self.shares, self.global_batch, self.min_batch, max_batch, self.granularity)

    def sizes_for_step(self, step: int) -> np.ndarray:
        """Batch sizes for one step (they sum to global_batch); step counts from the start of the epoch."""
        if not self.probing or step >= self.probe_steps:
            return self.sizes
        if self._probe_sizes is None:
            # Neighbouring ranks swap +-30% every step; with an odd world the shares are renormalised, so every
            # rank still sees two sizes. Rounding keeps the sizes within bounds and the sum exact.
            sign = np.where(np.arange(self.world) % 2 == 0, 1.0, -1.0)
            self._probe_sizes = tuple(batch_sizes(self.shares * (1 + 0.3 * s), self.global_batch, self.min_batch,
                                                  self.max_batch, self.granularity) for s in (sign, -sign))
        return self._probe_sizes[step % 2]

    def set_quota(self, quota_s, period_s) -> None:
        """Every rank's CFS quota and its period (s; inf or NaN: none), as the plan gathered them."""
        q, p = np.asarray(quota_s, float), np.asarray(period_s, float)
        if self.quota_s is None and not np.isfinite(q).any():  # none, as before (every decision asks; issue 51)
            return
        on = np.isfinite(q) & np.isfinite(p) & (q > 0) & (p > 0)
        self.quota_s, self.period_s = (np.where(on, q, np.inf), np.where(on, p, np.inf)) if on.any() else (None, None)

    def observe(self, batch, compute_s, cpu_s=None) -> None:
        """Record steps: batch and compute_s are [steps, world] arrays of sizes and local compute times (s); cpu_s,
        where measured, the CPU seconds each rank's process spent in each step (what a CFS quota charges)."""
        batch, compute_s = np.atleast_2d(batch), np.atleast_2d(compute_s)
        if len(batch):
            self._pending.append(window_stats(batch, self.sustained_s(compute_s, cpu_s)))

    def sustained_s(self, compute_s, cpu_s=None) -> np.ndarray:
        """[steps, world] the times the rules decide from (partition.sustained_s with this balancer's quotas)."""
        return sustained_s(compute_s, cpu_s, self.quota_s, self.period_s, self.overhead_s)

    def decide(self) -> bool:
        """Re-decide shares and batch sizes from the observations since the last decision; True if they changed."""
        self.window_noise_s = None
        if self.rule == "static" or not self._pending:
            self._pending.clear()
            return False
        window = np.sum(self._pending, axis=0)
        self._pending.clear()
        # the proportional rule decides from the windows since the sizes last changed (at most windows_kept), so a
        # difference held back as noise is measured again on more steps; affine's fit keeps windows of its own
        if self.rule == "proportional" and self._held and _moved(window, np.sum(self._held, axis=0)).any():
            self._held = []  # a rank's speed changed since the sizes last did: its earlier windows are stale
        new = np.sum([*self._held, window], axis=0) if self.rule == "proportional" else window
        if self.rule == "proportional":
            fixed, per = np.zeros(self.world), new[2] / np.maximum(new[1], 1)
            new_shares = proportional_shares(new[1], new[2])
            new_shares = self.smoothing * self.shares + (1 - self.smoothing) * new_shares
            new_sizes = batch_sizes(new_shares, self.global_batch, self.min_batch, self.max_batch, self.granularity)
        else:
            fixed, per = self._fit(new)
            new_sizes = affine_batch_sizes(fixed, per, self.global_batch, self.min_batch, self.max_batch,
                                           self.sit_out, self.granularity)
            new_shares = new_sizes / self.global_batch
        self.fixed_s, self.per_sample_s = fixed, per
        moments = _moments(new)  # once for both noise measures (a decision's cost, issue 51)
        self.window_noise_s = measured_noise_s(new, moments)
        self.decisions += 1
        self._probe_sizes = None
        gain = self._gain
        if self._last_move is None or self._changed_at != self.decisions - 1:
            gain = 1.0  # no change at the decision before: nothing to swing back from
        elif float(np.dot(new_sizes - self.sizes, self._last_move)) < -0.5 * float(np.dot(*[self._last_move] * 2)):
            gain = max(gain / 2, MIN_GAIN)  # it would undo most of the last change: half as far as the last time
        else:
            gain = min(1.0, 2 * gain)  # the same way again: back towards the full step
        if gain < 1:
            new_shares = self.shares + gain * (np.asarray(new_shares, float) - self.shares)
            new_sizes = batch_sizes(new_shares, self.global_batch, self.min_batch, self.max_batch, self.granularity)
        now, after = predicted_step_s(fixed, per, self.sizes), predicted_step_s(fixed, per, new_sizes)
        if now - after <= max(self.deadband * now, self.significance * noise_s(new, moments)):
            if self.rule == "proportional" and self.windows_kept > 1:
                self._held = [*self._held, window][-(self.windows_kept - 1):]
            return False  # too small a gain to be worth a change, or one the noise alone could show
        self._held = []
        changed = not np.array_equal(new_sizes, self.sizes)
        if changed:
            self._last_move, self._gain = np.asarray(new_sizes - self.sizes, float), gain
            self._changed_at = self.decisions
        self.shares, self.sizes = np.asarray(new_shares, float), np.asarray(new_sizes, np.int64)
        return changed

    def predicted(self) -> tuple[float, float] | None:
        """The cost model of the latest decision at the chosen sizes and at an even split: (chosen_s, even_s) per
        step (compute only), or None before the first decision (static never decides)."""
        fixed, per = self.fixed_s, self.per_sample_s
        if fixed is None or per is None or not (np.all(np.isfinite(fixed)) and np.all(np.isfinite(per))):
            return None
        return predicted_step_s(fixed, per, self.sizes), predicted_step_s(fixed, per, self._even())

    def _even(self) -> np.ndarray:
        """An even split within this balancer's bounds (plain DDP's sizes), made once per set of bounds: a decision's
        read-out needs it every time (issue 51: a second water-fill per decision)."""
        bounds = (self.world, self.global_batch, self.min_batch, self.granularity,
                  None if self.max_batch is None else tuple(np.ravel(self.max_batch).tolist()))
        cached = self._even_split
        if cached is None or cached[0] != bounds:
            cached = self._even_split = (bounds, batch_sizes(np.full(self.world, 1.0 / self.world), self.global_batch,
                                                             self.min_batch, self.max_batch, self.granularity))
        return cached[1]

    def _fit(self, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Affine fixed and per-sample costs per rank from the new window and the kept ones."""
        kept = self._windows
        if len(kept):
            # A rank whose mean time moved at an unchanged mean batch size changed speed: forget its past.
            kept = np.where(_moved(new, kept[-1])[None, None, :], 0.0, kept)
        pooled = kept.sum(0) + new
        prior = self.per_sample_s
        # Both costs come from every kept window, not the fixed part from the latest one alone: a rank whose cost is
        # not a line (a CFS quota whose period is as long as a step: a rank that waited at the all-reduce banked
        # quota, so its next steps look fast at a size where more work would be throttled) reads its mean rate
        # over the sizes it was timed at, instead of the one window that looked fastest. A speed change is still
        # followed at once where the size was unchanged (the rank's past is forgotten above), else a decision later.
        a, c = fit_stats(pooled, prior)
        if prior is not None and self.smoothing > 0:
            with np.errstate(invalid="ignore", divide="ignore"):
                s, mb = self.smoothing, pooled[1] / pooled[0]
                old_t, mt = self.fixed_s + prior * mb, a + c * mb
                c = np.where(np.isfinite(prior), s * prior + (1 - s) * c, c)
                mt = np.where(np.isfinite(old_t), s * old_t + (1 - s) * mt, mt)
                c = np.minimum(c, mt / mb)
                a = np.maximum(mt - c * mb, 0.0)
        seen = new[0] > 0
        if prior is not None:  # ranks with no new observations (sat out) keep their last estimate
            a, c = np.where(seen, a, self.fixed_s), np.where(seen, c, prior)
        a, c = _fill_unknown(a), _fill_unknown(c)
        self._windows = np.concatenate([kept, new[None]])[-self.windows_kept:]
        return a, c

    def snapshot(self) -> Balancer:
        """A copy that this balancer's later decisions leave as it is (a regime, schedule.adopt): its arrays are
        shared, since every change rebinds them, never writes into them; its lists are its own. A deepcopy of the
        kept windows cost a decision 80 µs (issue 51)."""
        c = copy.copy(self)
        c._pending, c._held = list(self._pending), list(self._held)
        return c

    def state_dict(self) -> dict:
        tolist = lambda v: None if v is None else np.asarray(v).tolist()  # noqa: E731
        return {"shares": tolist(self.shares), "sizes": tolist(self.sizes), "fixed_s": tolist(self.fixed_s),
                "per_sample_s": tolist(self.per_sample_s), "decisions": self.decisions,
                "pending": [p.tolist() for p in self._pending], "windows": self._windows.tolist(),
                "held": [h.tolist() for h in self._held], "gain": self._gain,
                "last_move": tolist(self._last_move), "changed_at": self._changed_at,
                "quota_s": _finite(self.quota_s), "period_s": _finite(self.period_s), "overhead_s": self.overhead_s}

    def load_state_dict(self, d: dict) -> None:
        self.shares, self.sizes = np.asarray(d["shares"], float), np.asarray(d["sizes"], np.int64)
        self.fixed_s = None if d["fixed_s"] is None else np.asarray(d["fixed_s"], float)
        self.per_sample_s = None if d["per_sample_s"] is None else np.asarray(d["per_sample_s"], float)
        self.decisions = int(d["decisions"])
        self._pending = [np.asarray(p, float) for p in d.get("pending", [])]
        self._held = [np.asarray(h, float) for h in d.get("held", [])]
        self._gain = float(d.get("gain", 1.0))
        self._last_move = None if d.get("last_move") is None else np.asarray(d["last_move"], float)
        self._changed_at = int(d.get("changed_at", -1))
        w = np.asarray(d.get("windows", []), float)
        self._windows = w.reshape(-1, N_STATS, self.world) if w.size else np.zeros((0, N_STATS, self.world))
        self.quota_s, self.period_s = (None if d.get(k) is None else
                                       np.array([np.inf if v is None else v for v in d[k]], float)
                                       for k in ("quota_s", "period_s"))
        self.overhead_s = float(d.get("overhead_s", 0.0))
        self._probe_sizes = None
        # resumed under lower limits (a GPU probed again): the same shares, new bounds
        if np.any(self.sizes > _as_bounds(self.world, self.max_batch, np.inf)):
            self.sizes = batch_sizes(self.shares, self.global_batch, self.min_batch, self.max_batch, self.granularity)


    def load_remapped(self, d: dict, src: list[int | None]) -> None:
        """Load a state saved by another world (or the same workers in another rank order): new rank j takes the
        estimate of saved rank src[j]; a worker never seen (None) starts from the median of the known ones (a
        neutral guess, robust to the one slow worker, until its first decision measures it). Shares are then
        renormalised (they sum to 1) and the sizes recut for this world; the measurement windows restart, the
        decision count is kept (affine does not probe again)."""
        known = [i for i in src if i is not None]
        old_world = len(d["shares"])
        if any(v is not None and len(v) != old_world for v in (d["sizes"], d["fixed_s"], d["per_sample_s"])):
            raise ValueError(f"a balancer state whose per-rank arrays are not all of {old_world} ranks")
        if any(not 0 <= i < old_world for i in known) or len(set(known)) != len(known):
            raise ValueError(f"a remap {src} of a {old_world}-rank state names a rank twice or outside it")

        def carry(values, normalise: bool):
            if values is None:
                return None
            old = np.asarray(values, float)
            fill = float(np.nanmedian(old[known])) if known else (1.0 if normalise else np.nan)
            new = np.array([old[i] if i is not None else fill for i in src], float)
            return new / new.sum() if normalise else new
        self.shares = carry(d["shares"], True)
        self.fixed_s, self.per_sample_s = carry(d["fixed_s"], False), carry(d["per_sample_s"], False)
        self.decisions = int(d["decisions"])
        self._pending, self._held, self._probe_sizes = [], [], None
        self._gain, self._last_move, self._changed_at = 1.0, None, -1  # another world: no last move to reverse
        self._windows = np.zeros((0, N_STATS, self.world))
        self.quota_s = self.period_s = None  # this world's own: gathered again at the next decision
        if self.rule == "affine" and self.fixed_s is not None and np.all(np.isfinite(self.fixed_s)):
            self.sizes = affine_batch_sizes(self.fixed_s, self.per_sample_s, self.global_batch, self.min_batch,
                                            self.max_batch, self.sit_out, self.granularity)
            self.shares = self.sizes / self.global_batch
        else:
            self.sizes = batch_sizes(self.shares, self.global_batch, self.min_batch, self.max_batch, self.granularity)


def _moved(new: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """[world] bool: ranks whose mean step time moved between two windows [N_STATS, world] at an unchanged mean
    batch size (by more than 2% and 4 standard errors of the difference): their speed changed."""
    n_new, mb_new, mt_new, _, _, vtt_new = _moments(new)
    n_old, mb_old, mt_old, _, _, vtt_old = _moments(prev)
    with np.errstate(invalid="ignore", divide="ignore"):
        se = np.sqrt(vtt_new / n_new ** 2 + vtt_old / n_old ** 2)  # of the difference of the two means
        same_size = np.abs(mb_new - mb_old) <= np.maximum(0.5, 0.01 * mb_old)
        moved = np.abs(mt_new - mt_old) > 0.02 * mt_old + 4 * se
    return same_size & moved & (new[0] > 0)


def noise_s(stats: np.ndarray, moments: tuple | None = None) -> float:
    """Standard error (s) of the difference of two ranks' mean step times in a window [N_STATS, world], from the
    noisiest rank's scatter about its fitted line (0 for a single step or exact times); moments: _moments(stats),
    if made already."""
    n, _, _, vbb, vbt, vtt = moments or _moments(stats)
    with np.errstate(invalid="ignore", divide="ignore"):
        resid = np.maximum(vtt - np.where(vbb > 0, vbt * vbt / vbb, 0.0), 0.0) / (n - 1 - (vbb > 0))
        se = np.where(n > 2, np.sqrt(resid / n), 0.0)
    return float(np.sqrt(2) * np.nanmax(se, initial=0.0))


def measured_noise_s(stats: np.ndarray, moments: tuple | None = None) -> float | None:
    """How far noise alone could move a difference of two ranks' mean step times in a window [N_STATS, world] (s):
    noise_s's standard error, but measured from two steps on (one degree of freedom left after the fit), plus the
    largest shift of a rank's mean by the stalls its slope clipped (one stall in a short window fakes a speed
    difference that the clipped scatter does not show). None where a timed rank left no degree of freedom (one step,
    or two steps at two sizes): the noise is unknown there, not zero (noise_s takes it as zero, to act at all).
    moments: _moments(stats), if made already."""
    n, _, _, vbb, vbt, vtt = moments or _moments(stats)
    timed, dof = n > 0, n - 1 - (vbb > 0)
    if not timed.any() or (dof[timed] < 1).any():
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        resid = np.maximum(vtt - np.where(vbb > 0, vbt * vbt / vbb, 0.0), 0.0) / dof
        se, stall = np.sqrt(resid / n), np.maximum(stats[2] - stats[6], 0.0) / n  # sum t less sum t clipped
    return float(np.sqrt(2) * se[timed].max() + stall[timed].max())


def _finite(x) -> list | None:
    """Plain data with None for inf (a rank without a quota): JSON has no infinity."""
    return None if x is None else [float(v) if np.isfinite(v) else None for v in np.asarray(x, float)]


def _fill_unknown(x: np.ndarray) -> np.ndarray:
    """Ranks never observed (NaN) take the median of the others: a neutral guess until they are measured."""
    bad = ~np.isfinite(x)
    if bad.any():
        x = np.where(bad, np.nanmedian(x) if (~bad).any() else 0.0, x)
    return x
