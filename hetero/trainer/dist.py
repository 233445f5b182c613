"""The trainer's distributed set-up: the process group from torchrun's environment, devices, backends, the DDP
wrapper and buffer averaging. The step clock and the gathers are the core's (core/clock.py, core/agree.py)."""
import inspect
import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..core.agree import LOCAL_RANK_FIELD, named_identity
from ..core.memory import gpu_identity  # noqa: F401 - setup uses it; tests import it here
from .config import ConfigError


@dataclass(frozen=True)
class World:
    rank: int          # global rank: decides roles (who is delayed, who writes, whose weight)
    size: int          # the world size: how many ranks
    local_rank: int    # only picks a device
    device: torch.device
    backend: str
    gpu: str = ""      # the physical GPU's identity (gpu_identity); "" on a CPU rank

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
    """cpu, cuda (the local rank's GPU, modulo the GPUs present: more local ranks than GPUs share them, which
    setup's backend choice then sees) or cuda:K."""
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
    elif cores:  # the cores actually granted: the kernel drops those outside this job's cpuset
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    elif not resolve_device(device).startswith("cuda"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))


def _loopback_interface() -> str:
    """The loopback interface's name: lo on Linux, lo0 on macOS and the BSDs."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), "lo")


@dataclass(frozen=True)
class Place:
    """Where one rank runs, as it published it before the process group starts."""
    host: str
    device: str   # resolved: "cpu" or "cuda:K"
    gpu: str      # gpu_identity of its GPU; "" on the CPU
    gpus: int     # GPUs this rank's host shows it
    worker: str = ""  # the name HETERO_WORKER_ID gives it ("": none; its identity is then host and device)


def shared_gpu_groups(places: list[Place]) -> list[list[int]]:
    """Groups of two or more ranks on one physical GPU (same host and identity), in rank order."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r, p in enumerate(places):
        if p.gpu:
            groups.setdefault((p.host, p.gpu), []).append(r)
    return [g for g in groups.values() if len(g) > 1]


def choose_backend(places: list[Place], backend: str) -> tuple[str, str]:
    """(backend, a line to print or "") from every rank's place, so every rank decides alike. auto: nccl when every
    rank has a GPU of its own, else gloo (said in one line when it is because ranks share a GPU). nccl that
    cannot work raises ValueError with one line: NCCL refuses a CPU rank and two ranks on one GPU."""
    shared = shared_gpu_groups(places)
    on_gpu = all(p.device.startswith("cuda") for p in places)
    why = ""
    if shared:
        g = shared[0]
        why = (f"ranks {', '.join(map(str, g))} share one GPU ({places[g[0]].device} on {places[g[0]].host}, "
               f"{places[g[0]].gpus} GPU(s) there)")
    if backend == "nccl":
        if not on_gpu:
            cpu = [r for r, p in enumerate(places) if not p.device.startswith("cuda")]
            raise ValueError(f"--backend nccl needs every rank on a GPU; rank {cpu[0]} is on the CPU "
                             f"(use --backend gloo or auto)")
        if shared:
            raise ValueError(f"--backend nccl: {why}, which NCCL refuses; use --backend gloo (or auto), or one "
                             f"rank per GPU")
        return "nccl", ""
    if backend == "auto":
        if not on_gpu:
            return "gloo", ""
        if shared:
            return "gloo", f"hetero: {why}: using gloo (NCCL refuses two ranks on one GPU)"
        return "nccl", ""
    return backend, ""


def duplicate_worker(places: list[Place]) -> str:
    """The line for two ranks that one HETERO_WORKER_ID names alike ("" when every given name is unique): the
    balancer would mix up their estimates, so the run is refused before the process group."""
    seen: dict[str, int] = {}
    for r, p in enumerate(places):
        if p.worker and p.worker in seen:
            q = seen[p.worker]
            return (f"ranks {q} and {r} are both worker {p.worker!r} (HETERO_WORKER_ID on {places[q].host} and "
                    f"{p.host}): give each worker its own name; an agent with several workers takes one per local "
                    f"rank (a,b,...) or a name holding {LOCAL_RANK_FIELD}")
        seen[p.worker] = r
    return ""


def exchange_places(store: dist.Store, rank: int, world: int, own: Place) -> list[Place]:
    """Every rank's Place, through torchrun's store (before the process group exists)."""
    store.set(f"place/{rank}", json.dumps(own.__dict__))
    return [Place(**json.loads(store.get(f"place/{r}"))) for r in range(world)]  # get waits for the key


def setup(devices: list[str], backend: str, timeout_s: float) -> World:
    """Join (or, outside torchrun, create a one-rank) process group. devices: every global rank's device setting.
    Before the group starts, each rank publishes where it runs (host, resolved device, GPU identity) on the
    rendezvous store and reads everyone's, so all ranks choose the backend from the same facts (also when
    `auto` resolves differently on different hosts). Raises ConfigError for an impossible --backend nccl."""
    rank, world, local_rank = env_world()
    dev = pick_device(devices[rank], local_rank)
    timeout = timedelta(seconds=timeout_s)
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:  # one host: gloo's sockets on loopback only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    if "MASTER_ADDR" not in os.environ:  # plain `python -m hetero.trainer`: a world of one
        store = dist.HashStore()  # in-process: a TCPStore would listen on every interface
    else:
        # torchrun keeps its store across restarts: keys of the previous attempt (a dead rank's address) would be
        # read by the new one and its connections refused. Each attempt gets a key space of its own.
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        store = dist.PrefixStore(f"hetero/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    cuda = dev.type == "cuda"
    own = Place(socket.gethostname(), str(dev), gpu_identity(torch.cuda.get_device_properties(dev), dev.index)
                if cuda else "", torch.cuda.device_count() if cuda else 0, named_identity() or "")
    places = exchange_places(store, rank, world, own)
    if why := duplicate_worker(places):  # the same on every rank: one line each, exit 2
        raise ConfigError(why)
    try:
        backend, note = choose_backend(places, backend)
    except ValueError as e:  # every rank raises alike: one line (rank 0's), exit 2
        raise ConfigError(str(e)) from None
    if note and rank == 0:
        print(note, flush=True)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=dev if backend == "nccl" else None)
    return World(rank, world, local_rank, dev, backend, own.gpu)


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
