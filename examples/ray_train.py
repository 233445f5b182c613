"""An MLP on a map-style data set under Ray Train (TorchTrainer) with hetero: per-worker batch sizes balanced by
measured speed, and checkpoints every K steps that carry the balance through Ray's restarts (docs/ray.md).

    python examples/ray_train.py --workers 2 --hetero 1:slowdown=3 --rebalance-every 5   # a local Ray cluster, CPU
    python examples/ray_train.py --workers 2 --min-workers 1 --max-failures 1            # an elastic group
"""
import argparse
import json
import os
import sys
import time

import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import hetero
from hetero.integrations import ray as hetero_ray


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
    device = hetero_ray.device()  # Ray's choice; cuda:LOCAL_RANK may be another worker's GPU
    ckpt = hetero_ray.Checkpoints(every=cfg["checkpoint_every"])
    me = hetero_ray.worker_id(device)
    ids = hetero_ray.identities(me)
    bal = hetero.Balance(scheme=cfg["scheme"], global_batch=cfg["global_batch"],
                         rebalance_every=cfg["rebalance_every"], seed=cfg["seed"], worker_id=me)
    bal.emulate(hetero_ray.for_this_world(cfg["hetero"], ckpt.workers or ids, ids))  # slow by identity, not rank
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    ds = Synthetic(cfg["samples"])
    model = make_model(cfg["seed"]).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    bal.attach(ddp)  # gradient weight b_i/B, the step clock, the emulated delay
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)))
    opt = make_optimizer(model, cfg["lr"])
    if (state := ckpt.resume(bal)) is not None:  # the Balance goes on where it was saved
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    record = cfg["record"]
    log = open(f"{record}.start{ckpt.restarts}.rank{rank}.jsonl", "a") if record else None
    seen, ran = {}, 0
    for epoch in range(bal.position.next_epoch, cfg["epochs"]):
        bal.set_epoch(epoch)
        seen[epoch], total, n = [], 0.0, 0
        for x, y, idx in loader:
            step = bal.position.step  # the step this batch is
            x, y = x.to(device), y.to(device)
            with bal.step():
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            seen[epoch] += idx.tolist()
            total, n = total + loss.item() * len(y), n + len(y)
            if log:  # one line per step: what it consumed, when, and (the first few) the parameters after it
                row = {"start": ckpt.restarts, "rank": rank, "worker": me, "pid": os.getpid(), "epoch": epoch,
                       "step": step, "idx": idx.tolist(), "sizes": bal.last_sizes, "t": time.time()}
                if ran < cfg["record_params"]:
                    row["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
                log.write(json.dumps(row) + "\n")
                log.flush()
            ran += 1
            ckpt.after_step(bal, {"loss": loss.item(), "epoch": epoch},
                            lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()})
        if rank == 0:
            print(f"epoch {epoch}: train loss {total / max(n, 1):.3f} ({n} samples on rank 0 of {world}), batch "
                  f"sizes {bal.last_sizes}", flush=True)
    if record:
        with open(f"{record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "worker": me, "restarts": ckpt.restarts, "resumed_at": ckpt.resumed_at,
                       "seen": seen, "decisions": [d.__dict__ for d in bal.decisions]}, f)


def bad_count(args) -> str:
    """What is wrong with the counts on the command line ("" if nothing): each says how many of something."""
    least = {"workers": 1, "min_workers": 0, "max_failures": -1, "samples": 1, "epochs": 1, "checkpoint_every": 0,
             "record_params": 0}  # max_failures -1: Ray's "for ever"; the Balance checks its own settings
    for name, low in least.items():
        if getattr(args, name) < low:
            return f"--{name.replace('_', '-')} {getattr(args, name)} must be at least {low}"
    if args.min_workers > args.workers:
        return f"--min-workers {args.min_workers} exceeds --workers {args.workers}"
    if args.global_batch > args.samples:
        return f"--global-batch {args.global_batch} exceeds the {args.samples} --samples"
    return ""


def main(args) -> int:
    if why := bad_count(args):  # before Ray starts, which would fail deep inside Ray or torch
        print(f"hetero: error: {why}", file=sys.stderr)
        return 2
    try:  # before Ray starts: a bad setting stops with one line
        hetero.Balance(scheme=args.scheme, global_batch=args.global_batch, rebalance_every=args.rebalance_every,
                       seed=args.seed).emulate(args.hetero)
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
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
        print(f"hetero: error: the Ray run failed: {result.error}", file=sys.stderr)
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
    p.add_argument("--scheme", default="edp", help="sync, dp, edp or affine")
    p.add_argument("--rebalance-every", type=int, default=10, help="decide every K steps (0: at epoch ends only)")
    p.add_argument("--hetero", default="", help='emulated heterogeneity by worker, e.g. "1:slowdown=3"')
    p.add_argument("--checkpoint-every", type=int, default=10, help="report a checkpoint every K steps")
    p.add_argument("--storage", default="runs/ray", help="Ray's storage_path (checkpoints)")
    p.add_argument("--name", default="ray_train", help="the run's folder under --storage")
    p.add_argument("--record", default="", help="write the indices each worker consumed to RECORD.rankR.json")
    p.add_argument("--record-params", type=int, default=0, help="with --record: the parameters after K steps too")
    sys.exit(main(p.parse_args()))
