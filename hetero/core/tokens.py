"""Variable-length samples (issue 49): a step's samples split among the ranks by what they cost, not by their count.

Pure maths, as partition.py: no torch, no collectives. Every rank runs the same functions on the same numbers (the
step's samples come from the one shared permutation; the fitted coefficients from the same gathered times), so every
rank reaches the same split without another collective.

A rank's step costs t_i = fixed_i + per_unit_i x work(its rows), where work counts what the collator makes of them:
- padded: rows x the longest row (every row is padded to it), plus `attention` x rows x longest row squared;
- packed: the sum of the lengths (one flat row, as DataCollatorWithFlattening makes), plus `attention` x the sum of
  the squared lengths (attention stays within each sequence).
`split` finds the rows of each rank that minimise the slowest predicted step, max_i t_i, every sample on exactly one
rank, none on a rank whose cap (the longest row it can hold, in tokens) it exceeds.

The search: the samples sorted longest first (ties by position, so the order is the same everywhere); for a candidate
time T, each rank in turn takes the longest run of the remaining samples its time allows (a run of similar lengths
pads least); the smallest T at which every sample is placed is found by bisection on the values where the count
placed jumps. The orders of the ranks tried: every order for padded rows on up to 3 ranks, else fastest first and
slowest first (the ranks that can hold the longest rows always first). Packed rows also try a longest-first greedy
onto the rank that would finish first, then improve the best by moving or swapping single samples off the slowest
rank. tests/core/test_tokens.py measures the result against the exhaustive optimum on small steps (padded: equal on
every case tried; packed: within 15%) and against the fluid lower bound on steps of 128-512 (packed: within 0.1%).
"""
from __future__ import annotations

import bisect
import copy
import itertools
import numbers
from dataclasses import dataclass

import numpy as np

from .partition import fit_stats, window_stats
from .rules import COLLATORS

MAX_PERMUTED = 3  # padded rows: ranks up to which split tries every order of them (3! = 6 searches)
EXCHANGES = 64  # packed rows: at most this many moves or swaps after the search


@dataclass(frozen=True)
class Cost:
    """What a rank's rows cost, in units of one token: how the collator lays them out, and the attention term."""
    collator: str = "padded"
    attention: float = 0.0  # the weight of a squared length against a length (0: linear in tokens)

    def __post_init__(self):
        if self.collator not in COLLATORS:
            raise ValueError(f"hetero: collator must be one of {', '.join(COLLATORS)} (got {self.collator!r})")
        if not (isinstance(self.attention, numbers.Real) and np.isfinite(self.attention) and self.attention >= 0):
            raise ValueError(f"hetero: attention must be a finite number >= 0 (got {self.attention!r})")

    def work(self, lengths) -> float:
        """The cost units of one rank's rows (0 for none)."""
        x = np.asarray(lengths, dtype=float)
        if not x.size:
            return 0.0
        if self.collator == "padded":
            top = float(x.max())
            return x.size * top * (1.0 + self.attention * top)
        return float(x.sum() + self.attention * np.square(x).sum())

    def parts(self, lengths) -> tuple[float, float]:
        """The two terms of `work` apart: the tokens the collator lays out, and the squared-length term that
        `attention` weighs (the cost model fits that weight)."""
        x = np.asarray(lengths, dtype=float)
        if not x.size:
            return 0.0, 0.0
        if self.collator == "padded":
            top = float(x.max())
            return x.size * top, x.size * top * top
        return float(x.sum()), float(np.square(x).sum())

    def unit(self, lengths) -> np.ndarray:
        """Packed: each length's own cost units (its tokens, and its attention term)."""
        x = np.asarray(lengths, dtype=float)
        return x + self.attention * x * x


def check_lengths(lengths, samples: int | None = None) -> np.ndarray:
    """The samples' lengths as int64, or one `hetero:` line saying what is wrong with them."""
    if isinstance(lengths, (str, bytes)):
        raise ValueError("hetero: lengths must be a sequence of whole token counts, one per sample (got a string)")
    try:
        a = np.asarray(lengths)
    except (ValueError, TypeError):
        raise ValueError("hetero: lengths must be a flat sequence of whole token counts, one per sample") from None
    if a.ndim != 1:
        raise ValueError(f"hetero: lengths must be one number per sample (got an array of shape {a.shape})")
    if samples is not None and a.size != samples:
        raise ValueError(f"hetero: {a.size} lengths for a data set of {samples} samples: give one per sample")
    if not a.size:
        raise ValueError("hetero: lengths is empty: give one per sample")
    if a.dtype == bool or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ValueError(f"hetero: lengths must be whole token counts (got values of type {a.dtype})")
    bad = np.flatnonzero(~np.isfinite(a.astype(float)) | (a != np.round(a)) | (a <= 0)) if a.dtype.kind == "f" \
        else np.flatnonzero(a <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"hetero: the length of sample {i} is {a[i].item()!r}: lengths are whole token counts >= 1 "
                         f"({bad.size} such)")
    return a.astype(np.int64)


def budget_steps(lengths, budget: int) -> int:
    """How many steps an epoch of a token budget has: ceil(T / budget) for the samples' T tokens, the same in every
    epoch (a scheduler, a loader's length and a resume can count on it). A budget above T, or a sample longer than
    the budget, is refused in one line."""
    L = check_lengths(lengths)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:
        raise ValueError(f"hetero: the token budget must be a whole number of tokens >= 1 (got {budget!r})")
    if (over := np.flatnonzero(L > budget)).size:
        i = int(over[0])
        raise ValueError(f"hetero: sample {i} is {int(L[i])} tokens long, more than the step's token budget of "
                         f"{budget}: raise token_budget to at least {int(L.max())}")
    if budget > (total := int(L.sum())):
        raise ValueError(f"hetero: token_budget {budget} exceeds the {total} tokens of the {L.size} samples")
    return -(-total // int(budget))


def budget_cuts(lengths, budget: int) -> np.ndarray:
    """One epoch's steps of a token budget: its samples' `lengths` in the order drawn (the shared permutation's) cut
    into S = budget_steps consecutive runs at even quantiles of their tokens. Sample j goes to run floor(S x (the
    tokens before it + half its own) / T), in integers. Every sample lands in exactly one step (none is dropped, as
    the N mod B samples past the last step of B are), and a step's tokens are within one sample's length of T / S
    (at most the budget). Which samples form a step depends on the lengths, their order and the budget only: never
    on the ranks, their speeds or their memory.

    Returns [S + 1] offsets: step s is lengths[offsets[s]:offsets[s + 1]].
    """
    L = check_lengths(lengths)
    steps = budget_steps(L, budget)
    ends = np.cumsum(L)
    run = (steps * (2 * ends - L)) // (2 * int(ends[-1]))  # the run of each sample's midpoint
    return np.searchsorted(run, np.arange(steps + 1), side="left").astype(np.int64)


def _coefficients(n_ranks: int, fixed_s, per_unit_s, caps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.broadcast_to(np.asarray(fixed_s, dtype=float), (n_ranks,)).copy()
    c = np.broadcast_to(np.asarray(per_unit_s, dtype=float), (n_ranks,)).copy()
    cap = np.full(n_ranks, np.inf) if caps is None else np.broadcast_to(np.asarray(caps, dtype=float),
                                                                        (n_ranks,)).copy()
    if not (np.all(np.isfinite(a)) and np.all(a >= 0) and np.all(np.isfinite(c)) and np.all(c > 0)):
        raise ValueError("hetero: the ranks' fixed costs must be finite and >= 0, their costs per token finite and > 0")
    if np.any(np.isnan(cap)) or np.any(cap < 1):
        raise ValueError("hetero: every rank's cap must be at least 1 token (or None: no cap)")
    return a, c, cap


class _Search:
    """The contiguous search for one order of the ranks: each takes a run of the samples sorted longest first. The
    bisection calls `place` some 40 times: it works on Python floats and lists (bisect), not numpy scalars."""

    def __init__(self, desc: np.ndarray, a, c, cap, order: list[int], cost: Cost, min_rows: int, total=None):
        self.desc, self.a, self.c, self.cap, self.order, self.cost = desc, a, c, cap, order, cost
        self.min_rows = min_rows
        d = desc.astype(float)
        self.row = (d * (1.0 + cost.attention * d)).tolist()  # padded: the cost of one row padded to desc[pos]
        self.prefix = np.concatenate([[0.0], np.cumsum(cost.unit(d))]).tolist()  # packed: units of desc[:k]
        # a rank's whole rows' tokens (the collator's layout) within its total: packed, by the tokens' prefix
        self.totals = None if total is None else [float(total[r]) for r in order]
        self.tokens = np.concatenate([[0.0], np.cumsum(d)]).tolist() if total is not None else None
        self._ranks = [(float(a[r]), float(c[r]), float(cap[r])) for r in order]
        self._lengths = desc.tolist()

    def _fits(self, a: float, c: float, pos: int, T: float) -> int:
        """How many samples from pos a rank of fixed cost a and cost c per unit can take within T (the run's cost is
        monotone in its length)."""
        budget = (T - a) / c
        if budget < 0:
            return 0
        if self.cost.collator == "padded":
            return int(budget // self.row[pos])
        return bisect.bisect_right(self.prefix, self.prefix[pos] + budget) - 1 - pos

    def _held(self, j: int, pos: int) -> int:
        """How many samples from pos the j-th rank of the order holds within its total of tokens (padded: rows x the
        first, the longest; packed: their sum)."""
        total = self.totals[j]
        if total == float("inf"):  # no cap on this rank
            return len(self._lengths) - pos
        if self.cost.collator == "padded":
            return int(total // self._lengths[pos])
        return bisect.bisect_right(self.tokens, self.tokens[pos] + total) - 1 - pos

    def place(self, T: float) -> list[int] | None:
        """How many of the sorted samples each rank (in self.order) takes at time T, or None if some are left."""
        n, pos, took, left = len(self._lengths), 0, [], len(self._ranks)
        for j, (a, c, cap) in enumerate(self._ranks):
            left -= 1
            room = n - pos - self.min_rows * left  # the ranks still to come are owed min_rows
            k = 0 if pos >= n or self._lengths[pos] > cap else min(self._fits(a, c, pos, T), room)
            if self.totals is not None and k:
                k = min(k, self._held(j, pos))
            if k < self.min_rows:
                return None
            took.append(k)
            pos += k
        return took if pos == n else None

    def best(self) -> tuple[float, list[int]] | None:
        """The smallest T at which every sample is placed, and the counts there (None: the caps never allow it)."""
        hi = float(np.max(self.a + self.c * self.cost.work(self.desc))) * (1 + 1e-9) + 1e-300
        if self.place(hi) is None:
            return None
        lo = 0.0
        while hi - lo > 1e-12 * hi:  # the placed count jumps at values a_r + c_r * work(run): close in on the jump
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            if self.place(mid) is None:
                lo = mid
            else:
                hi = mid
        took = self.place(hi)
        return self.worst(took), took

    def worst(self, took: list[int]) -> float:
        pos, worst = 0, 0.0
        for r, k in zip(self.order, took):
            if k:
                worst = max(worst, self.a[r] + self.c[r] * self.cost.work(self.desc[pos:pos + k]))
            pos += k
        return worst


def _greedy(desc: np.ndarray, a, c, cap, cost: Cost, total=None) -> list[list[int]] | None:
    """Packed rows: each sample, longest first, onto the rank that would then finish first (ties: the lower rank),
    among those it fits (its row cap, and its total of tokens). Python floats, not numpy: one sample at a time over a
    handful of ranks is cheaper without arrays."""
    a_, c_, cap_ = a.tolist(), c.tolist(), cap.tolist()
    ranks = range(len(a_))
    work = [0.0] * len(a_)
    room = [float("inf")] * len(a_) if total is None else [float(t) for t in total]  # tokens each can still take
    rows: list[list[int]] = [[] for _ in ranks]
    w = cost.attention
    for j, length in enumerate(desc.tolist()):
        unit, best, r = length * (1.0 + w * length), float("inf"), -1
        for q in ranks:  # the first rank of the least time (a plain loop: no tuple or generator per rank)
            if cap_[q] >= length and room[q] >= length and (t := a_[q] + c_[q] * (work[q] + unit)) < best:
                best, r = t, q
        if r < 0:
            return None
        work[r] += unit
        room[r] -= length
        rows[r].append(j)
    return rows


def _orders(c: np.ndarray, cap: np.ndarray, permute: bool) -> list[list[int]]:
    """The orders in which the ranks take their runs: every order for up to MAX_PERMUTED ranks, else fastest first and
    slowest first; the ranks that can hold the longest rows always come first."""
    n = c.size
    if n <= MAX_PERMUTED and permute:
        return [list(p) for p in itertools.permutations(range(n))
                if all(cap[p[j]] >= cap[p[j + 1]] for j in range(n - 1))]
    return [sorted(range(n), key=lambda r: (-cap[r], s * c[r], r)) for s in (1, -1)]


def split(lengths, fixed_s, per_unit_s, cost: Cost = Cost(), caps=None, min_rows: int = 1,
          totals=None) -> list[np.ndarray]:
    """The positions (into `lengths`, ascending) of each rank's rows, minimising the slowest predicted step.

    fixed_s, per_unit_s: each rank's cost model (seconds, seconds per unit of cost.work); caps: the longest row each
    rank can hold, in tokens (None: no cap); totals: the tokens each rank's rows may hold together, as the collator
    lays them out (padded: rows x the longest; packed: their sum; None: no cap), a rank's whole step in one forward.
    Every position lands on exactly one rank, at least min_rows on each.
    """
    L = check_lengths(lengths)
    if totals is not None:  # a row longer than a rank's total does not fit it either
        caps = totals if caps is None else np.minimum(caps, totals)
    given = [np.atleast_1d(np.asarray(v, dtype=float)) for v in (fixed_s, per_unit_s, caps) if v is not None]
    n_ranks = max(v.size for v in given)
    if any(v.ndim != 1 or v.size not in (1, n_ranks) for v in given):
        raise ValueError(f"hetero: fixed_s, per_unit_s and caps take one number per rank, or one for every rank (got "
                         f"{', '.join(str(v.size) for v in given)} numbers)")
    a, c, cap = _coefficients(n_ranks, fixed_s, per_unit_s, caps)
    total = None if totals is None else np.broadcast_to(np.asarray(totals, dtype=float), (n_ranks,))
    if isinstance(min_rows, bool) or not isinstance(min_rows, numbers.Integral) or min_rows < 0:
        raise ValueError(f"hetero: min_rows must be a whole number >= 0 (got {min_rows!r})")
    if L.size < min_rows * n_ranks:
        raise ValueError(f"hetero: a step of {L.size} samples cannot give {n_ranks} ranks {min_rows} each")
    if (too := np.flatnonzero(L > cap.max())).size:
        i = int(too[0])
        raise ValueError(f"hetero: sample {i} is {int(L[i])} tokens long, more than any rank can hold "
                         f"(the largest cap is {cap.max():g} tokens)")
    perm = np.lexsort((np.arange(L.size), -L))  # longest first, ties by position: the same order on every rank
    desc = L[perm]

    candidates: list[tuple[float, list[np.ndarray]]] = []
    for order in _orders(c, cap, permute=cost.collator == "padded"):
        found = _Search(desc, a, c, cap, order, cost, min_rows, total).best()
        if found is not None:
            worst, took = found
            bounds = np.concatenate([[0], np.cumsum(took)])
            parts = [np.empty(0, np.int64)] * n_ranks
            for j, r in enumerate(order):
                parts[r] = perm[bounds[j]:bounds[j + 1]]
            candidates.append((worst, parts))
    if cost.collator == "packed":
        rows = _greedy(desc, a, c, cap, cost, total)
        if rows is not None and min(len(x) for x in rows) >= min_rows:
            parts = [perm[np.asarray(x, dtype=np.int64)] for x in rows]
            candidates.append((float(np.max(times(L, parts, a, c, cost))), parts))
    if not candidates:
        raise ValueError(f"hetero: no split of this step's {L.size} samples fits the ranks' caps with {min_rows} "
                         f"row(s) each")
    best = min(range(len(candidates)), key=lambda j: (candidates[j][0], j))
    parts = candidates[best][1]
    if cost.collator == "packed":
        parts = _exchange(L, parts, a, c, cap, cost, min_rows, total)
    return [np.sort(p) for p in parts]


def _exchange(L: np.ndarray, parts: list[np.ndarray], a, c, cap, cost: Cost, min_rows: int,
              total=None) -> list[np.ndarray]:
    """Packed rows: moves of one sample off the slowest rank, or swaps of one of its samples with another rank's,
    while one lowers the slowest rank's time without lifting the other to it (each lowers the sorted times, so it
    ends; at most 4 x the samples' count of them), and keeps both within their totals of tokens."""
    unit = cost.unit(L)
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    total = np.full(len(parts), np.inf) if total is None else total
    for _ in range(EXCHANGES):
        work = np.array([unit[p].sum() for p in parts])
        held = np.array([L[p].sum() for p in parts], dtype=float)  # each rank's tokens, packed
        t = np.where([len(p) > 0 for p in parts], a + c * work, 0.0)
        r = int(np.argmax(t))
        ur = unit[parts[r]]
        best = (t[r] * (1 - 1e-12), None)
        for q in range(len(parts)):
            if q == r:
                continue
            fits_q = (L[parts[r]] <= cap[q]) & (held[q] + L[parts[r]] <= total[q])
            if len(parts[r]) > min_rows:  # a move: r keeps at least min_rows
                after = np.maximum(a[r] + c[r] * (work[r] - ur), a[q] + c[q] * (work[q] + ur))
                after = np.where(fits_q, after, np.inf)
                j = int(np.argmin(after))
                if after[j] < best[0]:
                    best = (after[j], ("move", q, j, None))
            if len(parts[q]):
                uq = unit[parts[q]]
                d = ur[:, None] - uq[None, :]
                after = np.maximum(a[r] + c[r] * (work[r] - d), a[q] + c[q] * (work[q] + d))
                moved = L[parts[r]][:, None] - L[parts[q]][None, :]  # tokens r hands q in a swap
                ok = ((L[parts[r]] <= cap[q])[:, None] & (L[parts[q]][None, :] <= cap[r])
                      & (held[q] + moved <= total[q]) & (held[r] - moved <= total[r]))
                after = np.where(ok, after, np.inf)
                j, k = np.unravel_index(int(np.argmin(after)), after.shape)
                if after[j, k] < best[0]:
                    best = (after[j, k], ("swap", q, int(j), int(k)))
        if best[1] is None:
            break
        kind, q, j, k = best[1]
        x = parts[r][j]
        if kind == "move":
            parts[r], parts[q] = np.delete(parts[r], j), np.append(parts[q], x)
        else:
            parts[r] = parts[r].copy()
            parts[q] = parts[q].copy()
            parts[r][j], parts[q][k] = parts[q][k], x
    return parts


def times(lengths, parts: list[np.ndarray], fixed_s, per_unit_s, cost: Cost = Cost()) -> np.ndarray:
    """Each rank's predicted step time for these rows (a rank without rows: 0, it waits for the others)."""
    L = np.asarray(lengths)
    a, c, _ = _coefficients(len(parts), fixed_s, per_unit_s, None)
    return np.array([a[r] + c[r] * cost.work(L[p]) if len(p) else 0.0 for r, p in enumerate(parts)])


def micro_batches(lengths, cap: float, cost: Cost = Cost()) -> list[np.ndarray]:
    """One rank's rows cut into micro-batches whose tokens (padded: rows x longest; packed: the sum) fit in cap.

    Longest first, so that each micro-batch pads least; positions into `lengths`, each exactly once.
    """
    L = check_lengths(lengths)
    if not (cap >= 1):
        raise ValueError(f"hetero: a micro-batch cap must be at least 1 token (got {cap!r})")
    if L.max() > cap:
        i = int(np.argmax(L))
        raise ValueError(f"hetero: sample {i} is {int(L[i])} tokens long, more than this rank's cap of {cap:g}")
    perm = np.lexsort((np.arange(L.size), -L))
    desc, out, pos = L[perm], [], 0
    while pos < L.size:
        tokens = desc[pos] * np.arange(1, L.size - pos + 1) if cost.collator == "padded" else np.cumsum(desc[pos:])
        k = int(np.searchsorted(tokens, cap, side="right"))
        out.append(np.sort(perm[pos:pos + k]))
        pos += k
    return out


ATTENTIONS = (0.0, *np.logspace(-5, -1, 17))  # the attention weights the cost model chooses among


class CostModel:
    """Each rank's t_i = fixed_i + per_unit_i x work, fitted online from its measured step times: the affine
    balancer's least-squares fit (partition.window_stats, fit_stats) on cost units in place of samples, pooled over
    the last `windows_kept` windows. Lengths vary from step to step, so every window holds many amounts of work and
    the fixed part separates from the per-unit cost without the affine rule's probe.

    work = tokens + attention x squared lengths (Cost). `attention` None fits it too: observed as its two terms
    ([steps, world, 2]), the weight among ATTENTIONS whose per-rank fits leave the least squared error is taken. It
    is one weight for every rank (the same model runs on each; a rank's speed scales both terms).

    The prior, before a rank has been timed: no fixed part and `prior_per_unit_s` per unit, the same for every rank,
    so the first steps split by equal cost, as transformers' BatchRebalanceSampler does. A rank that sat every
    observed step out keeps its last estimate (or the prior)."""

    def __init__(self, world: int, prior_per_unit_s: float = 1e-6, windows_kept: int = 4,
                 attention: float | None = None):
        if not (np.isfinite(prior_per_unit_s) and prior_per_unit_s > 0):
            raise ValueError(f"hetero: the prior cost per token must be finite and > 0 (got {prior_per_unit_s!r})")
        self.world, self.windows_kept = world, windows_kept
        self.fixed_s = np.zeros(world)
        self.per_unit_s = np.full(world, float(prior_per_unit_s))
        self.attention, self._fits_attention = float(attention or 0.0), attention is None
        self._windows: list[tuple[np.ndarray, np.ndarray]] = []  # (work [steps, world, 2], compute [steps, world])

    def observe(self, work, compute_s) -> None:
        """One window of steps: [steps, world] cost units, or [steps, world, 2] their two terms (Cost.parts), and the
        measured compute times (a rank without rows: work 0)."""
        work, compute = np.asarray(work, float), np.asarray(compute_s, float)
        if work.ndim == 2:  # already weighed: no squared term to fit
            work = np.stack([work, np.zeros_like(work)], axis=-1)
        self._windows = [*self._windows, (work, compute)][-self.windows_kept:]
        W = np.concatenate([w for w, _ in self._windows])
        T = np.concatenate([t for _, t in self._windows])
        if self._fits_attention and W[..., 1].any():
            self.attention = min(ATTENTIONS, key=lambda g: _residual(W[..., 0] + g * W[..., 1], T))
        pooled = window_stats(W[..., 0] + self.attention * W[..., 1], T)
        seen = pooled[0] > 0
        a, c = fit_stats(pooled)
        ok = seen & np.isfinite(a) & np.isfinite(c) & (c > 0)
        self.fixed_s = np.where(ok, np.maximum(a, 0.0), self.fixed_s)
        self.per_unit_s = np.where(ok, c, self.per_unit_s)

    def snapshot(self) -> CostModel:
        """A copy that this model's later fits leave as it is (a regime, schedule.adopt): every change rebinds its
        arrays and its list of windows, never writes into them."""
        return copy.copy(self)

    def coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        return self.fixed_s.copy(), self.per_unit_s.copy()

    def shares(self) -> np.ndarray:
        """Every rank's share of a step's work at equal times when the fixed parts are small: its speed in units per
        second over the sum (what a decision records)."""
        speed = 1.0 / self.per_unit_s
        return speed / speed.sum()

    def state_dict(self) -> dict:
        """Plain data: the coefficients, the attention weight and the pooled windows (torch.load(weights_only=True)
        loads it)."""
        return {"fixed_s": self.fixed_s.tolist(), "per_unit_s": self.per_unit_s.tolist(), "attention": self.attention,
                "windows": [[w.tolist(), t.tolist()] for w, t in self._windows]}

    def load_state_dict(self, d: dict, src: list[int | None] | None = None) -> None:
        """Resume; src (another world, or the same workers in another order): new rank j takes saved rank src[j]'s
        coefficients, a worker never seen (None) the median of the known ones; the pooled windows restart then."""
        fixed, per = np.asarray(d["fixed_s"], float), np.asarray(d["per_unit_s"], float)
        if fixed.shape != per.shape or fixed.ndim != 1 or not (np.all(np.isfinite(per)) and np.all(per > 0)):
            raise ValueError("a cost model state whose coefficients are not one finite positive number per rank")
        if self._fits_attention:
            self.attention = float(d.get("attention", 0.0))
        if src is None:
            if len(per) != self.world:
                raise ValueError(f"a cost model state of {len(per)} ranks for a world of {self.world}")
            self.fixed_s, self.per_unit_s = fixed, per
            self._windows = [(np.asarray(w, float), np.asarray(t, float))
                             for w, t in d.get("windows", [])][-self.windows_kept:]
            return
        known = [i for i in src if i is not None]
        if any(not 0 <= i < len(per) for i in known) or len(src) != self.world:
            raise ValueError(f"a remap {src} of a {len(per)}-rank cost model state names a rank outside it")

        def carry(old):
            fill = float(np.median(old[known])) if known else None
            return np.array([old[i] if i is not None else fill for i in src], float)
        if known:
            self.fixed_s, self.per_unit_s = carry(fixed), carry(per)
        self._windows = []


def _residual(work: np.ndarray, compute: np.ndarray) -> float:
    """The squared error left by each rank's least-squares line of compute over work, summed over the ranks (steps a
    rank had no work or no time left out)."""
    total = 0.0
    for w, t in zip(work.T, compute.T):
        ok = (w > 0) & np.isfinite(t)
        if ok.sum() < 3:
            continue
        w, t = w[ok], t[ok]
        vw = np.var(w)
        slope = np.cov(w, t, bias=True)[0, 1] / vw if vw > 0 else 0.0
        total += float(np.sum((t - t.mean() - slope * (w - w.mean())) ** 2))
    return total
