"""The DDP communication hook of hetero.Balance, and an emulated slow rank's delay.

The hook sums weight_i * g_i over ranks (api.Balance sets the weight per step: b_i/B, m/B with micro-batches, or
1/world); when the last bucket is handed over this rank's local gradients are complete, which is when the step
clock marks `ready` and an emulated slow rank spends its delay.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .clock import StepClock
from .emulator import Emulator
from .settle import settle

if TYPE_CHECKING:
    from .balance import Balance


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


def balance_hook(state: Balance, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum over ranks of weight_i * g_i (b_i/B: the global-batch gradient; 1/world: DDP's mean). Linear, so a
    GradScaler's scale passes through and clipping or unscaling after the all-reduce see the exact gradient."""
    step = state.gradients_ready() if bucket.is_last() else state.current_step()
    buf = bucket.buffer()
    buf.mul_(step.weight)
    step.bucket_sent(last=bucket.is_last())
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        step.bucket_back()
        return f.value()[0]
    settle.track(done)
    return fut.then(done)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings
balance_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
