"""A Lightning script started as `python lightning_inside.py OUT [--spawn] [--inside]`: Lightning's own launcher on
2 CPU processes. --inside builds the Balance, its loader and the callback inside the launched processes
(train_dataloader, configure_callbacks), else before the Trainer, as most scripts do. Rank 1 is 3x slower; each
rank writes the indices it consumed per epoch and the decisions to OUT.rankR.json."""
import json
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

import hetero

N, B = 256, 32
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
    def __init__(self, out: str, bal):
        super().__init__()
        self.net, self.out, self.bal, self.seen = torch.nn.Linear(8, 3), out, bal, {}

    def _balance(self):
        if self.bal is None:  # --inside: built in this launched process
            self.bal = hetero.Balance(scheme="dp", global_batch=B, rebalance_every=2)
            self.bal.emulate(SLOW)
        return self.bal

    def train_dataloader(self):
        return DataLoader(Indexed(), batch_sampler=self._balance().batch_sampler(N))

    def configure_callbacks(self):
        return [hetero.BalanceCallback(self._balance())] if "--inside" in sys.argv else []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        with open(f"{self.out}.rank{self.global_rank}.json", "w") as f:
            json.dump({"seen": self.seen, "decisions": [d.__dict__ for d in self.bal.decisions]}, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    inside = "--inside" in sys.argv
    bal = None
    if not inside:  # built before Lightning's launcher starts the processes: the world comes in the callback's setup
        bal = hetero.Balance(scheme="dp", global_batch=B, rebalance_every=2)
        bal.emulate(SLOW)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=2, use_distributed_sampler=False,
                        strategy=DDPStrategy(start_method="spawn" if "--spawn" in sys.argv else "popen"),
                        callbacks=[] if inside else [hetero.BalanceCallback(bal)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(sys.argv[1], bal))
