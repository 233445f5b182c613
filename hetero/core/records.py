"""The typed values of hetero.Balance: where training is, one finished step on a rank, one rebalancing decision."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepRecord:
    """One finished step on this rank: every rank's batch sizes and this rank's own times (s)."""
    epoch: int
    step: int
    sizes: np.ndarray    # [world] batch sizes of the step (sum = global batch)
    compute_s: float     # own work (all k_i micro-batches): start to gradients ready, plus backward's return to the end
    wait_s: float        # the last all-reduce, including waiting for slower ranks
    delay_s: float       # the emulated extra time spent in this step (part of compute_s)
    cpu_s: float = float("nan")  # this process's CPU seconds in the step, every thread (what a CFS quota charges)
    started_s: float = float("nan")  # the host's perf_counter at the step's start (steps' pace: their differences)
    work: np.ndarray | None = None   # by tokens: [world] every rank's cost units in the step (tokens.Cost.work)


@dataclass(frozen=True)
class Decision:
    """One rebalancing decision, identical on every rank; sizes sum to the global batch."""
    epoch: int           # made after this epoch's step `step`
    step: int
    effective: int       # first position (epoch * steps_per_epoch + step) cut with the new sizes
    sizes: list[int]     # per-rank batch sizes from `effective` on
    shares: list[float]  # the balancer's shares (sum to 1)
    compute_s: list[float]  # per-rank mean compute seconds per step over the window decided on
    # The cost model fitted at this decision (s per step, compute only), recorded when it is made so that the
    # read-out (metrics.py) is a function of the decisions: None where the rule has no model (no observations).
    predicted_step_s: float | None = None       # at `sizes`
    predicted_even_step_s: float | None = None  # at an even split (plain DDP's)
    noise_s: float | None = None  # how far noise could move a difference of two ranks' mean steps in the window
    #                               decided on (Balancer.window_noise_s); None: too few steps to measure it
    changed: bool = False         # `sizes` differ from the sizes in force before this decision
    # By tokens (a Balance with a collator): the fitted costs the split follows from `effective` on, every rank's
    # fixed seconds and seconds per cost unit, and the attention weight (tokens.CostModel); what bal.replay takes
    # to split every step of the run again exactly as it was. None when the Balance splits by counts.
    fixed_s: list[float] | None = None
    per_unit_s: list[float] | None = None
    attention: float | None = None


@dataclass(frozen=True)
class Position:
    """Where training is (`bal.position`), the same on every rank: `step` steps of `epoch` have ended.

    A host reads it instead of counting: the epoch to run next is `epoch + 1` once `epoch_complete`, else `epoch`
    (a fresh Balance and an epoch resumed mid-way both run `epoch`), and the next step is `step`.

    Attributes:
        epoch: the epoch last begun (0 before the first).
        step: steps of `epoch` that have ended (0 <= step <= steps_per_epoch).
        steps_per_epoch: the epoch's steps, floor(n_samples / global_batch), known from `bal.batch_sampler(len(ds))`
            on: what a learning-rate schedule is sized by (the loader's length is not it with micro_batch); 0 in a
            loop without epochs.
        global_step: steps ended over every epoch (a resumed Balance counts on from its state).
    """
    epoch: int
    step: int
    steps_per_epoch: int
    global_step: int

    @property
    def epoch_complete(self) -> bool:
        """Every step of `epoch` has ended: the next step is step 0 of epoch + 1."""
        return self.steps_per_epoch > 0 and self.step >= self.steps_per_epoch

    @property
    def next_epoch(self) -> int:
        """The epoch the loop runs next: `epoch + 1` once it is complete, else `epoch`."""
        return self.epoch + self.epoch_complete
