"""ResNet-18 on an ImageFolder with PyTorch Lightning and hetero: per-rank batch sizes, b_i/B weighting, rebalancing.

    torchrun --standalone --nproc-per-node=2 examples/lightning_example.py --data ../shared/data/cifar10-jpg/train \
        --hetero 1:slowdown=3
    python examples/lightning_example.py --devices 2 --data ...      # Lightning's own launcher (or --spawn)

What hetero needs from Lightning: its batch sampler on the DataLoader, `use_distributed_sampler=False` (Lightning
would otherwise replace it by a DistributedSampler of equal shares), and hetero.BalanceCallback, which attaches
the weighting hook to the strategy's DDP model and brackets every training step.
"""
import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Subset
from torchvision import transforms

import hetero

sys.path.insert(0, os.path.dirname(__file__))
from plain_torch import Indexed  # noqa: E402  (the same (image, label, index) wrapper)


class Classifier(L.LightningModule):
    def __init__(self, classes: int, lr: float, epochs: int, bal: hetero.Balance, record: str):
        super().__init__()
        self.model, self.lr, self.epochs = torchvision.models.resnet18(num_classes=classes), lr, epochs
        self.bal, self.record = bal, record
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        return F.cross_entropy(self.model(x), y)  # a plain mean: the hook weights it by b_i/B

    def on_train_end(self):  # in every training process (with --spawn the main process does not train)
        if self.global_rank == 0:
            print(f"hetero: final batch sizes {self.bal.last_sizes} after {len(self.bal.decisions)} decisions",
                  flush=True)
        if self.record:
            with open(f"{self.record}.rank{self.global_rank}.json", "w") as f:
                json.dump({"rank": self.global_rank, "seen": self.seen,
                           "decisions": [d.__dict__ for d in self.bal.decisions]}, f)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.epochs)]


def main(args) -> int:
    if not os.path.isdir(args.data):
        print(f"hetero: error: --data {args.data}: no such folder", file=sys.stderr)
        return 2
    try:
        bal = hetero.Balance(scheme=args.scheme, global_batch=args.global_batch, rebalance_every=args.rebalance_every,
                             seed=args.seed, min_batch=2)  # batch norm cannot train on 1 sample (1x1 maps at 32 px)
        bal.emulate(args.hetero)
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    tf = transforms.Compose([transforms.Resize(args.size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))])
    folder = torchvision.datasets.ImageFolder(args.data, transform=tf)
    keep = torch.randperm(len(folder), generator=torch.Generator().manual_seed(0))[:args.subset or len(folder)]
    ds = Indexed(Subset(folder, keep.tolist()))
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)), num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    torch.manual_seed(args.seed)
    module = Classifier(len(folder.classes), args.lr, args.epochs, bal, args.record)
    # under torchrun, its world; else Lightning's own launcher starts --devices processes
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", args.devices))
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu" if args.cpu else "auto", devices=devices,
                        num_nodes=int(os.environ.get("WORLD_SIZE", devices)) // devices,
                        strategy=DDPStrategy(start_method="spawn" if args.spawn else "popen"),
                        use_distributed_sampler=False, gradient_clip_val=5.0,
                        callbacks=[hetero.BalanceCallback(bal)],
                        logger=CSVLogger(args.log_dir) if args.log_dir else False, log_every_n_steps=args.log_every,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
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
    p.add_argument("--devices", type=int, default=1, help="processes Lightning starts (ignored under torchrun)")
    p.add_argument("--spawn", action="store_true", help="Lightning's ddp_spawn launcher instead of ddp's")
    p.add_argument("--cpu", action="store_true", help="accelerator cpu (default: auto)")
    p.add_argument("--log-dir", default="", help="a CSVLogger here (hetero's hetero/ numbers among them)")
    p.add_argument("--log-every", type=int, default=50, help="log every this many steps")
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    sys.exit(main(p.parse_args()))
