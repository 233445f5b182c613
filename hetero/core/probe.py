"""The largest-batch probe, as one collective: every rank's probe result, or one line on every rank.

Ranks set to max_batch "probe" try training steps of growing size on their GPU (memory.probe_max_batch; a CPU rank
gets no limit). Every rank then gathers every rank's answer as plain data (host, device, physical GPU, limit, or
the line its probe failed with), so a failure on one rank stops every rank with that rank's line instead of
leaving the others blocked in a collective it never joins. Ranks sharing one physical GPU are refused: a probe
measures one rank alone on its device, so it cannot speak for ranks that will train side by side.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .agree import HeteroError, gather_json, guarded
from .memory import gpu_identity, probe_max_batch, shared_gpus
from .plan import Plan


def probe_all(plan: Plan, model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int,
              device: torch.device, autocast=None, memory_format=torch.contiguous_format, gpu: str = "") -> list[float]:
    """Every rank's largest batch (inf: none; a CPU rank, or not probed: its configured one), in rank order, now
    the plan's bounds; HeteroError on every rank alike when a probe failed or probing ranks share a GPU."""
    if device.type == "cuda" and not gpu:
        gpu = gpu_identity(torch.cuda.get_device_properties(device), device.index or 0)
    own, err = float("inf"), ""
    s = plan.settings
    if plan.schedule.probes[plan.rank]:
        m = s.micro_batch
        try:
            own = probe_max_batch(model, sample_shape, classes, device, lo=min(s.min_batch, m or s.min_batch),
                                  hi=m or s.global_batch, autocast=autocast, memory_format=memory_format)
        except (RuntimeError, TimeoutError) as e:
            err = str(e).splitlines()[0] if str(e) else type(e).__name__
    row = {"host": socket.gethostname(), "device": str(device), "gpu": gpu,
           "limit": None if own == float("inf") else own, "error": err}
    if dist.is_initialized():
        coll = device if dist.get_backend() == "nccl" else torch.device("cpu")
        rows = guarded(gather_json, row, coll)
    else:
        rows = [row]
    if shared := shared_gpus([(r["host"], r["device"], r["gpu"]) for r in rows], plan.schedule.probes):
        g = shared[0]
        raise HeteroError(f"hetero: max_batch \"probe\" needs a GPU of its own per rank: ranks "
                          f"{', '.join(map(str, g))} share {rows[g[0]]['device']} on {rows[g[0]]['host']}; give "
                          f"their max_batch as numbers")
    if failed := [r for r, row in enumerate(rows) if row["error"]]:
        raise HeteroError(f"hetero: the largest-batch probe failed on rank {failed[0]}: {rows[failed[0]]['error']}")
    probed = [float("inf") if r["limit"] is None else float(r["limit"]) for r in rows]
    limits = [p if pr else c for p, pr, c in zip(probed, plan.schedule.probes, plan.schedule.configured)]
    try:
        plan.schedule.bound(limits)  # the sizes start afresh within them
    except ValueError as e:
        raise HeteroError(f"hetero: after the probe, {e}") from None
    return limits
