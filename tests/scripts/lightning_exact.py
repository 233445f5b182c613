"""One optimizer step of a Lightning fit with unequal per-rank work, against one process on the union of its
samples. `python lightning_exact.py OUT CASE [CASE ...]`, each CASE STRATEGY:MODE[:BREAK]: Lightning's own launcher,
2 CPU processes (gloo), every case a fit of its own in the same two processes (one launch, many checks; the second
fit finds LOCAL_RANK set by the first launch and the process group formed, as Lightning means it to).

STRATEGY: ddp (DDPStrategy) or fsdp (ModelParallelStrategy, fully_shard in configure_model).
MODE: micro (micro_batch 4, replayed counts k = [1, 3], manual optimisation: each batch in `with bal.step():`),
      batch (no micro_batch, replayed sizes [3, 13], automatic optimisation), or tokens (documents of 1-64 tokens,
      Balance(collator="padded", loss_mean="tokens"): each step split by the lengths, a token-mean loss, automatic
      optimisation; tests/tokenlm.py), or budget (the same documents, Balance(token_budget=BUDGET,
      collator="padded"): steps of 7-10 documents, a sample-mean loss), or decide (tokens over the epoch's 2 steps,
      rank 1 20 ms a step slower, a decision every step: its decisions are recorded).
BREAK (negative controls): double (this rank's weight doubled), remove (scheme "sync": the mean of the ranks'
      means, no b_i/B weighting), equal (counts [2, 2] instead of [1, 3]), tp (ModelParallelStrategy with
      tensor_parallel_size 2: refused in one line); with decide, replay (bal.replay of the decisions of this launch's
      decide case, through JSON) and swapped (the same with the ranks' fitted costs swapped).
Each rank writes the indices of every batch it trained on, the parameters after the fit and its decisions to
OUT.STRATEGY-MODE-BREAK.rankR.json (BREAK "ok" when none); a refusal is one line on stderr and exit status 2, and
ends the launch.
"""
import dataclasses
import json
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import hetero

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the variable-length model of tokenlm.py
import tokenlm  # noqa: E402

N, B, M, LR = 32, 16, 4, 0.5  # 2 steps per epoch of the global batch 16; one is trained
BUDGET = 360  # the 1,095 tokens in 4 steps
LENGTHS, TOKENS, LABELS = tokenlm.corpus(N, longest=64)
COUNTED = np.array([int((y != tokenlm.IGNORE).sum()) for y in LABELS])
RECORD: list[dict] = []  # the decisions of this launch's decide case, for its replay


def net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


X = torch.randn(N, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))


class Indexed(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return X[i], Y[i], i


class Module(L.LightningModule):
    def __init__(self, bal: hetero.Balance, out: str, strategy: str, mode: str, broken: str):
        super().__init__()
        self.net, self.bal, self.out, self.strategy, self.mode, self.broken = net(), bal, out, strategy, mode, broken
        self.batches: list[list[int]] = []

    def configure_model(self):  # ModelParallelStrategy: shard over the data-parallel mesh (the whole world)
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):  # automatic optimisation: this rank's b_i samples
        x, y, idx = batch
        self._double()
        self.batches.append(idx.tolist())
        return F.cross_entropy(self.net(x), y)

    def _double(self):
        step = self.bal.engine.running()
        if self.broken == "double" and step.left == step.expected:  # once per step, before its backward
            self.bal.set_weight(2 * step.weight)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_train_end(self):
        params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                  for p in self.net.parameters()]
        with open(f"{self.out}.rank{self.global_rank}.json", "w") as f:
            json.dump({"batches": self.batches, "params": params,
                       "decisions": [dataclasses.asdict(d) for d in self.bal.decisions]}, f)


class Tokens(Module):
    """Split by tokens: this rank's documents padded, a token-mean loss (the engine weighs n_i / N); under a token
    budget a sample-mean loss (b_i over the step's own count)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.net = tokenlm.PrefixLM()

    def training_step(self, batch, batch_idx):
        idx, docs = batch
        self.batches.append(idx)
        return tokenlm.loss(self.net, docs, "samples" if self.mode == "budget" else "tokens", len(idx))

    def on_train_end(self):
        super().on_train_end()
        if self.mode == "decide" and not self.broken:
            RECORD[:] = [dataclasses.asdict(d) for d in self.bal.decisions]


class Micro(Module):
    """Per-rank accumulation: manual optimisation, Lightning's dataloader_iter, each micro-batch in bal.step()."""

    def __init__(self, *args):
        super().__init__(*args)
        self.automatic_optimization = False

    def training_step(self, dataloader_iter):
        opt = self.optimizers()
        for (x, y, idx), _, _ in dataloader_iter:  # this rank's micro-batches, up to the step's last
            self.batches.append(idx.tolist())
            with self.bal.step():  # all but the step's last stay local (no_sync)
                self._double()
                self.manual_backward(F.cross_entropy(self.net(x), y))
                if self.bal.sync_now:
                    opt.step()
                    opt.zero_grad()
                    break


def fit(out: str, strategy: str, mode: str, broken: str) -> None:
    """One case: one optimizer step of a fit, recorded under OUT.STRATEGY-MODE-BREAK."""
    out = f"{out}.{strategy}-{mode}-{broken or 'ok'}"
    micro, tokens, decide = mode == "micro", mode in ("tokens", "budget", "decide"), mode == "decide"
    sizes = [8, 8] if broken == "equal" else [M, B - M] if micro else [3, B - 3]
    by = {"collator": "padded", "loss_mean": "tokens"} if mode == "tokens" else \
        {"collator": "padded", "token_budget": BUDGET, "global_batch": None} if mode == "budget" else \
        {"collator": "padded", "loss_mean": "tokens", "rebalance_every": 1} if decide else {}
    bal = hetero.Balance(**{"scheme": "sync" if broken == "remove" else "edp", "global_batch": B,
                            "micro_batch": M if micro else 0, **by})
    if not tokens:
        bal.replay({0: np.array([sizes] * (N // B))})
    if decide:
        bal.emulate("1:delay=0.02")  # rank 1 slower per step: the fitted costs move the split
        if broken:
            record = RECORD if broken == "replay" else [
                {**d, "fixed_s": d["fixed_s"][::-1], "per_unit_s": d["per_unit_s"][::-1]} for d in RECORD]
            bal.replay(json.loads(json.dumps(record)))  # as a run's decisions come back from a JSON file
    if strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strat = ModelParallelStrategy(data_parallel_size=1 if broken == "tp" else 2,
                                      tensor_parallel_size=2 if broken == "tp" else 1)
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strat = DDPStrategy(start_method="popen")
    trainer = L.Trainer(max_steps=N // B if decide else 1, accelerator="cpu", devices=2, strategy=strat,
                        use_distributed_sampler=False,
                        callbacks=[hetero.BalanceCallback(bal)], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    if tokens:
        counted = None if mode == "budget" else COUNTED
        loader = DataLoader(range(N), batch_sampler=bal.batch_sampler(N, lengths=LENGTHS, loss_tokens=counted),
                            collate_fn=lambda idx: (idx, tokenlm.collate(idx, TOKENS, LABELS, "padded")))
    else:
        loader = DataLoader(Indexed(), batch_sampler=bal.batch_sampler(N))
    kind = {"micro": Micro, "tokens": Tokens, "budget": Tokens, "decide": Tokens}.get(mode, Module)
    trainer.fit(kind(bal, out, strategy, mode, broken), loader)


def main(out: str, *cases: str) -> int:
    torch.set_num_threads(1)
    for case in cases:
        strategy, mode, broken = (case.split(":") + [""])[:3]
        try:
            fit(out, strategy, mode, broken)
        except (ValueError, hetero.HeteroError) as e:
            print(str(e).splitlines()[0], file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
