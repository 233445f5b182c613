"""hetero in your own DDP loop: per-rank batch sizes balanced by measured speed, with the exact gradient.

    bal = Balance(scheme="edp", global_batch=256, rebalance_every=20)
    ddp = DDP(model); bal.attach(ddp)
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds), seed=0), num_workers=2)
    for epoch in range(epochs):
        bal.set_epoch(epoch)
        for x, y in loader:
            with bal.step():
                F.cross_entropy(ddp(x), y).backward(); opt.step(); opt.zero_grad()

With `micro_batch=m` the sampler yields micro-batches of m, k_i per rank and step: `with bal.step(ddp):` runs all
but the step's last under ddp.no_sync(), and the loop steps the optimizer where `bal.sync_now` (README).

One object, the Balance, owns a step's gradient weight, clock and emulated delay; it is the state of the DDP
communication hook. Decisions (every `rebalance_every` steps and at each epoch's end) take effect at a step that
no rank's batch sampler has handed out yet, so DataLoader workers running ahead never see two partitions of one
step (README, "Use it in your own loop"). The built-in trainer (trainer.py) is one user: it cuts its own batches
on the device and calls `sizes = bal.begin_step(step)` ... `bal.end_step()` with lag 0, and reads the step records
(`bal.epoch_records()`) for its run folder.
"""
from __future__ import annotations

import copy
import threading
from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .balancer import Balancer
from .dist import StepClock, env_world, gather_rows
from .emulator import Emulator
from .hook import balance_hook, spend_delay
from .memory import probe_max_batch
from .partition import SCHEMES, batch_sizes, check_feasible
from .records import Decision, StepRecord
from .sampler import BalancedBatchSampler

FAR = -(1 << 62)  # the start of the first regime: before any step


class Balance:
    """Per-rank batch sizes, the b_i/B gradient weighting, the wait-free step clock and the rebalancing rule."""

    def __init__(self, *, global_batch: int, scheme: str = "edp", rebalance_every: int = 0, smoothing: float = 0.0,
                 deadband: float = 0.0, significance: float = 1.0, min_batch: int = 1, max_batch: int | str | Sequence | None = None,
                 hetero: str = "", seed: int = 0, lag: int | None = None, sit_out: bool = False,
                 replay: dict[int, np.ndarray] | None = None, micro_batch: int = 0):
        """scheme: sync, dp, edp or affine. max_batch: an int, "probe", or one entry (int, "probe", None) per rank.
        hetero: the emulation grammar (emulator.py), e.g. "1:slowdown=3". lag: None takes the first step no rank's
        sampler has handed out; an int fixes it (decision after step s -> effective at s + 1 + lag).
        sit_out (affine): a rank may get batch 0; its loop must still run forward and backward (its gradient
        weight is 0), as the built-in trainer does. replay: recorded sizes {epoch: [steps, world]} to train with
        instead of deciding (no decisions are made). micro_batch m > 0: every rank's micro-batch is m samples and
        the balancer decides how many (k_i >= 1) each rank runs per step; max_batch then bounds m, not k_i * m."""
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
        if min_batch < 1:
            raise ValueError("min_batch must be at least 1 (sit_out lets affine give a rank 0)")
        if rebalance_every < 0 or (lag is not None and lag < 0) or micro_batch < 0:
            raise ValueError("rebalance_every, lag and micro_batch must be >= 0")
        if micro_batch and sit_out:
            raise ValueError("sit_out does not combine with micro_batch (every rank runs at least one micro-batch)")
        self.rank, self.size, _ = env_world()  # before init_process_group too (Lightning builds callbacks first)
        self.scheme, self.global_batch = SCHEMES[scheme], global_batch
        self.rebalance_every, self.lag = rebalance_every, lag
        per_rank = list(max_batch) if isinstance(max_batch, (list, tuple)) else [max_batch] * self.size
        if len(per_rank) != self.size:
            raise ValueError(f"max_batch has {len(per_rank)} entries for {self.size} ranks")
        self.probes = [v == "probe" for v in per_rank]
        limits = [float("inf") if v in (None, 0, "probe", float("inf")) else int(v) for v in per_rank]
        self.micro_batch, self.min_batch = micro_batch, min_batch
        limits = self._check_limits(limits)
        self.balancer = Balancer(self.scheme.rule, self.size, global_batch, min_batch,
                                 None if all(v == float("inf") for v in limits) else limits, smoothing, deadband,
                                 significance, sit_out=sit_out, granularity=max(micro_batch, 1))
        self.replay = replay
        self.emulator = Emulator(hetero, self.rank, seed)
        self.seed, self.epoch, self.global_step = seed, 0, 0
        self.steps_per_epoch = 0
        self.decisions: list[Decision] = []
        self._regimes: list[tuple[int, Balancer]] = [(FAR, copy.deepcopy(self.balancer))]
        self._planned: dict[int, np.ndarray] = {}  # position -> every rank's sizes, fixed when handed out
        self._handed = FAR   # next position this rank's sampler hands out
        self.records: list[StepRecord] = []  # this epoch's finished steps (clocks read at decisions and on demand)
        self._unread: list[tuple[int, np.ndarray, StepClock, float]] = []  # (step, sizes, clock, delay) not yet read
        self._decided_upto = 0  # records before this index were part of an earlier decision
        self._device, self._coll = torch.device("cpu"), torch.device("cpu")
        self._pos, self._step, self._clock, self._weight, self._delay = 0, 0, None, 1.0 / self.size, 0.0
        self._sizes = self.balancer.sizes
        self._started: int | None = None  # the epoch set_epoch last started
        self._attached = self._probed = False
        self._micro_left, self._expected, self.sync_now = 1, 1, True  # micro-batches left; the current one syncs
        self._syncs = self._forwards = 0
        self._in_flight, self._all_issued, self._lock = 0, False, threading.Lock()

    # -- set-up ------------------------------------------------------------------------------------------------
    def probe(self, model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int, device: torch.device,
              autocast=None) -> list[float]:
        """Collective, before DDP: ranks set to "probe" find their largest batch on their GPU (CPU ranks: no limit);
        returns every rank's limit."""
        own = float("inf")
        if self.probes[self.rank]:
            own = probe_max_batch(model, sample_shape, classes, device, lo=min(self.balancer.min_batch,
                                  self.micro_batch or self.global_batch), hi=self.micro_batch or self.global_batch,
                                  autocast=autocast)
        coll = device if dist.get_backend() == "nccl" else torch.device("cpu")
        probed = gather_rows(torch.tensor([own]), coll).flatten().tolist()
        b = self.balancer
        old = b.max_batch if b.max_batch is not None else [float("inf")] * self.size
        limits = self._check_limits([p if pr else o for p, pr, o in zip(probed, self.probes, old)])
        b.max_batch, b._probe_sizes = limits, None
        b.sizes = batch_sizes(b.shares, self.global_batch, b.min_batch, limits, b.granularity)
        self._regimes, self._probed = [(FAR, copy.deepcopy(b))], True
        return limits

    def _check_limits(self, limits: list[float]) -> list[float]:
        """Check the per-rank largest batches; with micro-batches they bound m (the counts are unbounded)."""
        m = self.micro_batch
        if m and (small := [r for r, v in enumerate(limits) if v < m]):
            raise ValueError(f"micro_batch {m} exceeds rank {small[0]}'s largest batch {limits[small[0]]:g}: "
                             f"lower micro_batch")
        limits = [float("inf")] * self.size if m else limits
        check_feasible(self.size, self.global_batch, self.min_batch, limits, max(m, 1))
        return limits

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Install the weighting communication hook (with the clock and the emulated delay) on a DDP model."""
        if any(self.probes) and not self._probed:
            raise ValueError('max_batch "probe": call bal.probe(model, ...) before wrapping the model in DDP')
        self._device = next(ddp.parameters()).device
        self._coll = self._device if dist.get_backend() == "nccl" else torch.device("cpu")
        ddp.register_comm_hook(self, balance_hook)
        ddp.register_forward_pre_hook(self._count_forward)
        self._attached = True

    def _count_forward(self, module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self._forwards += 1

    def batch_sampler(self, n_samples: int, seed: int | None = None) -> BalancedBatchSampler:
        """Per-step index lists for this rank: its slice of each step's window of one shared permutation."""
        if self.global_batch > n_samples:
            raise ValueError(f"global batch {self.global_batch} exceeds the {n_samples} samples")
        self.set_samples(n_samples)
        return BalancedBatchSampler(self, n_samples, self.seed if seed is None else seed)

    def set_samples(self, n_samples: int) -> int:
        """The epoch's length for a loop that cuts its own batches (with sampler.EpochPlan); returns its steps."""
        self.steps_per_epoch = n_samples // self.global_batch
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Call before iterating the loader each epoch (the sampler's permutation and the emulator follow it)."""
        if epoch != self._started:  # idempotent: the user and Lightning may both call it
            self.epoch = self._started = epoch
            self.emulator.start_epoch(epoch)
            self._step, self.records, self._unread, self._decided_upto = 0, [], [], 0

    # -- the schedule: batch sizes per position, fixed when a sampler hands the position out ----------------------
    def sizes_at(self, epoch: int, step: int) -> np.ndarray:
        """Every rank's batch size at this step (sum = global batch); the same on every rank, once handed out."""
        pos = epoch * self.steps_per_epoch + step
        if pos not in self._planned:
            if self.replay is not None:
                self._planned[pos] = np.asarray(self.replay[epoch][step], np.int64)
            else:  # the regime in force at pos; affine's first epoch probes two sizes (Balancer.sizes_for_step)
                start, regime = next(r for r in reversed(self._regimes) if r[0] <= pos)
                self._planned[pos] = np.array(regime.sizes_for_step(step), np.int64)
            self._handed = max(self._handed, pos + 1)
        return self._planned[pos]

    @property
    def last_sizes(self) -> list[int]:
        """Every rank's batch size at the latest step begun."""
        return self._sizes.tolist()

    # -- one step ----------------------------------------------------------------------------------------------
    def begin_step(self, step: int | None = None) -> np.ndarray:
        """Start a step: this rank's gradient weight and a fresh clock (the clock marks `start` now); returns every
        rank's batch sizes for the step."""
        if not self.steps_per_epoch:
            raise RuntimeError("hetero: call bal.batch_sampler(len(dataset)) before the first step")
        self._step = self._step if step is None else step
        self._pos = self.epoch * self.steps_per_epoch + self._step
        self._sizes = self.sizes_at(self.epoch, self._step)
        b, m = int(self._sizes[self.rank]), self.micro_batch
        if m and (b % m or not b):
            raise RuntimeError(f"hetero: step {self._step} gives rank {self.rank} {b} samples, not whole micro-batches "
                               f"of {m} (a replay recorded with another micro_batch?)")
        # k micro-batches, each a mean over m: weight m/B makes their accumulated sum the global-batch mean gradient
        self._micro_left = self._expected = b // m if m else 1
        unit = m or b
        self._weight = unit / self.global_batch if self.scheme.weighted else 1.0 / (self.size * self._micro_left)
        self._syncs = self._forwards = 0
        self._in_flight, self._all_issued, self._delay = 0, False, 0.0
        self._clock = StepClock(self._device)
        self._clock.mark("start")
        return self._sizes

    def mark_backward(self) -> None:
        """Optional, right after loss.backward(): backward's return ends the all-reduce wait (by default the last
        all-reduce's completion does). The built-in trainer calls it."""
        self._clock.mark("returned")

    def set_weight(self, weight: float) -> None:
        """Replace this step's gradient weight (begin_step sets b_i/B, m/B or 1/world), after begin_step and before
        backward: 1/world where the loss is already normalised over every rank (the HF Trainer's token averaging),
        or this rank's share of the step's valid tokens. The weights of one step must sum to 1 over the ranks."""
        if self._clock is None:
            raise RuntimeError("hetero: set_weight needs a step begun (bal.begin_step or `with bal.step()`)")
        self._weight = float(weight)

    def end_step(self) -> Decision | None:
        """End a step (after the optimizer step); every K steps and at the epoch's end, decide (collective)."""
        self._clock.mark("end")
        clock, self._clock = self._clock, None
        if self._attached and (self._syncs != 1 or self._forwards > self._expected):
            hint = ("run each micro-batch in `with bal.step(ddp):`" if self.micro_batch else "gradient "
                    "accumulation (no_sync) is not supported: raise global_batch (max_batch bounds each rank's "
                    "batch) or set micro_batch")
            raise RuntimeError(f"hetero: a step ran {self._forwards} forward(s) and {self._syncs} gradient "
                               f"all-reduce(s); this rank needs {self._expected} and 1: {hint}")
        self._unread.append((self._step, self._sizes, clock, self._delay))
        self._planned = {p: s for p, s in self._planned.items() if p > self._pos}
        step, self._step, self.global_step = self._step, self._step + 1, self.global_step + 1
        last = step == self.steps_per_epoch - 1
        due = last or (self.rebalance_every and (step + 1) % self.rebalance_every == 0)
        if self.scheme.rule == "static" or self.replay is not None or not due:
            return None
        return self._decide(step)

    def epoch_records(self) -> list[StepRecord]:
        """This epoch's finished steps so far, in order (reads the clocks: on CUDA, waits for their events)."""
        for step, sizes, clock, delay in self._unread:
            compute, wait = clock.read()
            self.records.append(StepRecord(self.epoch, step, sizes, compute, wait, delay))
        self._unread.clear()
        return self.records

    @contextmanager
    def step(self, ddp: torch.nn.Module | None = None, batch_size: int | None = None) -> Iterator[None]:
        """Wrap one batch's forward and backward, and the optimizer step where `bal.sync_now` (always, without
        micro_batch). With micro_batch a rank runs k_i of these per step, all but the last under ddp.no_sync()
        (so pass ddp). batch_size (optional) is checked against the schedule."""
        if self._clock is None:  # the step's first batch (the built-in trainer begins its steps itself)
            self.begin_step()
        want = self.micro_batch or self._sizes[self.rank]
        if batch_size is not None and batch_size != want:
            raise RuntimeError(f"hetero: step {self._step} got {batch_size} samples, the schedule says "
                               f"{want}: is the loader this Balance's sampler?")
        self.sync_now = self._micro_left <= 1
        if self.micro_batch and ddp is None:  # on every rank alike, whatever its count (no rank left waiting)
            raise RuntimeError("hetero: with micro_batch, pass the DDP model: `with bal.step(ddp):`")
        with nullcontext() if self.sync_now else ddp.no_sync():
            yield
        self._micro_left -= 1
        if self.sync_now:
            self.end_step()

    def _decide(self, step: int) -> Decision:
        """The one decision path: gather every rank's compute times and sampler position, run the pure balancer."""
        window = self.epoch_records()[self._decided_upto:]
        sizes = np.stack([r.sizes for r in window])
        own = [r.compute_s for r in window]
        rows = gather_rows(torch.tensor([*own, float(self._handed)], dtype=torch.float64), self._coll).numpy()
        self._decided_upto = len(self.records)
        compute, ahead = rows[:, :-1].T, int(rows[:, -1].max())  # [steps, world], furthest sampler
        effective = self._pos + 1 + (self.lag or 0)
        if self.lag is None:
            effective = max(effective, ahead)
        elif ahead > effective:  # gathered, so every rank raises alike instead of cutting a step two ways
            raise RuntimeError(f"hetero: a batch sampler ran {ahead - self._pos - 1} steps ahead of training, beyond "
                               f"lag={self.lag}: set lag >= num_workers x prefetch_factor (+1 for Lightning), or None")
        self.balancer.observe(sizes, compute)
        self.balancer.decide()
        self._regimes = [r for i, r in enumerate(self._regimes)
                         if i + 1 == len(self._regimes) or self._regimes[i + 1][0] > self._pos]
        self._regimes.append((effective, copy.deepcopy(self.balancer)))
        d = Decision(self.epoch, step, effective, self.balancer.sizes.tolist(), self.balancer.shares.tolist(),
                     compute.mean(0).tolist())
        self.decisions.append(d)
        return d

    def _on_ready(self) -> None:
        """Last bucket handed over: local gradients are complete. An emulated slow rank spends its delay here."""
        if self._clock is None:
            raise RuntimeError("hetero: a backward ran outside `with bal.step()` (or begin_step/end_step)")
        self._syncs += 1
        if self.emulator.effects and self._sizes[self.rank] > 0:  # a rank sitting out has nothing to slow down
            self._delay = spend_delay(self.emulator, self.epoch, self.global_step, self._clock)
        self._clock.mark("ready")

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain lists and numbers (loadable with torch.load(weights_only=True)); save at an epoch's end."""
        return {"balancer": self.balancer.state_dict(), "epoch": self.epoch, "global_step": self.global_step}

    def load_state_dict(self, state: dict) -> None:
        self.balancer.load_state_dict(state["balancer"])
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self._regimes, self._planned, self._handed = [(FAR, copy.deepcopy(self.balancer))], {}, FAR
        self.records, self._unread, self._decided_upto = [], [], 0
        self._started = None
