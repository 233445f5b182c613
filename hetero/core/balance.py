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
but the step's last under ddp.no_sync(), and the loop steps the optimizer where `bal.sync_now` (README). A loop that
counts its own micro-batches (nanoGPT's `for micro_step in range(...)`) runs `bal.micro_batches` of them per step.
A loop without epochs (random batches, a stream) never calls set_epoch or set_samples: its steps are one endless
epoch, decided every `rebalance_every` steps.

The rank and world come from whatever launched the job: an initialised process group, else torchrun's RANK and
WORLD_SIZE, else (Lightning's own launcher) the callback's `setup` (set_world); never from a guess. At `attach` and at
every `set_epoch` the ranks compare their settings (Balance.fingerprint) and stop alike, with one line naming the
field, when they differ. A mistake only one rank can see (an optimizer step on gradients that were not all-reduced)
is posted on the process group's store before that rank raises, so the others, whose collectives then fail, raise
the same line instead of a socket error.

One object, the Balance, owns a step's gradient weight, clock and emulated delay; it is the state of the DDP
communication hook. Decisions (every `rebalance_every` steps and at each epoch's end) take effect at a step that
no rank's batch sampler has handed out yet, so DataLoader workers running ahead never see two partitions of one
step (README, "Use it in your own loop"). The built-in trainer (trainer.py) is one user: it cuts its own batches
on the device, calls `sizes = bal.begin_step(step)` (every rank's sizes, in samples) and then runs each of its
micro-batches in `bal.step(ddp)` (lag 0), and reads the step records (`bal.epoch_records()`) for its run folder.
"""
from __future__ import annotations

import copy
import numbers
import os
import threading
import weakref
from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import __version__
from .agree import HeteroError, agree, gather_rows, launcher_world, peer_error, post, same_steps
from .balancer import Balancer
from .clock import StepClock
from .emulator import Emulator, parse_hetero
from .hook import balance_hook, spend_delay
from .memory import probe_max_batch
from .partition import SCHEMES, batch_sizes, check_feasible
from .records import Decision, StepRecord
from .sampler import BalancedBatchSampler

__all__ = ["Balance", "BalancedBatchSampler", "Decision", "HeteroError", "StepRecord", "balance_hook"]

FAR = -(1 << 62)  # the start of the first regime: before any step
ENDLESS = 1 << 62  # steps_per_epoch of a loop without epochs (no set_samples): one epoch that never ends


def _whole(name: str, value, low: int) -> int:
    """An int >= low (not a bool, a float or a string): one clear line otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low} (got {value!r})")
    return int(value)


def _fraction(name: str, value, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < high:
        raise ValueError(f"{name} must be a number in [0, {high:g}) (got {value!r})")
    return float(value)


class Balance:
    """Per-rank batch sizes, the b_i/B gradient weighting, the wait-free step clock and the rebalancing rule."""

    def __init__(self, *, global_batch: int, scheme: str = "edp", rebalance_every: int = 0, smoothing: float = 0.0,
                 deadband: float = 0.0, significance: float = 1.0, min_batch: int = 1,
                 max_batch: int | str | Sequence | None = None, hetero: str = "", seed: int = 0,
                 lag: int | None = None, sit_out: bool = False, replay: dict[int, np.ndarray] | None = None,
                 micro_batch: int = 0):
        """scheme: sync, dp, edp or affine. max_batch: an int, "probe", or one entry (int, "probe", None) per rank.
        hetero: the emulation grammar (emulator.py), e.g. "1:slowdown=3". lag: None takes the first step no rank's
        sampler has handed out; an int fixes it (decision after step s -> effective at s + 1 + lag).
        sit_out (affine): a rank may get batch 0; its loop must still run forward and backward (its gradient
        weight is 0), as the built-in trainer does. replay: recorded sizes {epoch: [steps, world]} to train with
        instead of deciding (no decisions are made). micro_batch m > 0: every rank's micro-batch is m samples and
        the balancer decides how many (k_i >= 1) each rank runs per step; max_batch then bounds m, not k_i * m.
        The rank and world are read from the process group or torchrun's environment when there is one, else
        when first needed (Lightning's callback sets them in its setup)."""
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
        self.global_batch = _whole("global_batch", global_batch, 1)
        self.rebalance_every = _whole("rebalance_every", rebalance_every, 0)
        self.micro_batch, self.seed = _whole("micro_batch", micro_batch, 0), _whole("seed", seed, 0)
        self.lag = None if lag is None else _whole("lag", lag, 0)
        self.min_batch = _whole("min_batch", min_batch, 1)  # sit_out, not min_batch 0, lets affine give a rank 0
        if sit_out and SCHEMES[scheme].rule != "affine":
            raise ValueError(f"sit_out applies to the affine scheme only (got scheme {scheme!r})")
        if self.micro_batch and sit_out:
            raise ValueError("sit_out does not combine with micro_batch (every rank runs at least one micro-batch)")
        if not isinstance(hetero, str):
            raise ValueError(f"hetero must be a string such as '1:slowdown=3' (got {hetero!r})")
        parse_hetero(hetero)  # a bad spec fails here, before the world is known
        self._settings = dict(smoothing=_fraction("smoothing", smoothing, 1), deadband=_fraction("deadband", deadband, 1),
                              significance=_fraction("significance", significance, float("inf")), sit_out=bool(sit_out))
        self._max_batch = max_batch
        self.scheme_name, self.scheme, self.hetero, self.replay = scheme, SCHEMES[scheme], hetero, replay
        self.epoch, self.global_step, self.steps_per_epoch, self.n_samples = 0, 0, 0, None
        self.decisions: list[Decision] = []
        self._rank: int | None = None
        self._planned: dict[int, np.ndarray] = {}  # position -> every rank's sizes, fixed when handed out
        self._handed = FAR   # next position this rank's sampler hands out
        self._iterated: int | None = None  # the epoch a sampler last iterated
        self.records: list[StepRecord] = []  # this epoch's finished steps (clocks read at decisions and on demand)
        self._unread: list[tuple[int, np.ndarray, StepClock, float]] = []  # (step, sizes, clock, delay) not yet read
        self._decided_upto = 0  # records before this index were part of an earlier decision
        self._device, self._coll = torch.device("cpu"), torch.device("cpu")
        self._pos, self._step, self._clock, self._delay = 0, 0, None, 0.0
        self._started: int | None = None  # the epoch set_epoch last started
        self._ended = 0  # steps ended since set_epoch
        self._attached = self._probed = False
        self._fsdp = None  # an FSDP2 model's schedule (integrations/fsdp.py), set by attach
        self._micro_left, self._expected, self.sync_now = 1, 1, True  # micro-batches left; the current one syncs
        self._syncs = self._forwards = 0
        self._unsynced = False  # a backward ran under no_sync since the last all-reduce
        self._steps_since_opt = 0  # steps begun since the attached model's optimizer last stepped
        self._params: set[int] = set()
        self._owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> steps the attached model?
        self._first_param: torch.nn.Parameter | None = None
        self._in_flight, self._all_issued, self._lock = 0, False, threading.Lock()
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
        self._rank, self.size = _whole("rank", rank, 0), _whole("world", world, 1)
        if rank >= world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        if far := [r for r in parse_hetero(self.hetero) if r >= world]:
            raise ValueError(f"hetero names rank {far[0]}, but the world has {world} rank(s) (ranks count from 0)")
        per_rank = list(self._max_batch) if isinstance(self._max_batch, (list, tuple)) else [self._max_batch] * world
        if len(per_rank) != world:
            raise ValueError(f"max_batch has {len(per_rank)} entries for {world} ranks")
        for v in per_rank:
            if v not in (None, "probe", float("inf")):
                _whole("max_batch", v, 0)
        self.probes = [v == "probe" for v in per_rank]
        limits = self._check_limits([float("inf") if v in (None, 0, "probe", float("inf")) else int(v)
                                     for v in per_rank])
        self.balancer = Balancer(self.scheme.rule, world, self.global_batch, self.min_batch,
                                 None if all(v == float("inf") for v in limits) else limits,
                                 granularity=max(self.micro_batch, 1), **self._settings)
        self.emulator = Emulator(self.hetero, rank, self.seed)
        self._regimes: list[tuple[int, Balancer]] = [(FAR, copy.deepcopy(self.balancer))]
        self._weight, self._sizes = 1.0 / world, self.balancer.sizes

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
        # the parts built with the world (balancer, emulator, size, probes, ...) bind it on first use
        if name in ("balancer", "emulator", "size", "probes", "_regimes", "_weight", "_sizes") and \
                self.__dict__.get("_rank") is None and "_rank" in self.__dict__:
            self._world_now()
            return getattr(self, name)
        raise AttributeError(f"'Balance' object has no attribute {name!r}")

    def fingerprint(self) -> dict:
        """Every setting the ranks must share, as plain data (compared at attach and at each set_epoch)."""
        b = self.balancer
        return {"rank": self.rank, "world": self.size, "version": __version__, "scheme": self.scheme_name,
                "global_batch": self.global_batch, "micro_batch": self.micro_batch, "seed": self.seed,
                "n_samples": self.n_samples, "epoch": self.epoch, "rebalance_every": self.rebalance_every,
                "hetero": self.hetero, "min_batch": self.min_batch, "lag": self.lag, "replay": self.replay is not None,
                "max_batch": [None if v == float("inf") else v for v in (b.max_batch or [])],
                **self._settings}

    def _agree(self, where: str) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._guarded(agree, self.fingerprint(), self._coll, where)

    def _guarded(self, fn, *args):
        """Run a collective; when it fails because a peer stopped with a posted line, raise that line."""
        try:
            return fn(*args)
        except HeteroError:
            raise
        except Exception as e:  # noqa: BLE001 - a collective's failure: a peer's own reason, when it left one
            if (why := peer_error()) is not None:
                raise HeteroError(why) from None
            raise e

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
        limits = [float("inf")] * len(limits) if m else limits
        check_feasible(len(limits), self.global_batch, self.min_batch, limits, max(m, 1))
        return limits

    def attach(self, ddp: torch.nn.Module) -> None:
        """Install the weighting (with the clock and the emulated delay) on a DDP model, as a communication hook, or
        on an FSDP2 root, as its reduce-scatter (integrations/fsdp.py); one-line ValueError for any other model.
        Collective: every rank's Balance must have the same settings and the process group's rank and world."""
        if any(self.probes) and not self._probed:
            raise ValueError('max_batch "probe": call bal.probe(model, ...) before wrapping the model in DDP')
        from . import fsdp  # torch only; refuses FSDP1, DDP around FSDP2, a non-root, ...
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) or fsdp.refusal(ddp, self.size):
            self._fsdp = fsdp.attach(self, ddp)
        self._device = next(ddp.parameters()).device
        self._coll = self._device if dist.get_backend() == "nccl" else torch.device("cpu")
        self._agree("attach")
        if self._fsdp is None:
            ddp.register_comm_hook(self, balance_hook)
        ddp.register_forward_pre_hook(self._count_forward)
        self._params = {id(p) for p in ddp.parameters()}
        self._first_param = next(ddp.parameters())
        check = weakref.WeakMethod(self._before_optimizer_step)
        handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: (c := check()) and c(opt))
        weakref.finalize(self, handle.remove)
        self._attached = True

    def _count_forward(self, module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self._forwards += 1

    def _before_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """Any optimizer's step (a global hook): refuse one on the attached model whose gradients were not
        all-reduced, or that follows more steps of the schedule than one (a loop counting its own micro-batches)."""
        owns = self._owns.get(opt)
        if owns is None:
            owns = self._owns[opt] = any(id(p) in self._params for g in opt.param_groups for p in g["params"])
        if not owns:
            return
        if self._unsynced:
            done = self._expected - self._micro_left
            self._refuse(f"hetero: rank {self.rank} stepped its optimizer after {done} of its {self._expected} "
                         f"micro-batches at step {self._step} of epoch {self.epoch}, on gradients that were not "
                         f"all-reduced: run bal.micro_batches micro-batches per step (or use the loader's batches)")
        if self.micro_batch and self._steps_since_opt > 1:
            self._refuse(f"hetero: rank {self.rank} ran {self._steps_since_opt} steps of the schedule (their "
                         f"micro-batches) before one optimizer step, at epoch {self.epoch}: run bal.micro_batches "
                         f"micro-batches per step ({self._expected} now), then step the optimizer")
        self._steps_since_opt = 0

    def _refuse(self, message: str):
        """A mistake this rank alone sees: tell the others (agree.post), then raise."""
        post(message)
        raise HeteroError(message)

    def batch_sampler(self, n_samples: int, seed: int | None = None) -> BalancedBatchSampler:
        """Per-step index lists for this rank: its slice of each step's window of one shared permutation."""
        self.set_samples(n_samples)
        return BalancedBatchSampler(self, n_samples, self.seed if seed is None else _whole("seed", seed, 0))

    def set_samples(self, n_samples: int) -> int:
        """The epoch's length in samples (the sampler's, or that of a loop cutting its own batches with
        sampler.EpochPlan); returns its steps. A loop without epochs does not call it."""
        n = _whole("n_samples", n_samples, 1)
        if self.global_batch > n:
            raise ValueError(f"global batch {self.global_batch} exceeds the {n} samples")
        self.n_samples, self.steps_per_epoch = n, n // self.global_batch
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Call before iterating the loader each epoch (the sampler's permutation and the emulator follow it).
        Collective when the process group is up: the ranks compare their settings and the steps they ran."""
        epoch = _whole("epoch", epoch, 0)
        if epoch == self._started:  # idempotent: the user and Lightning may both call it
            return
        if epoch and not self.steps_per_epoch:
            raise HeteroError(f"hetero: set_epoch({epoch}) without an epoch length: call bal.batch_sampler(len(ds)) "
                              f"or bal.set_samples(n) first (a loop without epochs calls neither)")
        if self._started is not None:
            self._agree_steps()
        self.epoch = self._started = epoch
        self.emulator.start_epoch(epoch)
        self._step, self._ended, self.records, self._unread, self._decided_upto = 0, 0, [], [], 0
        if self._attached:
            self._agree("set_epoch")

    def _agree_steps(self) -> None:
        """The epoch just left: every rank ran as many steps (a rank that broke out early is named)."""
        if not (self._attached and dist.is_initialized() and self.size > 1):
            return
        if self.steps_per_epoch:
            same_steps(self.epoch, self._ended, self.steps_per_epoch)
        ran = self._guarded(gather_rows, torch.tensor([float(self._ended)]), self._coll).flatten().tolist()
        if any(r != ran[0] for r in ran):
            short = min(range(len(ran)), key=ran.__getitem__)
            raise HeteroError(f"hetero: rank {short} left epoch {self.epoch} after {int(ran[short])} steps, rank "
                              f"{max(range(len(ran)), key=ran.__getitem__)} ran {int(max(ran))}: every rank must run "
                              f"every step of the epoch")

    # -- the schedule: batch sizes per position, fixed when a sampler hands the position out ----------------------
    def sizes_at(self, epoch: int, step: int) -> np.ndarray:
        """Every rank's batch size in samples at this step of this epoch (sum = global batch); the same on every
        rank, and fixed once asked for (a sampler handing the step out asks)."""
        pos = epoch * (self.steps_per_epoch or ENDLESS) + step
        if pos not in self._planned:
            if self.replay is not None:
                self._planned[pos] = np.asarray(self.replay[epoch][step], np.int64)
            else:  # the regime in force at pos; affine's first epoch probes two sizes (Balancer.sizes_for_step)
                start, regime = next(r for r in reversed(self._regimes) if r[0] <= pos)
                self._planned[pos] = np.array(regime.sizes_for_step(step), np.int64)
            self._handed = max(self._handed, pos + 1)
        return self._planned[pos]

    def start_epoch_iteration(self, epoch: int) -> None:
        """A sampler starts handing out `epoch`: refuse a second pass over steps already handed out."""
        if epoch * (self.steps_per_epoch or ENDLESS) < self._handed:
            if self._iterated == epoch:
                raise HeteroError(f"hetero: the loader was iterated twice in epoch {epoch} (a `next(iter(loader))` "
                                  f"peek, or a second pass): each step's batches are handed out once; learn the "
                                  f"sizes from bal.sizes_at(epoch, step) instead of peeking")
            raise HeteroError(f"hetero: epoch {epoch} was already handed out: call bal.set_epoch(epoch) each epoch")
        self._iterated = epoch

    @property
    def micro_batches(self) -> int:
        """This rank's micro-batches in the current step (the next one, between steps): b_i / micro_batch; 1
        without micro_batch. A loop counting its own micro-batches (nanoGPT's) runs this many per step."""
        if self._clock is not None:
            return self._expected
        b = int(self.sizes_at(self.epoch, self._step)[self.rank])
        return b // self.micro_batch if self.micro_batch else 1

    @property
    def last_sizes(self) -> list[int]:
        """Every rank's batch size at the latest step begun."""
        return self._sizes.tolist()

    # -- one step ----------------------------------------------------------------------------------------------
    def begin_step(self, step: int | None = None) -> np.ndarray:
        """Start a step: this rank's gradient weight and a fresh clock (the clock marks `start` now); returns every
        rank's batch sizes for the step, in samples (with micro_batch m, this rank runs sizes[rank] // m)."""
        if self._started is None and self.steps_per_epoch:
            self.set_epoch(self.epoch)
        if not self.steps_per_epoch and not self.rebalance_every and self.scheme.rule != "static":
            raise HeteroError("hetero: a loop without epochs (no bal.batch_sampler or bal.set_samples) decides only "
                              "every rebalance_every steps: set rebalance_every > 0")
        if not self._attached and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise HeteroError("hetero: call bal.attach(ddp) before the first step: without it the gradients are "
                              "DDP's plain mean, not weighted by the batch sizes")
        self._step = self._step if step is None else step
        self._pos = self.epoch * (self.steps_per_epoch or ENDLESS) + self._step
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
        if self._first_param is not None and self._first_param.grad is None:
            self._steps_since_opt = 0  # gradients cleared (zero_grad): a step the optimizer skipped (GradScaler) is fine
        self._steps_since_opt += 1
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
        self._ended += 1
        last = step == self.steps_per_epoch - 1
        due = last or (self.rebalance_every and (step + 1) % self.rebalance_every == 0)
        if self.scheme.rule == "static" or self.replay is not None or not due:
            return None
        return self._guarded(self._decide, step)

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
        micro_batch). With micro_batch a rank runs k_i = bal.micro_batches of these per step, all but the last
        under ddp.no_sync() (so pass ddp). batch_size (optional) is checked against the schedule."""
        if self._clock is None:  # the step's first batch (the built-in trainer begins its steps itself)
            self.begin_step()
        want = self.micro_batch or self._sizes[self.rank]
        if batch_size is not None and batch_size != want:
            raise RuntimeError(f"hetero: step {self._step} got {batch_size} samples, the schedule says "
                               f"{want}: is the loader this Balance's sampler?")
        self.sync_now = self._micro_left <= 1
        if self._fsdp is not None:  # FSDP2: no no_sync; its own schedule (the same collectives on every rank)
            self._fsdp.begin(first=self._micro_left == self._expected, sync=self.sync_now)
        elif self.micro_batch and ddp is None:  # on every rank alike, whatever its count (no rank left waiting)
            raise RuntimeError("hetero: with micro_batch, pass the DDP model: `with bal.step(ddp):`")
        try:
            with nullcontext() if self.sync_now or self._fsdp is not None else ddp.no_sync():
                yield
        except HeteroError:
            raise
        except Exception as e:  # noqa: BLE001 - a backward's collective failed: a peer's posted reason, if any
            if (why := peer_error()) is not None:
                raise HeteroError(why) from None
            raise e
        self._micro_left -= 1
        if self.sync_now:
            self.end_step()
        else:
            self._unsynced = True  # local gradients only, until the step's last micro-batch all-reduces

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
        self._unsynced = False
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
        self._started = self._iterated = None

    def __getstate__(self) -> dict:  # Lightning's ddp_spawn pickles the callback: the lock is made anew
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_owns")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _owns=weakref.WeakKeyDictionary())
