"""A small character-level transformer with PyTorch Lightning and hetero's per-rank gradient accumulation: each rank
runs its own count k_i of micro-batches per optimizer step, decided by measured speed (docs/lightning.md).

    python examples/lightning_lm.py --devices 2 --micro-batch 4 --grad-accum 4 --hetero 1:slowdown=3
    python examples/lightning_lm.py --devices 2 --fsdp --hetero 1:slowdown=3      # FSDP2: ModelParallelStrategy

The global batch is the baseline's (examples/lightning_lm_baseline.py, accumulate_grad_batches): --micro-batch x
--grad-accum x --devices samples per step, in micro-batches of --micro-batch; the counts sum to --grad-accum x
--devices. Manual optimisation: training_step takes Lightning's dataloader_iter and runs this rank's micro-batches,
each in `with bal.step():` (all but the last under no_sync), and steps the optimizer on the last.
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

import hetero

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_lm import LM, CharWindows, read_text  # noqa: E402  (the same model and text)


class CharLM(L.LightningModule):
    def __init__(self, args, bal: hetero.Balance):
        super().__init__()
        self.model, self.args, self.seen = LM(args.seq_len, args.dim, args.heads, args.layers), args, {}
        self.bal, self.counts = bal, []
        self.automatic_optimization = False  # each rank accumulates its own count (Lightning's is one for all)

    def configure_model(self):  # --fsdp: each block and the whole LM sharded over the data-parallel ranks
        if self.args.fsdp:
            for block in self.model.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, dataloader_iter):  # one optimizer step: this rank's micro-batches, pulled here
        opt, losses = self.optimizers(), []
        for (x, y, idx), _, _ in dataloader_iter:
            self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
            with self.bal.step():  # all but the step's last micro-batch under no_sync
                loss = F.cross_entropy(self.model(x.to(self.device)), y.to(self.device).flatten())
                self.manual_backward(loss)  # a plain mean over the micro-batch: weighted m/B in the all-reduce
                losses.append(loss.detach())
                if self.bal.sync_now:  # the step's last: the weighted sum is every rank's gradient
                    self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
                    opt.step()
                    opt.zero_grad()
                    break
        if not losses:  # nothing left to pull (Lightning's call past a resumed epoch's end, before hetero fixed it)
            return
        self.counts.append(len(losses))
        self.log("train_loss", torch.stack(losses).mean(), on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=len(losses))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.0)

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch}: train loss {self.trainer.callback_metrics['train_loss']:.4f}",
                  flush=True)

    def on_train_end(self):
        if self.args.record:
            with open(f"{self.args.record}.rank{self.global_rank}.json", "w") as f:
                json.dump({"seen": self.seen, "counts": self.counts,
                           "decisions": [d.__dict__ for d in self.bal.decisions]}, f)


def main(args) -> int:
    try:
        bal = hetero.Balance(global_batch=args.micro_batch * args.grad_accum * args.devices,
                             micro_batch=args.micro_batch, rebalance_every=args.rebalance_every, seed=args.seed)
        bal.emulate(args.hetero)
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    ds = CharWindows(read_text(args.data), args.seq_len, args.subset)
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)))
    torch.manual_seed(args.seed)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices,
                        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
                        if args.fsdp else DDPStrategy(start_method="popen"),
                        use_distributed_sampler=False, callbacks=[hetero.BalanceCallback(bal)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(CharLM(args, bal), loader)
    except (ValueError, hetero.HeteroError) as e:  # a setting hetero refuses: one line, on every rank
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="", help="a text file or a folder of them (default: this checkout's files)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4, help="samples per forward and backward")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step and rank, on average")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=32, help="tokens (bytes) per sample")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--subset", type=int, default=0, help="train on this many samples (0: all)")
    p.add_argument("--devices", type=int, default=2, help="processes Lightning starts")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (ModelParallelStrategy, fully_shard) instead of DDP")
    p.add_argument("--rebalance-every", type=int, default=5, help="decide every K steps (0: at epoch ends only)")
    p.add_argument("--hetero", default="", help='emulated heterogeneity, e.g. "1:slowdown=3"')
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    sys.exit(main(p.parse_args()))
