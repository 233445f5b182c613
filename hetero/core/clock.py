"""The wait-free step clock: where a step's time went (its own compute, waiting in the all-reduce)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

_NAN = float("nan")


class StepClock:
    """Marks inside one training step: start, gradients ready (local compute done), backward returned, end.

    compute_s = (ready - start - held_s) + (end - returned): the rank's own work; wait_s = returned - ready + held_s:
    the last all-reduce, including waiting for slower ranks (held_s: collectives before `ready`, FSDP2's; else 0).
    On CUDA the marks are events on the current (compute) stream, read when the step is over. `event` makes such
    events (torch.cuda.Event; a test passes a fake to take the CUDA path on the CPU).
    """
    __slots__ = ("cuda", "_event", "marks", "device_waits", "held_s", "cpu_start", "cpu_end", "started")

    def __init__(self, device: torch.device, event: Callable[[], object] | None = None):
        self.cuda = event is not None or device.type == "cuda"
        self._event = event  # None: torch.cuda.Event (made once a step, on every step's path: nothing per clock)
        self.marks: dict[str, float | torch.cuda.Event] = {}
        self.device_waits = 0  # wait_device calls: the host waited for this rank's queued GPU work
        self.held_s = 0.0  # s in collectives before `ready` (FSDP2's per-module ones): waiting, moved out of compute
        self.cpu_start = self.cpu_end = _NAN  # this process's CPU time (all its threads) at start and end
        self.started = _NAN

    def _record(self):
        ev = self._event() if self._event is not None else torch.cuda.Event(enable_timing=True)
        ev.record()  # on the current stream: this rank's compute, not NCCL's streams
        return ev

    def mark(self, name: str) -> None:
        self.marks[name] = self._record() if self.cuda else time.perf_counter()
        if name == "end":
            self.cpu_end = time.process_time()
        elif name == "start":
            self.cpu_start = time.process_time()
            self.started = time.perf_counter()  # the host's clock at the start, for the pace of steps

    def start(self) -> None:
        """mark("start"), with one read of the host's clock on the CPU (the mark and `started` are the same clock
        there): on every step's path (issue 51)."""
        if self.cuda:
            self.mark("start")
            return
        self.started = self.marks["start"] = time.perf_counter()
        self.cpu_start = time.process_time()

    def cpu_s(self) -> float:
        """CPU seconds this process spent from start to end, every thread (the all-reduce's too): what a CFS quota
        charges for the step; NaN before the end."""
        return self.cpu_end - self.cpu_start  # NaN while either is

    def wait_device(self):
        """Block the host until the GPU work queued so far on the compute stream is done; returns that event (None
        on the CPU). Not torch.cuda.synchronize(): that also waits for every other stream, NCCL's included."""
        self.device_waits += 1
        if not self.cuda:
            return None
        ev = self._record()
        ev.synchronize()
        return ev

    def host_elapsed_s(self) -> float:
        """Seconds of this rank's compute since `start` (CPU: host time; CUDA: start to an event on the compute
        stream, after waiting for it, so the host is also caught up with its GPU work)."""
        if self.cuda:
            return self.marks["start"].elapsed_time(self.wait_device()) / 1e3 - self.held_s
        self.wait_device()
        return time.perf_counter() - self.marks["start"] - self.held_s

    def read(self) -> tuple[float, float]:
        """(compute_s, wait_s) of the finished step."""
        m = self.marks
        if "ready" not in m:  # no gradient hook ran (e.g. a world of one without DDP): all compute
            m["ready"] = m["returned"] = m["end"]
        if self.cuda:
            m["end"].synchronize()
            span = lambda a, b: m[a].elapsed_time(m[b]) / 1e3
        else:
            span = lambda a, b: m[b] - m[a]
        wait = span("ready", "returned") + self.held_s
        return span("start", "ready") - self.held_s + span("returned", "end"), wait
