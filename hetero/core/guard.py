"""An accumulation loop that cannot silently diverge: the optimizer-step guard of an attached Balance.

A global optimizer step pre-hook (torch.optim's register_optimizer_step_pre_hook; it holds the engine weakly and acts
only on optimizers that step the attached model's parameters) refuses, on the rank that sees it, and posts the line on
the process group's store so the other ranks, whose collectives then fail, raise the same line:
- an optimizer step on gradients not all-reduced: a backward ran under no_sync since the last all-reduce (a loop
  running fewer micro-batches than the schedule's);
- in micro-batch mode, an optimizer step after more than one step of the schedule (a loop running more). A
  `zero_grad(set_to_none=True)` resets the count, so a step a GradScaler skipped is not refused;
- an optimizer step after this rank's gradient collective failed because a peer stopped: the peer's line;
- with weighting="loss", an optimizer step after a backward that bypassed bal.backward (an unweighted gradient).
It reads the flags the step engine shares with it (its link, link.py), never the Balance.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .agree import HeteroError
from .engine import Engine, refuse

# the hooks of collected engines, removed at the next attach: never from the finalizer itself, which the garbage
# collector may run inside torch's loop over the global hooks (an optimizer step), where a removal breaks the loop
# ("OrderedDict mutated during iteration"); a retired hook is a no-op until then
_retired: list = []


class OptimizerGuard:
    def __init__(self, engine: Engine, model: torch.nn.Module):
        while _retired:
            _retired.pop().remove()
        self._engine = weakref.ref(engine)
        self._params = {id(p) for p in model.parameters()}
        self._owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> steps the model?
        self._last: tuple = (None, False)  # the last optimizer asked about (weakly) and its answer: once a step
        # torch holds the guard itself (no lambda and weak method to call through on every step; issue 51): it holds
        # the engine weakly, and goes at the next attach after the engine's collection
        weakref.finalize(engine, _retired.append, register_optimizer_step_pre_hook(self))

    def __call__(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        """The optimizer step's pre-hook (torch's signature): the checks above, for this model's optimizers only."""
        if (e := self._engine()) is None:  # a collected engine's guard, until the next attach removes it
            return
        last, owns = self._last
        if last is None or last() is not opt:
            owns = self._owns.get(opt)
            if owns is None:
                owns = self._owns[opt] = any(id(p) in self._params for g in opt.param_groups for p in g["params"])
            self._last = (weakref.ref(opt), owns)
        if not owns:
            return
        link, p = e.link, e.plan
        if link.peer_failed:
            raise HeteroError(link.peer_failed)
        s, epoch = e.running(required=False), p.at.epoch
        if link.loss is not None:
            link.loss.check(s)
        if link.unsynced and s is not None:
            refuse(f"hetero: rank {p.rank} stepped its optimizer after {s.expected - s.left} of its {s.expected} "
                   f"micro-batches at step {s.index} of epoch {epoch}, on gradients that were not all-reduced: "
                   f"run bal.micro_batches micro-batches per step (or use the loader's batches)")
        if p.settings.micro_batch and link.since_opt > 1:
            refuse(f"hetero: rank {p.rank} ran {link.since_opt} steps of the schedule (their micro-batches) before "
                   f"one optimizer step, at epoch {epoch}: run bal.micro_batches micro-batches per step, then step "
                   f"the optimizer")
        link.since_opt = 0
