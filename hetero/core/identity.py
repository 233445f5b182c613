"""Worker identities: what a balancer's per-rank estimate belongs to across restarts and changes of world size.

A rank number names a place in one world; after a restart with more or fewer workers, rank 1 may be another
machine. The balancer's estimates (speed, cost fits) are therefore kept per worker identity: by default the host
and the device (a GPU's UUID; on a CPU the cores it is pinned to, else its local rank on the host), or the name a
user gives it (HETERO_WORKER_ID in the worker's environment, e.g. set for a node's torchrun agent, whose workers
then add their local rank when it runs several; or Balance(worker_id=...)). Two agents on one host (a test of
elasticity) run workers that nothing tells apart but such a name.
"""
from __future__ import annotations

import os
import socket

import torch

ENV = "HETERO_WORKER_ID"


def default_identity(device: torch.device) -> str:
    """This worker's identity: HETERO_WORKER_ID if set, else host and device (GPU UUID, pinned cores, local rank)."""
    if named := os.environ.get(ENV, "").strip():  # set per node (agent): its workers add their local rank
        return named if os.environ.get("LOCAL_WORLD_SIZE", "1") == "1" else f"{named}/local rank " \
            f"{os.environ.get('LOCAL_RANK', '0')}"
    host = socket.gethostname()
    if device.type == "cuda":
        from .memory import gpu_identity

        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{host}/gpu {gpu_identity(torch.cuda.get_device_properties(index), index)}"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores and len(cores) < (os.cpu_count() or len(cores)):
        return f"{host}/cpu cores {'+'.join(map(str, cores))}"
    # unpinned CPU workers on one host are told apart by their local rank (the launcher's order on the host)
    return f"{host}/cpu local rank {os.environ.get('LOCAL_RANK', '0')}"


def duplicate(identities: list[str]) -> tuple[int, int] | None:
    """The first two ranks holding one identity (None: all distinct)."""
    seen: dict[str, int] = {}
    for r, name in enumerate(identities):
        if name in seen:
            return seen[name], r
        seen[name] = r
    return None


def remap(saved: list[str] | None, saved_world: int, now: list[str] | None, world: int) -> list[int | None]:
    """For every rank of this world, the saved rank whose state it takes (None: a worker not seen before). By
    identity where both worlds' identities are known; else rank r keeps rank r's state (the same world, or a state
    without identities: ranks past the saved world are new)."""
    if saved and now and len(saved) == saved_world:
        where = {name: r for r, name in enumerate(saved)}
        return [where.get(name) for name in now]
    return [r if r < saved_world else None for r in range(world)]
