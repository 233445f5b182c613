"""The trainer's overhead over a plain DDP loop (part of `make bench`): no heterogeneity, 2 ranks, the same model,
data tensor, batch, optimiser and DDP options, measured side by side in the same processes (README: benchmarks).

    torchrun --standalone --nproc-per-node=2 -m hetero.overhead --out FILE --subset N --global-batch B --epochs E
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .config import CliParser
from .launch import clean_env, torchrun_cmd
from .measure import launch


def worker(out: Path, subset: int, global_batch: int, epochs: int, seed: int = 0) -> None:
    """Run by torchrun: the trainer's epoch loop and a plain DDP loop over the same model, data and options, taking
    turns epoch by epoch in the same processes; rank 0 writes their epoch times (s) to `out` as JSON."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from .config import Config
    from .data import load_data
    from .dist import setup, teardown, wrap_ddp
    from .models import build_model
    from .train import Trainer

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
        b, steps = global_batch // world.world, len(data.train_y) // global_batch

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

        def trainer_epoch(epoch: int) -> float:
            bar = tqdm(total=steps, leave=False, file=sys.stderr) if world.is_main else None  # as Trainer.fit
            r = trainer.train_epoch(epoch, bar)
            if bar is not None:
                bar.close()
            return r["train_s"]

        epoch_s: dict[str, list[float]] = {"trainer": [], "plain": []}
        for epoch in range(1, epochs + 1):
            for kind in (("trainer", "plain") if epoch % 2 else ("plain", "trainer")):
                epoch_s[kind].append(trainer_epoch(epoch) if kind == "trainer" else plain_epoch(epoch))
        if world.is_main:
            out.write_text(json.dumps({"epoch_s": epoch_s, "steps": steps, "world": world.world}))
        ok = True
    finally:
        teardown(ok)


def measure(out: Path, repeats: int, subset: int, global_batch: int, epochs: int, notes: list[str]) -> dict:
    """Trainer step time over the plain loop's, for 2 ranks: the median over the back-to-back epoch pairs after each
    launch's first (slow changes of load cancel), with the medians, minima and pair ratios."""
    world, ratios, step_s = 2, [], {"trainer": [], "plain": []}
    for r in range(repeats):
        name = f"overhead-{r}"
        print(f"bench: {name}", flush=True)
        res = out / "runs" / f"{name}.json"
        res.parent.mkdir(parents=True, exist_ok=True)
        launch(torchrun_cmd(world, ["--out", str(res), "--subset", str(subset), "--global-batch", str(global_batch),
                                    "--epochs", str(epochs)], "hetero.overhead"),
               out / "logs" / f"{name}.log", 900, clean_env(threads="1"), done=res, notes=notes)
        d = json.loads(res.read_text())
        tr, pl = (np.array(d["epoch_s"][k][1:]) / d["steps"] for k in ("trainer", "plain"))
        ratios += (tr / pl).tolist()
        step_s["trainer"] += tr.tolist()
        step_s["plain"] += pl.tolist()
    med = {k: float(np.median(v)) for k, v in step_s.items()}
    return {"world": world, "global_batch": global_batch, "ratio": float(np.median(ratios)),
            "ratio_of_medians": med["trainer"] / med["plain"],
            "ratio_of_minima": min(step_s["trainer"]) / min(step_s["plain"]), "trainer_step_s": med["trainer"],
            "plain_step_s": med["plain"], "extra_ms_per_step": 1e3 * (med["trainer"] - med["plain"]),
            "pair_ratios": ratios, "step_s": step_s}


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog="python -m hetero.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the epoch times (rank 0 writes it)")
    p.add_argument("--subset", type=int, required=True, help="synthetic training samples")
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True, help="epochs of each loop, taken in turn; the first warms up")
    ns = p.parse_args(argv)
    if ns.epochs < 2 or ns.global_batch < 2 or ns.subset < ns.global_batch:
        p.error("need --epochs >= 2, --global-batch >= 2 and --subset >= --global-batch")
    worker(Path(ns.out), ns.subset, ns.global_batch, ns.epochs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
