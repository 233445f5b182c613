"""The weight on the loss, with DDP's own all-reduce (`Balance(weighting="loss")`, issue 51): the loop calls
`bal.backward(loss)`, which runs the backward of loss x w_i x n, and DDP's built-in reducer (C++, no comm hook)
all-reduces the mean over the n ranks, so every rank holds sum_i w_i g_i, the same gradient as the comm hook's.

Why: a communication hook written in Python costs about 100 us of host time per step (a Python call and a future's
callback for every bucket; docs/benchmarks.md#host), and hetero's default weighting is one. Here the only Python on
the backward's path is one multiplication of the loss and one gradient hook on one parameter per backward.

What it needs, and what it checks:
- The loop owns its backward and calls `bal.backward(loss)` for every one (an own DDP loop, a Ray Train function).
  The weight goes on the loss, the root of the backward, so it reaches every term of it (a regulariser, an auxiliary
  loss) exactly once. A backward that bypasses it would all-reduce an unweighted gradient: a hook on the model's
  first trainable parameter sees every backward that reaches it, and one that ran outside `bal.backward` is refused
  at the optimizer step (the guard), before anything steps on it, and at the step's end.
- The step's rules are the comm hook's: `bal.backward` counts the synced backward (DDP's
  `require_backward_grad_sync`: not under `no_sync`) and checks it before it enters the all-reduce (every forward
  first, one sync per step). The `ready` mark and an emulated slow rank's delay come at that parameter's gradient,
  before DDP's reducer can send the bucket that holds it (its hook runs after the gradient is accumulated), so the
  delay holds up the all-reduce as the comm hook's does; `returned` when the backward returns (DDP's wait ends in
  it). If that parameter gets no gradient in the synced backward, both come after it (no delay held up the others).
- A peer that refuses leaves this rank inside DDP's C++ all-reduce, which no Python watcher can end (gloo's
  `abort` does not end a pending operation): it ends when the peer's process exits, which it does after its line
  (agree.post gives the line `grace_s` to be read, then the rank raises), and the backward's error is then raised
  as the peer's line. The comm hook's watcher ends it within a second, even while the peer's process lives on.
- DDP models only: FSDP2 weighs in its reduce-scatter, DeepSpeed on the loss already (its door), and the hosts that
  own the backward (Lightning, the HF Trainer, Accelerate) call their own.
"""
from __future__ import annotations

import functools
import weakref

import torch

from .agree import HeteroError, peer_error
from .engine import Engine, refuse
from .step import Step

_EXACT = (torch.float32, torch.float64)  # a loss in a lower precision would round the weight on it


def _reached(door: weakref.ref, grad: torch.Tensor) -> None:
    """The parameter's hook holds its door weakly: a hook on a tensor is not seen by the garbage collector, so a
    strong one would keep the door, its engine and the model alive for good."""
    if (d := door()) is not None:
        d._reached(grad)


class LossWeighting:
    """The loss-weighting door of one DDP model (module docstring); `bal.backward(loss)` runs `backward`."""

    def __init__(self, engine: Engine, model: torch.nn.Module):
        self.engine, self.model = engine, model
        self.factor = float(engine.plan.world)  # DDP's reducer divides the sum by the world: weight x n undoes it
        self.weighing = self.syncing = self.marked = False
        self.stray = 0  # backwards that reached the parameters outside bal.backward (refused at the next check)
        self._seed: tuple = (None, None, None)  # (key, the backward's seed, its version): one per weight
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise HeteroError("hetero: the model has no parameter that requires grad: nothing to weight")
        trainable[0].register_hook(functools.partial(_reached, weakref.ref(self)))

    def _reached(self, grad: torch.Tensor) -> None:
        """The first trainable parameter's gradient (before DDP's reducer takes it): mark `ready` on a synced
        backward, note a backward that bypassed bal.backward."""
        if not self.weighing:
            self.stray += 1
        elif self.syncing and not self.marked:
            self.marked = True
            self.engine.gradients_ready(count=False)

    def check(self, s: Step | None) -> None:
        """Refuse when a backward ran outside bal.backward (the guard's and the step end's call; s: the step)."""
        if self.stray:
            self.stray = 0
            where = f" in step {s.index} of epoch {s.epoch} on rank {s.rank}" if s is not None else ""
            refuse(f"hetero: a backward ran outside bal.backward(loss){where}: with weighting='loss' hetero weights "
                   f"the loss there, so call bal.backward(loss), not loss.backward() (or leave weighting='hook')")

    def _seed_of(self, loss: torch.Tensor, k: float) -> torch.Tensor:
        """The backward's seed, k in the loss's shape, dtype and device: made once per weight (a decision changes it),
        not once per step (issue 51). A loss that is a leaf gets its own (its .grad could be the seed itself), and a
        seed that a backward wrote into (a custom Function's in-place grad_output) is made afresh."""
        key, (known, seed, version) = (k, loss.dtype, loss.device, loss.shape), self._seed
        if known != key or seed._version != version or loss.grad_fn is None:
            seed = torch.full_like(loss, k)
            self._seed = (key, seed, seed._version)
        return seed

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """The backward of loss x w_i x n (w_i read now: bal.set_weight may have replaced it), run from that weight
        as the loss's gradient (or `gradient` x it, for a loss that is not a scalar); a synced one (not under
        no_sync) is counted and checked first and ends the all-reduce's wait. kwargs: Tensor.backward's."""
        e = self.engine
        s = e.running()
        if self.stray:
            self.check(s)
        sync = self.model.require_backward_grad_sync
        if sync:
            e.gradients_ready(ready=False)
        if loss.dtype not in _EXACT:
            refuse(f"hetero: weighting='loss' puts the weight on the loss, in its dtype, and this loss is {loss.dtype} "
                   f"(the weight rounded): compute the loss in float32 (loss.float()), or leave weighting='hook'")
        # the backward from w_i x n (not from 1): no multiplication in the graph, the weight as the root's gradient
        k, grad = s.weight * self.factor, kwargs.pop("gradient", None) if kwargs else None
        if grad is None and loss.numel() == 1:
            grad = self._seed_of(loss, k)
        elif grad is not None:
            grad = grad * k
        self.weighing, self.syncing, self.marked = True, sync, False
        try:
            loss.backward(grad, **kwargs)
        except HeteroError:
            raise
        except Exception as err:  # noqa: BLE001 - DDP's all-reduce failed: a peer's posted reason, if any
            if (why := e.link.peer_failed or peer_error()) is not None:
                raise HeteroError(why) from None
            raise err
        finally:
            self.weighing = False
        if sync:
            if not self.marked:  # the parameter got no gradient in this backward
                e.gradients_ready(count=False)
            s.clock.mark("returned")
        else:
            e.link.unsynced = True
