"""Distributed plumbing: process group from torchrun's environment, devices, the gradient-weighting DDP
communication hook with its timing mark, and small gather helpers. The training loop lives in train.py."""
import inspect
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass(frozen=True)
class World:
    rank: int          # global rank: decides roles (who is delayed, who writes, whose weight)
    world: int
    local_rank: int    # only picks a device
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def coll_device(self) -> torch.device:
        """Where small collective tensors live: the GPU under nccl, the CPU under gloo (also for GPU ranks)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def pick_device(device: str, local_rank: int) -> torch.device:
    """cpu, cuda (the local rank's GPU, modulo the GPUs present) or cuda:K."""
    device = resolve_device(device)
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device} was asked for but torch sees no GPU (use --device cpu)")
        n = torch.cuda.device_count()
        index = int(device.split(":")[1]) if ":" in device else local_rank % n
        if index >= n:
            raise RuntimeError(f"--device {device}: this host has {n} GPU(s)")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def apply_cpu_budget(threads: int, cores: set[int] | None, device: str) -> None:
    """Pin this rank to its cores and size torch's thread pool; ranks on one host share its cores by default."""
    if cores:
        os.sched_setaffinity(0, cores)
    if threads:
        torch.set_num_threads(threads)
    elif cores:
        torch.set_num_threads(len(cores))
    elif not resolve_device(device).startswith("cuda"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))


def _loopback_interface() -> str:
    """The loopback interface's name: lo on Linux, lo0 on macOS and the BSDs."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def setup(devices: list[str], backend: str, timeout_s: float) -> World:
    """Join (or, outside torchrun, create a one-rank) process group. devices: every global rank's device, so all
    ranks agree on the backend: nccl when every rank has a GPU, gloo otherwise (CPU and mixed jobs)."""
    rank, world, local_rank = env_world()
    dev = pick_device(devices[rank], local_rank)
    if backend == "auto":
        backend = "nccl" if all(resolve_device(d).startswith("cuda") for d in devices) else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:  # one host: gloo's sockets on loopback only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    if "MASTER_ADDR" not in os.environ:  # plain `python -m hetero.train`: a world of one
        store = dist.HashStore()  # in-process: a TCPStore would listen on every interface
    else:
        # torchrun keeps its store across restarts: keys of the previous attempt (a dead rank's address) would be
        # read by the new one and its connections refused. Each attempt gets a key space of its own.
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        store = dist.PrefixStore(f"hetero/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=dev if backend == "nccl" else None)
    return World(rank, world, local_rank, dev, backend)


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DDP:
    """DDP without its per-forward buffer broadcast (see average_buffers); the flag's name changed in torch 2.14."""
    ids = [device] if device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return DDP(model, device_ids=ids, forward_sync_buffers=False)
    return DDP(model, device_ids=ids, broadcast_buffers=False)


def teardown(ok: bool) -> None:
    """Leave the group; after a clean finish first wait for every rank, so none exits mid-collective."""
    if dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


class StepClock:
    """Marks inside one training step: start, gradients ready (local compute done), backward returned, end.

    compute_s = (ready - start) + (end - returned): the rank's own work; wait_s = returned - ready: the last
    all-reduce, including waiting for slower ranks. On CUDA the marks are events, read when the step is over.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, float | torch.cuda.Event] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[name] = ev
        else:
            self.marks[name] = time.perf_counter()

    def host_elapsed_s(self) -> float:
        """Host seconds since `start` (exact on CPU; on CUDA after synchronising, for the slowdown emulation)."""
        if self.cuda:
            torch.cuda.synchronize()
            return self.marks["start"].elapsed_time(self._now()) / 1e3
        return time.perf_counter() - self.marks["start"]

    def _now(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()
        return ev

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
        wait = span("ready", "returned")
        return span("start", "ready") + span("returned", "end"), wait


@dataclass
class HookState:
    """Mutable state of the communication hook: this rank's gradient weight and the step's clock."""
    weight: float
    clock: StepClock | None = None
    on_ready: Callable[[], None] | None = None  # called once per step when local gradients are complete


def weighted_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum over ranks of weight_i * g_i: weight 1/world gives DDP's mean; b_i/B gives the global-batch gradient.

    Buckets are reduced in order, so when the last one is handed over every local gradient is computed: that
    instant ends the rank's compute (before any waiting), and is where an emulated slow rank spends its delay.
    """
    if bucket.is_last():
        if state.on_ready is not None:  # an emulated slow rank spends its extra time here, as compute
            state.on_ready()
        if state.clock is not None:
            state.clock.mark("ready")
    buf = bucket.buffer()
    buf.mul_(state.weight)
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def gather_rows(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """All ranks' float64 rows, stacked in rank order: [world, *values.shape], on the CPU."""
    t = values.to(device=device, dtype=torch.float64).contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def sum_all(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Element-wise float64 sum over ranks (exact metric totals)."""
    t = values.to(device=device, dtype=torch.float64, copy=True)
    dist.all_reduce(t)
    return t.cpu()


def average_buffers(model: torch.nn.Module) -> None:
    """Average floating buffers (batch-norm running statistics) over ranks, so every replica evaluates alike.

    DDP is built with broadcast_buffers=False: its per-step broadcast from rank 0 would be a second sync point
    inside forward and would bill waiting to compute time. Averaging once per epoch also uses every rank's
    statistics instead of only rank 0's.
    """
    world = dist.get_world_size()
    for b in model.buffers():
        if b.is_floating_point():
            dist.all_reduce(b)
            b.div_(world)
        else:
            dist.broadcast(b, src=0)
