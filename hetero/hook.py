"""The DDP communication hook of hetero.Balance, and an emulated slow rank's delay.

The hook sums weight_i * g_i over ranks (api.Balance sets the weight per step: b_i/B, m/B with micro-batches, or
1/world); when the last bucket is handed over this rank's local gradients are complete, which is when the step
clock marks `ready` and an emulated slow rank spends its delay.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .dist import StepClock
from .emulator import Emulator

if TYPE_CHECKING:
    from .api import Balance


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
    if bucket.is_last():
        state._on_ready()
    buf = bucket.buffer()
    buf.mul_(state._weight)
    with state._lock:
        state._in_flight += 1
        state._all_issued = bucket.is_last()
    fut = dist.all_reduce(buf, async_op=True).get_future()
    clock = state._clock

    def done(f):
        with state._lock:  # gloo may finish buckets out of order: the wait ends with the last one back
            state._in_flight -= 1
            if state._in_flight == 0 and state._all_issued:
                clock.mark("returned")
        return f.value()[0]
    _callbacks.track(done)
    return fut.then(done)


class _Callbacks:
    """The hook's Python callbacks that gloo's worker threads still hold.

    A future's callbacks are freed by the thread that completed it, after they ran, and freeing a Python function
    takes the GIL. After a job's last all-reduce that thread may only get there once the main thread is already
    shutting the interpreter down, and a thread taking the GIL then is ended mid-C++: the process aborts with
    "terminate called without an active exception" (exit status 1 after a finished run). So each callback is
    counted until it is freed, and at exit (atexit runs before the interpreter shuts down) the main thread waits,
    GIL released, until gloo's threads have freed every one (a few seconds at most)."""

    def __init__(self):
        self.alive, self._lock = 0, threading.Lock()

    def track(self, fn) -> None:
        with self._lock:
            self.alive += 1
        weakref.finalize(fn, self._freed)

    def _freed(self) -> None:
        with self._lock:
            self.alive -= 1

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every tracked callback is freed; False when some are still held after timeout_s."""
        deadline, tracked = time.monotonic() + timeout_s, self.alive > 0
        while self.alive > 0 and time.monotonic() < deadline:
            time.sleep(0.005)  # releases the GIL: the worker thread frees the callback
        if tracked:
            time.sleep(0.05)  # and leaves the GIL-holding free (the count drops inside it)
        return self.alive <= 0


_callbacks = _Callbacks()
atexit.register(_callbacks.drain)


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings
balance_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
