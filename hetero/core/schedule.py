"""The schedule of sizes: every rank's batch sizes at each position of training, fixed when first handed out.

A position is epoch x steps_per_epoch + step. A position's sizes are fixed when this rank's sampler first asks for
them (a DataLoader's workers may run ahead), from the regime in force there: the balancer as it was after the last
decision taking effect at or before it. A decision made after position p takes effect at p + 1 + lag; with lag
None, at the first position no rank's sampler has handed out yet (the furthest `handed` over the ranks), so no step
is ever cut two ways. A replay fixes the sizes instead: recorded {epoch: [steps, world]}, no decisions.

The plan (plan.py) owns the schedule and the live balancer it copies regimes from; the sampler, the probe and the
step engine read it. It holds no position of its own: where training is, is the plan's `at`, passed in.
"""
from __future__ import annotations

import copy

import numpy as np

from . import replay
from .agree import HeteroError
from .balancer import Balancer
from .partition import check_feasible
from .rules import micro_batch_too_big, whole
from .settings import Settings

FAR = -(1 << 62)    # the start of the first regime: before any step
ENDLESS = 1 << 62   # steps_per_epoch of a loop without epochs (no batch_sampler): one epoch that never ends


def epoch_length(settings: Settings, n_samples: int) -> int:
    """n_samples checked as an epoch's length: a whole number of at least one global batch."""
    n = whole("n_samples", n_samples, 1)
    if settings.global_batch > n:
        raise ValueError(f"global batch {settings.global_batch} exceeds the {n} samples")
    return n


class SizeSchedule:
    """Every rank's sizes per position of one rank's Balance: the regimes, the replay, the epoch's length, the
    per-rank largest batches."""

    def __init__(self, settings: Settings, rank: int, world: int):
        self.settings, self.rank, self.world = settings, rank, world
        per_rank = settings.per_rank_max(world)
        self.probes = [v == "probe" for v in per_rank]  # ranks whose largest batch bal.probe finds
        self.configured = [float("inf") if v in (None, 0, "probe", float("inf")) else int(v) for v in per_rank]
        self.replayed: dict[int, np.ndarray] | None = None
        self.n_samples: int | None = None
        self.steps_per_epoch = 0  # 0: no epochs (a loop without batch_sampler)
        self._balancer: Balancer | None = None

    # -- the limits -------------------------------------------------------------------------------------------
    def check_limits(self, limits: list[float]) -> list[float]:
        """The per-rank largest batches, checked; with micro-batches they bound m (the counts are unbounded)."""
        m = self.settings.micro_batch
        if (r := micro_batch_too_big(m, limits)) is not None:
            raise ValueError(f"micro_batch {m} exceeds rank {r}'s largest batch {limits[r]:g}: lower micro_batch")
        limits = [float("inf")] * len(limits) if m else limits
        check_feasible(len(limits), self.settings.global_batch, self.settings.min_batch, limits, max(m, 1))
        return limits

    def bound(self, limits: list[float]) -> None:
        """New per-rank largest batches (after a probe): the sizes start afresh within them."""
        self._balancer.bound(self.check_limits(limits))
        self.reset(self._balancer)

    @property
    def limits(self) -> list[float | None]:
        """Every rank's largest batch in force (None: unbounded), as the ranks compare them."""
        return [None if v == float("inf") else v for v in (self._balancer.max_batch or [])]

    def reset(self, balancer: Balancer) -> None:
        """Start afresh from the (live) balancer: at set-up, after a probe, on load_state_dict."""
        self._balancer = balancer
        self.regimes: list[tuple[int, Balancer]] = [(FAR, copy.deepcopy(balancer))]
        self.planned: dict[int, np.ndarray] = {}  # position -> every rank's sizes, fixed when handed out
        self.handed = FAR       # the next position this rank's sampler hands out
        self.iterated: int | None = None  # the epoch a sampler last iterated
        self.last = balancer.sizes  # every rank's sizes at the latest step begun

    # -- the sizes --------------------------------------------------------------------------------------------
    def index(self, epoch: int, step: int) -> int:
        """The position of (epoch, step), counted over every epoch."""
        return epoch * (self.steps_per_epoch or ENDLESS) + step

    def sizes_at(self, epoch: int, step: int) -> np.ndarray:
        """Every rank's sizes at (epoch, step), the same on every rank; fixed from now on."""
        pos = self.index(epoch, step)
        if pos not in self.planned:
            if self.replayed is not None:
                self.planned[pos] = replay.sizes(self.replayed, epoch, step)
            else:  # the regime in force at pos; affine's first epoch probes two sizes (Balancer.sizes_for_step)
                regime = next(b for start, b in reversed(self.regimes) if start <= pos)
                self.planned[pos] = np.array(regime.sizes_for_step(step), np.int64)
            self.handed = max(self.handed, pos + 1)
        return self.planned[pos]

    def handed_out(self, epoch: int, step: int) -> bool:
        """A sampler (or sizes_at) has fixed this step's sizes."""
        return self.index(epoch, step) in self.planned

    def set_length(self, n_samples: int) -> None:
        """The epoch's length: floor(n / B) steps."""
        n = epoch_length(self.settings, n_samples)
        self.n_samples, self.steps_per_epoch = n, n // self.settings.global_batch
        replay.fit(self.replayed, self.world, self.steps_per_epoch)  # a record of other epochs is refused here

    def start_iteration(self, epoch: int, first: int) -> int:
        """A sampler starts handing out `epoch` at step `first` (> 0 in an epoch resumed mid-way): refuse a second
        pass and an epoch already run; returns `first`."""
        if first >= self.steps_per_epoch:
            raise HeteroError(f"hetero: epoch {epoch} has run all its {self.steps_per_epoch} steps and the loader "
                              f"is iterated again: call bal.set_epoch(epoch) before each epoch")
        # positions fixed by sizes_at alone (bal.micro_batches read before the first batch) are handed out as
        # fixed; only a second pass of a sampler over the epoch is refused
        if self.index(epoch, first) < self.handed and self.iterated == epoch:
            raise HeteroError(f"hetero: the loader was iterated twice in epoch {epoch} (a `next(iter(loader))` "
                              f"peek, or a second pass): each step's batches are handed out once; learn the "
                              f"sizes from bal.sizes_at(epoch, step) instead of peeking")
        self.iterated = epoch
        return first

    def ended(self, pos: int) -> None:
        """The step at pos ended: the sizes fixed up to it are no longer needed."""
        self.planned = {p: v for p, v in self.planned.items() if p > pos}

    # -- regimes (a decision's sizes from where it takes effect) ----------------------------------------------
    def adopt(self, pos: int, furthest: int) -> int:
        """The live balancer just decided after the step at pos: its copy is the regime from where the decision
        takes effect, which it returns; furthest: the ranks' furthest `handed`. Every rank computes it from the same
        gathered numbers, so a refusal stops every rank alike."""
        lag = self.settings.lag
        at = pos + 1 + (lag or 0)
        if lag is None:
            at = max(at, furthest)
        elif furthest > at:
            raise HeteroError(f"hetero: a batch sampler ran {furthest - pos - 1} steps ahead of training, beyond "
                              f"lag={lag}: set lag >= num_workers x prefetch_factor (+1 for Lightning), or None")
        self.regimes = [r for i, r in enumerate(self.regimes)  # regimes no position after pos can use go
                        if i + 1 == len(self.regimes) or self.regimes[i + 1][0] > pos]
        self.regimes.append((at, copy.deepcopy(self._balancer)))
        return at

    def regimes_state(self, here: int) -> list:
        """The regimes still in force from position `here` on, as plain data: a decision made before a checkpoint
        that takes effect after it (DataLoader workers ran ahead) keeps the sizes the steps between were cut with."""
        first = max((i for i, (start, _) in enumerate(self.regimes) if start <= here), default=0)
        return [[None if start == FAR else start, b.state_dict()] for start, b in self.regimes[first:]]

    def load_regimes(self, saved: list) -> None:
        """The regimes of regimes_state, over copies of the live balancer."""
        self.regimes = []
        for start, b in saved:
            regime = copy.deepcopy(self._balancer)
            regime.load_state_dict(b)
            self.regimes.append((FAR if start is None else whole("regime start", start, 0), regime))
        self.last = self.regimes[0][1].sizes
