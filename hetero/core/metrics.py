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
  only: the all-reduce, the same in both, is left out, so a step's true speedup is a little smaller), or 1 while
  the decision's window does not show that gain beyond EVIDENCE times its noise (predicted_speedup below);
- hetero/misallocation: the measured slowest step (latest decision's window) over the step time predicted for it
  by the decision before (1: the plan was right; above 1: the ranks were slower than the model said);
- hetero/decisions, hetero/size_changes: decisions so far, and those that changed the sizes.

A pure function of the Balance's public values: each Decision carries its cost model's numbers from when it was
made (records.Decision), so nothing is kept beside the Balance, no call has to come after every step, and a
decision made between two calls is read like any other. Cost: no collective, ever, and a few dictionary entries per
rank. On CUDA, reading this rank's last step waits for that step's end event (as a logged loss.item() does).
Ranks beyond `PER_RANK_MAX` are summarised (min and max share) instead of listed one by one.
"""
from __future__ import annotations

import numpy as np

from .records import Decision

PREFIX = "hetero/"
PER_RANK_MAX = 16  # above this world size, per-rank keys are left out (a grid of 4096 charts helps nobody)
# A gain is shown when it exceeds this many times the window's noise (Decision.noise_s: about one standard error
# of a difference of two ranks' mean steps, plus what its stalls moved the means), about 95% one-sided.
EVIDENCE = 2.0


def predicted_speedup(d: Decision) -> float | None:
    """The speedup over an even split that decision `d` predicts; None without a model. 1.0 unless its window shows
    the gain beyond EVIDENCE times its noise: on equal ranks a short window's noise, or one stall, moves the
    proportional rule and its model then claims a gain (4x and more) that the measurements do not support."""
    chosen, even = d.predicted_step_s, d.predicted_even_step_s
    if chosen is None or even is None or not chosen > 0:
        return None
    if d.noise_s is None or not even - chosen > EVIDENCE * d.noise_s:
        return 1.0
    return even / chosen


_COUNTED: dict[int, tuple[int, int, Decision]] = {}  # id(decisions) -> (decisions counted, changes, the last counted)


def _size_changes(decisions: list[Decision]) -> int:
    """How many decisions changed the sizes, counting only those added since the last call on the same list (a
    Balance's list only grows): a read-out every step stays O(1) however long training runs (issue 51). A list
    that is not the one remembered (another object under a reused id, or a shorter one) is counted afresh."""
    n, changes, last = _COUNTED.get(id(decisions), (0, 0, None))
    if n > len(decisions) or (n and decisions[n - 1] is not last):
        n, changes = 0, 0
    changes += sum(d.changed for d in decisions[n:])
    if len(_COUNTED) > 64:  # a process holds a few Balances; forget the others'
        _COUNTED.clear()
    if decisions:
        _COUNTED[id(decisions)] = (len(decisions), changes, decisions[-1])
    return changes


def metrics(bal, per_rank: bool | None = None) -> dict[str, float]:
    """This Balance's read-out as {"hetero/...": float} (module docstring); no collective, cheap enough for every
    step. per_rank: list every rank's keys (None: when the world has at most PER_RANK_MAX ranks)."""
    rank, decisions = bal.rank, bal.decisions
    sizes = bal.last_sizes
    B = sum(sizes)  # global_batch; a token budget's step holds as many samples as its window
    world = len(sizes)  # one entry per rank (the name of the world's size is moving: size -> world)
    many = world <= PER_RANK_MAX if per_rank is None else per_rank
    out = {f"{PREFIX}batch_size": float(sizes[rank]), f"{PREFIX}share": sizes[rank] / B,
           f"{PREFIX}decisions": float(len(decisions)),
           f"{PREFIX}size_changes": float(_size_changes(decisions))}
    if many:
        for r, b in enumerate(sizes):
            out[f"{PREFIX}rank{r}/batch_size"] = float(b)
            out[f"{PREFIX}rank{r}/share"] = b / B
    else:
        out[f"{PREFIX}min_share"], out[f"{PREFIX}max_share"] = min(sizes) / B, max(sizes) / B
    records = bal.epoch_records()  # this rank's own finished steps this epoch (the clocks read here)
    if records:
        out[f"{PREFIX}compute_s"], out[f"{PREFIX}wait_s"] = float(records[-1].compute_s), float(records[-1].wait_s)
    if not decisions:
        return out
    latest = decisions[-1]
    compute = np.asarray(latest.compute_s, float)
    slowest = float(compute.max())
    out[f"{PREFIX}slowest_rank"] = float(np.argmax(compute))
    if many:
        for r, t in enumerate(compute):
            out[f"{PREFIX}rank{r}/compute_s"] = float(t)
            out[f"{PREFIX}rank{r}/idle_s"] = slowest - float(t)
    if len(decisions) > 1 and decisions[-2].predicted_step_s:  # the window ran at the sizes the one before chose
        out[f"{PREFIX}misallocation"] = slowest / decisions[-2].predicted_step_s
    if latest.predicted_step_s is not None and latest.predicted_even_step_s is not None:
        out[f"{PREFIX}predicted_step_s"] = float(latest.predicted_step_s)
        out[f"{PREFIX}predicted_even_step_s"] = float(latest.predicted_even_step_s)
        if (speedup := predicted_speedup(latest)) is not None:
            out[f"{PREFIX}predicted_speedup"] = speedup
    return out
