"""The read-out: a Balance's state as plain numbers named `hetero/...`, for any logger (TensorBoard, W&B, MLflow).

    writer.add_scalars / accelerator.log(metrics(bal), step=step) / trainer.log(metrics(bal))

What it reports (every value a float; a key is absent until there is something to say):
- hetero/batch_size, hetero/share: this rank's batch at the latest step begun and its part of the global batch;
  hetero/rank{r}/batch_size and /share for every rank (known on every rank: the schedule is shared);
- hetero/compute_s, hetero/wait_s: this rank's own last finished step (its work, and its wait in the all-reduce);
- hetero/rank{r}/compute_s: every rank's mean compute per step over the latest decision's window (the numbers the
  ranks gathered to decide), hetero/rank{r}/idle_s: how long it waited for the slowest rank on average
  (max_j compute_j - compute_r), hetero/slowest_rank;
- hetero/predicted_step_s and hetero/predicted_even_step_s: the latest decision's cost model (affine:
  t_r(b) = fixed_r + per_sample_r * b; dp/edp: the proportional model, fixed_r = 0) at the chosen sizes and at an
  even split; hetero/predicted_speedup = even / chosen, the speedup over plain DDP the balancer expects (compute
  only: the all-reduce, the same in both, is left out, so a step's true speedup is a little smaller);
- hetero/misallocation: the measured slowest step (latest decision's window) over the step time predicted for it
  by the decision before (1: the plan was right; above 1: the ranks were slower than the model said);
- hetero/decisions, hetero/size_changes: decisions so far, and those that changed the sizes.

Cost: no collective, ever: it reads what the Balance already holds (the gathered compute times arrive with each
decision). The cost model is evaluated once per decision and remembered; a call is a few dictionary entries per
rank. On CUDA, reading this rank's last step waits for that step's end event (as a logged loss.item() does).
Ranks beyond `PER_RANK_MAX` are summarised (min and max share) instead of listed one by one.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from .partition import batch_sizes, predicted_step_s

PREFIX = "hetero/"
PER_RANK_MAX = 16  # above this world size, per-rank keys are left out (a grid of 4096 charts helps nobody)


@dataclass
class _Seen:
    """What the read-out remembers per Balance: the decisions' predictions, filled in as they are first seen."""
    decisions: int = 0
    predicted: tuple[float, float] | None = None  # the latest decision's (chosen, even) predicted step (s)
    before: float | None = None  # the decision before the latest one: its predicted step at its chosen sizes (s)
    changes: int = 0
    last_sizes: list[int] | None = None


_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def predicted(balancer) -> tuple[float, float] | None:
    """The balancer's cost model at its chosen sizes and at an even split: (chosen_s, even_s) per step, or None
    before its first decision (static schemes never decide). Pure numpy, no collective."""
    fixed, per = balancer.fixed_s, balancer.per_sample_s
    if fixed is None or per is None or not (np.all(np.isfinite(fixed)) and np.all(np.isfinite(per))):
        return None
    n = balancer.world
    even = batch_sizes(np.full(n, 1.0 / n), balancer.global_batch, balancer.min_batch, balancer.max_batch,
                       balancer.granularity)
    return predicted_step_s(fixed, per, balancer.sizes), predicted_step_s(fixed, per, even)


def _catch_up(bal, seen: _Seen) -> None:
    """Fold in the decisions made since the last call. The cost model is the balancer's as of the latest decision,
    so a decision passed over between two calls leaves no prediction: misallocation then waits for the next pair."""
    decisions = bal.decisions
    if len(decisions) == seen.decisions:
        return
    for d in decisions[seen.decisions:]:
        if seen.last_sizes is not None and d.sizes != seen.last_sizes:
            seen.changes += 1
        seen.last_sizes = list(d.sizes)
    missed = len(decisions) - seen.decisions > 1
    seen.before = None if missed or seen.predicted is None else seen.predicted[0]
    seen.predicted = predicted(bal.engine.plan._balancer)  # the plan's balancer: the cost model lives there
    seen.decisions = len(decisions)


def watch(bal) -> _Seen:
    """Note the decisions made since the last call (their predictions, for misallocation); cheap (a length
    compare between decisions). metrics() calls it; an integration logging less often than it decides calls it
    after every step, so no decision's prediction is passed over."""
    seen = _SEEN.get(bal)
    if seen is None:  # first seen: the sizes in force now are those before its next decision (if none yet)
        seen = _SEEN[bal] = _Seen(last_sizes=None if bal.decisions else bal.engine.plan._balancer.sizes.tolist())
    _catch_up(bal, seen)
    return seen


def metrics(bal, per_rank: bool | None = None) -> dict[str, float]:
    """This Balance's read-out as {"hetero/...": float} (module docstring); no collective, cheap enough for every
    step. per_rank: list every rank's keys (None: when the world has at most PER_RANK_MAX ranks)."""
    seen = watch(bal)
    rank, world, B = bal.rank, bal.world, bal.settings.global_batch
    sizes = bal.last_sizes
    many = world <= PER_RANK_MAX if per_rank is None else per_rank
    out = {f"{PREFIX}batch_size": float(sizes[rank]), f"{PREFIX}share": sizes[rank] / B,
           f"{PREFIX}decisions": float(seen.decisions), f"{PREFIX}size_changes": float(seen.changes)}
    if many:
        for r, b in enumerate(sizes):
            out[f"{PREFIX}rank{r}/batch_size"] = float(b)
            out[f"{PREFIX}rank{r}/share"] = b / B
    else:
        out[f"{PREFIX}min_share"], out[f"{PREFIX}max_share"] = min(sizes) / B, max(sizes) / B
    records = bal.epoch_records()  # this rank's own finished steps this epoch (the clocks read here)
    if records:
        out[f"{PREFIX}compute_s"], out[f"{PREFIX}wait_s"] = float(records[-1].compute_s), float(records[-1].wait_s)
    if bal.decisions:
        compute = np.asarray(bal.decisions[-1].compute_s, float)
        slowest = float(compute.max())
        out[f"{PREFIX}slowest_rank"] = float(np.argmax(compute))
        if many:
            for r, t in enumerate(compute):
                out[f"{PREFIX}rank{r}/compute_s"] = float(t)
                out[f"{PREFIX}rank{r}/idle_s"] = slowest - float(t)
        if seen.before:
            out[f"{PREFIX}misallocation"] = slowest / seen.before
    if seen.predicted is not None:
        chosen, even = seen.predicted
        out[f"{PREFIX}predicted_step_s"], out[f"{PREFIX}predicted_even_step_s"] = chosen, even
        if chosen > 0:
            out[f"{PREFIX}predicted_speedup"] = even / chosen
    return out
