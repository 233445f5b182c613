"""hetero in your own DDP loop: per-rank batch sizes balanced by measured speed, with the exact gradient.

    bal = Balance(scheme="edp", global_batch=256, rebalance_every=20)
    ddp = DDP(model); bal.attach(ddp)
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)), num_workers=2)
    for epoch in range(epochs):
        bal.set_epoch(epoch)
        for x, y in loader:
            with bal.step():
                F.cross_entropy(ddp(x), y).backward(); opt.step(); opt.zero_grad()

One step protocol: `begin_step()` ... `end_step()`, which `with bal.step():` wraps (per batch, or per micro-batch)
and the Lightning callback calls around each training step; the built-in trainer runs `with bal.step():` as a
plain loop does. With `micro_batch=m` the sampler yields micro-batches of m, k_i per rank and step: `with
bal.step():` runs all but the step's last under the attached model's no_sync(), and the loop steps the optimizer
where `bal.sync_now`. A loop that counts its own micro-batches (nanoGPT's `for micro_step in range(...)`) runs
`bal.micro_batches` of them per step. A loop without epochs (random batches, a stream) never calls set_epoch or
batch_sampler: its steps are one endless epoch, decided every `rebalance_every` steps.

The rank and world come from whatever launched the job: an initialised process group, else torchrun's RANK and
WORLD_SIZE, else (Lightning's own launcher) the callback's `setup` (set_world); never from a guess. At `attach` and at
every `set_epoch` the ranks compare their settings (Balance.fingerprint) and stop alike, with one line naming the
field, when they differ. A mistake only one rank can see (an optimizer step on gradients that were not all-reduced)
is posted on the process group's store before that rank raises, so the others raise the same line.

The parts: the schedule of sizes per position (schedule.py: regimes, lag, replay), one step's state (step.py:
weight, clock, buckets in flight), the balancer (balancer.py, pure numpy), the sampler (sampler.py), the DDP comm
hook (hook.py) and FSDP2's reduce-scatter (fsdp.py). The hook and the sampler talk to the Balance through
`current_step()`, `gradients_ready()`, `sizes_at()` and `start_epoch_iteration()`. Experiments plug in an
emulated slow rank (`emulate`) or recorded sizes (`replay`) before attach.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist

from .. import __version__
from .agree import (
    IDENTITY_ENV,
    HeteroError,
    agree,
    default_identity,
    duplicate_identity,
    gather_json,
    gather_rows,
    guarded,
    launcher_world,
    peer_error,
    remap_identities,
    same_steps,
)
from .balancer import Balancer
from .emulator import Emulator, parse_hetero
from .guard import OptimizerGuard
from .hook import balance_hook, spend_delay
from .partition import SCHEMES, batch_sizes, check_feasible
from .probe import probe_all
from .records import Decision, StepRecord
from .rules import check_sit_out, fraction, micro_batch_too_big, whole
from .sampler import BalancedBatchSampler
from .schedule import ENDLESS, Schedule
from .settle import settle
from .step import Step

__all__ = ["Balance", "BalancedBatchSampler", "Decision", "HeteroError", "StepRecord", "balance_hook"]

_WORLD_PARTS = ("balancer", "emulator", "size", "probes", "schedule")  # built with the world, bound on first use


class Balance:
    """Per-rank batch sizes, the b_i/B gradient weighting, the wait-free step clock and the rebalancing rule."""

    def __init__(self, *, global_batch: int, scheme: str = "edp", rebalance_every: int = 0, smoothing: float = 0.0,
                 deadband: float = 0.0, significance: float = 1.0, min_batch: int = 1,
                 max_batch: int | str | Sequence | None = None, seed: int = 0, lag: int | None = None,
                 sit_out: bool = False, micro_batch: int = 0, worker_id: str | None = None):
        """scheme: sync, dp, edp or affine. rebalance_every K: decide every K steps (0: at epoch ends only).
        smoothing, deadband, significance: how eagerly a decision follows the measured times (balancer.py).
        min_batch: the smallest batch a rank gets. max_batch: an int, "probe" (bal.probe finds it on a GPU), or
        one entry (int, "probe", None) per rank. seed: the sampler's permutation. lag: None takes the first step
        no rank's sampler has handed out; an int fixes it (decision after step s -> effective at s + 1 + lag).
        sit_out (affine): a rank may get batch 0; its loop must still run forward and backward (weight 0).
        micro_batch m > 0: every rank's micro-batch is m samples and the balancer decides how many (k_i >= 1)
        each rank runs per step; max_batch then bounds m, not k_i * m.
        worker_id: this worker's identity, which its balancer estimate is kept under across restarts and changes
        of world size (None: HETERO_WORKER_ID, else host and device; agree.py).
        The rank and world are read from the process group or torchrun's environment when there is one, else
        when first needed (Lightning's callback sets them in its setup)."""
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
        self.global_batch = whole("global_batch", global_batch, 1)
        self.rebalance_every = whole("rebalance_every", rebalance_every, 0)
        self.micro_batch, self.seed = whole("micro_batch", micro_batch, 0), whole("seed", seed, 0)
        self.lag = None if lag is None else whole("lag", lag, 0)
        self.min_batch = whole("min_batch", min_batch, 1)  # sit_out, not min_batch 0, lets affine give a rank 0
        check_sit_out(bool(sit_out), SCHEMES[scheme].rule, self.micro_batch)
        self._settings = dict(smoothing=fraction("smoothing", smoothing, 1), deadband=fraction("deadband", deadband, 1),
                              significance=fraction("significance", significance, float("inf")), sit_out=bool(sit_out))
        self._max_batch = max_batch
        self.scheme_name, self.scheme = scheme, SCHEMES[scheme]
        self.hetero, self._replay = "", None  # plugged in by experiments: emulate(), replay()
        self.epoch, self.global_step, self.steps_per_epoch, self.n_samples = 0, 0, 0, None
        self.decisions: list[Decision] = []
        self.records: list[StepRecord] = []  # this epoch's finished steps (clocks read at decisions and on demand)
        self._unread: list[Step] = []  # finished steps whose clocks are not read yet
        self._decided_upto = 0  # records before this index were part of an earlier decision
        self._rank: int | None = None
        self._device, self._coll = torch.device("cpu"), torch.device("cpu")
        self._step: Step | None = None  # the step running now
        self._index = 0  # the epoch's next step
        self._last: np.ndarray | None = None  # every rank's sizes at the latest step begun
        self._started: int | None = None  # the epoch set_epoch last started
        self._ended = 0  # steps ended since set_epoch
        self._model: torch.nn.Module | None = None  # the attached DDP model or FSDP2 root
        self._probed = False
        self._fsdp = None  # an FSDP2 model's schedule (fsdp.py), set by attach
        self.sync_now = True  # the micro-batch running now (or next) all-reduces
        self._guard: OptimizerGuard | None = None  # the optimizer-step guard, from attach (guard.py)
        self._observed_at: tuple | None = None  # (epoch, steps ended) at the last observe_now()
        self._worker_id = worker_id
        self.identities: list[str] | None = None  # every rank's worker identity, gathered at attach
        if (known := launcher_world()) is not None:
            self.set_world(*known)

    # -- the world: rank and size, from the launcher ---------------------------------------------------------------
    def set_world(self, rank: int, world: int) -> None:
        """This process's global rank and the world size, for launchers that set neither a process group nor
        torchrun's environment before the Balance is built (the Lightning callback calls it in `setup`)."""
        if self._rank is not None:
            if (rank, world) != (self._rank, self.size):
                raise HeteroError(f"hetero: this Balance was already used as rank {self._rank} of {self.size}, but "
                                  f"the launcher says rank {rank} of {world}: build it in the launched process")
            return
        rank, world = whole("rank", rank, 0), whole("world", world, 1)
        if rank >= world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        per_rank = list(self._max_batch) if isinstance(self._max_batch, (list, tuple)) else [self._max_batch] * world
        if len(per_rank) != world:
            raise ValueError(f"max_batch has {len(per_rank)} entries for {world} ranks")
        for v in per_rank:
            if v not in (None, "probe", float("inf")):
                whole("max_batch", v, 0)
        self._rank, self.size = rank, world
        self.probes = [v == "probe" for v in per_rank]
        self._configured = [float("inf") if v in (None, 0, "probe", float("inf")) else int(v) for v in per_rank]
        limits = self._check_limits(self._configured)
        self.balancer = Balancer(self.scheme.rule, world, self.global_batch, self.min_batch,
                                 None if all(v == float("inf") for v in limits) else limits,
                                 granularity=max(self.micro_batch, 1), **self._settings)
        self.schedule = Schedule(self.balancer, self.lag)
        self.schedule.replayed = self._replay
        self._bind_emulation()
        self._last = self.balancer.sizes

    def _bind_emulation(self) -> None:
        if far := [r for r in parse_hetero(self.hetero) if r >= self.size]:
            raise ValueError(f"hetero names rank {far[0]}, but the world has {self.size} rank(s) (ranks count from 0)")
        self.emulator = Emulator(self.hetero, self._rank, self.seed)
        if self._started is not None:  # plugged in mid-run: its draws follow the epoch already started
            self.emulator.start_epoch(self.epoch)

    @property
    def rank(self) -> int:
        """This process's global rank (read from the launcher when first needed)."""
        if self._rank is None:
            self._world_now()
        return self._rank

    def _world_now(self) -> None:
        """Bind the world when it was unknown at construction: the launcher's, else a plain one-process run.
        WORLD_SIZE without RANK is a launcher hetero cannot read: refused, not guessed."""
        if (known := launcher_world()) is not None:
            return self.set_world(*known)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise HeteroError("hetero: WORLD_SIZE is set but neither RANK nor a process group: build the Balance "
                              "after init_process_group, run under torchrun, or (Lightning) use hetero.BalanceCallback")
        self.set_world(0, 1)

    def __getattr__(self, name: str):
        # the parts built with the world bind it on first use
        if name in _WORLD_PARTS and "_rank" in self.__dict__ and self.__dict__["_rank"] is None:
            self._world_now()
            return getattr(self, name)
        raise AttributeError(f"'Balance' object has no attribute {name!r}")

    def fingerprint(self) -> dict:
        """Every setting the ranks must share, as plain data (compared at attach and at each set_epoch)."""
        b = self.balancer
        return {"rank": self.rank, "world": self.size, "version": __version__, "scheme": self.scheme_name,
                "global_batch": self.global_batch, "micro_batch": self.micro_batch, "seed": self.seed,
                "n_samples": self.n_samples, "epoch": self.epoch, "rebalance_every": self.rebalance_every,
                "hetero": self.hetero, "min_batch": self.min_batch, "lag": self.lag, "replay": self.replayed,
                "max_batch": [None if v == float("inf") else v for v in (b.max_batch or [])],
                **self._settings}

    def _agree(self, where: str) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            guarded(agree, self.fingerprint(), self._coll, where)

    # -- experiments: what the trainer and the lab plug in ---------------------------------------------------------
    def emulate(self, spec: str) -> None:
        """Emulate slow ranks with the HETERO grammar (emulator.py), e.g. "1:slowdown=3"; before attach. The delay
        is spent when a rank's gradients are ready and counts as its compute."""
        if not isinstance(spec, str):
            raise ValueError(f"hetero must be a string such as '1:slowdown=3' (got {spec!r})")
        parse_hetero(spec)  # a bad spec fails here, in one line
        if self._model is not None:
            raise HeteroError("hetero: emulate() after attach: plug the emulation in before bal.attach(model)")
        self.hetero = spec
        if self._rank is not None:  # else when the world is bound (Lightning's launcher: in the callback's setup)
            self._bind_emulation()

    def replay(self, sizes: dict[int, np.ndarray]) -> None:
        """Train with recorded sizes {epoch: [steps, world]} instead of deciding (no decisions are made)."""
        if self._model is not None:
            raise HeteroError("hetero: replay() after attach: plug the recorded sizes in before bal.attach(model)")
        self._replay = sizes
        if self._rank is not None:
            self.schedule.replayed = sizes

    @property
    def replayed(self) -> bool:
        """Training with recorded sizes (replay): no decisions."""
        return self._replay is not None

    # -- set-up ------------------------------------------------------------------------------------------------
    def probe(self, model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int, device: torch.device,
              autocast=None, memory_format=torch.contiguous_format, gpu: str = "") -> list[float]:
        """Collective, before DDP: ranks set to "probe" find their largest batch on their GPU (CPU ranks: no
        limit); returns every rank's largest batch (inf: none; with micro_batch it bounds m). gpu: this rank's
        physical GPU (memory.gpu_identity; found when empty), so that ranks sharing one GPU are refused: a probe
        measures a rank alone. A rank's failure stops every rank with the same line (probe.py)."""
        probed = probe_all(self, model, sample_shape, classes, device, autocast, memory_format, gpu)
        limits = [p if pr else c for p, pr, c in zip(probed, self.probes, self._configured)]
        try:
            bounds = self._check_limits(limits)
        except ValueError as e:
            raise HeteroError(f"hetero: after the probe, {e}") from None
        b = self.balancer
        b.max_batch, b._probe_sizes = bounds, None
        b.sizes = batch_sizes(b.shares, self.global_batch, b.min_batch, bounds, b.granularity)
        self.schedule.reset(b)
        self._last, self._probed = b.sizes, True
        return limits

    def _check_limits(self, limits: list[float]) -> list[float]:
        """Check the per-rank largest batches; with micro-batches they bound m (the counts are unbounded)."""
        m = self.micro_batch
        if (r := micro_batch_too_big(m, limits)) is not None:
            raise ValueError(f"micro_batch {m} exceeds rank {r}'s largest batch {limits[r]:g}: lower micro_batch")
        limits = [float("inf")] * len(limits) if m else limits
        check_feasible(len(limits), self.global_batch, self.min_batch, limits, max(m, 1))
        return limits

    def attach(self, model: torch.nn.Module) -> None:
        """Install the weighting (with the clock and the emulated delay) on a DDP model, as a communication hook, or
        on an FSDP2 root, as its reduce-scatter (fsdp.py); one-line ValueError for any other model. The model is
        given here once. Collective: every rank's Balance must have the same settings and the process group's rank
        and world."""
        if any(self.probes) and not self._probed:
            raise ValueError('max_batch "probe": call bal.probe(model, ...) before wrapping the model in DDP')
        from . import fsdp  # torch only; refuses FSDP1, DDP around FSDP2, a non-root, ...
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or fsdp.refusal(model, self.size):
            self._fsdp = fsdp.attach(self, model)
        settle.collectives()  # this process runs collectives: its exit waits for gloo's threads (settle.py)
        self._device = next(model.parameters()).device
        self._coll = self._device if dist.get_backend() == "nccl" else torch.device("cpu")
        self._agree("attach")
        self._gather_identities()
        if self._fsdp is None:
            model.register_comm_hook(self, balance_hook)
        model.register_forward_pre_hook(self._count_forward)
        self._guard = OptimizerGuard(self, model)
        self._model = model

    def _gather_identities(self) -> None:
        """Every rank's identity; named ones must differ, default ones that coincide (unpinned CPU workers of two
        agents on one host) are told apart by their rank."""
        named = bool(self._worker_id or os.environ.get(IDENTITY_ENV, "").strip())
        own = [self._worker_id or default_identity(self._device), named]
        pairs = [own]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            pairs = guarded(gather_json, own, self._coll)  # plain data: nothing unpickled from a peer
        ids = [name for name, _ in pairs]
        while (pair := duplicate_identity(ids)) is not None:
            if pairs[pair[0]][1] or pairs[pair[1]][1]:
                raise HeteroError(f"hetero: ranks {pair[0]} and {pair[1]} are both worker {ids[pair[0]]!r}: give "
                                  f"each worker its own name (HETERO_WORKER_ID, or Balance(worker_id=...))")
            same = ids[pair[0]]
            ids = [f"{n} (rank {r})" if n == same else n for r, n in enumerate(ids)]
        self.identities = ids

    def _count_forward(self, module, args) -> None:
        if module.training and torch.is_grad_enabled() and self._step is not None:
            self._step.forwards += 1

    # -- the epoch ---------------------------------------------------------------------------------------------
    def batch_sampler(self, n_samples: int, seed: int | None = None) -> BalancedBatchSampler:
        """The one way to give the epoch's length (n_samples): per-step index lists for this rank, its slice of each
        step's window of one shared permutation. A loop cutting its own batches (the built-in trainer) takes the
        sampler's `indices(step)` instead of iterating it."""
        n = whole("n_samples", n_samples, 1)
        if self.global_batch > n:
            raise ValueError(f"global batch {self.global_batch} exceeds the {n} samples")
        self.n_samples, self.steps_per_epoch = n, n // self.global_batch
        return BalancedBatchSampler(self, n, self.seed if seed is None else whole("seed", seed, 0))

    def set_epoch(self, epoch: int) -> None:
        """Call before iterating the loader each epoch (the sampler's permutation and the emulator follow it).
        Collective when the process group is up: the ranks compare their settings and the steps they ran."""
        epoch = whole("epoch", epoch, 0)
        if epoch == self._started:  # idempotent: the user and Lightning may both call it
            return
        if epoch and not self.steps_per_epoch:
            raise HeteroError(f"hetero: set_epoch({epoch}) without an epoch length: call bal.batch_sampler(len(ds)) "
                              f"first (a loop without epochs calls neither)")
        if self._started is not None:
            self._agree_steps()
        self.epoch = self._started = epoch
        self.emulator.start_epoch(epoch)
        self._index, self._ended, self.records, self._unread, self._decided_upto = 0, 0, [], [], 0
        if self._model is not None:
            self._agree("set_epoch")

    def _agree_steps(self) -> None:
        """The epoch just left: every rank ran as many steps (a rank that broke out early is named)."""
        if not (self._model is not None and dist.is_initialized() and self.size > 1):
            return
        if self.steps_per_epoch:
            same_steps(self.epoch, self._ended, self.steps_per_epoch)
        ran = guarded(gather_rows, torch.tensor([float(self._ended)]), self._coll).flatten().tolist()
        if any(r != ran[0] for r in ran):
            short = min(range(len(ran)), key=ran.__getitem__)
            raise HeteroError(f"hetero: rank {short} left epoch {self.epoch} after {int(ran[short])} steps, rank "
                              f"{max(range(len(ran)), key=ran.__getitem__)} ran {int(max(ran))}: every rank must run "
                              f"every step of the epoch")

    def _position(self, epoch: int, step: int) -> int:
        return epoch * (self.steps_per_epoch or ENDLESS) + step

    def sizes_at(self, epoch: int, step: int) -> np.ndarray:
        """Every rank's batch size in samples at this step of this epoch (sum = global batch); the same on every
        rank, and fixed once asked for (a sampler handing the step out asks)."""
        return self.schedule.sizes(epoch, step, self._position(epoch, step))

    def start_epoch_iteration(self, epoch: int) -> int:
        """A sampler starts handing out `epoch`: refuse a second pass over steps already handed out. Returns the
        step to start at: 0, or where a mid-epoch state (load_state_dict) goes on."""
        first = self._ended if self._started == epoch else 0
        self.schedule.start_iteration(epoch, self._position(epoch, first))
        return first

    @property
    def micro_batches(self) -> int:
        """This rank's micro-batches in the current step (the next one, between steps): b_i / micro_batch; 1
        without micro_batch. A loop counting its own micro-batches (nanoGPT's) runs this many per step."""
        if self._step is not None:
            return self._step.expected
        b = int(self.sizes_at(self.epoch, self._index)[self.rank])
        return b // self.micro_batch if self.micro_batch else 1

    @property
    def last_sizes(self) -> list[int]:
        """Every rank's batch size at the latest step begun."""
        return self._last.tolist() if self._last is not None else self.balancer.sizes.tolist()

    # -- one step: begin_step ... end_step (`with bal.step():` wraps them) ------------------------------------------
    def begin_step(self, step: int | None = None) -> np.ndarray:
        """Start a step (the epoch's next, or `step`): this rank's gradient weight and a fresh clock (which marks
        `start` now); returns every rank's batch sizes for the step, in samples (with micro_batch m, this rank
        runs sizes[rank] // m micro-batches)."""
        if self._started is None and self.steps_per_epoch:
            self.set_epoch(self.epoch)
        if not self.steps_per_epoch and not self.rebalance_every and self.scheme.rule != "static":
            raise HeteroError("hetero: a loop without epochs (no bal.batch_sampler) decides only every "
                              "rebalance_every steps: set rebalance_every > 0")
        if self._model is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise HeteroError("hetero: call bal.attach(ddp) before the first step: without it the gradients are "
                              "DDP's plain mean, not weighted by the batch sizes")
        index = self._index if step is None else step
        sizes = self.sizes_at(self.epoch, index)
        b, m = int(sizes[self.rank]), self.micro_batch
        if m and (b % m or not b):
            raise RuntimeError(f"hetero: step {index} gives rank {self.rank} {b} samples, not whole micro-batches "
                               f"of {m} (a replay recorded with another micro_batch?)")
        k = b // m if m else 1
        # k micro-batches, each a mean over m: weight m/B makes their accumulated sum the global-batch mean gradient
        weight = (m or b) / self.global_batch if self.scheme.weighted else 1.0 / (self.size * k)
        if self._guard is not None:
            self._guard.step_begun()
        self._index, self._last = index, sizes
        self._step = Step(self.epoch, index, sizes, self.rank, weight, k, self._device)
        self.sync_now = k <= 1
        return sizes

    @property
    def weight(self) -> float:
        """This rank's gradient weight in the running step (1/world between steps)."""
        return self._step.weight if self._step is not None else 1.0 / self.size

    def set_weight(self, weight: float) -> None:
        """Replace this step's gradient weight (begin_step sets b_i/B, m/B or 1/world), after begin_step and before
        backward: 1/world where the loss is already normalised over every rank (the HF Trainer's token averaging),
        or this rank's share of the step's valid tokens. The weights of one step must sum to 1 over the ranks."""
        if self._step is None:
            raise RuntimeError("hetero: set_weight needs a step begun (bal.begin_step or `with bal.step()`)")
        self._step.weight = float(weight)

    def current_step(self, required: bool = True) -> Step | None:
        """The running step (the comm hook and FSDP2's comms read its weight and clock); between steps None, or
        a one-line error where a step is required (a backward outside any step)."""
        if self._step is None and required:
            raise RuntimeError("hetero: a backward ran outside `with bal.step()` (or begin_step/end_step)")
        return self._step

    def gradients_ready(self) -> Step:
        """The comm hook's call when the last bucket is handed over: local gradients are complete. An emulated
        slow rank spends its delay here; the clock marks `ready`."""
        s = self.current_step()
        s.syncs += 1
        if self._guard is not None:
            self._guard.unsynced = False
        if self.emulator.effects and not s.sits_out:  # a rank sitting out has nothing to slow down
            s.delay_s = spend_delay(self.emulator, self.epoch, self.global_step, s.clock)
        s.clock.mark("ready")
        return s

    def mark_backward(self) -> None:
        """Optional, right after loss.backward(): backward's return ends the all-reduce wait (by default the last
        all-reduce's completion does)."""
        self.current_step().clock.mark("returned")

    def end_step(self) -> Decision | None:
        """End a step (after the optimizer step); every K steps and at the epoch's end, decide (collective)."""
        s = self.current_step()
        s.clock.mark("end")
        self._step = None
        if self._model is not None and (s.syncs != 1 or s.forwards > s.expected):
            hint = ("run each micro-batch in `with bal.step():`" if self.micro_batch else "gradient "
                    "accumulation (no_sync) is not supported: raise global_batch (max_batch bounds each rank's "
                    "batch) or set micro_batch")
            raise RuntimeError(f"hetero: a step ran {s.forwards} forward(s) and {s.syncs} gradient "
                               f"all-reduce(s); this rank needs {s.expected} and 1: {hint}")
        self._unread.append(s)
        pos = self._position(self.epoch, s.index)
        self.schedule.done(pos)
        self._index, self.global_step, self._ended = s.index + 1, self.global_step + 1, self._ended + 1
        last = s.index == self.steps_per_epoch - 1
        due = last or (self.rebalance_every and (s.index + 1) % self.rebalance_every == 0)
        if self.scheme.rule == "static" or self.replayed or not due:
            return None
        return guarded(self._decide, s.index, pos)

    @contextmanager
    def step(self, batch_size: int | None = None) -> Iterator[None]:
        """Wrap one batch's forward and backward, and the optimizer step where `bal.sync_now` (always, without
        micro_batch). With micro_batch a rank runs k_i = bal.micro_batches of these per step, all but the last
        under the attached model's no_sync(). batch_size (optional) is checked against the schedule."""
        if self._step is None:  # the step's first batch
            self.begin_step()
        s = self._step
        want = self.micro_batch or int(s.sizes[self.rank])
        if batch_size is not None and batch_size != want:
            raise RuntimeError(f"hetero: step {s.index} got {batch_size} samples, the schedule says "
                               f"{want}: is the loader this Balance's sampler?")
        self.sync_now = s.last_micro_batch
        if self._fsdp is not None:  # FSDP2: no no_sync; its own schedule (the same collectives on every rank)
            self._fsdp.begin(first=s.left == s.expected, sync=self.sync_now)
        elif self.micro_batch and self._model is None:  # on every rank alike, whatever its count
            raise RuntimeError("hetero: with micro_batch, attach the model first (bal.attach(ddp)): its no_sync "
                               "keeps all but the step's last micro-batch local")
        try:
            with nullcontext() if self.sync_now or self._fsdp is not None else self._model.no_sync():
                yield
        except HeteroError:
            raise
        except Exception as e:  # noqa: BLE001 - a backward's collective failed: a peer's posted reason, if any
            if (why := peer_error()) is not None:
                raise HeteroError(why) from None
            raise e
        s.left -= 1
        if self.sync_now:
            self.end_step()
        else:
            self._guard.unsynced = True  # local gradients only, until the step's last micro-batch all-reduces

    def epoch_records(self) -> list[StepRecord]:
        """This epoch's finished steps so far, in order (reads the clocks: on CUDA, waits for their events)."""
        for s in self._unread:
            compute, wait = s.clock.read()
            self.records.append(StepRecord(self.epoch, s.index, s.sizes, compute, wait, s.delay_s))
        self._unread.clear()
        return self.records

    def _decide(self, step: int, pos: int) -> Decision:
        """The one decision path: gather every rank's compute times and sampler position, run the pure balancer."""
        window = self.epoch_records()[self._decided_upto:]
        sizes = np.stack([r.sizes for r in window])
        own = [r.compute_s for r in window]
        rows = gather_rows(torch.tensor([*own, float(self.schedule.handed)], dtype=torch.float64), self._coll).numpy()
        self._decided_upto = len(self.records)
        compute, furthest = rows[:, :-1].T, int(rows[:, -1].max())  # [steps, world], furthest sampler
        effective = self.schedule.effective(pos, furthest)
        self.balancer.observe(sizes, compute)
        self.balancer.decide()
        self.schedule.decided(pos, effective, self.balancer)
        d = Decision(self.epoch, step, effective, self.balancer.sizes.tolist(), self.balancer.shares.tolist(),
                     compute.mean(0).tolist())
        self.decisions.append(d)
        return d

    # -- checkpoints -------------------------------------------------------------------------------------------
    def observe_now(self) -> None:
        """Collective, between steps: fold the steps since the last decision into the balancer's observations, so
        that a state_dict taken now (mid-epoch) keeps them. The next decision then sees the same sums."""
        self._observed_at = (self._started, self._ended)
        if self.scheme.rule == "static" or self.replayed:
            return
        window = self.epoch_records()[self._decided_upto:]
        own = torch.tensor([r.compute_s for r in window] or [0.0], dtype=torch.float64)
        together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rows = (guarded(gather_rows, own, self._coll) if together else own[None]).numpy()
        self._decided_upto = len(self.records)
        if window:
            self.balancer.observe(np.stack([r.sizes for r in window]), rows.T)

    def state_dict(self) -> dict:
        """Plain lists and numbers (loadable with torch.load(weights_only=True)). Taken between two steps right
        after observe_now() on every rank, it holds the position: `step` steps of `epoch` have run, and
        load_state_dict goes on there (the sampler starts at that step). Otherwise `step` is 0: the epoch's
        position is the loop's own to restore (a Hugging Face Trainer skips the batches it ran), and the steps since
        the last decision are not in it. `identities` (every rank's worker, from attach) lets load_state_dict
        carry the estimates to another world."""
        mid = self._started is not None and 0 < self._ended < (self.steps_per_epoch or ENDLESS) \
            and self._step is None and self._observed_at == (self._started, self._ended)
        return {"balancer": self.balancer.state_dict(), "epoch": self.epoch, "global_step": self.global_step,
                "step": self._ended if mid else 0, "identities": self.identities}

    def load_state_dict(self, state: dict, identities: list[str] | None = None) -> None:
        """Resume from state_dict(); a state saved by another world size (or rank order) is carried over by worker
        identity (agree.remap_identities: a worker seen before keeps its estimate, a new one starts neutral).
        identities: this world's, when attach has not gathered them."""
        saved = state["balancer"]
        ids = state.get("identities")
        if ids is not None and len(ids) != len(saved["shares"]):
            raise ValueError(f"a balancer state of {len(saved['shares'])} rank(s) with {len(ids)} identities")
        now = identities or self.identities
        src = remap_identities(state.get("identities"), len(saved["shares"]), now, self.size)
        if src == list(range(self.size)) and len(saved["shares"]) == self.size:
            self.balancer.load_state_dict(saved)
        else:
            self.balancer.load_remapped(saved, src)
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.schedule.reset(self.balancer)
        self.records, self._unread, self._decided_upto = [], [], 0
        self._started = None
        step = int(state.get("step", 0))
        if step:  # mid-epoch: the epoch goes on at `step` (set_epoch(epoch) now leaves it as it is)
            if not 0 < step < (self.steps_per_epoch or ENDLESS):
                raise ValueError(f"a mid-epoch state at step {step} of an epoch of {self.steps_per_epoch} steps")
            self._started, self._index, self._ended = self.epoch, step, step
            self.emulator.start_epoch(self.epoch)
        self._last = self.balancer.sizes

    def __getstate__(self) -> dict:  # Lightning's ddp_spawn pickles the callback (before attach: no guard yet)
        if self._guard is not None:
            raise HeteroError("hetero: an attached Balance cannot be pickled: build it before the launcher starts "
                              "the processes, and attach it in each")
        return self.__dict__
