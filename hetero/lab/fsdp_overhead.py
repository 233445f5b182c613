r"""The API's step over plain FSDP2's (part `fsdp` of `make bench`): 2 CPU ranks, no heterogeneity, the same model
(an MLP stack, each block and the root fully_shard'ed), data, optimiser and DataLoader settings, in the same
processes, taking turns step by step (which goes first alternates), so load from elsewhere falls on both alike.

    torchrun --standalone --nproc-per-node=2 -m hetero.lab.fsdp_overhead \
        --out FILE --subset N --global-batch B --epochs E
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from ..core import safeio
from .launch import clean_env, torchrun_cmd
from .measure import launch, loop_pair_main, pair_summary, turns

REBALANCE_EVERY = 10  # as the DDP API pair (overhead.py): the decisions' gathers are part of the cost
DIM, BLOCKS = 128, 4


def worker(out: Path, subset: int, global_batch: int, epochs: int, seed: int = 0) -> None:
    """Run by torchrun: hetero's FSDP2 loop and plain FSDP2's, interleaved step by step; rank 0 writes their epoch
    times (s) to `out` as JSON."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ..core.balance import Balance
    from ..trainer.dist import setup, teardown

    torch.set_num_threads(1)
    world = setup(["cpu"] * int(os.environ.get("WORLD_SIZE", 1)), "gloo", 300)
    ok = False
    try:
        gen = torch.Generator().manual_seed(seed)
        ds = TensorDataset(torch.randn(subset, DIM, generator=gen), torch.randint(0, 10, (subset,), generator=gen))

        def model() -> nn.Module:
            torch.manual_seed(seed)
            m = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
                                for _ in range(BLOCKS)], nn.Linear(DIM, 10))
            for block in m[:BLOCKS]:
                fully_shard(block)
            return fully_shard(m)

        loops = {}
        for kind in ("api", "plain"):
            m = model()
            if kind == "api":
                bal = Balance(global_batch=global_batch, scheme="edp", rebalance_every=REBALANCE_EVERY, seed=seed)
                bal.attach(m)
                loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds), seed))
            else:
                sampler = DistributedSampler(ds, shuffle=True, seed=seed, drop_last=True)
                loader = DataLoader(ds, batch_size=global_batch // world.size, sampler=sampler, drop_last=True)
            loops[kind] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3), loader)

        def step(kind: str, batch) -> None:
            m, o, _ = loops[kind]
            with bal.step() if kind == "api" else nullcontext():
                F.cross_entropy(m(batch[0]), batch[1]).backward()
                o.step()
                o.zero_grad(set_to_none=True)

        def epoch_s(epoch: int) -> dict[str, list[float]]:
            bal.set_epoch(epoch)
            loops["plain"][2].sampler.set_epoch(epoch)
            return turns({k: loops[k][2] for k in loops}, len(loops["api"][2]), step)

        times = [epoch_s(epoch) for epoch in range(epochs)]
        if world.is_main:
            safeio.write_text(out, json.dumps({"step_s": times, "steps": len(loops["api"][2]), "world": world.size,
                                             "api_sizes": [d.sizes for d in bal.decisions]}))
        ok = True
    finally:
        teardown(ok)


def measure(out: Path, subset: int, global_batch: int, epochs: int, notes: list[str]) -> dict:
    """The API's FSDP2 step time over plain FSDP2's, 2 ranks: the median ratio of back-to-back steps after the first
    epoch (slow changes of load cancel), and the ratio of the median step times."""
    res = out / "runs" / "fsdp-overhead.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    print("bench: fsdp-overhead", flush=True)
    launch(torchrun_cmd(2, ["--out", str(res), "--subset", str(subset), "--global-batch", str(global_batch),
                            "--epochs", str(epochs)], "hetero.lab.fsdp_overhead"),
           out / "logs" / "fsdp-overhead.log", 900, clean_env(threads="1"), done=res, notes=notes)
    d = json.loads(res.read_text())
    return {"world": 2, "global_batch": global_batch, **pair_summary(d["step_s"], d["steps"]),
            "rebalance_every": REBALANCE_EVERY}


def main(argv: list[str] | None = None) -> int:
    return loop_pair_main("hetero.lab.fsdp_overhead", __doc__, worker, argv)


if __name__ == "__main__":
    sys.exit(main())
