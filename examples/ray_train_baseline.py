"""An MLP on a map-style data set under Ray Train (TorchTrainer) without hetero (the baseline of ray_train.py:
`diff` the two).

    python examples/ray_train_baseline.py --workers 2
"""
import argparse
import json
import os
import sys
import tempfile
import time

import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Synthetic(Dataset):
    """(x, label, index): n seeded 32-vectors labelled by a fixed random linear teacher; the index lets --record
    write which samples each worker consumed."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 32, generator=g)
        self.y = (self.x @ torch.randn(32, 4, generator=g)).argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every worker
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train_fn(cfg: dict) -> None:
    """Run by every Ray Train worker, at each start of the group (Ray re-runs it from the latest checkpoint)."""
    device = ray.train.torch.get_device()  # Ray's choice; cuda:LOCAL_RANK may be another worker's GPU
    ckpt, start_epoch = ray.train.get_checkpoint(), 0
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    ds = Synthetic(cfg["samples"])
    model = make_model(cfg["seed"]).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(ds, seed=cfg["seed"], drop_last=True)
    loader = DataLoader(ds, batch_size=cfg["global_batch"] // world, sampler=sampler, drop_last=True)
    opt = make_optimizer(model, cfg["lr"])
    if ckpt is not None:  # at epoch ends only: DistributedSampler cannot go on mid-epoch
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    record = cfg["record"]
    log = open(f"{record}.rank{rank}.jsonl", "a") if record else None
    seen = {}
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        seen[epoch], total, n = [], 0.0, 0
        for x, y, idx in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen[epoch] += idx.tolist()
            total, n = total + loss.item() * len(y), n + len(y)
            if log:
                log.write(json.dumps({"rank": rank, "epoch": epoch, "idx": idx.tolist(), "t": time.time()}) + "\n")
                log.flush()
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                           os.path.join(d, "state.pt"))
            ray.train.report({"loss": total / max(n, 1), "epoch": epoch},
                             checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        if rank == 0:
            print(f"epoch {epoch}: train loss {total / max(n, 1):.3f} ({n} samples on rank 0 of {world})", flush=True)
    if record:
        with open(f"{record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "seen": seen}, f)


def main(args) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local cluster reports nothing outside this machine
    if args.address:  # a running cluster: host:port, or "auto" for the one `ray start` began on this machine
        ray.init(address=args.address)
    else:  # a cluster of its own, stopped at the end (address=None would join one `ray start` began here)
        ray.init(address="local", num_cpus=args.workers, include_dashboard=False)
    try:
        workers = (args.min_workers, args.workers) if args.min_workers else args.workers
        trainer = TorchTrainer(
            train_fn, train_loop_config=vars(args),
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=args.gpu),
            run_config=RunConfig(name=args.name, storage_path=os.path.abspath(args.storage),
                                 failure_config=FailureConfig(max_failures=args.max_failures)))
        result = trainer.fit()
    finally:
        ray.shutdown()
    if result.error is not None:
        print(f"error: the Ray run failed: {result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers (one CPU, or one GPU with --gpu, each)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", ""),
                   help="a running Ray cluster to join (host:port, or auto); default $RAY_ADDRESS, else a local "
                        "cluster of --workers CPUs, started here and stopped at the end")
    p.add_argument("--min-workers", type=int, default=0, help="elastic: go on with as few as this many (0: fixed)")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--max-failures", type=int, default=0, help="Ray restarts the group this many times")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", default="runs/ray", help="Ray's storage_path (checkpoints)")
    p.add_argument("--name", default="ray_train_baseline", help="the run's folder under --storage")
    p.add_argument("--record", default="", help="write the indices each worker consumed to RECORD.rankR.json")
    sys.exit(main(p.parse_args()))
