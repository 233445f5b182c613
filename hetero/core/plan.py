"""The plan: where training is, the schedule of sizes, and the decisions that move the sizes.

The plan holds where training is (`at`: the epoch, the steps ended in it and over every epoch, one frozen value),
the schedule of every rank's sizes per position (schedule.py), the window of finished steps since the last decision,
and the balancer; `state_dict` is all of it that a resume needs. The parts above it (the step engine, the sampler,
the probe) call down into it; it calls nothing above.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .agree import gather_rows, guarded, remap_identities
from .balancer import Balancer
from .cpuquota import own_quota
from .partition import batch_sizes
from .records import Decision, StepRecord
from .rules import whole
from .schedule import ENDLESS, SizeSchedule
from .settings import Settings
from .step import Step
from .tokens import CostModel

STATE_VERSION = 3   # state_dict's format: 2 holds the position and the window's observations itself; 3 saves a
                    # complete epoch as step = steps_per_epoch (2 saved it as step 0, which also meant "not begun")


class At(NamedTuple):
    """Where training is: `step` steps of `epoch` have ended, `global_step` over every epoch; started False before the
    epoch's set_epoch. (A named tuple: one is made per step, a third of a frozen dataclass's cost.)"""
    epoch: int = 0
    step: int = 0
    started: bool = False
    global_step: int = 0


class Plan:
    """The position, the schedule of sizes, the decision window and the balancer of one rank's Balance."""

    def __init__(self, settings: Settings, rank: int, world: int):
        self.settings, self.rank, self.world = settings, rank, world
        self.schedule = SizeSchedule(settings, rank, world)
        limits = self.schedule.check_limits(self.schedule.configured)
        # under a token budget no count is fixed, and the balancer (which a split by tokens keeps for its bounds
        # and state, not for its sizes) holds every rank's least
        nominal = settings.global_batch or world * settings.min_batch * max(settings.micro_batch, 1)
        self._balancer = Balancer(settings.rule, world, nominal, settings.min_batch,
                                  None if all(v == float("inf") for v in limits) else limits,
                                  granularity=max(settings.micro_batch, 1), smoothing=settings.smoothing,
                                  deadband=settings.deadband, significance=settings.significance,
                                  sit_out=settings.sit_out)
        # by tokens: every rank's fixed and per-token cost, fitted at each decision (the regimes copy it)
        self._costs = CostModel(world, attention=settings.attention) if settings.by_tokens else None
        self._quota = own_quota()  # this rank's CFS quota (s of CPU per period s; inf: none), gathered at decisions
        self.at = At()
        self._decisions: list[Decision] = []
        self.identities: list[str] | None = None  # every rank's worker identity (gathered at attach)
        # a resumed plan's first step, kept out of every window: its process's warm-up (lazy initialisation, the
        # allocator, the autograd graph's first build, a framework's restore), which a fresh run's first window
        # shares with as many steps as the window has, but a resumed window may hold it alone (#48 item 2)
        self._warming, self._cold = False, None
        self._new_epoch()
        self.schedule.reset(self._balancer, self._costs)

    @property
    def decisions(self) -> list[Decision]:
        """Every decision so far, in order (identical on every rank)."""
        return self._decisions

    # -- the position -----------------------------------------------------------------------------------------
    def _new_epoch(self) -> None:
        self._records: list[StepRecord] = []  # this epoch's finished steps whose clocks were read
        self._unread: list[Step] = []         # finished steps whose clocks are not read yet
        self._window = 0                       # records before this index were part of an earlier decision

    def start_epoch(self, epoch: int) -> None:
        """A new epoch begins (set_epoch)."""
        self.at = At(epoch, 0, True, self.at.global_step)
        self._new_epoch()

    def end_step(self, s: Step, coll: torch.device) -> Decision | None:
        """A step ended: keep it for the window and move the position; every K steps and at the epoch's end, decide
        (collective: every rank's compute times of the window and its sampler position, into the pure balancer)."""
        self._unread.append(s)
        at, sched = self.at, self.schedule
        sched.ended(sched.index(at.epoch, s.index))
        self.at = At(at.epoch, s.index + 1, True, at.global_step + 1)
        every = self.settings.rebalance_every
        due = s.index == sched.steps_per_epoch - 1 or (every and (s.index + 1) % every == 0)
        if not due or self.settings.rule == "static" or sched.replayed is not None:
            return None
        return guarded(self._decide, s.index, coll)

    def epoch_records(self) -> list[StepRecord]:
        """This epoch's finished steps so far, in order (reads the clocks: on CUDA, waits for their events)."""
        for s in self._unread:
            compute, wait = s.clock.read()
            self._records.append(StepRecord(self.at.epoch, s.index, s.sizes, compute, wait, s.delay_s,
                                            s.clock.cpu_s(), s.clock.started, s.work))
            if self._warming:
                self._cold, self._warming = self._records[-1], False
        self._unread.clear()
        return self._records

    def _open(self) -> list[StepRecord]:
        """The window: this epoch's steps since the last decision, less a resumed plan's first step."""
        return [r for r in self.epoch_records()[self._window:] if r is not self._cold]

    # -- decisions (collective) -------------------------------------------------------------------------------
    def _decide(self, step: int, coll: torch.device) -> Decision:
        """Gather every rank's compute times of the window and its sampler position, run the pure balancer. A window
        holding only a resumed plan's first step decides nothing (on every rank alike: each resumed from the same
        state): its observations wait for the next decision."""
        window = self._open()
        if not window:
            return None
        n, sched, b = len(window), self.schedule, self._balancer
        # per rank: [compute_s x n, cpu_s x n, quota_s, period_s, mean step interval, furthest sampler position]
        own = torch.tensor([*(r.compute_s for r in window), *(r.cpu_s for r in window), *self._quota,
                            self._interval(window), float(sched.handed)], dtype=torch.float64)
        rows = (gather_rows(own, coll) if self.world > 1 else own[None]).numpy()
        self._window = len(self._records)
        compute, cpu = rows[:, :n].T, rows[:, n:2 * n].T  # [steps, world] each
        furthest = int(rows[:, -1].max())  # the furthest sampler
        b.set_quota(rows[:, 2 * n], rows[:, 2 * n + 1])
        paces = rows[:, 2 * n + 2][np.isfinite(rows[:, 2 * n + 2])]
        if len(paces) and n:  # the steps' pace beyond their slowest compute: the all-reduce, the loop's own time
            b.overhead_s = max(float(np.median(paces) - compute.max(1).mean()), 0.0)
        if self._costs is not None:  # by tokens: the cost model learns, the split follows each step's lengths
            before = self._costs.per_unit_s
            self._costs.observe(np.stack([r.work for r in window]), compute)
            changed = not np.array_equal(before, self._costs.per_unit_s)
            shares = self._costs.shares()
            B = self.settings.global_batch or max(sched.n_samples // sched.steps_per_epoch, self.world)
            sizes, chosen, even, noise = batch_sizes(shares, B, self.settings.min_batch, None), None, None, None
        else:
            b.observe(np.stack([r.sizes for r in window]), compute, cpu)
            changed = b.decide()
            shares, sizes, noise = b.shares, b.sizes, b.window_noise_s
            chosen, even = b.predicted() or (None, None)  # the read-out's numbers, kept with the decision
        at = sched.adopt(sched.index(self.at.epoch, step), furthest)
        costs = {} if self._costs is None else {"fixed_s": self._costs.fixed_s.tolist(),
                                                 "per_unit_s": self._costs.per_unit_s.tolist(),
                                                 "attention": self._costs.attention}
        d = Decision(self.at.epoch, step, at, sizes.tolist(), shares.tolist(), compute.mean(0).tolist(), chosen,
                     even, noise, changed, **costs)
        self._decisions.append(d)
        return d

    def _interval(self, window) -> float:
        """This rank's mean time (s) from one step's start to the next's over the window (the epoch's step before
        it included); NaN with fewer than two steps."""
        starts = [r.started_s for r in self._records[max(self._window - 1, 0):] if r is not self._cold] if window \
            else []
        # the mean gap is the span over the gaps (no numpy round trip on a decision's path; issue 51)
        return (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else float("nan")

    def _fold(self, coll: torch.device) -> None:
        """Collective: the window's steps into the balancer's observations (the next decision sees the same sums)."""
        if self.settings.rule == "static" or self.schedule.replayed is not None:
            return
        window = self._open()
        if not window:  # the same on every rank: the ranks end steps in lockstep
            return
        n = len(window)
        own = torch.tensor([*(r.compute_s for r in window), *(r.cpu_s for r in window)], dtype=torch.float64)
        rows = (guarded(gather_rows, own, coll) if self.world > 1 else own[None]).numpy()
        self._window = len(self._records)
        if self._costs is not None:
            self._costs.observe(np.stack([r.work for r in window]), rows[:, :n].T)
        else:
            self._balancer.observe(np.stack([r.sizes for r in window]), rows[:, :n].T, rows[:, n:].T)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self, coll: torch.device) -> dict:
        """Collective (between steps, on every rank): plain data for load_state_dict, the position included."""
        self._fold(coll)
        at, sched = self.at, self.schedule
        return {"version": STATE_VERSION, "balancer": self._balancer.state_dict(), "epoch": at.epoch,
                "step": at.step if at.started else 0, "global_step": at.global_step, "identities": self.identities,
                "steps_per_epoch": sched.steps_per_epoch,
                "regimes": sched.regimes_state(sched.index(at.epoch, at.step)),
                **({"token_budget": self.settings.token_budget} if self.settings.budgeted else {}),
                **({"costs": self._costs.state_dict()} if self._costs is not None else {})}

    def load_state_dict(self, state: dict, identities: list[str] | None) -> None:
        """Resume: the balancer (carried over by worker identity to this world's, when known) and the position."""
        saved, ids, sched = state["balancer"], state.get("identities"), self.schedule
        if (t := state.get("token_budget")) != self.settings.token_budget:  # the budget cuts each step's window
            raise ValueError(f"a state of token_budget {t}, but this Balance's is {self.settings.token_budget}: resume "
                             f"with " + (f"token_budget={t}" if t else "the global_batch it was saved with"))
        if not self.settings.budgeted and (b := int(np.sum(saved["sizes"]))) != self.settings.global_batch:
            raise ValueError(f"a state of the global batch {b}, but this Balance's is {self.settings.global_batch}: "
                             f"resume with global_batch={b}")
        m = self.settings.micro_batch
        odd = [v for v in [saved["sizes"], *(r[1]["sizes"] for r in state.get("regimes") or [] if "sizes" in r[1])]
               if m and any(int(x) % m for x in v)]
        if odd:  # its sizes would cut this run's steps into parts of micro-batches
            raise ValueError(f"a state of batch sizes {[int(x) for x in odd[0]]}, not whole micro-batches of {m}: "
                             f"resume with the micro_batch it was saved with")
        if ids is not None and len(ids) != len(saved["shares"]):
            raise ValueError(f"a balancer state of {len(saved['shares'])} rank(s) with {len(ids)} identities")
        src = remap_identities(ids, len(saved["shares"]), identities, self.world)
        same = src == list(range(self.world)) and len(saved["shares"]) == self.world
        if same:
            self._balancer.load_state_dict(saved)
        else:
            self._balancer.load_remapped(saved, src)
        if (self._costs is not None) != ("costs" in state):
            raise ValueError("a state saved splitting by counts, resumed splitting by tokens (or the other way): "
                             "resume with the collator it was saved with")
        if self._costs is not None:
            self._costs.load_state_dict(state["costs"], None if same else src)
        epoch, step = whole("epoch", state["epoch"], 0), whole("step", state.get("step", 0), 0)
        spe, own = state.get("steps_per_epoch"), sched.steps_per_epoch
        if step and own and spe not in (None, own):
            raise ValueError(f"a mid-epoch state of an epoch of {spe} steps, but this epoch has {own}: the data set "
                             f"or global_batch changed")
        complete = state.get("version", 1) >= 3 and step == own  # 3: every step of `epoch` ran
        if step and not (step < (own or ENDLESS) or complete):
            raise ValueError(f"a mid-epoch state at step {step} of an epoch of {own} steps")
        global_step = whole("global_step", state["global_step"], 0)
        sched.reset(self._balancer, self._costs)
        if same and state.get("regimes") and spe in (None, own):  # else: from the balancer alone
            sched.load_regimes(state["regimes"])
        self._new_epoch()
        self._warming, self._cold = True, None  # the next step to end is this process's first (a resume's)
        # mid-epoch: the epoch goes on at `step` (set_epoch(epoch) then leaves it as it is); complete: set_epoch(epoch
        # + 1) comes next
        self.at = At(epoch, step, bool(step), global_step)
