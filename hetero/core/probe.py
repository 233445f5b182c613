"""The memory probes, each one collective: every rank's probe result, or one line on every rank.

Ranks set to max_batch "probe" try training steps of growing size on their GPU (memory.probe_max_batch); ranks set
to max_tokens "probe" (split by tokens) try a language model's steps of growing token counts (memory.probe_max_tokens).
A CPU rank gets no limit. Every rank then gathers every rank's answer as plain data (host, device, physical GPU,
limit, or the line its probe failed with), so a failure on one rank stops every rank with that rank's line instead
of leaving the others blocked in a collective it never joins. Ranks sharing one physical GPU are refused: a probe
measures one rank alone on its device, so it cannot speak for ranks that will train side by side.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .agree import HeteroError, gather_json, guarded
from .memory import gpu_identity, probe_max_batch, probe_max_tokens, shared_gpus
from .plan import Plan


def probe_limits(plan: Plan, model: torch.nn.Module, sample_shape: tuple[int, ...] | None, classes: int | None,
                 device: torch.device | None, autocast=None, memory_format=torch.contiguous_format, gpu: str = "",
                 max_length: int | None = None) -> list[float]:
    """bal.probe: the token caps where max_tokens has "probe" entries, else the largest batches (docs/api.md)."""
    if device is None:
        raise ValueError("hetero: bal.probe needs the device the rank trains on (device=...)")
    if any(plan.schedule.token_probes):
        length = max_length or getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if not length:
            raise ValueError('hetero: max_tokens "probe" needs the longest row the model takes: '
                             'bal.probe(model, device=..., max_length=...)')
        return probe_tokens_all(plan, model, device, int(length), autocast, gpu)
    if not any(plan.schedule.probes) and sample_shape is None:
        raise ValueError('hetero: nothing to probe: set max_batch="probe" or (split by tokens) max_tokens="probe" '
                         'on the ranks to probe')
    if sample_shape is None or classes is None:
        raise ValueError('hetero: max_batch "probe" tries batches of samples: bal.probe(model, sample_shape, '
                         'classes, device)')
    return probe_all(plan, model, sample_shape, classes, device, autocast, memory_format, gpu)


def probe_all(plan: Plan, model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int,
              device: torch.device, autocast=None, memory_format=torch.contiguous_format, gpu: str = "") -> list[float]:
    """Every rank's largest batch (inf: none; a CPU rank, or not probed: its configured one), in rank order, now
    the plan's bounds; HeteroError on every rank alike when a probe failed or probing ranks share a GPU."""
    s, sched = plan.settings, plan.schedule
    m = s.micro_batch
    probed = _agreed(plan, device, gpu, sched.probes, "max_batch", lambda: probe_max_batch(
        model, sample_shape, classes, device, lo=min(s.min_batch, m or s.min_batch), hi=m or s.global_batch,
        autocast=autocast, memory_format=memory_format))
    limits = [p if pr else c for p, pr, c in zip(probed, sched.probes, sched.configured)]
    try:
        sched.bound(limits)  # the sizes start afresh within them
    except ValueError as e:
        raise HeteroError(f"hetero: after the probe, {e}") from None
    return limits


def probe_tokens_all(plan: Plan, model: torch.nn.Module, device: torch.device, max_length: int, autocast=None,
                     gpu: str = "") -> list[float]:
    """Every rank's max_tokens (inf: none; a CPU rank, or not probed: its configured one), in rank order, now the
    schedule's caps: what one forward holds (a micro-batch's, or without micro_batch the step's); HeteroError on
    every rank alike as probe_all."""
    s, sched = plan.settings, plan.schedule
    # the most one forward could be given: m rows, the global batch's, or a token budget's step (at most the budget
    # and one sample more in its tokens, as many rows)
    rows = s.micro_batch or s.global_batch or s.token_budget + max_length
    hi = rows * max_length
    probed = _agreed(plan, device, gpu, sched.token_probes, "max_tokens", lambda: probe_max_tokens(
        model, device, lo=1, hi=hi, max_length=max_length, collator=s.collator, autocast=autocast))
    caps = [p if pr else float(c) for p, pr, c in zip(probed, sched.token_probes, sched.row_caps)]
    try:
        sched.set_token_caps(caps)
    except ValueError as e:
        raise HeteroError(f"hetero: after the probe, {e}") from None
    return caps


def _agreed(plan: Plan, device: torch.device, gpu: str, probes: list[bool], what: str, probe) -> list[float]:
    """This rank's probe (probes[rank]: it probes) gathered with every rank's, as plain data (host, device, physical
    GPU, limit, or the line its probe failed with): every rank's limit (inf: none), or one line on every rank."""
    if device.type == "cuda" and not gpu:
        gpu = gpu_identity(torch.cuda.get_device_properties(device), device.index or 0)
    own, err = float("inf"), ""
    if probes[plan.rank]:
        try:
            own = probe()
        except (RuntimeError, TimeoutError, TypeError) as e:
            err = str(e).splitlines()[0] if str(e) else type(e).__name__
    row = {"host": socket.gethostname(), "device": str(device), "gpu": gpu,
           "limit": None if own == float("inf") else own, "error": err}
    if dist.is_initialized():
        coll = device if dist.get_backend() == "nccl" else torch.device("cpu")
        rows = guarded(gather_json, row, coll)
    else:
        rows = [row]
    if shared := shared_gpus([(r["host"], r["device"], r["gpu"]) for r in rows], probes):
        g = shared[0]
        raise HeteroError(f"hetero: {what} \"probe\" needs a GPU of its own per rank: ranks "
                          f"{', '.join(map(str, g))} share {rows[g[0]]['device']} on {rows[g[0]]['host']}; give "
                          f"their {what} as numbers")
    if failed := [r for r, row in enumerate(rows) if row["error"]]:
        kind = "largest-batch" if what == "max_batch" else "token-cap"
        raise HeteroError(f"hetero: the {kind} probe failed on rank {failed[0]}: {rows[failed[0]]['error']}")
    return [float("inf") if r["limit"] is None else float(r["limit"]) for r in rows]
