"""The step engine: one rank's step protocol beneath the Balance, and the integrations' extension surface.

    sizes = engine.begin()        # a step: every rank's sizes, this rank's weight, a fresh clock
    with engine.micro(m):         # each micro-batch (or the step's one batch): no_sync / FSDP2's schedule, checks
        ...forward and backward...    # the DDP hook / FSDP2 reduce-scatter call running() and gradients_ready()
    engine.end()                  # the checks, the position, and every K steps a decision (collective)

It holds the running Step (weight, micro-batch count, forwards, syncs, clock, emulated delay) and shares its `link`
(link.py) with the parts installed on the model (the comm hook, FSDP2's comms, the optimizer guard), which hold the
engine; it calls down into the plan only. Every door runs through `begin`, `micro` and `end`, so each rule is
checked once, here:
- with epochs, a step's sizes were handed out by hetero's sampler: a plain DataLoader is refused at its first step;
- a rank runs exactly its k_i forwards and one gradient all-reduce per step. One too many stops at the extra
  forward, an early sync in the hook before its last bucket is reduced; the rank posts its line (agree.post) and
  its peers, whose collective then fails, raise it at their optimizer step or end(): no rank steps on a wrong
  gradient, every rank says why.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager

import numpy as np
import torch
import torch.distributed as dist

from .agree import HeteroError, agree, gather_identities, guarded, peer_error, polled, post, same_steps
from .clock import StepClock
from .emulator import Emulator, parse_hetero
from .link import Link
from .plan import Plan
from .records import Decision
from .schedule import ENDLESS
from .settings import Settings
from .settle import settle
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


def build(settings: Settings, rank: int, world: int, hetero: str, replay) -> Engine:
    """The parts of one rank's Balance, once its world is known: the plan and the emulated slow ranks."""
    plan = Plan(settings, rank, world)
    plan.schedule.replayed = replay
    return Engine(plan, emulated(hetero, rank, world, settings.seed), hetero)


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
    """One rank's steps: begin, micro, end, the running step, the checks every door shares (engine.py's docstring).
    Integrations may call `micro`, `running` and `count_forward` (the extension surface); the rest is the core's."""

    def __init__(self, plan: Plan, emulator: Emulator, hetero: str = ""):
        self.plan = plan
        self.link = Link()  # shared with the comm hook, FSDP2's comms and the optimizer guard
        self._emulator, self._hetero = emulator, hetero
        self._drawn: int | None = None  # the epoch the emulator's draws follow (set at a step's begin)
        self._step: Step | None = None  # the step running now
        self._share: tuple = (None, 0, 0.0)  # (a regime's read-only sizes, k, weight): begin's, once per regime

    # -- set-up and epochs -----------------------------------------------------------------------------------
    def connect(self, model: torch.nn.Module, fsdp=None, ds=None) -> None:
        """attach's one write (collective): the model (a DDP model, an FSDP2 root with its schedule, or a DeepSpeed
        engine with its door), its device and the collectives'; the ranks compare their settings and gather their
        worker identities."""
        link = self.link
        settle.collectives()  # this process runs collectives: its exit waits for gloo's threads (settle.py)
        link.fsdp, link.ds, link.device = fsdp, ds, next(model.parameters()).device
        link.coll = link.device if dist.get_backend() == "nccl" else torch.device("cpu")
        self._agree("attach")
        self.plan.identities = gather_identities(self.plan.settings.worker_id, link.device, link.coll)
        link.model, link.first, link.watch = model, next(model.parameters()), polled()

    def _fingerprint(self) -> dict:
        """Every setting the ranks must share, as plain data (compared at attach and at each set_epoch)."""
        from . import __version__

        p = self.plan
        return {"rank": p.rank, "world": p.world, "version": __version__, **p.settings.shared(),
                "n_samples": p.schedule.n_samples, "epoch": p.at.epoch, "hetero": self._hetero,
                "replay": p.schedule.replayed is not None, "max_batch": p.schedule.limits,
                "lengths": p.schedule.digest()}

    def _agree(self, where: str) -> None:
        if _together():
            guarded(agree, self._fingerprint(), self.link.coll, where)

    def start_epoch(self, epoch: int) -> None:
        """set_epoch: the epoch just left is checked (every rank ran its steps), the new one starts."""
        p = self.plan
        if p.at.started and p.at.epoch == epoch:  # idempotent: the user and Lightning may both call it
            return
        if epoch and not p.schedule.steps_per_epoch:
            raise HeteroError(f"hetero: set_epoch({epoch}) without an epoch length: call bal.batch_sampler(len(ds)) "
                              f"first (a loop without epochs calls neither)")
        if p.at.started and self.link.model is not None and _together():
            self._agree_steps()
        p.start_epoch(epoch)
        if self.link.model is not None:
            self._agree("set_epoch")

    def _agree_steps(self) -> None:
        """The epoch just left: every rank ran as many steps (a rank that broke out early is named)."""
        from .agree import gather_rows

        p, spe = self.plan, self.plan.schedule.steps_per_epoch
        if spe:
            same_steps(p.at.epoch, p.at.step, spe)
        ran = guarded(gather_rows, torch.tensor([float(p.at.step)]), self.link.coll).flatten().tolist()
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
        p, sched, link = self.plan, self.plan.schedule, self.link
        s, spe, rank = p.settings, sched.steps_per_epoch, p.rank
        if self._step is not None:
            _stop(f"hetero: begin_step at step {self._step.index} of epoch {p.at.epoch}, which has not "
                  f"ended: end each step (end_step) before the next begins")
        if not p.at.started and spe:
            self.start_epoch(p.at.epoch)
        if not spe and not s.rebalance_every and s.rule != "static" and sched.replayed is None:
            raise HeteroError("hetero: a loop without epochs (no bal.batch_sampler) decides only every "
                              "rebalance_every steps: set rebalance_every > 0")
        if link.model is None and _together():
            raise HeteroError("hetero: call bal.attach(ddp) before the first step: without it the gradients are "
                              "DDP's plain mean, not weighted by the batch sizes")
        epoch, index = p.at.epoch, p.at.step
        if step is not None and step != index:
            _stop(f"hetero: the loop is at step {step} of epoch {epoch}, but the Balance at step {index}: every step "
                  f"must begin and end once, in order (a resumed loop loads the Balance's state_dict)")
        if link.fsdp is not None and s.micro_batch and not from_loader:
            raise HeteroError("hetero: FSDP2 with micro_batch runs each micro-batch in `with bal.step():` (its "
                              "schedule keeps every rank's collectives equal); begin_step by hand cannot")
        if link.ds is not None and not from_loader:
            raise HeteroError("hetero: a DeepSpeed engine runs each micro-batch in `with bal.step():` (where its "
                              "engine.step() reduces the step's gradients); begin_step by hand cannot")
        if index >= (spe or ENDLESS):
            _stop(f"hetero: epoch {epoch} has run all its {spe} steps: call bal.set_epoch(epoch) before each epoch")
        sizes = sched.planned.get(sched.index(epoch, index))  # fixed when handed out (sched.handed_out)
        if sizes is None:
            if from_loader and spe:
                _stop(f"hetero: step {index} of epoch {epoch} was not handed out by hetero's sampler: give the "
                      f"DataLoader batch_sampler=bal.batch_sampler(len(ds)) (a loop cutting its own batches begins "
                      f"each step with bal.begin_step(), which returns the sizes)")
            sizes = sched.sizes_at(epoch, index)
        work, (held, k, weight) = None, self._share
        if held is not sizes:  # a regime's read-only sizes, the same step after step: checked once (issue 51)
            k, weight = self._count(sizes, epoch, index)
            if not s.by_tokens and not sizes.flags.writeable and sizes.base is None:
                self._share = (sizes, k, weight)
        if s.by_tokens:  # each rank's rows cost what their lengths say; a token-mean loss weighs n_i / N; with
            # micro-batches each one's loss divides by this rank's count for the step (docs/tokens.md), so the rank's
            # share weighs their sum; the sizes sum to the step's window (global_batch, or a token budget's)
            work, counted = sched.work_at(epoch, index)
            weight = int(sizes[rank]) / int(sizes.sum())
            if s.loss_mean == "tokens":
                if not counted.sum():
                    _stop(f"hetero: step {index} of epoch {epoch} has no token its loss counts (every loss_tokens "
                          f"of its samples is 0): a token-mean loss over none is undefined")
                weight = float(counted[rank]) / float(counted.sum())
        if link.model is not None:
            self._cleared()
            link.since_opt += 1
        if self._drawn != epoch:  # the emulator's draws follow the epoch (also one resumed or plugged in mid-way)
            self._emulator.start_epoch(epoch)
            self._drawn = epoch
        sched.last = sizes
        self._step = Step(epoch, index, sizes, rank, weight, k, link.device, work)
        link.sync_now = k <= 1
        return sizes

    def _count(self, sizes: np.ndarray, epoch: int, index: int) -> tuple[int, float]:
        """This rank's micro-batches in a step of these sizes, and its gradient weight (by tokens, begin's)."""
        p, s = self.plan, self.plan.settings
        b, m, rank = int(sizes[p.rank]), s.micro_batch, p.rank
        if m and s.by_tokens:  # by tokens a rank's rows are cut by count and max_tokens (schedule.micro_at)
            b = len(p.schedule.micro_at(epoch, index)[rank]) * m
        if m and (b % m or not b):
            _stop(f"hetero: step {index} gives rank {rank} {b} samples, not whole micro-batches of {m} (a replay "
                  f"recorded with another micro_batch?)")
        k = b // m if m else 1
        # k micro-batches, each a mean over m: weight m/B makes their accumulated sum the global-batch mean gradient
        if s.by_tokens:
            return k, 0.0  # begin weighs by the step's tokens or samples
        return k, (m or b) / s.global_batch if s.weighted else 1.0 / (p.world * k)

    def _cleared(self) -> None:
        link = self.link  # FSDP2 may swap the registered parameters (sharded, unsharded): read them afresh there
        first = link.first if link.first is not None and link.fsdp is None else next(link.model.parameters())
        if first.grad is None:  # gradients cleared (zero_grad): a step skipped by a GradScaler is fine
            self.link.since_opt = 0

    def micro(self, batch_size: int | None = None, ends_step: bool = True) -> AbstractContextManager[None]:
        """One micro-batch (or the step's one batch): the one door every loop's batches run through (`with
        bal.step():`, Lightning's per-rank recipe, the HF Trainer's loop). It begins the step at its first batch
        unless the host began it (`bal.begin_step`), keeps all but the step's last micro-batch local (DDP's no_sync
        or FSDP2's schedule) and checks each batch against the schedule.

        Args:
            batch_size: optional, checked against the schedule (m, or this rank's size without micro-batches).
            ends_step: end the step after its last micro-batch (False: the host calls `bal.end_step()` after its
                optimizer step, as the HF Trainer's callback does).

        Returns:
            A context manager around the micro-batch's forward and backward.

        Raises:
            HeteroError: micro_batch before attach, a batch of another size than the schedule's, a micro-batch
                beyond this rank's count, a peer's refusal (the backward's collective failed); `begin_step`'s.
        """
        return _Micro(self, batch_size, ends_step)

    def running(self, required: bool = True) -> Step | None:
        """The step running now, for a host that checks where its step is (Lightning's callback at a batch's end).

        Args:
            required: raise between steps instead of returning None.

        Returns:
            The running step, or None between steps: read its `expected` (this rank's micro-batches in the step)
                and `left` (those still to run).

        Raises:
            HeteroError: between steps, where required.
        """
        if self._step is None and required:
            raise HeteroError("hetero: a backward ran outside `with bal.step()` (or begin_step/end_step)")
        return self._step

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """`bal.backward(loss)`: the loss door's weighted backward (weighting="loss"), a DeepSpeed engine's own
        backward (its door weighs), else loss.backward() (the comm hook or FSDP2's reduce-scatter weighs)."""
        link = self.link
        if link.loss is not None:
            link.loss.backward(loss, **kwargs)
        elif link.ds is not None:
            link.model.backward(loss, **kwargs)
        else:
            loss.backward(**kwargs)

    def count_forward(self, module: torch.nn.Module, args: tuple) -> None:
        """Count one training forward of the running step. The attached model's forward pre-hook calls it; a host
        whose framework runs all the step's micro-batches inside one forward calls it at each backward instead
        (Lightning's callback under DDP). Nothing is counted between steps, in eval mode or without grad.

        Args:
            module: the model the forward runs on (its `training` flag says whether the forward counts).
            args: the forward's positional arguments (unread: a forward pre-hook's signature).

        Raises:
            HeteroError: a forward beyond this rank's count in the step (posted to the other ranks first).
        """
        s = self._step
        if s is None or not (module.training and torch.is_grad_enabled()):
            return
        s.forwards += 1
        if s.forwards > s.expected:
            refuse(f"hetero: rank {s.rank} ran {s.forwards} forwards in step {s.index} of epoch {s.epoch}, where its "
                   f"count is {s.expected}: run bal.micro_batches micro-batches per step (the loader's batches)")

    def gradients_ready(self, count: bool = True, ready: bool = True) -> Step:
        """The hook's call at the step's last bucket: local gradients are complete (an emulated slow rank spends
        its delay here; the clock marks `ready`). A sync before this rank's last micro-batch stops here. The loss
        door (lossweight.py) makes the two halves apart: the count and its check before a synced backward enters
        DDP's all-reduce (ready=False), the mark at its first parameter's gradient (count=False)."""
        s, link = self.running(), self.link
        if count:
            s.syncs += 1
            if link.model is not None and (s.forwards != s.expected or s.syncs > 1):
                refuse(f"hetero: rank {s.rank} all-reduced its gradients after {s.forwards} of its {s.expected} "
                       f"micro-batches in step {s.index} of epoch {s.epoch}: run bal.micro_batches micro-batches "
                       f"per step, all but the last under no_sync (or use `with bal.step()`)")
            link.unsynced = False
        if ready:
            if self._emulator.effects and not s.sits_out:  # a rank sitting out has nothing to slow down
                s.delay_s = spend_delay(self._emulator, s.epoch, self.plan.at.global_step, s.clock)
            s.clock.mark("ready")
        return s

    def end(self) -> Decision | None:
        """End the step (after the optimizer step); every K steps and at the epoch's end, decide (collective)."""
        s, link = self._step or self.running(), self.link
        s.clock.mark("end")
        self._step = None
        if link.peer_failed:
            raise HeteroError(link.peer_failed)
        if link.loss is not None and link.loss.stray:
            link.loss.check(s)
        if link.model is not None and (s.syncs != 1 or s.forwards != s.expected):
            hint = ("run bal.micro_batches micro-batches per step, the last one synced"
                    if self.plan.settings.micro_batch else
                    "gradient accumulation (no_sync) needs micro_batch: set Balance(micro_batch=m)")
            refuse(f"hetero: rank {s.rank} ran {s.forwards} forward(s) and {s.syncs} gradient all-reduce(s) in step "
                   f"{s.index} of epoch {s.epoch}; it needs {s.expected} and 1: {hint}")
        return self.plan.end_step(s, link.coll)


def _peer_line(link: Link, err: Exception) -> HeteroError | None:
    """A backward's collective failed: the peer's posted line, if one stopped and said why (else None)."""
    if isinstance(err, HeteroError) or not isinstance(err, Exception):
        return None
    why = link.peer_failed or peer_error()
    return HeteroError(why) if why is not None else None


class _Micro:
    """`Engine.micro`'s context (a class, not a generator: a third of the cost, on every step's path; issue 51)."""
    __slots__ = ("e", "batch_size", "ends_step", "s", "local")

    def __init__(self, engine: Engine, batch_size: int | None, ends_step: bool):
        self.e, self.batch_size, self.ends_step, self.local = engine, batch_size, ends_step, None

    def __enter__(self) -> None:
        e = self.e
        link, m = e.link, e.plan.settings.micro_batch
        if m and link.model is None:  # on every rank alike, whatever its count
            raise HeteroError("hetero: with micro_batch, attach the model first (bal.attach(ddp)): its no_sync "
                              "keeps all but the step's last micro-batch local")
        if e._step is None:  # the step's first batch
            e.begin(from_loader=True)
        self.s = s = e._step
        want = m or int(s.sizes[s.rank])
        if m and e.plan.settings.by_tokens:  # the rank's rows in micro-batches of at most m (and max_tokens)
            want = len(e.plan.schedule.micro_at(s.epoch, s.index)[s.rank][s.expected - s.left])
        if self.batch_size is not None and self.batch_size != want:
            _stop(f"hetero: step {s.index} got {self.batch_size} samples, the schedule says {want}: is the loader "
                  f"this Balance's sampler?")
        if s.left <= 0:
            _stop(f"hetero: rank {s.rank} ran a micro-batch beyond its {s.expected} in step {s.index} of epoch "
                  f"{s.epoch}: run bal.micro_batches micro-batches per step")
        link.sync_now = s.last_micro_batch
        try:
            if link.fsdp is not None:  # FSDP2: no no_sync; its own schedule (the same collectives on every rank)
                link.fsdp.begin(first=s.left == s.expected, sync=link.sync_now)
            if link.ds is not None:  # DeepSpeed: the step's backwards stay local until its door's finish
                link.ds.begin(first=s.left == s.expected)
        except Exception as err:  # noqa: BLE001 - a collective failed: a peer's posted reason, if any
            if (line := _peer_line(link, err)) is not None:
                raise line from None
            raise
        if not (link.sync_now or link.fsdp is not None or link.ds is not None):  # DDP's no_sync, or the door's own
            self.local = link.model.no_sync()
            self.local.__enter__()

    def __exit__(self, typ, err, tb) -> bool:
        e, s = self.e, self.s
        link = e.link
        try:
            if self.local is not None:
                self.local.__exit__(typ, err, tb)
            if typ is None and link.ds is not None and link.sync_now:
                link.ds.finished()  # the loop's engine.step() reduced and stepped
        except Exception as late:  # noqa: BLE001 - the door's reduction failed: a peer's posted reason, if any
            if (line := _peer_line(link, late)) is not None:
                raise line from None
            raise
        if typ is not None:  # the micro-batch failed: a backward's collective, because a peer stopped and said why?
            if (line := _peer_line(link, err)) is not None:
                raise line from None
            return False
        s.left -= 1
        if not link.sync_now:
            link.unsynced = True  # local gradients only, until the step's last micro-batch all-reduces
        elif self.ends_step:
            e.end()
        return False
