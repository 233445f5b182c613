"""The plan: every rank's batch sizes per position, where training is, and the decisions that move the sizes.

A position is epoch x steps_per_epoch + step. A position's sizes are fixed when this rank's sampler first asks for
them (a DataLoader's workers may run ahead), from the regime in force there: the balancer as it was after the last
decision taking effect at or before it. A decision made after position p takes effect at p + 1 + lag; with lag
None, at the first position no rank's sampler has handed out yet (the furthest `handed` over the ranks), so no step
is ever cut two ways. A replay fixes the sizes instead: recorded {epoch: [steps, world]}, no decisions.

The plan also holds where training is (`at`: the epoch and the steps ended in it, one value), the window of
finished steps since the last decision, and the balancer; `state_dict` is all of it that a resume needs. The parts
above it (the step engine, the sampler, the probe) call down into it; it calls nothing above.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from .agree import HeteroError, gather_rows, guarded, remap_identities
from .balancer import Balancer
from .cpuquota import own_quota
from .partition import check_feasible
from .records import Decision, StepRecord
from .rules import micro_batch_too_big, whole
from .settings import Settings
from .step import Step

FAR = -(1 << 62)    # the start of the first regime: before any step
ENDLESS = 1 << 62   # steps_per_epoch of a loop without epochs (no batch_sampler): one epoch that never ends
STATE_VERSION = 2   # state_dict's format: 2 holds the position and the window's observations itself


@dataclass(frozen=True)
class At:
    """Where training is: `step` steps of `epoch` have ended; started False before the epoch's set_epoch."""
    epoch: int = 0
    step: int = 0
    started: bool = False



def epoch_length(settings: Settings, n_samples: int) -> int:
    """n_samples checked as an epoch's length: a whole number of at least one global batch."""
    n = whole("n_samples", n_samples, 1)
    if settings.global_batch > n:
        raise ValueError(f"global batch {settings.global_batch} exceeds the {n} samples")
    return n

class Plan:
    """The schedule of sizes, the position, the decision window and the balancer of one rank's Balance."""

    def __init__(self, settings: Settings, rank: int, world: int):
        self.settings, self.rank, self.world = settings, rank, world
        per_rank = settings.per_rank_max(world)
        self.probes = [v == "probe" for v in per_rank]  # ranks whose largest batch bal.probe finds
        self.configured = [float("inf") if v in (None, 0, "probe", float("inf")) else int(v) for v in per_rank]
        limits = self.check_limits(self.configured)
        self.balancer = Balancer(settings.rule, world, settings.global_batch, settings.min_batch,
                                 None if all(v == float("inf") for v in limits) else limits,
                                 granularity=max(settings.micro_batch, 1), smoothing=settings.smoothing,
                                 deadband=settings.deadband, significance=settings.significance,
                                 sit_out=settings.sit_out)
        self.quota = own_quota()  # this rank's CFS quota (s of CPU per period s; inf: none), gathered at decisions
        self.replayed: dict[int, np.ndarray] | None = None
        self.n_samples: int | None = None
        self.steps_per_epoch = 0  # 0: no epochs (a loop without batch_sampler)
        self.at, self.global_step = At(), 0
        self.decisions: list[Decision] = []
        self.identities: list[str] | None = None  # every rank's worker identity (gathered at attach)
        self.last = self.balancer.sizes  # every rank's sizes at the latest step begun
        self._new_epoch()
        self.reset()

    # -- the sizes --------------------------------------------------------------------------------------------
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
        self.balancer.bound(self.check_limits(limits))
        self.reset()

    def reset(self) -> None:
        """Start the schedule afresh from the balancer (at set-up, after a probe, on load_state_dict)."""
        self.regimes: list[tuple[int, Balancer]] = [(FAR, copy.deepcopy(self.balancer))]
        self.planned: dict[int, np.ndarray] = {}  # position -> every rank's sizes, fixed when handed out
        self.handed = FAR       # the next position this rank's sampler hands out
        self.iterated: int | None = None  # the epoch a sampler last iterated
        self.last = self.balancer.sizes

    def position(self, epoch: int, step: int) -> int:
        return epoch * (self.steps_per_epoch or ENDLESS) + step

    def sizes_at(self, epoch: int, step: int) -> np.ndarray:
        """Every rank's sizes at (epoch, step), the same on every rank; fixed from now on."""
        pos = self.position(epoch, step)
        if pos not in self.planned:
            if self.replayed is not None:
                self.planned[pos] = np.asarray(self.replayed[epoch][step], np.int64)
            else:  # the regime in force at pos; affine's first epoch probes two sizes (Balancer.sizes_for_step)
                regime = next(b for start, b in reversed(self.regimes) if start <= pos)
                self.planned[pos] = np.array(regime.sizes_for_step(step), np.int64)
            self.handed = max(self.handed, pos + 1)
        return self.planned[pos]

    def handed_out(self, epoch: int, step: int) -> bool:
        """A sampler (or sizes_at) has fixed this step's sizes."""
        return self.position(epoch, step) in self.planned

    def set_length(self, n_samples: int) -> None:
        """The epoch's length: floor(n / B) steps."""
        n = epoch_length(self.settings, n_samples)
        self.n_samples, self.steps_per_epoch = n, n // self.settings.global_batch

    def start_iteration(self, epoch: int) -> int:
        """A sampler starts handing out `epoch`: refuse a second pass and an epoch already run; returns the step to
        start at (> 0 in an epoch resumed mid-way)."""
        at = self.at
        first = at.step if at.started and at.epoch == epoch else 0
        if at.started and at.epoch == epoch and first >= self.steps_per_epoch:
            raise HeteroError(f"hetero: epoch {epoch} has run all its {self.steps_per_epoch} steps and the loader "
                              f"is iterated again: call bal.set_epoch(epoch) before each epoch")
        pos = self.position(epoch, first)
        if pos < self.handed:
            if self.iterated == epoch:
                raise HeteroError(f"hetero: the loader was iterated twice in epoch {epoch} (a `next(iter(loader))` "
                                  f"peek, or a second pass): each step's batches are handed out once; learn the "
                                  f"sizes from bal.sizes_at(epoch, step) instead of peeking")
            raise HeteroError(f"hetero: epoch {epoch} was already handed out: call bal.set_epoch(epoch) each epoch")
        self.iterated = epoch
        return first

    # -- the position -----------------------------------------------------------------------------------------
    def _new_epoch(self) -> None:
        self.records: list[StepRecord] = []  # this epoch's finished steps whose clocks were read
        self._unread: list[Step] = []        # finished steps whose clocks are not read yet
        self._window = 0                      # records before this index were part of an earlier decision

    def start_epoch(self, epoch: int) -> None:
        """A new epoch begins (set_epoch)."""
        self.at = At(epoch, 0, True)
        self._new_epoch()

    def ended(self, s: Step) -> bool:
        """A step ended: keep it for the window, move the position; True when a decision is due now."""
        self._unread.append(s)
        pos = self.position(self.at.epoch, s.index)
        self.planned = {p: v for p, v in self.planned.items() if p > pos}
        self.at, self.global_step = At(self.at.epoch, s.index + 1, True), self.global_step + 1
        every = self.settings.rebalance_every
        due = s.index == self.steps_per_epoch - 1 or (every and (s.index + 1) % every == 0)
        return bool(due) and self.settings.rule != "static" and self.replayed is None

    def epoch_records(self) -> list[StepRecord]:
        """This epoch's finished steps so far, in order (reads the clocks: on CUDA, waits for their events)."""
        for s in self._unread:
            compute, wait = s.clock.read()
            self.records.append(StepRecord(self.at.epoch, s.index, s.sizes, compute, wait, s.delay_s, s.clock.cpu_s(),
                                          s.clock.started))
        self._unread.clear()
        return self.records

    # -- decisions (collective) -------------------------------------------------------------------------------
    def decide(self, step: int, coll: torch.device) -> Decision:
        """Gather every rank's compute times of the window and its sampler position, run the pure balancer."""
        window = self.epoch_records()[self._window:]
        n = len(window)
        # per rank: [compute_s x n, cpu_s x n, quota_s, period_s, mean step interval, furthest sampler position]
        own = torch.tensor([*(r.compute_s for r in window), *(r.cpu_s for r in window), *self.quota,
                            self._interval(window), float(self.handed)], dtype=torch.float64)
        rows = (guarded(gather_rows, own, coll) if self.world > 1 else own[None]).numpy()
        self._window = len(self.records)
        compute, cpu = rows[:, :n].T, rows[:, n:2 * n].T  # [steps, world] each
        furthest = int(rows[:, -1].max())  # the furthest sampler
        pos = self.position(self.at.epoch, step)
        at = self._effective(pos, furthest)
        self.balancer.set_quota(rows[:, 2 * n], rows[:, 2 * n + 1])
        paces = rows[:, 2 * n + 2][np.isfinite(rows[:, 2 * n + 2])]
        if len(paces) and n:  # the steps' pace beyond their slowest compute: the all-reduce, the loop's own time
            self.balancer.overhead_s = max(float(np.median(paces) - compute.max(1).mean()), 0.0)
        self.balancer.observe(np.stack([r.sizes for r in window]), compute, cpu)
        self.balancer.decide()
        self.regimes = [r for i, r in enumerate(self.regimes)  # regimes no position after pos can use go
                        if i + 1 == len(self.regimes) or self.regimes[i + 1][0] > pos]
        self.regimes.append((at, copy.deepcopy(self.balancer)))
        d = Decision(self.at.epoch, step, at, self.balancer.sizes.tolist(), self.balancer.shares.tolist(),
                     compute.mean(0).tolist())
        self.decisions.append(d)
        return d

    def _interval(self, window) -> float:
        """This rank's mean time (s) from one step's start to the next's over the window (the epoch's step before
        it included); NaN with fewer than two steps."""
        starts = [r.started_s for r in self.records[max(self._window - 1, 0):]] if window else []
        gaps = np.diff(starts)
        return float(np.mean(gaps)) if len(gaps) else float("nan")

    def _effective(self, pos: int, furthest: int) -> int:
        """Where a decision made after the step at pos takes effect; furthest: the ranks' furthest `handed`.
        Every rank computes it from the same gathered numbers, so a refusal stops every rank alike."""
        lag = self.settings.lag
        at = pos + 1 + (lag or 0)
        if lag is None:
            return max(at, furthest)
        if furthest > at:
            raise HeteroError(f"hetero: a batch sampler ran {furthest - pos - 1} steps ahead of training, beyond "
                              f"lag={lag}: set lag >= num_workers x prefetch_factor (+1 for Lightning), or None")
        return at

    def _fold(self, coll: torch.device) -> None:
        """Collective: the window's steps into the balancer's observations (the next decision sees the same sums)."""
        if self.settings.rule == "static" or self.replayed is not None:
            return
        window = self.epoch_records()[self._window:]
        if not window:  # the same on every rank: the ranks end steps in lockstep
            return
        n = len(window)
        own = torch.tensor([*(r.compute_s for r in window), *(r.cpu_s for r in window)], dtype=torch.float64)
        rows = (guarded(gather_rows, own, coll) if self.world > 1 else own[None]).numpy()
        self._window = len(self.records)
        self.balancer.observe(np.stack([r.sizes for r in window]), rows[:, :n].T, rows[:, n:].T)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self, coll: torch.device) -> dict:
        """Collective (between steps, on every rank): plain data for load_state_dict, the position included."""
        self._fold(coll)
        at = self.at
        mid = at.started and 0 < at.step < (self.steps_per_epoch or ENDLESS)
        here = self.position(at.epoch, at.step)
        first = max((i for i, (start, _) in enumerate(self.regimes) if start <= here), default=0)
        # the regimes still in force from here on: a decision made before the checkpoint that takes effect after it
        # (DataLoader workers ran ahead) keeps the sizes the steps between were cut with
        regimes = [[None if start == FAR else start, b.state_dict()] for start, b in self.regimes[first:]]
        return {"version": STATE_VERSION, "balancer": self.balancer.state_dict(), "epoch": at.epoch,
                "step": at.step if mid else 0, "global_step": self.global_step, "identities": self.identities,
                "steps_per_epoch": self.steps_per_epoch, "regimes": regimes}

    def load_state_dict(self, state: dict, identities: list[str] | None) -> None:
        """Resume: the balancer (carried over by worker identity to this world's, when known) and the position."""
        saved, ids = state["balancer"], state.get("identities")
        if (b := int(np.sum(saved["sizes"]))) != self.settings.global_batch:  # the sizes cut each step's window
            raise ValueError(f"a state of the global batch {b}, but this Balance's is {self.settings.global_batch}: "
                             f"resume with global_batch={b}")
        if ids is not None and len(ids) != len(saved["shares"]):
            raise ValueError(f"a balancer state of {len(saved['shares'])} rank(s) with {len(ids)} identities")
        src = remap_identities(ids, len(saved["shares"]), identities, self.world)
        if src == list(range(self.world)) and len(saved["shares"]) == self.world:
            self.balancer.load_state_dict(saved)
        else:
            self.balancer.load_remapped(saved, src)
        epoch, step = whole("epoch", state["epoch"], 0), whole("step", state.get("step", 0), 0)
        spe = state.get("steps_per_epoch")
        if step and self.steps_per_epoch and spe not in (None, self.steps_per_epoch):
            raise ValueError(f"a mid-epoch state of an epoch of {spe} steps, but this epoch has "
                             f"{self.steps_per_epoch}: the data set or global_batch changed")
        if step and not step < (self.steps_per_epoch or ENDLESS):
            raise ValueError(f"a mid-epoch state at step {step} of an epoch of {self.steps_per_epoch} steps")
        self.global_step = whole("global_step", state["global_step"], 0)
        self.reset()
        same = src == list(range(self.world)) and len(saved["shares"]) == self.world
        if same and state.get("regimes") and spe in (None, self.steps_per_epoch):  # else: from the balancer alone
            self.regimes = []
            for start, b in state["regimes"]:
                regime = copy.deepcopy(self.balancer)
                regime.load_state_dict(b)
                self.regimes.append((FAR if start is None else whole("regime start", start, 0), regime))
            self.last = self.regimes[0][1].sizes
        self._new_epoch()
        # mid-epoch: the epoch goes on at `step` (set_epoch(epoch) then leaves it as it is)
        self.at = At(epoch, step, bool(step))
