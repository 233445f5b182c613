"""hetero on a DeepSpeed engine (what `deepspeed.initialize` returns): ZeRO stages 0 to 3, per-rank batch sizes
and per-rank micro-batch counts, the exact global-batch gradient. Needs deepspeed only when such an engine is
attached (`Balance.attach(engine)` calls `attach` here); docs/deepspeed.md has the loop.

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)  # gradient_accumulation_steps 1
    bal.attach(engine)
    for x, y in loader:                                 # batch_sampler=bal.batch_sampler(len(ds))
        with bal.step():                                # each micro-batch (or the step's one batch)
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()                               # a no-op before the rank's last micro-batch

The weight. DeepSpeed reduces inside its engine (a mean over ranks, or a sum with `gradient_allreduce_op: "sum"`),
so there is no communication hook to weight: hetero multiplies the loss the loop hands `engine.backward` by
w_i x F, with w_i this rank's weight (b_i/B, m/B per micro-batch) and F the factor DeepSpeed's reduction divides by
(the world for a mean, 1 for a sum). hetero puts its backward in the engine's place at attach, as it does the step,
so the loop stays a plain DeepSpeed loop; every parameter's gradient is then w_i x F x its own, and the reduced
gradient is sum_i w_i g_i: the global-batch mean. The weight goes on the loss, the root of the backward, and not on
the model's outputs: a Hugging Face model returns its loss and the logits it came from, and a weight on every output
would reach the logits' gradient twice (w_i squared). A backward that bypasses engine.backward (`loss.backward()`)
would go unweighted: a hook on the outputs refuses it in one line. The factor never reaches a setting DeepSpeed
applies to the reduced sum on every rank (`gradient_predivide_factor`, `prescale_gradients`): those stay the same on
every rank, so the replicas stay identical.

One reduction per step, whatever the rank's micro-batch count. A step's backwards stay local: on ZeRO 1-3 inside
`engine.coalesce_grad_reduction()` (DeepSpeed's 2026 context: every backward keeps its gradients on the parameters,
and leaving it reduces them once), on ZeRO-0 inside `engine.no_sync()`, then `engine.allreduce_gradients()`. The
loop's `engine.step()` is where hetero leaves that context, at the rank's last micro-batch: hetero puts its own step
in the engine's place at attach (as accelerate wraps an optimizer's step), a no-op before the last micro-batch as
DeepSpeed's own step is off its accumulation boundary. There the clock marks `ready` (after an emulated slow rank's
delay), and `returned` once the reduction is back; then DeepSpeed's step runs (the optimizer, clipping, the
learning-rate scheduler). An engine.step() outside `with bal.step()`, twice in a step, before the backward, or
missing at the step's end is refused in one line, as is an engine.backward() outside the block or after the step.

Under the HF Trainer (`deepspeed=`, `hosted`), the config's gradient_accumulation_steps is the Trainer's G: the
Trainer passes scale_wrt_gas=False, so DeepSpeed does not divide the loss by it, and accelerate's wrapper sets the
accumulation boundary before each backward and calls engine.step() after each of the step's last entry's
micro-batches (all this rank's k_i): hetero's step is a no-op until the last, and sets the boundary again after
the reduction (leaving the coalescing context restores the one from before its first backward).

ZeRO-3 gathers parameters in every forward and backward: ranks must run as many micro-batches. With micro_batch,
a rank with fewer than the step's most runs the difference as padding: its last micro-batch's first sample, in eval
mode, with a zero weight (no gradient, no batch-norm statistics, no dropout draws), so every rank issues the same
collectives and the padding costs one sample's compute each. Those gathers are waits inside the clock's compute (a
known bias toward the faster rank, as FSDP2's on CUDA); ZeRO 0-2 have no collective inside a step's backwards.

DeepSpeed's own numbers: its config's batch sizes stay nominal and uniform (train_batch_size = micro x G x world);
hetero's sampler decides each rank's. With `train_batch_size` equal to the Balance's global_batch, DeepSpeed's
`global_samples` and its throughput figures count the true global batch per step.
"""
from __future__ import annotations

import sys
import weakref
from contextlib import AbstractContextManager

import torch

from .engine import Engine, refuse

TESTED = "0.19.8"  # the DeepSpeed release this door was built and tested on
_LOW_PRECISION_WRAPPERS = ("FP16_Optimizer", "FP16_UnfusedOptimizer", "BF16_Optimizer")
_HOSTED: weakref.WeakSet = weakref.WeakSet()  # engines whose accumulation boundary the HF Trainer owns (hosted)


def hosted(engine) -> None:
    """Mark the HF Trainer's engine before attach: its config's gradient_accumulation_steps is the Trainer's G, and
    the Trainer neither lets it divide the loss (it passes scale_wrt_gas=False) nor count the boundary (accelerate
    sets it before every backward, true on the step's last entry, which holds all of this rank's micro-batches)."""
    _HOSTED.add(engine)


def is_engine(model: object) -> bool:
    """True for a DeepSpeed engine (deepspeed imported and `model` one of its engines)."""
    ds = sys.modules.get("deepspeed")
    return ds is not None and isinstance(model, getattr(ds, "DeepSpeedEngine", ()))


def refusal(engine, world: int) -> str | None:
    """Why hetero cannot attach to this engine in a world of `world` ranks (one line), or None. The same on every
    rank (it reads the config)."""
    import deepspeed

    version = f"DeepSpeed {deepspeed.__version__}, hetero tested on {TESTED}"
    if not hasattr(engine, "coalesce_grad_reduction"):
        return f"the DeepSpeed door needs engine.coalesce_grad_reduction (DeepSpeed >= {TESTED}); this is {version}"
    if isinstance(getattr(engine.step, "__self__", None), DeepSpeedDoor):
        return "this DeepSpeed engine has a Balance attached already: one Balance per engine"
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        return f"pipeline parallelism (PipelineModule) runs its own micro-batch schedule: not supported ({version})"
    if getattr(engine, "dp_world_size", world) != world:
        return (f"DeepSpeed's data-parallel group has {engine.dp_world_size} of the {world} ranks (model or sequence "
                f"parallelism): hetero weights over the whole world, so this is not supported ({version})")
    if engine.is_deepcompile_enabled():
        return f"DeepCompile reduces gradients in its compiled graph: turn compile.deepcompile off ({version})"
    if engine.gradient_accumulation_steps() != 1 and engine not in _HOSTED:
        return (f"DeepSpeed's gradient_accumulation_steps is {engine.gradient_accumulation_steps()}: hetero decides "
                f"each rank's micro-batches (Balance(micro_batch=m)), so set it to 1")
    if not engine.managed_gradient_accumulation():
        return "managed_gradient_accumulation is false: hetero keeps a step's backwards local itself; leave it true"
    if engine.training_dataloader is not None:
        return ("deepspeed.initialize was given training_data: hetero's sampler feeds the engine, so build the "
                "DataLoader with batch_sampler=bal.batch_sampler(len(ds)) instead")
    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    if opt is None:
        return "the DeepSpeed engine has no optimizer: pass one (or an optimizer section) to deepspeed.initialize"
    name = type(opt).__name__
    if stage == 0 and name in _LOW_PRECISION_WRAPPERS:
        return f"ZeRO stage 0 with DeepSpeed's {name} (fp16/bf16) is not supported: use ZeRO stage 1-3 ({version})"
    if stage and not hasattr(opt, "_coalesce_grad_reduction"):
        return (f"DeepSpeed's optimizer wrapper {name} cannot keep a step's backwards local "
                f"(coalesce_grad_reduction): not supported ({version})")
    return None


def _rows(value, m: int):
    """value with every tensor whose first dimension is m (the micro-batch) cut to its first row."""
    if isinstance(value, torch.Tensor):
        return value[:1] if value.dim() and value.shape[0] == m else value
    if isinstance(value, dict):
        return type(value)({k: _rows(v, m) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        rows = [_rows(v, m) for v in value]
        return type(value)(*rows) if hasattr(value, "_fields") else type(value)(rows)
    return value


def _tensors(value) -> list[torch.Tensor]:
    """Every floating tensor in a model's outputs that has a gradient path (nested lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad and value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class DeepSpeedDoor:
    """The DeepSpeed side of a Balance: the output weighting, the step's local backwards, the one reduction and
    `engine.step()` at the step's end (module docstring). The step engine calls `begin` before each micro-batch and
    `finished` after the rank's last one; the loop's engine.step() runs `step`."""

    def __init__(self, engine: Engine, ds):
        self.engine, self.ds = engine, ds
        self.stage = ds.zero_optimization_stage()
        # DeepSpeed's reduction divides by the world for a mean (ZeRO-3 always averages), by nothing for a sum
        self.factor = float(engine.plan.world) if getattr(ds, "gradient_average", True) or self.stage == 3 else 1.0
        m = engine.plan.settings.micro_batch
        self.hosted = ds in _HOSTED  # the HF Trainer's: its G in the config, the boundary accelerate's
        self.pads = self.stage == 3 and bool(m)  # ZeRO-3 with per-rank counts: every rank runs the step's most
        self._m = m
        self._local: AbstractContextManager | None = None  # the step's coalescing (or no_sync) context, entered
        self._inputs: tuple | None = None  # the last micro-batch's inputs (ZeRO-3 padding)
        self._padding = self._backward = self._weighing = False
        # the loop's engine.backward(loss) and engine.step() come here (as accelerate patches an optimizer's step)
        self._ds_backward, ds.backward = ds.backward, self.backward
        self._ds_step, ds.step = ds.step, self.step
        ds.module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        ds.module.register_forward_hook(self._after_forward)

    # -- the weight, on the loss the loop hands engine.backward -------------------------------------------------
    def _before_forward(self, module, args, kwargs):
        if self.pads and module.training and self.engine.running(required=False) is not None:
            self._inputs = (args, kwargs)

    def _after_forward(self, module, args, output):
        if torch.is_grad_enabled() and self.engine.running(required=False) is not None:
            for t in _tensors(output):  # a sentinel: a backward from these outputs went through engine.backward
                t.register_hook(self._check)

    def _check(self, grad: torch.Tensor) -> None:
        if not self._weighing:
            s = self.engine.running(required=False)
            where = f" in step {s.index} of epoch {s.epoch} on rank {s.rank}" if s is not None else ""
            refuse(f"hetero: a backward ran outside engine.backward(loss){where}: hetero weights the loss there, so "
                   f"call engine.backward(loss), not loss.backward()")

    def backward(self, loss: torch.Tensor, *args, **kwargs):
        """`engine.backward(loss)` as the loop calls it (hetero puts this in its place at attach): DeepSpeed's
        backward of loss x w_i x F, this rank's weight (read now: bal.set_weight may have replaced it) times the
        factor DeepSpeed's reduction divides by. Returns DeepSpeed's return, unweighted."""
        s = self.engine.running(required=False)
        if s is None:
            refuse("hetero: engine.backward(loss) ran outside `with bal.step()`: hetero weights each rank's loss "
                   "there, so run the forward and backward inside it")
        if self._local is None:
            refuse(f"hetero: a backward ran after engine.step() in step {s.index} of epoch {s.epoch} on rank {s.rank}: "
                   f"call engine.step() after engine.backward(loss)")
        k = 0.0 if self._padding else s.weight * self.factor
        self._backward, self._weighing = True, True
        try:
            out = self._ds_backward(loss * k, *args, **kwargs)
        finally:
            self._weighing = False
        return out / k if k and isinstance(out, torch.Tensor) else out

    # -- a step's micro-batches ----------------------------------------------------------------------------------
    def begin(self, first: bool) -> None:
        """Before a micro-batch: the step's first enters the local context (no reduction until engine.step())."""
        self._backward = False  # this micro-batch's backward has not reached the outputs yet
        if first:
            self._local = self.ds.coalesce_grad_reduction() if self.stage else self.ds.no_sync()
            self._local.__enter__()

    def step(self, lr_kwargs=None) -> None:
        """`engine.step()` as the loop calls it (hetero puts this in its place at attach): a no-op before the
        rank's last micro-batch, as DeepSpeed's own step is off its accumulation boundary; after it, ZeRO-3's
        padding, `ready`, the one reduction, `returned`, and DeepSpeed's step."""
        e = self.engine
        s = e.running(required=False)
        if s is None:
            refuse("hetero: engine.step() ran outside `with bal.step()`: call it inside, after engine.backward(loss) "
                   "(hetero makes it a no-op before the step's last micro-batch)")
        if not e.link.sync_now:
            return
        if self._local is None:
            refuse(f"hetero: engine.step() ran twice in step {s.index} of epoch {s.epoch} on rank {s.rank}: call it "
                   f"once, after engine.backward(loss)")
        if not self._backward:
            refuse(f"hetero: engine.step() ran before engine.backward(loss) in step {s.index} of epoch {s.epoch} on "
                   f"rank {s.rank}: call it after the backward")
        if self.pads:
            self._pad(self._most(s) - s.expected)
        e.gradients_ready()  # marks ready (an emulated slow rank sleeps first)
        local, self._local = self._local, None
        local.__exit__(None, None, None)  # ZeRO 1-3: the coalesced reduction
        if self.hosted:  # the boundary as accelerate sets it on the step's last entry (leaving the coalescing
            self.ds.set_gradient_accumulation_boundary(True)  # context put back the one before its first backward)
        if not self.stage:
            self.ds.allreduce_gradients()
        s.clock.mark("returned")
        self._ds_step(lr_kwargs)

    def finished(self) -> None:
        """After the rank's last micro-batch: it must have stepped the engine."""
        if self._local is not None:
            s = self.engine.running()
            refuse(f"hetero: step {s.index} of epoch {s.epoch} ended on rank {s.rank} without engine.step(): call "
                   f"engine.step() after engine.backward(loss) in each `with bal.step()`")

    def _most(self, s) -> int:
        """The most micro-batches any rank runs in step s: b_i / m by counts; by tokens each rank's rows are cut by
        count and max_tokens (schedule.micro_at), so its count is not its rows over m."""
        plan = self.engine.plan
        if plan.settings.by_tokens:
            return max(map(len, plan.schedule.micro_at(s.epoch, s.index)))
        return int(max(s.sizes)) // self._m

    def _pad(self, extra: int) -> None:
        """ZeRO-3: `extra` zero-weight micro-batches of one sample, so every rank runs the step's most."""
        if extra <= 0:
            return
        args, kwargs = self._inputs
        args, kwargs = _rows(args, self._m), _rows(kwargs, self._m)
        ds, was = self.ds, self.ds.module.training
        ds.eval()
        self._padding = True
        try:
            for _ in range(extra):
                out = ds(*args, **kwargs)
                ds.backward(_tensors(out)[0].float().sum() * 0.0)
        finally:
            self._padding, self._inputs = False, None
            ds.train(was)


def attach(engine: Engine, ds) -> DeepSpeedDoor:
    """Install hetero on a DeepSpeed engine; raises ValueError with one line for what it refuses (on every rank)."""
    if (why := refusal(ds, engine.plan.world)) is not None:
        raise ValueError(why)
    return DeepSpeedDoor(engine, ds)
