"""The DDP communication hook that `Balance.attach` registers: the b_i/B weighting, with the step clock.

The hook's state is the step engine (engine.py), never the Balance. It sums weight_i * g_i over ranks (the engine
sets the weight per step: b_i/B, m/B with micro-batches, or 1/world); at the last bucket this rank's local
gradients are complete, which is when the engine marks `ready` (and an emulated slow rank spends its delay). An
all-reduce that fails because a peer stopped with a posted line is not raised from inside DDP's reducer (it would
come out as "Got the following error when running the callback"): the engine keeps the line and raises it at this
rank's optimizer step or end of step, so no rank steps on a wrong gradient. A peer that refuses without entering
the all-reduce (its optimizer stepped early) leaves it waiting: the future DDP waits on is also completed once the
peer's line is posted (agree.watched), within a second instead of at the group's timeout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .agree import watched
from .engine import Engine
from .settle import Held


class _Back(Held):
    """One bucket's all-reduce came back (gloo's thread runs it): the step's wait ends with its last bucket; a failure
    because a peer stopped and said why passes the bucket on unreduced (the line is raised at the optimizer step)."""
    __slots__ = ("link", "step", "buf")

    def __init__(self, link, step, buf):
        super().__init__()
        self.link, self.step, self.buf = link, step, buf

    def __call__(self, f):
        self.step.bucket_back()
        try:
            return f.value()[0]
        except Exception:
            if self.link.collective_failed():
                return self.buf
            raise

    def stopped(self, why: str) -> None:  # a peer refused while this rank waited: raised at the optimizer step or end
        self.link.peer_failed = self.link.peer_failed or why


def balance_hook(engine: Engine, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum over ranks of weight_i * g_i (b_i/B: the global-batch gradient; 1/world: DDP's mean). Linear, so a
    GradScaler's scale passes through and clipping or unscaling after the all-reduce see the exact gradient.
    Per bucket: the weight, the all-reduce and one counted callback (issue 51: no lookups that can be made once)."""
    link, last = engine.link, bucket.is_last()
    step = engine.gradients_ready() if last else engine.running()
    buf = bucket.buffer()
    buf.mul_(step.weight)
    step.bucket_sent(last)
    back = _Back(link, step, buf)
    # on DDP's own process group, as its C++ reducer all-reduces (dist.all_reduce's Python checks: ~20 us a bucket)
    return watched(link.model.process_group.allreduce([buf]).get_future(), back, buf, back.stopped, link.watch)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings
balance_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
