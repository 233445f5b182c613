"""ResNet-18 on an ImageFolder with PyTorch DDP and hetero: per-rank batch sizes balanced by measured speed.

    torchrun --standalone --nproc-per-node=2 examples/plain_torch.py --data ../shared/data/cifar10-jpg/train \
        --hetero 1:slowdown=3 --rebalance-every 10       # rank 1 emulated 3x slower (docs/quickstart.md)
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms

import hetero


class Indexed(Dataset):
    """(image, label, index): lets --record write which samples each rank consumed."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i


def main(args) -> int:
    if not os.path.isdir(args.data):
        print(f"hetero: error: --data {args.data}: no such folder", file=sys.stderr)
        return 2
    try:  # before any process group: a bad setting stops every rank alike, with one line
        bal = hetero.Balance(scheme=args.scheme, global_batch=args.global_batch, rebalance_every=args.rebalance_every,
                             seed=args.seed, min_batch=2)  # batch norm cannot train on 1 sample (1x1 maps at 32 px)
        bal.emulate(args.hetero)
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    tf = transforms.Compose([transforms.Resize(args.size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))])
    folder = torchvision.datasets.ImageFolder(args.data, transform=tf)
    keep = torch.randperm(len(folder), generator=torch.Generator().manual_seed(0))[:args.subset or len(folder)]
    ds = Indexed(Subset(folder, keep.tolist()))
    torch.manual_seed(args.seed)
    model = torchvision.models.resnet18(num_classes=len(folder.classes)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    bal.attach(ddp)  # gradient weight b_i/B, the step clock, the emulated delay
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)),
                        num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    seen = {}
    for epoch in range(args.epochs):
        bal.set_epoch(epoch)
        seen[epoch], total, n = [], 0.0, 0
        for x, y, idx in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with bal.step():
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            seen[epoch] += idx.tolist()
            total, n = total + loss.item() * len(y), n + len(y)
        sched.step()
        if rank == 0:
            print(f"epoch {epoch}: train loss {total / max(n, 1):.3f} ({n} samples on rank 0), batch sizes "
                  f"{bal.last_sizes}", flush=True)
    if args.record:
        with open(f"{args.record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "seen": seen, "decisions": [d.__dict__ for d in bal.decisions]}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="an ImageFolder root (one folder per class)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=32, help="images are resized to this many pixels")
    p.add_argument("--subset", type=int, default=0, help="train on this many samples (0: all)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--scheme", default="edp", help="sync, dp, edp or affine")
    p.add_argument("--rebalance-every", type=int, default=10, help="decide every K steps (0: at epoch ends only)")
    p.add_argument("--hetero", default="", help='emulated heterogeneity, e.g. "1:slowdown=3"')
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    sys.exit(main(p.parse_args()))
