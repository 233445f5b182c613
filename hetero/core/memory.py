"""Memory-aware batch limits: the largest per-rank batch that fits on a GPU, found once before training.

`--max-batch probe` (for every rank, or per rank as in "probe,0,64") makes each GPU rank try training steps of
growing size on its own device until one runs out of memory, then bisect; the largest that fits, times a headroom
factor, becomes that rank's maximum batch, which every scheme respects. A CPU rank with `probe` gets no
limit: host memory does not fail cleanly (the kernel's OOM killer or swap, not an exception), so it is not probed.
"""
from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

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


# Messages of a GPU allocation failure that does not arrive as torch.cuda.OutOfMemoryError: near the memory limit
# cuDNN and cuBLAS fail to get their workspace and say so in a plain RuntimeError, from forward or backward
# (PyTorch issue 108645: "GET was unable to find an engine to execute this computation" out of backward()).
# Not CUDNN_STATUS_NOT_SUPPORTED or _INTERNAL_ERROR: those also mean real faults, which must not pass as "too big".
ALLOC_FAILURES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                  "unable to find an engine", "Unable to find a valid cuDNN algorithm")


def is_alloc_failure(e: BaseException) -> bool:
    """Whether an error from a training step means "this batch does not fit" (see ALLOC_FAILURES)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m.lower() in text for m in ALLOC_FAILURES)


def recover(device: torch.device) -> None:
    """After an allocation failure: free what the failed trial held and check the device still computes (a
    RuntimeError if not: the CUDA context is broken, and the probe must not go on as if the batch were too big)."""
    if device.type == "cuda":
        gc.collect()  # reference cycles through the failed trial's frames still hold its tensors
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    if torch.ones(8, device=device).add_(1).sum().item() != 16:
        raise RuntimeError(f"{device} computes wrongly after an out-of-memory failure")


def gpu_identity(props, index: int) -> str:
    """One physical GPU's identity, the same in every process that sees it (whatever its cuda:K number there):
    its UUID, else its PCI address, else its name and index (which may call two same-model GPUs one)."""
    if uuid := str(getattr(props, "uuid", "") or ""):
        return f"uuid {uuid}"
    if getattr(props, "pci_bus_id", None) is not None:
        return f"pci {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
    return f"{props.name} #{index}"


def shared_gpus(places: list[tuple[str, str, str]], probing: list[bool]) -> list[list[int]]:
    """Groups of ranks (at least one of them probing) that share a GPU: places[r] = (host, device, gpu identity) of
    rank r (gpu_identity; "" on a CPU rank): the physical GPU, not the "cuda:K" name, which with one GPU
    visible per rank is cuda:0 everywhere. The probe measures one rank alone on its device, so it cannot speak for
    ranks that will train side by side."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r, (host, _, gpu) in enumerate(places):
        if gpu:
            groups.setdefault((host, gpu), []).append(r)
    return [g for g in groups.values() if len(g) > 1 and any(probing[r] for r in g)]


def probe_max_batch(model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int, device: torch.device, *,
                    lo: int, hi: int, autocast=None, memory_format=torch.contiguous_format,
                    headroom: float = HEADROOM, limit_s: float | None = None) -> float:
    """The largest training batch that fits on this GPU rank, times headroom, within [lo, hi]; inf on a CPU rank.

    Call before wrapping the model in DDP. A trial is forward, loss and backward of the bare model on a batch of zeros,
    as the trainer's step (same autocast and memory format), while a reserve holds what training adds to it: SGD's
    momentum buffers and DDP's gradient buckets (each the size of the trainable parameters). Batch-norm running
    statistics, gradients and the random state are restored afterwards: the probe leaves the run as it found it.
    A trial that fails to allocate (is_alloc_failure) means "does not fit"; any other error propagates. Raises
    RuntimeError when not even lo samples fit, TimeoutError when the search runs past limit_s seconds (checked
    between trials).
    """
    if device.type != "cuda":
        return float("inf")
    return fitting_batch(model, sample_shape, classes, device, lo=lo, hi=hi, autocast=autocast,
                         memory_format=memory_format, headroom=headroom, limit_s=limit_s)


def fitting_batch(model: torch.nn.Module, sample_shape: tuple[int, ...], classes: int, device: torch.device, *,
                  lo: int, hi: int, autocast=None, memory_format=torch.contiguous_format,
                  headroom: float = HEADROOM, limit_s: float | None = None) -> float:
    """probe_max_batch's search on any device (the tests run it on the CPU with a model that raises the CUDA
    out-of-memory error, or cuDNN's and cuBLAS's allocation failures, above a size)."""
    autocast = autocast if autocast is not None else torch.autocast(device.type, enabled=False)

    def trial(b: int):
        x = torch.zeros(b, *sample_shape, device=device).contiguous(memory_format=memory_format)
        y = torch.arange(b, device=device) % classes
        with autocast:
            return F.cross_entropy(model(x).float(), y)
    return _largest(model, device, trial, lo=lo, hi=hi, headroom=headroom, limit_s=limit_s,
                    what=("--max-batch probe", "sample(s)"))


def token_batch(tokens: int, max_length: int, collator: str, device: torch.device) -> dict:
    """What a token-cap trial runs for `tokens` tokens, in the layout that costs its collator the most memory for
    them. Padded: rows as long as the model takes (max_length), as few as hold the tokens (rows x length from tokens
    to tokens + rows - 1): attention grows with a row's square. Packed: one row of all of them, documents of
    max_length told apart by position_ids that restart (DataCollatorWithFlattening's layout)."""
    if collator == "packed":
        ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
        return {"input_ids": ids, "labels": ids,
                "position_ids": (torch.arange(tokens, device=device) % max_length)[None]}
    rows = -(-tokens // max_length)
    ids = torch.zeros(rows, -(-tokens // rows), dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}


def probe_max_tokens(model: torch.nn.Module, device: torch.device, *, lo: int, hi: int, max_length: int,
                     collator: str = "padded", autocast=None, headroom: float = HEADROOM,
                     limit_s: float | None = None) -> float:
    """The most tokens one training forward holds on this GPU rank (max_tokens "probe"), times headroom, within
    [lo, hi]; inf on a CPU rank. A trial is a language model's forward with labels and its loss's backward
    (`model(**batch).loss`, the Hugging Face convention) on token_batch's layout; otherwise as probe_max_batch
    (before DDP, what training adds reserved, the model left as found)."""
    if device.type != "cuda":
        return float("inf")
    return fitting_tokens(model, device, lo=lo, hi=hi, max_length=max_length, collator=collator, autocast=autocast,
                          headroom=headroom, limit_s=limit_s)


def fitting_tokens(model: torch.nn.Module, device: torch.device, *, lo: int, hi: int, max_length: int,
                   collator: str = "padded", autocast=None, headroom: float = HEADROOM,
                   limit_s: float | None = None) -> float:
    """probe_max_tokens's search on any device (the tests run it on the CPU with a model that raises CUDA's
    out-of-memory error above a number of tokens)."""
    autocast = autocast if autocast is not None else torch.autocast(device.type, enabled=False)

    def trial(tokens: int):
        with autocast:
            out = model(**token_batch(tokens, max_length, collator, device))
        loss = getattr(out, "loss", None)  # a ModelOutput's, or a plain dict's
        loss = out.get("loss") if loss is None and isinstance(out, dict) else loss
        if not isinstance(loss, torch.Tensor):
            raise TypeError("max_tokens probe: the model must return its loss for model(input_ids=..., labels=...) "
                            "(a Hugging Face causal language model does)")
        return loss.float()
    return _largest(model, device, trial, lo=lo, hi=hi, headroom=headroom, limit_s=limit_s,
                    what=("max_tokens probe", "token(s)"))


def _largest(model: torch.nn.Module, device: torch.device, trial: Callable[[int], torch.Tensor], *, lo: int, hi: int,
             headroom: float, limit_s: float | None, what: tuple[str, str]) -> float:
    """The largest size in [lo, hi] whose trial (a loss to run backward from) fits, times headroom: the search both
    probes share. A reserve holds what training adds (SGD's momentum buffers and DDP's gradient buckets, each the
    size of the trainable parameters); buffers, gradients and the random state are restored afterwards. A trial
    that fails to allocate (is_alloc_failure) means "does not fit"; any other error propagates. RuntimeError when
    not even lo fits, TimeoutError past limit_s (checked between trials)."""
    name, unit = what
    cuda = device.type == "cuda"
    deadline = None if limit_s is None else time.perf_counter() + limit_s
    failures: list[str] = []
    trainable = [p for p in model.parameters() if p.requires_grad]
    reserve_bytes = 2 * sum(p.numel() * p.element_size() for p in trainable)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def fits(b: int) -> bool:
        if deadline is not None and time.perf_counter() > deadline:
            raise TimeoutError(f"{name} ran past its {limit_s:g} s limit")
        loss = None
        failed = False
        try:
            loss = trial(b)
            loss.backward()
            if cuda:
                torch.cuda.synchronize(device)
            return True
        except RuntimeError as e:
            if not is_alloc_failure(e):
                raise
            failures.append(str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            failed = True
            return False
        finally:
            del loss
            model.zero_grad(set_to_none=True)
            if failed:
                recover(device)  # outside the except block: the error's traceback no longer pins the tensors
            elif cuda:
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
        raise RuntimeError(f"{name}: not even {lo} {unit} fit on {device}{free}: {failures[-1]}")
    return float(min(hi, max(lo, int(best * headroom))))
