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
from .settle import settle


def balance_hook(engine: Engine, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum over ranks of weight_i * g_i (b_i/B: the global-batch gradient; 1/world: DDP's mean). Linear, so a
    GradScaler's scale passes through and clipping or unscaling after the all-reduce see the exact gradient."""
    step = engine.gradients_ready() if bucket.is_last() else engine.running()
    buf = bucket.buffer()
    buf.mul_(step.weight)
    step.bucket_sent(last=bucket.is_last())
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        step.bucket_back()
        try:
            return f.value()[0]
        except Exception:
            if engine.link.collective_failed():  # a peer stopped and said why: raised at the optimizer step
                return buf
            raise
    def stopped(why: str) -> None:  # a peer refused while this rank waited: raised at the optimizer step or end
        engine.link.peer_failed = engine.link.peer_failed or why
    settle.track(done)
    return watched(fut.then(done), buf, stopped)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings
balance_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
