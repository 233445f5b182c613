"""hetero inside a Ray Train training function (`ray.train.torch.TorchTrainer`, the [ray] extra): the device Ray
gave the worker, a worker identity that survives Ray's renumbering of ranks at each start, per-worker settings
keyed by that identity, and checkpoints that carry the Balance through Ray's restarts and elastic resizes.

    def train_fn(config):                                  # run by every Ray Train worker
        device = hetero_ray.device()
        ckpt = hetero_ray.Checkpoints(every=20)            # reads ray.train.get_checkpoint(), if any
        me = hetero_ray.worker_id(device)                  # pass it to the Balance: its key across restarts
        ids = hetero_ray.identities(me)                    # every worker's, in this start's rank order
        bal = hetero.Balance(global_batch=256, rebalance_every=10, worker_id=me)
        bal.emulate(hetero_ray.for_this_world(config["hetero"], ckpt.workers or ids, ids))
        ddp = DDP(model.to(device)); bal.attach(ddp)
        loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)))
        if (state := ckpt.resume(bal)) is not None:            # the Balance goes on where it was saved
            model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])
        for epoch in range(bal.position.next_epoch, epochs):
            bal.set_epoch(epoch)
            for x, y in loader:
                with bal.step(): ...
                ckpt.after_step(bal, {"loss": loss.item()}, lambda: {"model": ..., "optimizer": ...})

Ray sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) and initialises the process group before the
training function runs, so a Balance built inside it binds its rank and world from the process group. Ray does not
set TORCHELASTIC_RESTART_COUNT: the restart count lives in the checkpoint. A restart re-runs the training function
from the latest checkpoint given to `ray.train.report`; steps run after it are run again (counted in the docs).
"""
from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.agree import default_identity, gather_json
from ..core.balance import Balance
from ..core.emulator import parse_hetero
from ..core.rules import whole

# Ray itself is imported where it is used: the pure parts (for_this_world, by_worker) load without it, in seconds
FILE = "hetero.pt"  # the checkpoint's one file: plain tensors, lists and numbers (torch.load weights_only=True)


def device() -> torch.device:
    """The device Ray assigned this worker: Ray shares CUDA_VISIBLE_DEVICES on a node, so cuda:LOCAL_RANK may be
    another worker's GPU; ray.train.torch.get_device() is the one Ray reserved."""
    import ray.train.torch

    return ray.train.torch.get_device()


def worker_id(dev: torch.device) -> str:
    """This worker's identity, the same at every start whatever rank Ray gives it: HETERO_WORKER_ID when set (the
    local rank appended where a node runs several workers), else the host and the GPU's UUID, else (CPU) the host
    and the local rank (CPU workers of one node are interchangeable: the local rank is their only name). Ray's node
    id is left out: it changes with every raylet start (a new cluster, a replaced node), the host does not."""
    return default_identity(dev)


def identities(own: str) -> list[str]:
    """Collective: every worker's identity in this start's rank order (plain JSON: nothing unpickled from a peer)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [own]
    coll = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return gather_json(own, coll)


_RANK = re.compile(r"^(\d+):", re.ASCII)


def for_this_world(spec: str, first: list[str], now: list[str]) -> str:
    """An emulation spec (the HETERO grammar, e.g. "1:slowdown=3") whose ranks name the workers of the first start
    (`first`, their identities), rewritten for this start's rank order (`now`); a worker absent now is left out."""
    parse_hetero(spec)  # a bad spec fails here, in one line
    items = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        r = int(_RANK.match(item).group(1))
        if r >= len(first):
            raise ValueError(f"hetero names worker {r}, but the first start had {len(first)} worker(s)")
        if first[r] in now:
            items.append(_RANK.sub(f"{now.index(first[r])}:", item))
    return ",".join(items)


def by_worker(values: Mapping[str, object], now: list[str], default=None) -> list:
    """A per-worker setting (e.g. Balance(max_batch=...)) keyed by identity, as one entry per rank of this start."""
    return [values.get(name, default) for name in now]


class Checkpoints:
    """The Balance (its position included) and the restart count with the user's state, given to ray.train.report
    every `every` steps and at each epoch's end, and read back from ray.train.get_checkpoint() at each start. Where
    training is, is the Balance's `position`: a resumed start goes on at `bal.position.next_epoch`."""

    def __init__(self, every: int):
        """every: report a checkpoint every this many steps (also at every epoch's end); 0: at epoch ends only."""
        self.every = whole("every", every, 0)
        self.saved = _read()
        self.restarts = self.saved["restarts"] + 1 if self.saved else 0  # starts that resumed from a checkpoint
        self.workers: list[str] | None = self.saved["workers"] if self.saved else None  # the first start's
        self.resumed_at: tuple[int, int] | None = None  # the (epoch, step) a resumed start runs first
        self._resumed = False

    def resume(self, bal: Balance) -> dict | None:
        """After bal.attach and bal.batch_sampler(len(ds)): the saved Balance goes on where it was saved (carried by
        identity to this start's ranks and world); returns the user's state (None on a first start)."""
        if self.workers is None:
            self.workers = bal.workers or []
        self._resumed = True
        if not self.saved:
            return None
        state = self.saved["balance"]
        if "position" in self.saved:  # written before the Balance's state held its own complete position
            e, k = self.saved["position"]
            state = {**state, "epoch": e, "step": k}
        bal.load_state_dict(state)
        pos = bal.position
        self.resumed_at = (pos.next_epoch, 0 if pos.epoch_complete else pos.step)
        return self.saved["user"]

    def after_step(self, bal: Balance, metrics: dict, state: Callable[[], dict]) -> bool:
        """Every worker, after each step: when due (read from bal.position), report a checkpoint (collective; rank 0
        writes it, every worker calls ray.train.report, as Ray requires). state() gives the user's tensors. True:
        reported."""
        pos = bal.position
        if not pos.steps_per_epoch or not self._resumed:
            raise RuntimeError("hetero: call ckpt.resume(bal) after bal.batch_sampler(len(ds)), before the first step")
        if not (pos.epoch_complete or (self.every and pos.step % self.every == 0)):
            return False
        balance = bal.state_dict()  # collective: complete mid-epoch (the steps since the last decision included)
        payload = {"balance": balance, "restarts": self.restarts, "workers": self.workers, "user": state()}
        import ray.train

        if not dist.is_initialized() or dist.get_rank() == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save(payload, Path(d) / FILE)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d),
                                 checkpoint_dir_name=f"start{self.restarts}-epoch{pos.epoch}-step{pos.step}")
        else:
            ray.train.report(metrics, checkpoint=None)
        return True


def _read() -> dict | None:
    """The latest reported checkpoint's hetero file, or None (a first start)."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        path = Path(d) / FILE
        if not path.is_file():
            raise ValueError(f"hetero: the checkpoint at {ckpt.path} has no {FILE}: not written by hetero's "
                             f"Checkpoints")
        return torch.load(path, weights_only=True)
