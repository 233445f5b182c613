"""One step of one rank, as the Balance runs it: every rank's sizes, this rank's gradient weight and micro-batch
count, the step clock, and the all-reduce buckets still in flight (the comm hook reports them here)."""
from __future__ import annotations

import threading

import numpy as np
import torch

from .clock import StepClock

# the comm hook's bucket counts, shared by every step: each holds it for a few operations, and a lock made per step
# was one more allocation on every step's path (issue 51)
_BUCKETS = threading.Lock()


class Step:
    """Made by the step engine's `begin` (engine.py; `bal.begin_step` and `with bal.step()` call it), which counts
    the micro-batches, syncs and forwards; the comm hook and FSDP2's reduce-scatter read `weight` and `clock` and
    report through `bucket_sent` / `bucket_back`, and the optimizer guard reads `expected` and `left`."""
    __slots__ = ("epoch", "index", "sizes", "rank", "work", "weight", "expected", "left", "syncs", "forwards",
                 "delay_s", "_in_flight", "_all_sent", "clock")

    def __init__(self, epoch: int, index: int, sizes: np.ndarray, rank: int, weight: float, micro_batches: int,
                 device: torch.device, work: np.ndarray | None = None):
        self.epoch, self.index, self.sizes, self.rank, self.work = epoch, index, sizes, rank, work
        self.weight = weight           # this rank's factor on its gradients: b_i/B, m/B, or 1/(world k_i)
        self.expected = self.left = micro_batches  # micro-batches this rank runs in the step; left to run
        self.syncs = self.forwards = 0  # gradient all-reduces and training forwards seen in the step
        self.delay_s = 0.0              # an emulated slow rank's delay, spent when its gradients were ready
        self._in_flight, self._all_sent = 0, False
        self.clock = StepClock(device)
        self.clock.start()

    @property
    def sits_out(self) -> bool:
        """This rank's batch is 0 (affine's sit-out): it still runs forward and backward, with weight 0."""
        return int(self.sizes[self.rank]) == 0

    @property
    def last_micro_batch(self) -> bool:
        """The micro-batch about to run is the step's last: its backward all-reduces."""
        return self.left <= 1

    def bucket_sent(self, last: bool) -> None:
        """The comm hook handed one bucket to the all-reduce (last: the step's last bucket)."""
        with _BUCKETS:
            self._in_flight += 1
            self._all_sent = last

    def bucket_back(self) -> None:
        """One bucket's all-reduce finished (gloo may finish them out of order): the wait ends with the last."""
        with _BUCKETS:
            self._in_flight -= 1
            if self._in_flight == 0 and self._all_sent:
                self.clock.mark("returned")
