"""Building a Balance's parts, installing them on a model, and plugging experiments in before that.

- bind: the engine and its plan for one rank of a world, once (a second bind must name the same world).

- attach: a DDP model gets the weighting communication hook (hook.py), or with weighting="loss" the loss door
  (lossweight.py: bal.backward weighs the loss, DDP's own all-reduce sums); an FSDP2 root gets its weighted
  reduce-scatter (fsdp.py); a DeepSpeed engine gets its door (deepspeed.py: the weighted loss, one reduction); each
  gets the forward counter and the optimizer guard (guard.py). Collective: the ranks compare their settings and
  gather their worker identities.
- plug: the emulated slow ranks (emulator.py) and recorded sizes (a replay) go into the engine and its plan,
  before attach only.
"""
from __future__ import annotations

import numpy as np
import torch

from .agree import HeteroError
from .engine import Engine, build, emulated
from .guard import OptimizerGuard
from .hook import balance_hook
from .lossweight import LossWeighting
from .replay import CostReplay, fit
from .rules import whole
from .settings import Settings


def bind(current: Engine | None, settings: Settings, rank: int, world: int, hetero: str,
         replay: dict[int, np.ndarray] | CostReplay | None, length: int, lengths: tuple | None = None) -> Engine:
    """The engine of rank `rank` in a world of `world` (the current one if it is that world's); `length`: the
    epoch's n_samples given before the world was known (0: none yet); `lengths`: batch_sampler's (lengths,
    loss_tokens, seed) then, by tokens."""
    if current is not None:
        p = current.plan
        if (rank, world) != (p.rank, p.world):
            raise HeteroError(f"hetero: this Balance was already used as rank {p.rank} of {p.world}, but the "
                              f"launcher says rank {rank} of {world}: build it in the launched process")
        return current
    rank, world = whole("rank", rank, 0), whole("world", world, 1)
    if rank >= world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    e = build(settings, rank, world, hetero, replay)
    if length:
        e.plan.schedule.set_length(length, lengths)
    fit(replay, world, e.plan.schedule.steps_per_epoch)  # a record of another world's ranks is refused here
    return e


def attach(e: Engine, model: torch.nn.Module, probed: bool) -> OptimizerGuard:
    """The parts installed on `model` (a DDP model or an FSDP2 root); returns the optimizer guard."""
    if e.link.model is not None:
        raise HeteroError("hetero: this Balance is attached already (one Balance per model): build a new Balance "
                          "for another model")
    if any(e.plan.schedule.probes) and not probed:
        raise ValueError('max_batch "probe": call bal.probe(model, ...) before wrapping the model in DDP')
    if any(e.plan.schedule.token_probes) and not probed:
        raise ValueError('max_tokens "probe": call bal.probe(model, device=..., max_length=...) before wrapping the '
                         'model in DDP')
    from . import deepspeed, fsdp  # torch only (deepspeed is imported only for one of its engines)

    schedule = door = None
    if deepspeed.is_engine(model):  # its door weights the outputs and owns the step's one reduction
        door = deepspeed.attach(e, model)
    elif not isinstance(model, torch.nn.parallel.DistributedDataParallel) or fsdp.refusal(model, e.plan.world):
        schedule = fsdp.attach(e, model)  # refuses FSDP1, DDP around FSDP2, a non-root, ... in one line
    if e.plan.settings.weighting == "loss" and (schedule is not None or door is not None):
        own = "FSDP2 weighs in its reduce-scatter" if door is None else "DeepSpeed weighs the loss in engine.backward"
        raise HeteroError(f"hetero: weighting='loss' is for a DDP model ({own}): leave weighting='hook'")
    e.connect(model, schedule, door)
    if e.plan.settings.weighting == "loss" and schedule is None and door is None:
        e.link.loss = LossWeighting(e, model)  # DDP's own all-reduce; bal.backward(loss) weighs the loss
    elif schedule is None and door is None:
        model.register_comm_hook(e, balance_hook)
    # a DeepSpeed engine's own `training` never changes (its train() and eval() set its module's): count there
    (model.module if door is not None else model).register_forward_pre_hook(e.count_forward)
    return OptimizerGuard(e, model)


def plug(e: Engine | None, what: str, hetero: str | None = None,
         replay: dict[int, np.ndarray] | CostReplay | None = None) -> Engine | None:
    """The emulation spec or the recorded sizes into a bound engine (None: the world is not bound yet, and build
    takes them then); refused once attached. Returns the engine to use from now on (an emulation spec makes a new
    one over the same plan)."""
    if e is None:
        return None
    if e.link.model is not None:
        raise HeteroError(f"hetero: {what}() after attach: plug it in before bal.attach(model)")
    if replay is not None:
        fit(replay, e.plan.world, e.plan.schedule.steps_per_epoch)
        e.plan.schedule.replayed = replay
    if hetero is not None:
        p = e.plan
        return Engine(p, emulated(hetero, p.rank, p.world, p.settings.seed), hetero)
    return e
