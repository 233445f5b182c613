"""Overheads over plain DDP (part of `make bench`): no heterogeneity, 2 ranks, the same model, batch, optimiser and
DDP options, measured side by side in the same processes (docs/benchmarks.md). Two pairs: the built-in trainer
against a plain loop over the same data tensor, and the public API (hetero.Balance, edp, rebalancing every
REBALANCE_EVERY steps) against plain DDP through the same DataLoader (a DistributedSampler there). Inside the API's
loop, the read-out (hetero.core.metrics) is called on every other step, so steps with and without it interleave.

    torchrun --standalone --nproc-per-node=2 -m hetero.lab.overhead --out FILE --subset N --global-batch B --epochs E
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..core import safeio
from .launch import clean_env, torchrun_cmd
from .measure import launch, loop_pair_main

REBALANCE_EVERY = 10  # the API loop's decision interval: its overhead includes the decisions' gathers
KINDS = ("trainer", "plain", "api", "ddp_loader")


def worker(out: Path, subset: int, global_batch: int, epochs: int, seed: int = 0) -> None:
    """Run by torchrun: the trainer's epoch loop and a plain DDP loop over the same model, data and options, taking
    turns epoch by epoch, then the API's loop and plain DDP over the same DataLoader, taking turns step by step, in
    the same processes; rank 0 writes their epoch times (s) to `out` as JSON."""
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from tqdm import tqdm

    from ..core.balance import Balance
    from ..core.metrics import metrics
    from ..trainer.config import Config
    from ..trainer.data import load_data
    from ..trainer.dist import setup, teardown, wrap_ddp
    from ..trainer.loop import Trainer
    from ..trainer.models import build_model

    torch.set_num_threads(1)
    cfg = Config(model="tiny", data="synthetic", subset=subset, global_batch=global_batch, epochs=epochs,
                 scheme="sync", augment=False, threads="1", seed=seed, run_dir=str(out.with_suffix("")))
    world = setup(["cpu"] * int(os.environ.get("WORLD_SIZE", 1)), "gloo", cfg.timeout_s)
    ok = False
    try:
        data = load_data(cfg.data, cfg.data_dir, subset)
        trainer = Trainer(cfg, world, data, Path(cfg.run_dir), None)
        mean = torch.tensor(data.mean).view(1, -1, 1, 1) * 255
        std = torch.tensor(data.std).view(1, -1, 1, 1) * 255
        torch.manual_seed(seed)
        model = wrap_ddp(build_model(cfg.model, len(data.classes)), torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=True,
                              weight_decay=cfg.weight_decay)
        b, steps = global_batch // world.size, len(data.train_y) // global_batch

        def plain_epoch(epoch: int) -> float:
            perm = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(seed + epoch))
            t0 = time.perf_counter()
            for step in range(steps):
                idx = perm[step * global_batch + world.rank * b:][:b]
                loss = F.cross_entropy(model((data.train_x[idx].float() - mean) / std), data.train_y[idx])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        # The API against plain DDP: the same normalised tensors through the same DataLoader settings.
        ds = TensorDataset((data.train_x.float() - mean) / std, data.train_y)
        loops = {}
        for kind in ("api", "ddp_loader"):
            torch.manual_seed(seed)
            m = wrap_ddp(build_model(cfg.model, len(data.classes)), torch.device("cpu"))
            o = torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=True,
                                weight_decay=cfg.weight_decay)
            if kind == "api":
                bal = Balance(global_batch=global_batch, scheme="edp", rebalance_every=REBALANCE_EVERY, seed=seed)
                bal.attach(m)
                loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds), seed))
            else:
                sampler = DistributedSampler(ds, shuffle=True, seed=seed, drop_last=True)
                loader = DataLoader(ds, batch_size=b, sampler=sampler, drop_last=True)
            loops[kind] = (m, o, loader)

        def loader_epochs(epoch: int) -> tuple[float, float]:
            """One epoch of each DataLoader loop, interleaved step by step (which goes first alternates), so load
            from elsewhere falls on both alike; returns (api, ddp_loader) epoch seconds, batch fetches included."""
            bal.set_epoch(epoch)
            loops["ddp_loader"][2].sampler.set_epoch(epoch)
            its = {k: iter(loops[k][2]) for k in ("api", "ddp_loader")}
            spent = {"api": 0.0, "ddp_loader": 0.0}
            for step in range(len(loops["api"][2])):
                for kind in (("api", "ddp_loader") if step % 2 else ("ddp_loader", "api")):
                    m, o, _ = loops[kind]
                    t0 = time.perf_counter()
                    x, y = next(its[kind])
                    with bal.step() if kind == "api" else nullcontext():
                        F.cross_entropy(m(x), y).backward()
                        o.step()
                        o.zero_grad(set_to_none=True)
                    read = kind == "api" and (step // 2) % 2  # two with, two without: each in either order
                    call_s = 0.0
                    if read:  # the read-out, as a logger calls it after a step
                        t1 = time.perf_counter()
                        metrics(bal)
                        call_s = time.perf_counter() - t1
                        read_s["call_s"].append(call_s)
                    spent[kind] += time.perf_counter() - t0 - call_s  # the API's own ratio leaves the call out
                    if kind == "api" and epoch > 1:
                        read_s["with_s" if read else "without_s"].append(time.perf_counter() - t0)
            return spent["api"], spent["ddp_loader"]

        def trainer_epoch(epoch: int) -> float:
            bar = tqdm(total=steps, leave=False, file=sys.stderr) if world.is_main else None  # as Trainer.fit
            r = trainer.train_epoch(epoch, bar)
            if bar is not None:
                bar.close()
            return r.train_s

        run = {"trainer": trainer_epoch, "plain": plain_epoch}
        read_s: dict[str, list[float]] = {"with_s": [], "without_s": [], "call_s": []}  # API steps, epoch 1 left out
        epoch_s: dict[str, list[float]] = {k: [] for k in KINDS}
        for epoch in range(1, epochs + 1):
            for kind in (("trainer", "plain") if epoch % 2 else ("plain", "trainer")):  # back to back, in turn
                epoch_s[kind].append(run[kind](epoch))
            api_s, ddp_s = loader_epochs(epoch)
            epoch_s["api"].append(api_s)
            epoch_s["ddp_loader"].append(ddp_s)
        if world.is_main:
            safeio.write_text(out, json.dumps({"epoch_s": epoch_s, "steps": steps, "world": world.size,
                                               "api_sizes": [d.sizes for d in bal.decisions],
                                               "metrics": read_s}))
        ok = True
    finally:
        teardown(ok)


def measure(out: Path, repeats: int, subset: int, global_batch: int, epochs: int, notes: list[str]) -> dict:
    """Trainer step time over the plain loop's, for 2 ranks: the median over the back-to-back epoch pairs after each
    launch's first (slow changes of load cancel), with the medians, minima and pair ratios; and the same for the
    API's step over plain DDP's through the same DataLoader (api_*); and the API's steps that call the read-out
    (metrics(bal)) over those that do not, interleaved, with the call's own median time (metrics_*)."""
    world, ratios, api_ratios, step_s = 2, [], [], {k: [] for k in KINDS}
    read_s: dict[str, list[float]] = {"with_s": [], "without_s": [], "call_s": []}
    for r in range(repeats):
        name = f"overhead-{r}"
        print(f"bench: {name}", flush=True)
        res = out / "runs" / f"{name}.json"
        res.parent.mkdir(parents=True, exist_ok=True)
        launch(torchrun_cmd(world, ["--out", str(res), "--subset", str(subset), "--global-batch", str(global_batch),
                                    "--epochs", str(epochs)], "hetero.lab.overhead"),
               out / "logs" / f"{name}.log", 900, clean_env(threads="1"), done=res, notes=notes)
        d = json.loads(res.read_text())
        per = {k: np.array(d["epoch_s"][k][1:]) / d["steps"] for k in KINDS}
        ratios += (per["trainer"] / per["plain"]).tolist()
        api_ratios += (per["api"] / per["ddp_loader"]).tolist()
        for k in KINDS:
            step_s[k] += per[k].tolist()
        for k in read_s:
            read_s[k] += d["metrics"][k]
    med = {k: float(np.median(v)) for k, v in step_s.items()}
    with_s, without_s = (float(np.median(read_s[k])) if read_s[k] else float("nan") for k in ("with_s", "without_s"))
    call_s = float(np.median(read_s["call_s"])) if read_s["call_s"] else float("nan")
    return {"world": world, "global_batch": global_batch, "ratio": float(np.median(ratios)),
            "ratio_of_medians": med["trainer"] / med["plain"],
            "ratio_of_minima": min(step_s["trainer"]) / min(step_s["plain"]), "trainer_step_s": med["trainer"],
            "plain_step_s": med["plain"], "extra_ms_per_step": 1e3 * (med["trainer"] - med["plain"]),
            "pair_ratios": ratios, "step_s": step_s, "api_ratio": float(np.median(api_ratios)),
            "api_ratio_of_medians": med["api"] / med["ddp_loader"], "api_step_s": med["api"],
            "ddp_loader_step_s": med["ddp_loader"], "api_extra_ms_per_step": 1e3 * (med["api"] - med["ddp_loader"]),
            "api_pair_ratios": api_ratios, "api_rebalance_every": REBALANCE_EVERY,
            "metrics_ratio": with_s / without_s, "metrics_call_s": call_s, "metrics_call_fraction": call_s / without_s,
            "metrics_steps": len(read_s["with_s"])}


def main(argv: list[str] | None = None) -> int:
    return loop_pair_main("hetero.lab.overhead", __doc__, worker, argv)


if __name__ == "__main__":
    sys.exit(main())
