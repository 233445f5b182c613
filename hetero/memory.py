"""Memory-aware batch limits: the largest per-rank batch that fits on a GPU, found once before training.

`--max-batch probe` (for every rank, or per rank as in "probe,0,64") makes each GPU rank try training steps of
growing size on its own device until one runs out of memory, then bisect; the largest that fits, times a headroom
factor, becomes that rank's maximum batch, which every scheme respects. A CPU rank with `probe` gets no
limit: host memory does not fail cleanly (the kernel's OOM killer or swap, not an exception), so it is not probed.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

HEADROOM = 0.9  # the probe's result is scaled by this: allocator fragmentation, evaluation, communication


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest b in [lo, hi] with fits(b), for a monotone fits (whatever fits, smaller fits too); 0 when not even
    lo fits. Doubling from lo, then bisection: at most about 2 log2(hi / lo) + 2 calls, the large ones last."""
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= lo <= hi (got {lo}, {hi})")
    if not fits(lo):
        return 0
    good = lo
    while good < hi:
        b = min(2 * good, hi)
        if not fits(b):
            bad = b
            break
        good = b
    else:
        return good
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def shared_gpus(places: list[tuple[str, str]], probing: list[bool]) -> list[list[int]]:
    """Groups of ranks (at least one of them probing) that share a GPU: places[r] = (host, device) of rank r.
    The probe measures one rank alone on its device, so it cannot speak for ranks that will train side by side."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r, (host, dev) in enumerate(places):
        if dev.startswith("cuda"):
            groups.setdefault((host, dev), []).append(r)
    return [g for g in groups.values() if len(g) > 1 and any(probing[r] for r in g)]


def probe_max_batch(model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int, device: torch.device, *,
                    lo: int, hi: int, autocast=None, memory_format=torch.contiguous_format,
                    headroom: float = HEADROOM) -> float:
    """The largest training batch that fits on this GPU rank, times headroom, within [lo, hi]; inf on a CPU rank.

    Call before wrapping the model in DDP. A trial is forward, loss and backward of the bare model on a batch of zeros,
    as the trainer's step (same autocast and memory format), while a reserve holds what training adds to it: SGD's
    momentum buffers and DDP's gradient buckets (each the size of the trainable parameters). Batch-norm running
    statistics, gradients and the random state are restored afterwards: the probe leaves the run as it found it.
    Raises RuntimeError when not even lo samples fit.
    """
    if device.type != "cuda":
        return float("inf")
    return fitting_batch(model, sample_shape, classes, device, lo=lo, hi=hi, autocast=autocast,
                         memory_format=memory_format, headroom=headroom)


def fitting_batch(model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int, device: torch.device, *,
                  lo: int, hi: int, autocast=None, memory_format=torch.contiguous_format,
                  headroom: float = HEADROOM) -> float:
    """probe_max_batch's search on any device (the tests run it on the CPU with a model that raises the CUDA
    out-of-memory error above a size)."""
    cuda = device.type == "cuda"
    trainable = [p for p in model.parameters() if p.requires_grad]
    reserve_bytes = 2 * sum(p.numel() * p.element_size() for p in trainable)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    autocast = autocast if autocast is not None else torch.autocast(device.type, enabled=False)

    def fits(b: int) -> bool:
        x = y = loss = None
        try:
            x = torch.zeros(b, *sample_shape, device=device).contiguous(memory_format=memory_format)
            y = torch.arange(b, device=device) % classes
            with autocast:
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del x, y, loss
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()

    reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=device)
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):  # dropout must not move the run's RNG
            best = largest_fitting(fits, lo, max(lo, math.ceil(hi / headroom)))  # so that hi survives the headroom
    finally:
        del reserve
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        if cuda:
            torch.cuda.empty_cache()
    if best == 0:
        free = f" (free {torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB)" if cuda else ""
        raise RuntimeError(f"--max-batch probe: not even {lo} sample(s) fit on {device}{free}")
    return float(min(hi, max(lo, int(best * headroom))))
