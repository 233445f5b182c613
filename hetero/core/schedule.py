"""The schedule: every rank's batch sizes per position (epoch x steps_per_epoch + step), the same on every rank.

A position's sizes are fixed when this rank's sampler first asks for them (a DataLoader's workers may run ahead),
from the regime in force there: the balancer as it was after the last decision taking effect at or before it. A
decision made after position p takes effect at p + 1 + lag; with lag None, at the first position no rank's sampler
has handed out yet (the furthest `handed` over the ranks), so no step is ever cut two ways. A replay fixes the
sizes instead: recorded {epoch: [steps, world]}, no decisions.
"""
from __future__ import annotations

import copy

import numpy as np

from .agree import HeteroError
from .balancer import Balancer

FAR = -(1 << 62)    # the start of the first regime: before any step
ENDLESS = 1 << 62   # steps_per_epoch of a loop without epochs (no batch_sampler): one epoch that never ends


class Schedule:
    def __init__(self, balancer: Balancer, lag: int | None):
        self.lag = lag
        self.replayed: dict[int, np.ndarray] | None = None
        self.reset(balancer)

    def reset(self, balancer: Balancer) -> None:
        """Start afresh from this balancer (at set-up, after a probe, on load_state_dict)."""
        self.regimes: list[tuple[int, Balancer]] = [(FAR, copy.deepcopy(balancer))]
        self.planned: dict[int, np.ndarray] = {}  # position -> every rank's sizes, fixed when handed out
        self.handed = FAR       # the next position this rank's sampler hands out
        self.iterated: int | None = None  # the epoch a sampler last iterated

    def sizes(self, epoch: int, step: int, pos: int) -> np.ndarray:
        """Every rank's sizes at (epoch, step), position pos; fixed from now on."""
        if pos not in self.planned:
            if self.replayed is not None:
                self.planned[pos] = np.asarray(self.replayed[epoch][step], np.int64)
            else:  # the regime in force at pos; affine's first epoch probes two sizes (Balancer.sizes_for_step)
                regime = next(b for start, b in reversed(self.regimes) if start <= pos)
                self.planned[pos] = np.array(regime.sizes_for_step(step), np.int64)
            self.handed = max(self.handed, pos + 1)
        return self.planned[pos]

    def start_iteration(self, epoch: int, first: int) -> None:
        """A sampler starts handing out `epoch` (its first position `first`): refuse a second pass over it."""
        if first < self.handed:
            if self.iterated == epoch:
                raise HeteroError(f"hetero: the loader was iterated twice in epoch {epoch} (a `next(iter(loader))` "
                                  f"peek, or a second pass): each step's batches are handed out once; learn the "
                                  f"sizes from bal.sizes_at(epoch, step) instead of peeking")
            raise HeteroError(f"hetero: epoch {epoch} was already handed out: call bal.set_epoch(epoch) each epoch")
        self.iterated = epoch

    def done(self, pos: int) -> None:
        """The step at pos ended: its sizes and those before are no longer needed."""
        self.planned = {p: s for p, s in self.planned.items() if p > pos}

    def effective(self, pos: int, furthest: int) -> int:
        """Where a decision made after the step at pos takes effect; furthest: the ranks' furthest `handed`.
        Every rank computes it from the same gathered numbers, so a refusal stops every rank alike."""
        at = pos + 1 + (self.lag or 0)
        if self.lag is None:
            return max(at, furthest)
        if furthest > at:
            raise RuntimeError(f"hetero: a batch sampler ran {furthest - pos - 1} steps ahead of training, beyond "
                               f"lag={self.lag}: set lag >= num_workers x prefetch_factor (+1 for Lightning), or None")
        return at

    def decided(self, pos: int, at: int, balancer: Balancer) -> None:
        """A new regime from `at` on; regimes no position after pos can use are dropped."""
        self.regimes = [r for i, r in enumerate(self.regimes)
                        if i + 1 == len(self.regimes) or self.regimes[i + 1][0] > pos]
        self.regimes.append((at, copy.deepcopy(balancer)))
