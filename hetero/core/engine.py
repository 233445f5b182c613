"""The step engine: one rank's step protocol beneath the Balance, and the extension surface of integrations.

    sizes = engine.begin()        # a step: every rank's sizes, this rank's weight, a fresh clock
    ...forward and backward...    # the DDP hook / FSDP2 reduce-scatter read engine.step and call gradients_ready
    engine.end()                  # the checks, the position, and every K steps a decision (collective)

It holds one step's state (the running Step: weight, micro-batch count, forwards, syncs, clock marks, the emulated
delay) and the optimizer guard's flags. The comm hook, FSDP2's comms and the guard hold the engine; the engine
calls down into the plan only. Every door (`with bal.step()`, begin/end, the Lightning and Hugging Face callbacks,
FSDP2) runs through `begin` and `end`, so each rule is checked once, here:
- a step's sizes were handed out by hetero's sampler (or sizes_at) in a loop with epochs: a plain DataLoader is
  refused before its first step;
- a rank runs exactly its k_i micro-batches (forwards) and one gradient all-reduce per step. A rank that runs too
  many stops at the extra forward, one that syncs early stops in the hook before its last bucket is reduced; it
  posts its line (agree.post), and its peers, whose collective then fails, raise that line at their optimizer
  step or end(): no rank steps on a wrong gradient, every rank says why.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist

from .agree import HeteroError, agree, guarded, peer_error, post, same_steps
from .clock import StepClock
from .emulator import Emulator, parse_hetero
from .plan import ENDLESS, Plan
from .records import Decision
from .settings import Settings
from .step import Step


def spend_delay(emulator: Emulator, epoch: int, global_step: int, clock: StepClock) -> float:
    """An emulated slow rank's extra time (s), spent when its gradients are ready; returns it.

    On CUDA the host runs ahead of the GPU: a sleep while this rank's kernels are still queued would overlap them
    and be lost. So the host first waits for the compute stream (clock.wait_device: an event, not a device-wide
    synchronise, which would also wait for NCCL), once per delayed step; the `ready` mark, recorded after the
    sleep, then counts the delay as compute on CUDA as on the CPU."""
    waited = emulator.needs_compute_time
    own = clock.host_elapsed_s() if waited else 0.0  # slowdown: waits for the device to measure its own time
    delay = emulator.delay_s(epoch, global_step, own)
    if delay > 0:
        if not waited:
            clock.wait_device()
        time.sleep(delay)
    return delay


def emulated(spec: str, rank: int, world: int, seed: int) -> Emulator:
    """This rank's emulated effects; a spec naming a rank outside the world is refused."""
    if far := [r for r in parse_hetero(spec) if r >= world]:
        raise ValueError(f"hetero names rank {far[0]}, but the world has {world} rank(s) (ranks count from 0)")
    return Emulator(spec, rank, seed)


def refuse(message: str):
    """A mistake this rank alone sees: tell the others (agree.post), then raise."""
    post(message)
    raise HeteroError(message)


def _together() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _stop(message: str):
    """A refusal that may hold on this rank alone (its loop, not the settings): posted when others may be waiting."""
    if _together():
        refuse(message)
    raise HeteroError(message)


class Engine:
    """One rank's steps: begin ... end, the running step, the checks every door shares (module docstring)."""

    def __init__(self, plan: Plan, emulator: Emulator, hetero: str = ""):
        self.plan, self.emulator, self.hetero = plan, emulator, hetero
        self.rank, self.world, self.settings = plan.rank, plan.world, plan.settings
        self.step: Step | None = None           # the step running now
        self.model: torch.nn.Module | None = None  # the attached DDP model or FSDP2 root
        self.fsdp = None                        # an FSDP2 model's schedule (fsdp.py)
        self.device = self.coll = torch.device("cpu")
        self.sync_now = True      # the micro-batch running now (or next) all-reduces
        self.unsynced = False     # a backward ran under no_sync since the last all-reduce (the guard reads it)
        self.since_opt = 0        # steps begun since the model's optimizer last stepped (the guard resets it)
        self.peer_failed: str | None = None  # a peer's posted line, seen when this rank's collective failed

    # -- set-up and epochs -----------------------------------------------------------------------------------
    @classmethod
    def build(cls, settings: Settings, rank: int, world: int, hetero: str, replay) -> Engine:
        """The parts of one rank's Balance, once its world is known: the plan and the emulated slow ranks."""
        plan = Plan(settings, rank, world)
        plan.replayed = replay
        return cls(plan, emulated(hetero, rank, world, settings.seed), hetero)

    def fingerprint(self) -> dict:
        """Every setting the ranks must share, as plain data (compared at attach and at each set_epoch)."""
        from . import __version__

        p = self.plan
        return {"rank": self.rank, "world": self.world, "version": __version__, **self.settings.shared(),
                "n_samples": p.n_samples, "epoch": p.at.epoch, "hetero": self.hetero,
                "replay": p.replayed is not None,
                "max_batch": [None if v == float("inf") else v for v in (p.balancer.max_batch or [])]}

    def agree(self, where: str) -> None:
        if _together():
            guarded(agree, self.fingerprint(), self.coll, where)

    def start_epoch(self, epoch: int) -> None:
        """set_epoch: the epoch just left is checked (every rank ran its steps), the new one starts."""
        p = self.plan
        if p.at.started and p.at.epoch == epoch:  # idempotent: the user and Lightning may both call it
            return
        if epoch and not p.steps_per_epoch:
            raise HeteroError(f"hetero: set_epoch({epoch}) without an epoch length: call bal.batch_sampler(len(ds)) "
                              f"first (a loop without epochs calls neither)")
        if p.at.started and self.model is not None and _together():
            self._agree_steps()
        p.start_epoch(epoch)
        self.emulator.start_epoch(epoch)
        if self.model is not None:
            self.agree("set_epoch")

    def _agree_steps(self) -> None:
        """The epoch just left: every rank ran as many steps (a rank that broke out early is named)."""
        from .agree import gather_rows

        p = self.plan
        if p.steps_per_epoch:
            same_steps(p.at.epoch, p.at.step, p.steps_per_epoch)
        ran = guarded(gather_rows, torch.tensor([float(p.at.step)]), self.coll).flatten().tolist()
        if any(r != ran[0] for r in ran):
            short = min(range(len(ran)), key=ran.__getitem__)
            raise HeteroError(f"hetero: rank {short} left epoch {p.at.epoch} after {int(ran[short])} steps, rank "
                              f"{max(range(len(ran)), key=ran.__getitem__)} ran {int(max(ran))}: every rank must run "
                              f"every step of the epoch")

    # -- one step --------------------------------------------------------------------------------------------
    def begin(self, step: int | None = None, from_loader: bool = False) -> np.ndarray:
        """Start the epoch's next step (`step`, if given, must be it): this rank's gradient weight and a fresh
        clock; returns every rank's batch sizes for the step, in samples. from_loader: the step's batch came from
        a loader (`with bal.step()` began it), so hetero's sampler must have handed it out."""
        p, s = self.plan, self.settings
        if self.step is not None:
            _stop(f"hetero: begin_step at step {self.step.index} of epoch {p.at.epoch}, which has not "
                              f"ended: end each step (end_step) before the next begins")
        if not p.at.started and p.steps_per_epoch:
            self.start_epoch(p.at.epoch)
        if not p.steps_per_epoch and not s.rebalance_every and s.rule != "static" and p.replayed is None:
            raise HeteroError("hetero: a loop without epochs (no bal.batch_sampler) decides only every "
                              "rebalance_every steps: set rebalance_every > 0")
        if self.model is None and _together():
            raise HeteroError("hetero: call bal.attach(ddp) before the first step: without it the gradients are "
                              "DDP's plain mean, not weighted by the batch sizes")
        index = p.at.step
        if step is not None and step != index:
            _stop(f"hetero: the loop is at step {step} of epoch {p.at.epoch}, but the Balance at step "
                              f"{index}: every step must begin and end once, in order (a resumed loop loads the "
                              f"Balance's state_dict)")
        if self.fsdp is not None and s.micro_batch and not from_loader:
            raise HeteroError("hetero: FSDP2 with micro_batch runs each micro-batch in `with bal.step():` (its "
                              "schedule keeps every rank's collectives equal); begin_step by hand cannot")
        if index >= (p.steps_per_epoch or ENDLESS):
            _stop(f"hetero: epoch {p.at.epoch} has run all its {p.steps_per_epoch} steps: call "
                              f"bal.set_epoch(epoch) before each epoch")
        if from_loader and p.steps_per_epoch and not p.handed_out(p.at.epoch, index):
            _stop(f"hetero: step {index} of epoch {p.at.epoch} was not handed out by hetero's sampler: "
                              f"give the DataLoader batch_sampler=bal.batch_sampler(len(ds)) (a loop cutting its own "
                              f"batches begins each step with bal.begin_step(), which returns the sizes)")
        sizes = p.sizes_at(p.at.epoch, index)
        b, m = int(sizes[self.rank]), s.micro_batch
        if m and (b % m or not b):
            _stop(f"hetero: step {index} gives rank {self.rank} {b} samples, not whole micro-batches "
                              f"of {m} (a replay recorded with another micro_batch?)")
        k = b // m if m else 1
        # k micro-batches, each a mean over m: weight m/B makes their accumulated sum the global-batch mean gradient
        weight = (m or b) / s.global_batch if s.weighted else 1.0 / (self.world * k)
        if self.model is not None:
            self._cleared()
            self.since_opt += 1
        p.last = sizes
        self.step = Step(p.at.epoch, index, sizes, self.rank, weight, k, self.device)
        self.sync_now = k <= 1
        return sizes

    def _cleared(self) -> None:
        first = next(self.model.parameters())
        if first.grad is None:  # gradients cleared (zero_grad): a step skipped by a GradScaler is fine
            self.since_opt = 0

    @contextmanager
    def micro(self, batch_size: int | None = None) -> Iterator[None]:
        """One micro-batch (or the step's one batch): `with bal.step():` (Balance.step has the contract)."""
        if self.settings.micro_batch and self.model is None:  # on every rank alike, whatever its count
            raise HeteroError("hetero: with micro_batch, attach the model first (bal.attach(ddp)): its no_sync "
                              "keeps all but the step's last micro-batch local")
        if self.step is None:  # the step's first batch
            self.begin(from_loader=True)
        s = self.step
        want = self.settings.micro_batch or int(s.sizes[self.rank])
        if batch_size is not None and batch_size != want:
            _stop(f"hetero: step {s.index} got {batch_size} samples, the schedule says {want}: is the "
                              f"loader this Balance's sampler?")
        self.sync_now = s.last_micro_batch
        try:
            if self.fsdp is not None:  # FSDP2: no no_sync; its own schedule (the same collectives on every rank)
                self.fsdp.begin(first=s.left == s.expected, sync=self.sync_now)
            with nullcontext() if self.sync_now or self.fsdp is not None else self.model.no_sync():
                yield
        except HeteroError:
            raise
        except Exception as e:  # noqa: BLE001 - a backward's collective failed: a peer's posted reason, if any
            if (why := self.peer_failed or peer_error()) is not None:
                raise HeteroError(why) from None
            raise e
        s.left -= 1
        if self.sync_now:
            self.end()
        else:
            self.unsynced = True  # local gradients only, until the step's last micro-batch all-reduces

    def running(self, required: bool = True) -> Step | None:
        """The running step; between steps None, or a one-line error where one is required."""
        if self.step is None and required:
            raise HeteroError("hetero: a backward ran outside `with bal.step()` (or begin_step/end_step)")
        return self.step

    def set_weight(self, weight: float) -> None:
        """Replace the running step's gradient weight (begin sets b_i/B, m/B or 1/world), before backward: 1/world
        where the loss is already normalised over every rank, or this rank's share of the step's valid tokens. The
        weights of one step must sum to 1 over the ranks."""
        self.running().weight = float(weight)

    def count_forward(self, module, args) -> None:
        """The attached model's forward pre-hook: a training forward beyond this rank's count stops here."""
        s = self.step
        if s is None or not (module.training and torch.is_grad_enabled()):
            return
        s.forwards += 1
        if s.forwards > s.expected:
            refuse(f"hetero: rank {self.rank} ran {s.forwards} forwards in step {s.index} of epoch "
                   f"{self.plan.at.epoch}, where its count is {s.expected}: run bal.micro_batches micro-batches per "
                   f"step (the loader's batches)")

    def gradients_ready(self) -> Step:
        """The hook's call at the step's last bucket: local gradients are complete (an emulated slow rank spends
        its delay here; the clock marks `ready`). A sync before this rank's last micro-batch stops here."""
        s = self.running()
        s.syncs += 1
        if self.model is not None and (s.forwards != s.expected or s.syncs > 1):
            refuse(f"hetero: rank {self.rank} all-reduced its gradients after {s.forwards} of its {s.expected} "
                   f"micro-batches in step {s.index} of epoch {self.plan.at.epoch}: run bal.micro_batches "
                   f"micro-batches per step, all but the last under no_sync (or use `with bal.step()`)")
        self.unsynced = False
        if self.emulator.effects and not s.sits_out:  # a rank sitting out has nothing to slow down
            s.delay_s = spend_delay(self.emulator, self.plan.at.epoch, self.plan.global_step, s.clock)
        s.clock.mark("ready")
        return s

    def collective_failed(self) -> bool:
        """This rank's gradient collective failed: True when a peer posted why (raised at the optimizer step or
        end); False when it did not (the collective's own error stands)."""
        self.peer_failed = self.peer_failed or peer_error()
        return self.peer_failed is not None

    def mark_backward(self) -> None:
        """Optional, right after loss.backward(): backward's return ends the all-reduce wait."""
        self.running().clock.mark("returned")

    def end(self) -> Decision | None:
        """End the step (after the optimizer step); every K steps and at the epoch's end, decide (collective)."""
        s = self.running()
        s.clock.mark("end")
        self.step = None
        if self.peer_failed:
            raise HeteroError(self.peer_failed)
        if self.model is not None and (s.syncs != 1 or s.forwards != s.expected):
            hint = ("run bal.micro_batches micro-batches per step, the last one synced" if self.settings.micro_batch
                    else "gradient accumulation (no_sync) needs micro_batch: set Balance(micro_batch=m)")
            refuse(f"hetero: rank {self.rank} ran {s.forwards} forward(s) and {s.syncs} gradient all-reduce(s) in "
                   f"step {s.index} of epoch {self.plan.at.epoch}; it needs {s.expected} and 1: {hint}")
        if self.plan.ended(s):
            return guarded(self.plan.decide, s.index, self.coll)
        return None
