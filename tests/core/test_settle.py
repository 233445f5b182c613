"""hetero.core.settle: a rank's fork (a DataLoader's workers) waits, GIL released, until the threads holding hetero's
comm-hook callbacks have let go of them (python/cpython#112275: a child forked while a gloo thread enters Python can
wait forever on the thread-list lock it inherited held)."""
from __future__ import annotations

import os
import threading

import pytest

from hetero.core.settle import settle


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_fork_waits_until_another_thread_has_freed_the_tracked_callbacks():
    before = settle.alive  # callbacks other tests left alive are waited for too, up to the fork's bound
    done = lambda fut: None  # noqa: E731 - a comm hook's callback, held by another thread as gloo's holds it
    settle.track(done)
    held = [done]
    del done
    threading.Timer(0.05, held.clear).start()  # the other thread frees it a moment later (it needs the GIL)
    r, w = os.pipe()
    pid = os.fork()  # the forking thread holds the GIL: without the wait, the callback is still alive here
    if pid == 0:
        os.write(w, str(settle.alive).encode())
        os._exit(0)
    os.close(w)
    seen = int(os.read(r, 32))
    os.close(r)
    os.waitpid(pid, 0)
    assert not held and seen == before, f"the child saw {seen - before} of hetero's callbacks still held"
