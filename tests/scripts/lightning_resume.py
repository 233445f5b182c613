"""A Lightning fit stopped mid-epoch at a checkpoint and resumed from it: `python lightning_resume.py OUT DIR first`
trains 11 steps (epoch 0's 8 and 3 of epoch 1) and saves a checkpoint at step 11 into DIR; `... OUT DIR again`
resumes from it with trainer.fit(ckpt_path=...) and finishes epoch 1. Lightning's own launcher, 2 CPU processes,
rank 1 3x slower. Each rank writes the indices it consumed per epoch and the sizes of its first step to
OUT.PHASE.rankR.json."""
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

import hetero

N, B = 256, 32  # 8 steps per epoch


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
            json.dump({"seen": self.seen, "first": self.first}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, folder, phase = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    bal = hetero.Balance(scheme="dp", global_batch=B, rebalance_every=2)
    bal.emulate("1:slowdown=3")
    save = ModelCheckpoint(dirpath=folder, filename="step{step}", every_n_train_steps=11, save_top_k=-1)
    trainer = L.Trainer(max_epochs=2, max_steps=11 if phase == "first" else -1, accelerator="cpu", devices=2,
                        use_distributed_sampler=False, strategy=DDPStrategy(start_method="popen"),
                        callbacks=[hetero.BalanceCallback(bal), save], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(out, bal), ckpt_path=None if phase == "first" else str(next(folder.glob("*.ckpt"))))
