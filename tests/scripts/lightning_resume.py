"""A Lightning fit stopped mid-epoch at a checkpoint and resumed from it: `python lightning_resume.py OUT DIR first
[MODE] [B]` trains 11 steps (epoch 0's 8 and 3 of epoch 1) and saves a checkpoint at step 11 into DIR; `... OUT DIR
again [MODE] [B]` resumes from it with trainer.fit(ckpt_path=...) and finishes epoch 1. Lightning's own launcher, 2
CPU processes, rank 1 3x slower. Each rank writes the indices it consumed per epoch, the sizes of its first step, the
micro-batches of each training_step and the decisions to OUT.PHASE.rankR.json; a refusal is one line on stderr and
exit status 2.

MODE: batch (per-rank batch sizes, automatic optimisation; the default), micro (per-rank accumulation: micro-batches
of 4 on Lightning's dataloader_iter, docs/lightning.md#accumulation), or nobreak (the accumulation recipe without the
`break` after the optimizer step where bal.sync_now, with replayed sizes). B: the global batch (default 32)."""
import json
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

import hetero

N, M = 256, 4  # 8 steps per epoch of the default global batch 32; micro-batches of 4
# rank 1 3x slower and 50 ms a step more: the 3x of a step of microseconds alone is below a busy host's noise, and
# the tests check that the shares move
SLOW = "1:slowdown=3,1:delay=0.05"


class Indexed(Dataset):
    def __init__(self):
        self.x = torch.randn(N, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], i % 3, i


class Module(L.LightningModule):
    def __init__(self, out: str, bal: hetero.Balance):
        super().__init__()
        self.net, self.out, self.bal, self.seen, self.first = torch.nn.Linear(8, 3), out, bal, {}, None
        self.counts: list[list[int]] = []  # [epoch, micro-batches] per training_step

    def train_dataloader(self):
        return DataLoader(Indexed(), batch_sampler=self.bal.batch_sampler(N))

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        if self.first is None:
            self.first = {"sizes": self.bal.last_sizes, "epoch": self.current_epoch, "batch_idx": batch_idx}
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        with open(f"{self.out}.{sys.argv[3]}.rank{self.global_rank}.json", "w") as f:
            json.dump({"seen": self.seen, "first": self.first, "counts": self.counts,
                       "decisions": [d.__dict__ for d in self.bal.decisions]}, f)


class Micro(Module):
    """The accumulation recipe: one training_step is one optimizer step on this rank's micro-batches."""

    def __init__(self, *args, stop: bool = True):
        super().__init__(*args)
        self.automatic_optimization, self.stop = False, stop

    def training_step(self, dataloader_iter):
        opt, n = self.optimizers(), 0
        for (x, y, idx), _, _ in dataloader_iter:
            if self.first is None:
                self.first = {"sizes": self.bal.last_sizes, "epoch": self.current_epoch,
                              "batch_idx": self.trainer.fit_loop.epoch_loop.batch_idx}
            self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
            with self.bal.step():
                n += 1
                self.manual_backward(F.cross_entropy(self.net(x), y))
                if self.bal.sync_now:
                    opt.step()
                    opt.zero_grad()
                    if self.stop:
                        break
        self.counts.append([self.current_epoch, n])


def main(out: str, folder: Path, phase: str, mode: str, global_batch: int) -> int:
    torch.set_num_threads(1)
    bal = hetero.Balance(scheme="dp", global_batch=global_batch, rebalance_every=2,
                         micro_batch=0 if mode == "batch" else M)
    bal.emulate(SLOW)
    if mode == "nobreak":
        bal.replay({e: np.array([[8, 24]] * (N // global_batch)) for e in range(2)})
    save = ModelCheckpoint(dirpath=folder, filename="step{step}", every_n_train_steps=11, save_top_k=-1)
    trainer = L.Trainer(max_epochs=2, max_steps=11 if phase == "first" else -1, accelerator="cpu", devices=2,
                        use_distributed_sampler=False, strategy=DDPStrategy(start_method="popen"),
                        callbacks=[hetero.BalanceCallback(bal), save], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = Module(out, bal) if mode == "batch" else Micro(out, bal, stop=mode != "nobreak")
    try:
        trainer.fit(module, ckpt_path=None if phase == "first" else str(next(folder.glob("*.ckpt"))))
    except (ValueError, hetero.HeteroError) as e:  # a setting hetero refuses: one line, on every rank
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    args = sys.argv[1:] + ["batch", "32"][len(sys.argv) - 4:] if len(sys.argv) < 6 else sys.argv[1:]
    sys.exit(main(args[0], Path(args[1]), args[2], args[3], int(args[4])))
