"""Per-rank index slices of one shared permutation per epoch, with the same number of steps on every rank.

Step s of an epoch consumes the global-batch window perm[s*B:(s+1)*B]; rank r takes the part of that window at
offset sum(b[:r]) of length b[r]. So slices are disjoint by construction, every rank runs floor(N/B) steps,
each sample is seen at most once per epoch and only the N mod B < B samples past the last window are left out.
Because the cut is made per step, batch sizes may change at any step (mid-epoch rebalancing) and the
not-yet-seen part of the permutation is simply cut differently: nothing is repeated or dropped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from .plan import Plan
from .seeding import permutation


class EpochPlan:
    """The shared permutation of one epoch; identical on every rank (seeded by run seed and epoch)."""

    def __init__(self, n_samples: int, global_batch: int, seed: int, epoch: int, device: torch.device | str = "cpu"):
        if global_batch > n_samples:
            raise ValueError(f"global batch {global_batch} exceeds the {n_samples} training samples")
        self.global_batch = global_batch
        self.steps = n_samples // global_batch
        # drawn on the CPU (the same permutation whatever the devices), then moved once per epoch: on a GPU the
        # per-step slices are then device tensors, and no step waits for a host-to-device copy of its indices
        self.perm = permutation(n_samples, seed, epoch).to(device)
        self._listed: list[int] | None = None  # perm as a list, for the sampler (index_list)
        self._cached: tuple = (None, None, 0, 0)  # (read-only sizes, rank, offset in the window, length): _cut

    def _cut(self, step: int, sizes, rank: int) -> tuple[int, int]:
        """Where `rank`'s slice of `step` starts in the permutation, and its length. A regime's read-only sizes
        (schedule._fixed), the same object step after step, are checked and summed once (issue 51)."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} outside 0..{self.steps - 1}")
        held, at, offset, n = self._cached
        if held is not sizes or at != rank:
            ints = [int(b) for b in sizes]
            if sum(ints) != self.global_batch:
                raise ValueError(f"batch sizes {ints} do not sum to the global batch {self.global_batch}")
            offset, n = sum(ints[:rank]), ints[rank]
            if isinstance(sizes, np.ndarray) and not sizes.flags.writeable and sizes.base is None:
                self._cached = (sizes, rank, offset, n)
        return step * self.global_batch + offset, n

    def indices(self, step: int, sizes, rank: int) -> torch.Tensor:
        """Sample indices of `rank` at `step`, given every rank's batch size for that step (sizes sum to B)."""
        start, n = self._cut(step, sizes, rank)
        return self.perm[start:start + n]

    def index_list(self, step: int, sizes, rank: int) -> list[int]:
        """`indices` as a list, cut from the permutation's list made once per epoch (no tensor per step)."""
        if self._listed is None:
            self._listed = self.perm.tolist()
        start, n = self._cut(step, sizes, rank)
        return self._listed[start:start + n]


class BalancedBatchSampler(torch.utils.data.Sampler):
    """Rank r's slice of each step's window of one shared per-epoch permutation (sampler.EpochPlan); with a
    micro_batch m, the slice in k_r micro-batches of m (each rank's slice is a whole number of them). Made by
    Balance.batch_sampler; it reads the plan of sizes (plan.py) and starts epochs through `start_epoch`.

    The plan comes from `plan()` when first needed, not at construction: a launcher that starts the processes after
    the loader is built (Lightning's own) binds the world in between, and the sampler reads that world's plan."""

    def __init__(self, plan: Callable[[], Plan], n_samples: int, seed: int, start_epoch: Callable[[int], None]):
        self._plan, self.n_samples, self.seed, self._start_epoch = plan, n_samples, seed, start_epoch

    def __len__(self) -> int:
        """Batches per epoch; with micro-batches at most this many: a rank's count may grow at any decision, and a
        loader stopped at its length (Lightning stops it there) must not cut a step short."""
        p = self._plan()
        m, spe = p.settings.micro_batch, p.schedule.steps_per_epoch
        if not m:
            return spe
        others = 0 if p.settings.sit_out else p.world - 1  # each other rank runs at least one micro-batch
        if p.settings.by_tokens:  # ... of at least min_batch rows; cut by max_tokens, as many as its rows
            rows = max(1, p.schedule.most_rows() - others * p.settings.min_batch)
            return spe * (rows if p.settings.max_tokens is not None else -(-rows // m))
        return spe * max(1, p.settings.global_batch // m - others)

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this before each epoch
        self._start_epoch(epoch)

    def plan(self, epoch: int, device: torch.device | str = "cpu") -> EpochPlan:
        """The epoch's shared permutation, for a loop that cuts its own batches (on the device: the built-in
        trainer): its `indices(step, bal.sizes_at(epoch, step), rank)` is what iterating would hand out."""
        if (p := self._plan()).settings.by_tokens:
            raise ValueError("hetero: split by tokens, a rank's rows are not a slice of the permutation: read "
                             "sampler.rows_at(epoch, step)")
        return EpochPlan(self.n_samples, p.settings.global_batch, self.seed, epoch, device)

    def rows_at(self, epoch: int, step: int) -> list[int]:
        """Split by tokens (a Balance with collator): this rank's sample indices at (epoch, step), what iterating hands
        out there, for a loop that cuts its own batches; fixed once asked for."""
        p = self._plan()
        return p.schedule.rows_at(epoch, step)[p.rank].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        p = self._plan()
        at, sched = p.at, p.schedule
        # refuses a second pass; > 0 in an epoch resumed mid-way
        first = sched.start_iteration(at.epoch, at.step if at.started else 0)
        epoch, m = at.epoch, p.settings.micro_batch
        plan = None if sched.cost is not None else EpochPlan(self.n_samples, p.settings.global_batch, self.seed, epoch)
        for step in range(first, sched.steps_per_epoch):
            if sched.cost is not None and m:  # by tokens: cut by count and max_tokens
                yield from (b.tolist() for b in sched.micro_at(epoch, step)[p.rank])
                continue
            idx = sched.rows_at(epoch, step)[p.rank].tolist() if sched.cost is not None else \
                plan.index_list(step, sched.sizes_at(epoch, step), p.rank)
            if not m:
                yield idx
                continue
            yield from (idx[i:i + m] for i in range(0, len(idx), m))
