"""hetero on an FSDP2 model (`fully_shard` on the blocks and the root): the b_i/B weighting, the step clock, the
emulated delay and the micro-batch schedule. Needs torch only; `Balance.attach(model)` calls `attach` here.

    for block in model.blocks: fully_shard(block)
    fully_shard(model); bal.attach(model)        # then the same loop as under DDP: `with bal.step(): ...`

The exact gradient. FSDP2 reduce-scatters each module's gradients; hetero asks every FSDP module for a plain sum
(`set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)`) and installs a custom
reduce-scatter (`set_custom_reduce_scatter`) that multiplies this rank's flat contribution by its weight (b_i/B;
m/B per micro-batch accumulated) before the sum. Why this route: the factor is applied once, to the rank's own
contribution in the reduce dtype (fp32 under a bf16 MixedPrecisionPolicy), so each shard is sum_i w_i g_i exactly
as the DDP hook makes it; per-rank divide factors are wrong where FSDP post-divides the reduced shard by the local
rank's factor, and scaling the user's loss would need a second call in their loop. The same comm is where the
clock sees the rank's local gradients complete: the step's last reduce-scatter marks `ready` (after an emulated
slow rank's delay) and `returned` when the sum is back.

FSDP2 synchronises ranks inside forward and backward (every module's all-gather, every earlier reduce-scatter).
Time spent in those calls is waiting for peers, not compute: hetero's all-gather and reduce-scatter add it to the
clock's `held_s`, so the balancer sees each rank's own speed. CPU (gloo) collectives block in the call; on CUDA
they run on FSDP's streams and the per-module waits stay inside compute_s (a known bias toward the faster rank).

Micro-batches (micro_batch m, k_i per rank and step): every forward of a resharded module all-gathers, so ranks
with unequal k_i would issue unequal collectives and hang. The schedule: parameters are kept unsharded after
forward (`set_reshard_after_forward(False)`); before a step's first micro-batch every FSDP module is unsharded
once (the same all-gathers on every rank); gradients are kept locally (`set_requires_gradient_sync(False)`) and
the parameters stay unsharded after backward until the rank's last micro-batch, whose backward reduce-scatters
the accumulated sum once. Memory: during a step each rank holds the whole model's unsharded parameters and, after
its first micro-batch, their unsharded gradients (ZeRO-1/2-like within a step: only optimizer state and the
gradients kept between steps stay sharded).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .agree import HeteroError
from .engine import Engine

try:  # FSDP2's custom comms came in torch 2.9; an older torch is refused in attach with one line
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover
    AllGather = ReduceScatter = None
# torch 2.14 renamed the collectives (the old names warn); torch 2.11 has only the old ones
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_fsdp(model: nn.Module) -> bool:
    """True for an FSDP2 module (fully_shard applied)."""
    return isinstance(model, FSDPModule)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules under model (itself included), in module order: the same on every rank."""
    return [m for m in model.modules() if is_fsdp(m)]


def refusal(model: nn.Module, world: int) -> str | None:
    """Why hetero cannot attach to this model (one line), or None. The same on every rank (it reads the model)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.nn.parallel import DistributedDataParallel as DDP

    name = type(model).__name__
    if isinstance(model, FSDP1) or any(isinstance(m, FSDP1) for m in model.modules()):
        return "FSDP1 (FullyShardedDataParallel) is not supported: shard with FSDP2's fully_shard instead"
    if isinstance(model, DDP):
        inner = [m for m in model.module.modules() if is_fsdp(m)]
        return "DDP around an FSDP2 model: pass the fully_shard'ed model itself, without DDP" if inner else None
    if ReduceScatter is None or not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        return f"FSDP2 with hetero needs torch >= 2.9 (its custom reduce-scatter); this is {torch.__version__}"
    if not is_fsdp(model):
        fix = ("its submodules are fully_shard'ed but it is not: apply fully_shard to the root module too"
               if fsdp_modules(model) else "wrap it in DistributedDataParallel, or fully_shard it")
        return f"attach takes a DDP model or an FSDP2 root; this {name} is neither ({fix})"
    if any(isinstance(m, DDP) for m in model.modules()):
        return "DDP inside an FSDP2 model: shard the inner module with fully_shard instead of wrapping it in DDP"
    if world < 2:
        return "FSDP2 on a world of one rank has nothing to balance: run it without hetero"
    meshes = {p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")}
    if any(mesh.ndim != 1 or mesh.size() != world for mesh in meshes):
        return "hetero weights over the whole world: HSDP or a sub-group mesh is not supported (one 1-D mesh)"
    return None


class _Timed:
    """Shared by the comms: the step engine, and this step's count of reduce-scatters (the last marks the clock)."""

    def __init__(self, engine: Engine, reduces_per_step: int = 0):
        self.engine, self.reduces_per_step = engine, reduces_per_step
        self._step, self._reduces = None, 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def held(self, t0: float) -> None:
        """A collective inside forward or backward since t0 (perf_counter): waiting for peers, not compute."""
        if (step := self.engine.running(required=False)) is not None:
            step.clock.held_s += time.perf_counter() - t0


class WeightedReduceScatter(_Timed, ReduceScatter or object):
    """Sum over ranks of w_i x this rank's flat gradients (w_i from the engine: b_i/B, m/B, or 1/(world k_i)
    unweighted). The step's last one is where local gradients are complete: it marks `ready` and `returned`."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        step = self.engine.running()
        if step is not self._step:  # a new step: count its reduce-scatters afresh
            self._step, self._reduces = step, 0
        self._reduces += 1
        last = self._reduces == self.reduces_per_step
        if last:
            self.engine.gradients_ready()  # marks ready; an emulated slow rank sleeps first
        input_tensor.mul_(step.weight)  # FSDP's own copy of the gradients, in the reduce dtype
        t0 = time.perf_counter()
        try:
            work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        except Exception:
            if self.engine.link.collective_failed():  # a peer stopped and said why
                raise HeteroError(self.engine.link.peer_failed) from None
            raise
        if last:
            step.clock.mark("returned")
        else:
            self.held(t0)
        return work


class TimedAllGather(_Timed, AllGather or object):
    """FSDP's all-gather, its time counted as waiting (held_s), not compute."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        t0 = time.perf_counter()
        try:
            work = _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        except Exception:
            if self.engine.link.collective_failed():  # a peer stopped and said why
                raise HeteroError(self.engine.link.peer_failed) from None
            raise
        self.held(t0)
        return work


class FSDPSchedule:
    """The FSDP2 side of a Balance: the comms on every FSDP module and the micro-batch schedule (module docstring)."""

    def __init__(self, engine: Engine, model: nn.Module):
        self.modules = fsdp_modules(model)
        # one reduce-scatter per step for each FSDP state (param group) managing a trainable parameter: modules
        # sharded together, fully_shard([norm, lm_head]) as accelerate's FSDP2 plugin does, share one state
        reduces = len({id(m._get_fsdp_state()) for m in self.modules if any(p.requires_grad for p in _own_params(m))})
        if not reduces:
            raise ValueError("the FSDP2 model has no trainable parameters")
        reduce_scatter, all_gather = WeightedReduceScatter(engine, reduces), TimedAllGather(engine)
        for m in self.modules:
            m.set_gradient_divide_factor(1.0)        # per module: the weight is applied in the comm instead
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo refuses PREMUL_SUM)
            m.set_custom_reduce_scatter(reduce_scatter)
            m.set_custom_all_gather(all_gather)
        self.micro = bool(engine.plan.settings.micro_batch)
        if self.micro:
            model.set_reshard_after_forward(False)  # recurses; no forward all-gathers, whatever k_i

    def begin(self, first: bool, sync: bool) -> None:
        """Before a micro-batch: the step's first unshards every module (same all-gathers on every rank); only the
        rank's last reduce-scatters and reshards."""
        if not self.micro:
            return
        if first:
            for m in self.modules:
                m.unshard()
        for m in self.modules:
            m.set_requires_gradient_sync(sync, recurse=False)
            m.set_reshard_after_backward(sync, recurse=False)


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters an FSDP module manages itself (not those of FSDP modules nested in it)."""
    nested = {id(p) for m in module.modules() if m is not module and is_fsdp(m) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def attach(engine: Engine, model: nn.Module) -> FSDPSchedule:
    """Install hetero on an FSDP2 root; raises ValueError with one line for what it refuses (on every rank)."""
    if (why := refusal(model, engine.plan.world)) is not None:
        raise ValueError(why)
    schedule = FSDPSchedule(engine, model)

    def root_only(module, args):  # lazy init has run (FSDP's own pre-hook comes first): it knows the root
        if not module._get_fsdp_state()._is_root:
            raise RuntimeError("hetero: the attached module is not the FSDP2 root: attach the outermost "
                               "fully_shard'ed module")
    model.register_forward_pre_hook(root_only)
    return schedule
