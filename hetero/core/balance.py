"""hetero in your own DDP loop: per-rank batch sizes balanced by measured speed, with the exact gradient.

    bal = Balance(scheme="edp", global_batch=256, rebalance_every=20)
    ddp = DDP(model); bal.attach(ddp)
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)), num_workers=2)
    for epoch in range(epochs):
        bal.set_epoch(epoch)
        for x, y in loader:
            with bal.step():
                F.cross_entropy(ddp(x), y).backward(); opt.step(); opt.zero_grad()

The Balance is the front: it keeps the user's verbs and builds the parts beneath it when the world is known (the
process group, torchrun's RANK and WORLD_SIZE, or the Lightning callback's `set_world`): the plan (plan.py: the
position, the schedule of sizes, the window and the balancer), the step engine that every door runs through
(engine.py) with its emulated slow rank (emulator.py). The parts never call back up. Hosts read where training is
from `bal.position` and set a step's weight with `bal.set_weight`; an integration's loop reaches the engine as
`bal.engine` for three verbs only, `micro`, `running` and `count_forward` (docs/api.md: the extension surface).
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np
import torch

from .agree import HeteroError, launcher_world, lone_world
from .attach import attach, bind, plug
from .emulator import parse_hetero
from .engine import Engine
from .metrics import metrics as read_out
from .plan import At, Plan
from .probe import probe_limits
from .records import Decision, Position, StepRecord
from .replay import recorded
from .rules import whole
from .sampler import BalancedBatchSampler
from .schedule import by_tokens, epoch_length
from .settings import Settings

__all__ = ["Balance"]


class Balance:
    """Per-rank batch sizes by measured speed, the b_i/B gradient weighting, the wait-free step clock, rebalancing.

    Args:
        global_batch: samples per step over every rank, the per-rank sizes' sum (None: token_budget's steps).
        scheme: "sync" (equal sizes), "dp" (sizes by speed, DDP's mean), "edp" (sizes by speed, b_i/B weights) or
            "affine" (sizes from a fitted fixed + per-sample cost per rank, b_i/B weights).
        rebalance_every: decide every K steps; 0: at each epoch's end only (a loop without epochs needs K > 0).
        smoothing: weight of the previous estimate in [0, 1) (0: the new measurements alone).
        deadband: keep the sizes unless the predicted slowest step shrinks by more than this fraction.
        significance: ... and by more than this many standard errors of the measured times.
        min_batch: the smallest batch a rank gets.
        max_batch: an int, "probe" (bal.probe finds it on a GPU), or one entry (int, "probe", None) per rank.
            With micro_batch it bounds m, not k_i x m.
        seed: the sampler's permutations (the same on every rank).
        lag: None takes the first step no rank's sampler handed out; an int fixes it (a decision after step s
            takes effect at s + 1 + lag).
        sit_out: (affine) a rank may get batch 0; its loop still runs forward and backward (weight 0).
        micro_batch: m > 0: every micro-batch is m samples and each rank runs its own count k_i >= 1 per step.
        worker_id: this worker's identity, which its estimate is kept under across restarts and changes of world
            size (None: HETERO_WORKER_ID, else host and device).
        collator: "padded" or "packed" (DataCollatorWithFlattening): split each step by its samples' cost, from
            batch_sampler's lengths and each rank's fitted per-token cost (docs/tokens.md); None: by counts.
        attention: with collator, a squared length's weight in a row's cost; None: fitted with the costs.
        loss_mean: "samples" (weights b_i/B) or, with collator, "tokens" (a token-mean loss: weights n_i/N).
        max_tokens: with collator, the most tokens one forward of a rank holds (an int, "probe", or one per rank;
            None: no cap): its micro-batches, or without micro_batch its step's rows, within it (docs/tokens.md).
        weighting: "hook" (a communication hook weighs every backward) or, for a DDP loop that calls
            `bal.backward(loss)`, "loss": the weight on the loss, DDP's own all-reduce (less host time per step).
        token_budget: with collator, in place of global_batch: steps of about this many tokens (docs/tokens.md).

    Raises:
        ValueError: a setting out of range, in one line.
    """

    def __init__(self, *, global_batch: int | None = None, scheme: str = "edp", rebalance_every: int = 0,
                 smoothing: float = 0.0, deadband: float = 0.0, significance: float = 1.0, min_batch: int = 1,
                 max_batch: int | str | Sequence | None = None, seed: int = 0, lag: int | None = None,
                 sit_out: bool = False, micro_batch: int = 0, worker_id: str | None = None, collator: str | None = None,
                 attention: float | None = None, loss_mean: str = "samples", max_tokens: int | Sequence | None = None,
                 weighting: str = "hook", token_budget: int | None = None):
        self.settings = Settings(global_batch=global_batch, scheme=scheme, rebalance_every=rebalance_every,
                                 smoothing=smoothing, deadband=deadband, significance=significance,
                                 min_batch=min_batch, max_batch=max_batch, seed=seed, lag=lag, sit_out=sit_out,
                                 micro_batch=micro_batch, worker_id=worker_id, collator=collator, attention=attention,
                                 loss_mean=loss_mean, max_tokens=max_tokens, weighting=weighting,
                                 token_budget=token_budget)
        self._hetero, self._replay, self._probed = "", None, False
        self._engine: Engine | None = None
        self._data: tuple = (0, None)  # batch_sampler's n_samples and by_tokens', kept for a world bound after it
        if (known := launcher_world()) is not None:
            self.set_world(*known)

    # -- the world and the extension surface -----------------------------------------------------------------
    def set_world(self, rank: int, world: int) -> None:
        """Bind this process's global rank and the world size, once: for launchers that set neither a process
        group nor torchrun's environment before the Balance is built (the Lightning callback calls it in setup).

        Raises:
            HeteroError: the Balance is already bound to another rank or world.
        """
        self._engine = bind(self._engine, self.settings, rank, world, self._hetero, self._replay, *self._data)

    @property
    def engine(self) -> Engine:
        """The step engine (engine.py); binds the world when first used. Integrations call three of its verbs, the
        extension surface: `micro(batch_size, ends_step)`, `running(required)` and `count_forward(module, args)`.
        A world that cannot be read (WORLD_SIZE without RANK or a process group) is refused, never guessed."""
        if self._engine is None:
            self.set_world(*lone_world())
        return self._engine

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.engine.plan.rank

    @property
    def world(self) -> int:
        """The world size (ranks)."""
        return self.engine.plan.world

    @property
    def workers(self) -> list[str] | None:
        """Every rank's worker identity (its estimate's key across restarts), in rank order; None before attach."""
        ids = self.engine.plan.identities
        return None if ids is None else list(ids)

    # -- experiments: before attach ----------------------------------------------------------------------------
    def emulate(self, spec: str) -> None:
        """Emulate slow ranks with the HETERO grammar (emulator.py), e.g. "1:slowdown=3"; before attach. The delay
        is spent when a rank's gradients are ready and counts as its compute.

        Raises:
            ValueError: a malformed spec, or one naming a rank outside the world.
            HeteroError: called after attach.
        """
        if not isinstance(spec, str):
            raise ValueError(f"hetero must be a string such as '1:slowdown=3' (got {spec!r})")
        parse_hetero(spec)  # a bad spec fails here, in one line
        self._engine = plug(self._engine, "emulate", hetero=spec)  # unbound: bind takes it (Lightning: in setup)
        self._hetero = spec

    def replay(self, sizes: dict[int, np.ndarray] | list[Decision]) -> None:
        """Train with recorded sizes {epoch: [steps, world]} summing to global_batch, or with a collator the run's
        `bal.decisions` (each step split by the costs they recorded), instead of deciding (checked by replay.py).

        Raises:
            ValueError: a record that does not fit the world or the epoch. HeteroError: after attach; past the record.
        """
        sizes = recorded(sizes, self.settings)
        self._engine = plug(self._engine, "replay", replay=sizes)
        self._replay = sizes

    # -- set-up ----------------------------------------------------------------------------------------------
    def probe(self, model: torch.nn.Module, sample_shape: tuple[int, ...] | None = None, classes: int | None = None,
              device: torch.device | None = None, autocast=None, memory_format=torch.contiguous_format,
              gpu: str = "", max_length: int | None = None) -> list[float]:
        """Collective, before DDP: ranks set to "probe" find their limit on their GPU (a CPU rank gets none):
        max_batch's largest batch of `sample_shape` samples (with micro_batch it bounds m), or max_tokens' most
        tokens in one forward of a language model (`model(input_ids=..., labels=...).loss`) on rows of up to
        max_length tokens (default: its config's max_position_embeddings). Returns every rank's limit (inf: none).

        Args:
            model: the bare model (before DDP); gpu: this rank's physical GPU (found when empty): ranks sharing one
                are refused.

        Raises:
            HeteroError: on every rank alike, when a rank's probe failed or probing ranks share a GPU.
            ValueError: nothing set to "probe", or what its probe needs missing."""
        limits = probe_limits(self.engine.plan, model, sample_shape, classes, device, autocast, memory_format, gpu,
                              max_length)
        self._probed = True
        return limits

    def attach(self, model: torch.nn.Module) -> None:
        """Install the weighting, the step clock and the emulated delay on a DDP model (a communication hook) or an
        FSDP2 root (its reduce-scatter); once. Collective: the ranks compare their settings and gather their
        worker identities.

        Raises:
            ValueError: a model that is neither (one line saying what to do), or "probe" without bal.probe.
            HeteroError: a second attach, or ranks whose settings differ (naming the field, on every rank).
        """
        self._guard = attach(self.engine, model, self._probed)

    # -- the epoch and its steps -----------------------------------------------------------------------------
    def batch_sampler(self, n_samples: int, seed: int | None = None, *, lengths: Sequence[int] | None = None,
                      loss_tokens: Sequence[int] | None = None, collator: str | None = None) -> BalancedBatchSampler:
        """The one way to give the epoch's length: per-step index lists for this rank, its slice of each step's
        window of one shared permutation (floor(n_samples / global_batch) steps on every rank). A loop cutting its
        own batches takes the sampler's `plan(epoch)` and `bal.sizes_at` instead of iterating it.

        Args:
            lengths: with collator (only then), every sample's length in tokens: each step's window is split by cost.
            loss_tokens: with loss_mean "tokens", the tokens each sample's loss counts (None: its length).
            collator: the Balance's collator said here, where the lengths are (a Balance built without one).

        Raises:
            ValueError: n_samples below the global batch; lengths without collator or the reverse; bad counts.
        """
        length = epoch_length(self.settings, n_samples)
        seed = self.settings.seed if seed is None else whole("seed", seed, 0)
        if collator is not None and collator != self.settings.collator:
            split_by(self, collator)
        # checked before any collective; kept for a world bound later (Lightning's launcher)
        self._data = (length, by_tokens(self.settings, length, lengths, loss_tokens, seed))
        if self._engine is not None:
            self._engine.plan.schedule.set_length(*self._data)
        return BalancedBatchSampler(self._plan, length, seed, self.set_epoch)

    def _plan(self) -> Plan:
        return self.engine.plan

    def set_epoch(self, epoch: int) -> None:
        """Before iterating the loader each epoch (the permutation and the emulator follow it); idempotent.
        Collective once attached: the ranks compare their settings and the steps they ran.

        Raises:
            HeteroError: the ranks disagree, or a rank left the last epoch early (named, on every rank).
        """
        self.engine.start_epoch(whole("epoch", epoch, 0))

    def step(self, batch_size: int | None = None) -> AbstractContextManager[None]:
        """Wrap one batch's forward and backward, and the optimizer step where `bal.sync_now`. With micro_batch a
        rank runs `bal.micro_batches` of these per step, all but the last under the model's no_sync().

        Args:
            batch_size: optional, checked against the schedule (a loader that is not this Balance's sampler).

        Raises:
            HeteroError: on every rank alike, for any rule of the step (engine.py): counts, syncs, epochs.
        """
        return self.engine.micro(batch_size)

    def begin_step(self, step: int | None = None, *, from_loader: bool = False) -> np.ndarray:
        """Start a step by hand (a loop counting its own micro-batches, or a host's loop); `with bal.step():` does
        it at a step's first batch.

        Args:
            step: optional, checked against `bal.position.step` (the steps ended in the epoch).
            from_loader: the batch came from a framework's loader: hetero's sampler must have handed it out.

        Returns:
            Every rank's batch size for the step, in samples (this rank's k_i = sizes[rank] // m micro-batches).

        Raises:
            HeteroError: a step not ended, `step` out of order or past the epoch, a batch not from the sampler.
        """
        return self.engine.begin(step, from_loader=from_loader)

    def end_step(self) -> Decision | None:
        """End the step, after the optimizer step. Every K steps and at the epoch's end it decides (collective).

        Returns:
            The decision, if one was made (else None).

        Raises:
            HeteroError: no step running, or a rank that ran other than its micro-batches and one all-reduce.
        """
        return self.engine.end()

    def set_weight(self, weight: float) -> None:
        """Replace the running step's gradient weight (b_i/B, m/B or 1/world) before its backward.

        Args:
            weight: 1/world for a loss normalised over every rank, or this rank's share of the step's valid tokens.

        Raises:
            HeteroError: no step running (call it inside `with bal.step():` or after begin_step).
        """
        self.engine.running().weight = float(weight)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """The step's backward, weighted: with weighting="loss" the backward of loss x w_i x n (DDP's own all-reduce
        then gives every rank the exact gradient); else `loss.backward(**kwargs)`, which the comm hook weighs.

        Raises:
            HeteroError: with weighting="loss", no step running, a backward that bypassed it, a sync out of turn.
        """
        self.engine.backward(loss, **kwargs)

    def mark_backward(self) -> None:
        """Optional, right after loss.backward(): the all-reduce's wait ends there (what follows counts as compute).

        Raises:
            HeteroError: no step running."""
        self.engine.running().clock.mark("returned")

    @property
    def sync_now(self) -> bool:
        """The micro-batch running now (or next) all-reduces: step the optimizer after its backward."""
        return self.engine.link.sync_now

    @property
    def micro_batches(self) -> int:
        """This rank's micro-batches in the current step (the next one, between steps and before an epoch's first
        batch); 1 without micro_batch."""
        e, m = self.engine, self.settings.micro_batch
        if (s := e.running(required=False)) is not None:
            return s.expected
        at = e.plan.at
        if m and self.settings.by_tokens:  # cut by count and max_tokens
            return len(e.plan.schedule.micro_at(at.epoch, at.step)[e.plan.rank])
        return -(-int(self.sizes_at(at.epoch, at.step)[e.plan.rank]) // m) if m else 1

    # -- what a user reads -----------------------------------------------------------------------------------
    def sizes_at(self, epoch: int, step: int) -> np.ndarray:
        """Every rank's batch size in samples at this step (sum = global batch); the same on every rank, and fixed
        once asked for (read-only: the steps of one decision share one array)."""
        return self.engine.plan.schedule.sizes_at(epoch, step)

    @property
    def last_sizes(self) -> list[int]:
        """Every rank's batch size at the latest step begun."""
        return self.engine.plan.schedule.last.tolist()

    @property
    def position(self) -> Position:
        """Where training is, the same on every rank (records.Position): hosts read it instead of counting; a
        resumed Balance is where its state was saved."""
        p = self.engine.plan
        return Position(p.at.epoch, p.at.step, p.schedule.steps_per_epoch, p.at.global_step)

    @property
    def decisions(self) -> list[Decision]:
        """Every rebalancing decision so far, in order (identical on every rank)."""
        return self.engine.plan.decisions

    def metrics(self) -> dict[str, float]:
        """This rank's `hetero/...` numbers for a logger (metrics.py): sizes, shares, times, the last decision's
        predicted speedup and misallocation. No collective; cheap enough for every step."""
        return read_out(self)

    def epoch_records(self) -> list[StepRecord]:
        """This epoch's finished steps so far, in order (reads the clocks: on CUDA, waits for their events)."""
        return self.engine.plan.epoch_records()

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The complete state, mid-epoch or not: plain lists and numbers (torch.load(weights_only=True) loads it).
        Collective: every rank calls it between two steps (the steps since the last decision are gathered).

        Raises:
            HeteroError: called inside a step.
        """
        e = self.engine
        if e.running(required=False) is not None:
            raise HeteroError("hetero: state_dict() inside a step: take it between steps (after end_step)")
        return e.plan.state_dict(e.link.coll)

    def load_state_dict(self, state: dict, identities: list[str] | None = None) -> None:
        """Resume from state_dict(), at its epoch and step (the sampler starts there). A state saved by another
        world (or rank order) is carried over by worker identity: a worker seen before keeps its estimate.

        Args:
            identities: this world's worker identities, when attach has not gathered them.

        Raises:
            ValueError: a state that does not fit (its world's identities, or its position past the epoch).
        """
        plan = self.engine.plan
        plan.load_state_dict(state, identities or plan.identities)

    def __getstate__(self) -> dict:  # Lightning's ddp_spawn pickles the callback (before attach: no guard yet)
        if self._engine is not None and self._engine.link.model is not None:
            raise HeteroError("hetero: an attached Balance cannot be pickled: build it before the launcher starts "
                              "the processes, and attach it in each")
        return self.__dict__


def tokens_refusal(bal: Balance, collator: str = "padded") -> str | None:
    """Why `bal` cannot split by tokens with this collator (one line), or None: the HF Trainer's default asks."""
    if bal._replay is not None:
        return "hetero: replay() records sizes, and a collator splits each step by its samples' lengths"
    try:
        replace(bal.settings, collator=collator)  # check_tokens: the scheme, sit_out, max_batch
    except ValueError as e:
        return str(e)
    return None


def split_by(bal: Balance, collator: str) -> None:
    """batch_sampler's collator on a Balance built without one: from now on it splits by tokens (before any step).

    Raises:
        ValueError: the Balance has another collator, a replay, or settings that do not combine with one.
        HeteroError: a step has begun.
    """
    if bal.settings.collator is not None:
        raise ValueError(f"hetero: the Balance splits with collator={bal.settings.collator!r}, and batch_sampler "
                         f"says collator={collator!r}: say one")
    if (why := tokens_refusal(bal, collator)) is not None:
        raise ValueError(why)
    e = bal._engine
    if e is not None and (e.link.model is not None or e.plan.at != At() or e.plan.decisions):
        raise HeteroError("hetero: batch_sampler(collator=...) after attach, a step or a resume: say the collator "
                          "first (or build the Balance with it)")
    bal.settings = replace(bal.settings, collator=collator)
    if e is not None:  # the engine built afresh for these settings (nothing has run on it)
        bal._engine = None
        bal.set_world(e.plan.rank, e.plan.world)
