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

The same wait runs before every fork (os.register_at_fork): a DataLoader's worker processes, forked from a rank. A gloo
thread entering Python for such a free first makes its thread state, holding the interpreter's thread-list lock
without the GIL; a fork at that moment hands the child that lock held, and on CPython before the fix of
python/cpython#112275 (3.11.7 here) the child waits on it forever, before running a line: its rank then waits
forever for that worker's first batch (seen once in 20 runs of a HeteroTrainer with 2 workers on a loaded 2-core VM,
a DataLoader worker stuck in PyOS_AfterFork_Child). Released GIL and grace let such a thread leave the lock first.
A start method that does not fork this process (dataloader_multiprocessing_context / multiprocessing_context=
"forkserver") avoids the hazard whatever the threads do (docs/own-loop.md, A clean exit).
"""
from __future__ import annotations

import atexit
import os
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

    def hold(self) -> None:
        """One Held made (cheaper than track's finalizer, for the comm hook's per-bucket callbacks)."""
        with self._lock:
            self.alive += 1
            self.used = True

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


class Held:
    """A callback counted from its making until the thread that ran it frees it, as `settle.track` counts a function:
    the comm hook's per-bucket callbacks are Held (a counter and __del__, no finalizer per bucket)."""
    __slots__ = ()

    def __init__(self):
        settle.hold()

    def __del__(self):
        settle._freed()
atexit.register(settle.wait)
if hasattr(os, "register_at_fork"):  # POSIX: before a DataLoader's workers are forked from a rank
    os.register_at_fork(before=lambda: settle.wait(timeout_s=2.0))
