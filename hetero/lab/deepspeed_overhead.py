r"""The API's step over plain DeepSpeed's (part `deepspeed` of `make bench`): 2 CPU ranks (gloo,
DS_ACCELERATOR=cpu), no heterogeneity, two ZeRO-2 engines of the same model (an MLP stack), data, optimiser and
config: one attached to a Balance and fed by its sampler, one fed by a DistributedSampler, in the same processes,
taking turns step by step (which goes first alternates), so load from elsewhere falls on both alike.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node=2 -m hetero.lab.deepspeed_overhead \
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

REBALANCE_EVERY = 10  # as the DDP and FSDP2 pairs: the decisions' gathers are part of the cost
DIM, BLOCKS, STAGE = 128, 4, 2


def worker(out: Path, subset: int, global_batch: int, epochs: int, seed: int = 0) -> None:
    """Run by torchrun: hetero's DeepSpeed loop and plain DeepSpeed's, interleaved step by step; rank 0 writes their
    step times (s) to `out` as JSON."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ..core.balance import Balance
    from ..trainer.dist import setup, teardown

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference's op: no compile (docs/deepspeed.md)
    world = setup(["cpu"] * int(os.environ.get("WORLD_SIZE", 1)), "gloo", 300)
    ok = False
    try:
        gen = torch.Generator().manual_seed(seed)
        ds = TensorDataset(torch.randn(subset, DIM, generator=gen), torch.randint(0, 10, (subset,), generator=gen))
        config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": global_batch // world.size,
                  "gradient_accumulation_steps": 1, "zero_optimization": {"stage": STAGE},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0, "steps_per_print": 10**9}

        def engine():
            torch.manual_seed(seed)
            m = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
                                for _ in range(BLOCKS)], nn.Linear(DIM, 10))
            e, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                                         config=config)
            return e

        loops = {}
        for kind in ("api", "plain"):
            e = engine()
            if kind == "api":
                bal = Balance(global_batch=global_batch, scheme="edp", rebalance_every=REBALANCE_EVERY, seed=seed)
                bal.attach(e)
                loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds), seed))
            else:
                sampler = DistributedSampler(ds, shuffle=True, seed=seed, drop_last=True)
                loader = DataLoader(ds, batch_size=global_batch // world.size, sampler=sampler, drop_last=True)
            loops[kind] = (e, loader)

        def step(kind: str, batch) -> None:
            e, _ = loops[kind]
            with bal.step() if kind == "api" else nullcontext():
                e.backward(F.cross_entropy(e(batch[0]), batch[1]))
                e.step()

        def epoch_s(epoch: int) -> dict[str, list[float]]:
            bal.set_epoch(epoch)
            loops["plain"][1].sampler.set_epoch(epoch)
            return turns({k: loops[k][1] for k in loops}, len(loops["api"][1]), step)

        times = [epoch_s(epoch) for epoch in range(epochs)]
        if world.is_main:
            safeio.write_text(out, json.dumps({"step_s": times, "steps": len(loops["api"][1]), "world": world.size,
                                             "api_sizes": [d.sizes for d in bal.decisions]}))
        ok = True
    finally:
        teardown(ok)


def measure(out: Path, subset: int, global_batch: int, epochs: int, notes: list[str]) -> dict | None:
    """The API's DeepSpeed step time over plain DeepSpeed's, ZeRO-2, 2 ranks (measure.pair_summary); None without
    the [deepspeed] extra (a note says so)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        notes.append("deepspeed part skipped: the [deepspeed] extra is not installed")
        return None
    res = out / "runs" / "deepspeed-overhead.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    print("bench: deepspeed-overhead", flush=True)
    launch(torchrun_cmd(2, ["--out", str(res), "--subset", str(subset), "--global-batch", str(global_batch),
                            "--epochs", str(epochs)], "hetero.lab.deepspeed_overhead"),
           out / "logs" / "deepspeed-overhead.log", 900, {**clean_env(threads="1"), "DS_ACCELERATOR": "cpu"},
           done=res, notes=notes)
    d = json.loads(res.read_text())
    return {"world": 2, "global_batch": global_batch, "zero_stage": STAGE, **pair_summary(d["step_s"], d["steps"]),
            "rebalance_every": REBALANCE_EVERY}


def main(argv: list[str] | None = None) -> int:
    return loop_pair_main("hetero.lab.deepspeed_overhead", __doc__, worker, argv)


if __name__ == "__main__":
    sys.exit(main())
