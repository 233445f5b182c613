"""A clean exit after gloo collectives (pytorch/pytorch#190489).

A gloo worker thread lets go of a finished collective only after the caller was told it finished: it frees the
work's tensors and a comm hook's Python callbacks, and freeing a tensor that Python has seen takes the GIL. When
the main thread reaches the end of the script first, that thread asks for the GIL while the interpreter is shutting
down and is ended mid-C++: the process aborts with "terminate called without an active exception" (SIGABRT, exit
status 1, after a finished run). `destroy_process_group` does not prevent it: the group lives on, with its
threads, while a DDP model or a cycle still refers to it.

So at exit (atexit runs before the interpreter shuts down) the main thread, GIL released, waits until gloo's threads
have freed every comm-hook callback hetero issued (counted exactly), then gives them a quarter of a second for the
works' own tensors, which cannot be counted from Python. Nothing waits in a process that never ran a collective.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref

GRACE_S = 0.25


class _Settle:
    def __init__(self):
        self.alive, self.used, self._lock = 0, False, threading.Lock()

    def collectives(self) -> None:
        """This process runs collectives: wait at exit."""
        self.used = True

    def track(self, fn) -> None:
        """Count fn (a future's callback) until the thread that ran it frees it."""
        with self._lock:
            self.alive += 1
            self.used = True
        weakref.finalize(fn, self._freed)

    def _freed(self) -> None:
        with self._lock:
            self.alive -= 1

    def wait(self, timeout_s: float = 5.0) -> bool:
        """Release the GIL until every tracked callback is freed and the grace time has passed; False when some
        callbacks are still held after timeout_s."""
        if not self.used:
            return True
        deadline = time.monotonic() + timeout_s
        while self.alive > 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(GRACE_S)
        return self.alive <= 0


settle = _Settle()
atexit.register(settle.wait)
