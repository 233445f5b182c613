"""A small character-level transformer with PyTorch Lightning and gradient accumulation: the script without hetero
(examples/lightning_lm.py is the same with per-rank counts of micro-batches; docs/lightning.md shows the diff).

    python examples/lightning_lm_baseline.py --devices 2 --micro-batch 4 --grad-accum 4      # Lightning's launcher
    python examples/lightning_lm_baseline.py --devices 2 --fsdp      # FSDP2: ModelParallelStrategy, fully_shard

Every rank runs --grad-accum micro-batches of --micro-batch samples per optimizer step.
"""
import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_lm import LM, CharWindows, read_text  # noqa: E402  (the same model and text)


class CharLM(L.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.model, self.args, self.seen = LM(args.seq_len, args.dim, args.heads, args.layers), args, {}

    def configure_model(self):  # --fsdp: each block and the whole LM sharded over the data-parallel ranks
        if self.args.fsdp:
            for block in self.model.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        loss = F.cross_entropy(self.model(x), y.flatten())
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.0)

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch}: train loss {self.trainer.callback_metrics['train_loss']:.4f}",
                  flush=True)

    def on_train_end(self):
        if self.args.record:
            with open(f"{self.args.record}.rank{self.global_rank}.json", "w") as f:
                json.dump({"seen": self.seen}, f)


def main(args) -> int:
    ds = CharWindows(read_text(args.data), args.seq_len, args.subset)
    loader = DataLoader(ds, batch_size=args.micro_batch, shuffle=True, drop_last=True)
    torch.manual_seed(args.seed)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices,
                        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
                        if args.fsdp else DDPStrategy(start_method="popen"),
                        accumulate_grad_batches=args.grad_accum, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(CharLM(args), loader)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="", help="a text file or a folder of them (default: this checkout's files)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4, help="samples per forward and backward")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step on every rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=32, help="tokens (bytes) per sample")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--subset", type=int, default=0, help="train on this many samples (0: all)")
    p.add_argument("--devices", type=int, default=2, help="processes Lightning starts")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (ModelParallelStrategy, fully_shard) instead of DDP")
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    sys.exit(main(p.parse_args()))
