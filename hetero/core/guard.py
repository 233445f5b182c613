"""An accumulation loop that cannot silently diverge: the optimizer-step guard of an attached Balance.

A global optimizer step pre-hook (torch.optim's register_optimizer_step_pre_hook, held weakly; it acts only on
optimizers that step the attached model's parameters) refuses, on the rank that sees it, and posts the line on the
process group's store so the other ranks, whose collectives then fail, raise the same line:
- an optimizer step on gradients not all-reduced: a backward ran under no_sync since the last all-reduce (a loop
  running fewer micro-batches than the schedule's);
- in micro-batch mode, an optimizer step after more than one step of the schedule (a loop running more). A
  `zero_grad(set_to_none=True)` resets the count, so a step a GradScaler skipped is not refused.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .agree import HeteroError, post

if TYPE_CHECKING:
    from .balance import Balance


class OptimizerGuard:
    def __init__(self, bal: Balance, model: torch.nn.Module):
        self._bal = weakref.ref(bal)
        self._params = {id(p) for p in model.parameters()}
        self._first = next(model.parameters())
        self._owns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> steps the model?
        self.unsynced = False  # a backward ran under no_sync since the last all-reduce
        self.steps = 0         # steps begun since the model's optimizer last stepped
        check = weakref.WeakMethod(self._before_step)
        handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: (c := check()) and c(opt))
        weakref.finalize(bal, handle.remove)

    def step_begun(self) -> None:
        if self._first.grad is None:
            self.steps = 0  # gradients cleared (zero_grad): a step skipped by a GradScaler is fine
        self.steps += 1

    def _before_step(self, opt: torch.optim.Optimizer) -> None:
        owns = self._owns.get(opt)
        if owns is None:
            owns = self._owns[opt] = any(id(p) in self._params for g in opt.param_groups for p in g["params"])
        bal = self._bal()
        if not owns or bal is None:
            return
        s = bal.current_step(required=False)
        if self.unsynced and s is not None:
            refuse(f"hetero: rank {bal.rank} stepped its optimizer after {s.expected - s.left} of its {s.expected} "
                   f"micro-batches at step {s.index} of epoch {bal.epoch}, on gradients that were not all-reduced: "
                   f"run bal.micro_batches micro-batches per step (or use the loader's batches)")
        if bal.micro_batch and self.steps > 1:
            refuse(f"hetero: rank {bal.rank} ran {self.steps} steps of the schedule (their micro-batches) before "
                   f"one optimizer step, at epoch {bal.epoch}: run bal.micro_batches micro-batches per step "
                   f"({bal.micro_batches} now), then step the optimizer")
        self.steps = 0


def refuse(message: str):
    """A mistake this rank alone sees: tell the others (agree.post), then raise."""
    post(message)
    raise HeteroError(message)
