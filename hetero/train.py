"""The heterogeneity-aware DDP trainer. Launch with torchrun:

    torchrun --standalone --nproc-per-node=2 -m hetero.train --model tiny --data synthetic --epochs 3 \
        --scheme edp --hetero 1:slowdown=3
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=job1 -m hetero.train --model vgg16          # and --node-rank=1 on the second node
    python -m hetero.train ...                                  # a world of one, no torchrun needed

Each step every rank takes its slice of the shared permutation (sampler.py), computes its gradient, and the
DDP communication hook sums weight_i * g_i (dist.py). The balancer (balancer.py, partition.py) re-decides the batch sizes
from each rank's own compute time, measured up to the moment its gradients are ready, before any waiting.
"""
from __future__ import annotations

import gc
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import __version__
from .config import Config, ConfigError, default_run_dir, parse_args, parse_cores
from .data import DataError, DataSet, DeviceLoader, load_data
from .dist import (HookState, StepClock, World, apply_cpu_budget, average_buffers, env_world, gather_rows, setup,
                   sum_all, teardown, weighted_allreduce_hook, wrap_ddp)
from .emulator import Emulator
from .models import build_model
from .balancer import Balancer
from .memory import probe_max_batch, shared_gpus
from .partition import SCHEMES, check_feasible
from .resume import relay_cosine, resumed_config
from .runlog import DiskError, RunFolder, claim_run_dir
from .sampler import EpochPlan
from .seeding import AUGMENT, epoch_seed


class TrainingError(RuntimeError):
    """A fault during training (non-finite loss, bad replay): one clear line, the run marked failed."""


def evaluate(model: torch.nn.Module, loader: DeviceLoader, batch: int) -> torch.Tensor:
    """[loss sum, top-1 correct, top-5 correct, count] over this rank's test slice (sum over ranks for totals)."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=loader.device)
    with torch.no_grad():
        for start in range(0, len(loader), batch):
            x, y = loader.batch(torch.arange(start, min(start + batch, len(loader))))
            out = model(x).float()
            top5 = out.topk(min(5, out.shape[1]), dim=1).indices
            hit = top5 == y[:, None]
            sums += torch.stack([F.cross_entropy(out, y, reduction="sum"), hit[:, 0].sum(),
                                 hit.any(1).sum(), torch.tensor(len(y), device=out.device)]).double()
    model.train()
    return sums


def run_metadata(cfg: Config, world: World, run_dir: Path) -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    import torchvision
    ranks = [None] * world.world
    dist.all_gather_object(ranks, {"host": socket.gethostname(), "device": str(world.device),
                                   "threads": torch.get_num_threads()})
    return {"config": cfg.to_dict(), "run_dir": str(run_dir), "world_size": world.world, "backend": world.backend,
            "ranks": ranks, "host": socket.gethostname(), "git_commit": git("rev-parse", "HEAD") or "unknown",
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "versions": {"hetero": __version__, "python": platform.python_version(), "torch": torch.__version__,
                         "torchvision": torchvision.__version__, "numpy": np.__version__},
            "started": datetime.now().isoformat(timespec="seconds"),
            "torchrun": {k: os.environ[k] for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                                   "LOCAL_WORLD_SIZE") if k in os.environ}}


def load_replay(run: Path, cfg: Config, world: int) -> dict[int, np.ndarray]:
    """Recorded batch sizes {epoch: [steps, world]} of an earlier run, to train with the same partition."""
    import pandas as pd

    path = run / "steps.csv"
    if not path.exists():
        raise ConfigError(f"cannot replay {run}: it has no steps.csv")
    df = pd.read_csv(path)
    if df["rank"].nunique() != world:
        raise ConfigError(f"cannot replay {run}: it ran {df['rank'].nunique()} ranks, this run has {world}")
    out = {}
    for epoch, g in df.groupby("epoch"):
        sizes = g.pivot(index="step", columns="rank", values="batch_size").to_numpy(np.int64)
        if not np.all(sizes.sum(1) == cfg.global_batch):
            raise ConfigError(f"cannot replay {run}: its global batch is not {cfg.global_batch}")
        out[int(epoch)] = sizes
    return out


def _numpy_rng_plain(state: tuple) -> list:
    """numpy's legacy RNG state as plain lists and numbers, so the checkpoint loads with weights_only=True."""
    name, keys, pos, has_gauss, cached = state
    return [str(name), np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]


def exit_with_launcher(rank: int, poll_s: float = 1.0) -> None:
    """Under torchrun, end this worker within ~poll_s of its launcher's death, writing nothing.

    torchrun starts workers in sessions of their own, so killing the launcher's process group leaves them running,
    re-parented; they would go on writing the run folder beside a resumed job. A daemon thread notices the new
    parent. os._exit skips every handler: the folder's lock goes with the process, a temporary file it was writing
    is removed at the next start."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(f"hetero: rank {rank}: error: its launcher (pid {parent}) is gone: stopping without writing",
                      file=sys.stderr, flush=True)
                os._exit(1)
    threading.Thread(target=watch, name="hetero-launcher-watch", daemon=True).start()


def limits_text(limits: list[float] | None, world: int) -> str:
    """Per-rank maximum batch sizes as "512,-" ('-': no limit)."""
    return ",".join("-" if v == float("inf") else str(int(v)) for v in (limits or [float("inf")] * world))


class Trainer:
    def __init__(self, cfg: Config, world: World, data: DataSet, run_dir: Path, replay: dict | None):
        self.cfg, self.world, self.replay = cfg, world, replay
        self.scheme = SCHEMES[cfg.scheme]
        dev = world.device
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        model = build_model(cfg.model, len(data.classes)).to(dev, memory_format=self.memory_format)
        self.model = model
        self.autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16)
        self.train = DeviceLoader(data.train_x, data.train_y, data.mean, data.std, dev, cfg.augment,
                                  memory_format=self.memory_format)  # batches come in the model's format
        lo, hi = (len(data.test_y) * world.rank) // world.world, (len(data.test_y) * (world.rank + 1)) // world.world
        self.test = DeviceLoader(data.test_x[lo:hi], data.test_y[lo:hi], data.mean, data.std, dev, augment=False,
                                 memory_format=self.memory_format)
        self.max_batches = cfg.max_batches(world.world)
        if any(cfg.probes(r, world.world) for r in range(world.world)):
            self.max_batches = self._probe_limits(data)  # data on the device, before DDP: the bare model
        self.ddp = wrap_ddp(model, dev)
        self.hook = HookState(weight=1.0 / world.world)
        self.ddp.register_comm_hook(self.hook, weighted_allreduce_hook)
        self.opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0,
                                   weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.epochs)
        self.balancer = Balancer(self.scheme.rule, world.world, cfg.global_batch, cfg.min_batch,
                                 self.max_batches, cfg.smoothing, cfg.deadband, sit_out=cfg.sit_out)
        self.emulator = Emulator(cfg.hetero, world.rank, cfg.seed)
        self.folder = RunFolder(run_dir) if world.is_main else None
        self.epoch, self.train_time_s, self.global_step = 0, 0.0, 0
        self.history: list[dict] = []

    def _probe_limits(self, data: DataSet) -> list[float] | None:
        """Collective: GPU ranks set to `probe` find their largest batch (memory.py), all ranks gather the results
        (a failed probe as -1, so every rank stops with the same error instead of waiting on the failed one)."""
        cfg, w = self.cfg, self.world
        places = [None] * w.world
        dist.all_gather_object(places, (socket.gethostname(), str(w.device), w.gpu))
        if shared := shared_gpus(places, [cfg.probes(r, w.world) for r in range(w.world)]):
            ranks = shared[0]
            raise TrainingError(f"--max-batch probe needs a GPU of its own per rank: ranks "
                                f"{', '.join(map(str, ranks))} share {places[ranks[0]][1]} on {places[ranks[0]][0]}; "
                                f"give their --max-batch as numbers")
        own, err = float("inf"), ""
        if cfg.probes(w.rank, w.world):
            try:
                own = probe_max_batch(self.model, tuple(data.train_x.shape[1:]), len(data.classes), w.device,
                                      lo=cfg.min_batch, hi=cfg.global_batch, autocast=self.autocast,
                                      memory_format=self.memory_format)
            except RuntimeError as e:
                own, err = -1.0, str(e)
        probed = gather_rows(torch.tensor([own]), w.coll_device).flatten().tolist()
        if err:
            raise TrainingError(err)
        if failed := [r for r, v in enumerate(probed) if v < 0]:
            raise TrainingError(f"--max-batch probe failed on rank {failed[0]} (its log has the reason)")
        limits = cfg.max_batches(w.world, probed)
        try:
            check_feasible(w.world, cfg.global_batch, cfg.min_batch, limits)
        except ValueError:
            raise TrainingError(f"the largest batches per rank ({limits_text(limits, w.world)}; probed with "
                                f"--max-batch {cfg.max_batch}) hold less than the global batch {cfg.global_batch}: "
                                f"lower --global-batch or add ranks") from None
        return limits

    # -- checkpoint -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "balancer": self.balancer.state_dict(),
                "emulator": {"spec": self.cfg.hetero, "seed": self.cfg.seed}, "epoch": self.epoch,
                "train_time_s": self.train_time_s, "global_step": self.global_step, "history": self.history,
                "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_rng_plain(np.random.get_state())}}

    def load_state_dict(self, s: dict) -> None:
        self.model.load_state_dict(s["model"])
        self.opt.load_state_dict(s["optimizer"])
        self.sched.load_state_dict(s["scheduler"])
        if self.sched.T_max != self.cfg.epochs:  # --epochs changed on resume
            relay_cosine(self.opt, self.sched, s["epoch"], self.cfg.epochs)
        self.balancer.load_state_dict(s["balancer"])
        self.epoch, self.train_time_s, self.global_step = s["epoch"], s["train_time_s"], s["global_step"]
        self.history = s["history"]
        torch.set_rng_state(s["rng"]["torch"])
        name, keys, pos, has_gauss, cached = s["rng"]["numpy"]
        np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))

    # -- one epoch --------------------------------------------------------------------------------------------
    def sizes_for(self, epoch: int, step: int) -> np.ndarray:
        if self.replay is not None:  # checked up front to cover every epoch and step
            return self.replay[epoch][step]
        return self.balancer.sizes_for_step(step)

    @property
    def dynamic(self) -> bool:
        """Whether batch sizes are re-decided during the run (not for sync, not when replaying a record)."""
        return self.replay is None and self.balancer.rule != "static"

    def rebalance(self, sizes: np.ndarray, compute_s: np.ndarray) -> None:
        """Collective: every rank gathers all ranks' step compute times and runs the same pure decision."""
        times = gather_rows(torch.from_numpy(compute_s), self.world.coll_device).numpy().T  # [steps, world]
        self.balancer.observe(sizes, times)
        self.balancer.decide()

    def train_epoch(self, epoch: int, bar) -> dict:
        cfg, w, rank = self.cfg, self.world, self.world.rank
        plan = EpochPlan(len(self.train), cfg.global_batch, cfg.seed, epoch, w.device)
        self.train.seed(epoch_seed(cfg.seed, epoch, AUGMENT + rank))
        self.emulator.start_epoch(epoch)
        steps = plan.steps
        sizes = np.zeros((steps, w.world), np.int64)
        compute, wait, delay = np.zeros(steps), np.zeros(steps), np.zeros(steps)
        # Metric sums and the first non-finite step stay on the device: no host sync inside the step.
        sums = torch.zeros(2, dtype=torch.float64, device=w.device)  # loss sum, correct
        first_bad = torch.tensor(-1, device=w.device)
        clocks: list[tuple[int, StepClock]] = []

        def read_clocks() -> None:  # CUDA events are read late, so the host never waits on them per step
            for s, c in clocks:
                compute[s], wait[s] = c.read()
            clocks.clear()

        last_decision = 0
        t0 = time.perf_counter()
        for step in range(steps):
            if self.dynamic and cfg.rebalance_every and step and step % cfg.rebalance_every == 0:
                read_clocks()
                self.rebalance(sizes[last_decision:step], compute[last_decision:step])
                last_decision = step
            sizes[step] = self.sizes_for(epoch, step)
            b = int(sizes[step, rank])
            self.hook.weight = b / cfg.global_batch if self.scheme.weighted else 1.0 / w.world
            clock = StepClock(w.device)
            self.hook.clock = clock
            self.hook.on_ready = self._delay_hook(epoch, step, clock, delay) if self.emulator.effects and b else None
            clock.mark("start")
            # A rank sitting out (batch 0) still joins the all-reduce: DDP needs its backward. It computes two
            # borrowed samples with the loss scaled to zero, and its gradient weight is 0.
            idx = plan.indices(step, sizes[step], rank) if b else plan.indices(step, sizes[step], 0)[:2]
            x, y = self.train.batch(idx)
            with self.autocast:
                out = self.ddp(x.contiguous(memory_format=self.memory_format))  # a no-op: the loader's format
                loss = F.cross_entropy(out.float(), y) * (1.0 if b else 0.0)
            loss.backward()
            clock.mark("returned")
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                sums += torch.stack([loss.detach().double() * b, (out.argmax(1) == y).sum().double() * (b > 0)])
                first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss.detach()),
                                        torch.full_like(first_bad, step), first_bad)
            clock.mark("end")
            clocks.append((step, clock))
            self.global_step += 1
            if bar is not None:
                bar.update(1)
        read_clocks()
        bad = gather_rows(first_bad.reshape(1), w.coll_device).flatten()
        if (bad >= 0).any():
            step = int(bad[bad >= 0].min())
            kept = f"epochs 1..{epoch - 1} and their checkpoint are kept" if epoch > 1 else "no epoch had completed"
            raise TrainingError(f"non-finite loss at epoch {epoch} step {step}: stopping (lower --lr?); {kept}")
        per_rank = gather_rows(torch.from_numpy(np.stack([compute, wait, delay])), w.coll_device).numpy()
        if self.dynamic:
            self.balancer.observe(sizes[last_decision:], per_rank[:, 0, last_decision:].T)
            self.balancer.decide()
        train_s = time.perf_counter() - t0
        count = torch.tensor([float(sizes[:, rank].sum())], dtype=torch.float64, device=w.device)
        totals = sum_all(torch.cat([sums, count]), w.coll_device)
        return {"sizes": sizes, "per_rank": per_rank, "train_s": train_s,
                "train_loss": float(totals[0] / totals[2]), "train_top1": float(totals[1] / totals[2])}

    def _delay_hook(self, epoch: int, step: int, clock: StepClock, delay: np.ndarray):
        """The emulated slow rank's extra time, spent when its gradients are ready (records delay[step], s).

        On CUDA the host runs ahead of the GPU: a sleep while this rank's kernels are still queued would overlap
        them and be lost. So the host first waits for the compute stream (clock.wait_device: an event, not a
        device-wide synchronise, which would also wait for NCCL); the `ready` mark, recorded after the sleep,
        then counts the delay as compute on CUDA as on the CPU."""
        def on_ready() -> None:
            waited = self.emulator.needs_compute_time
            own = clock.host_elapsed_s() if waited else 0.0  # slowdown: waits for the device to measure
            d = self.emulator.delay_s(epoch, self.global_step, own)
            delay[step] = d
            if d > 0:
                if not waited:
                    clock.wait_device()
                time.sleep(d)
        return on_ready

    # -- the run ----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, w = self.cfg, self.world
        from tqdm import tqdm

        while self.epoch < cfg.epochs:
            epoch = self.epoch + 1
            lr = self.opt.param_groups[0]["lr"]
            steps = len(self.train) // cfg.global_batch
            # a step-by-step bar on a terminal only: in a log file each refresh is a line; the epoch line follows
            bar = tqdm(total=steps, desc=f"epoch {epoch}/{cfg.epochs}", leave=False, dynamic_ncols=True,
                       file=sys.stderr) if w.is_main and sys.stderr.isatty() else None
            r = self.train_epoch(epoch, bar)
            if bar is not None:
                bar.close()
            t_eval = time.perf_counter()
            average_buffers(self.model)
            ev = sum_all(evaluate(self.model, self.test, cfg.eval_batch), w.coll_device)
            eval_s = time.perf_counter() - t_eval
            self.sched.step()
            self.epoch, self.train_time_s = epoch, self.train_time_s + r["train_s"]
            row = self._record(epoch, r, ev, eval_s, lr)
            if w.is_main:
                self.folder.save_checkpoint(self.state_dict())
                self.folder.write_json("summary.json", self.summary("running"))
                print(self._line(row), flush=True)
        return self.summary("completed")

    def _record(self, epoch: int, r: dict, ev: torch.Tensor, eval_s: float, lr: float) -> dict:
        sizes, per_rank = r["sizes"], r["per_rank"]  # [steps, world], [world, 3, steps]
        compute_total = per_rank[:, 0].sum(1)
        row = {"epoch": epoch, "train_time_s": self.train_time_s, "epoch_time_s": r["train_s"], "eval_time_s": eval_s,
               "train_loss": r["train_loss"], "train_top1": r["train_top1"],
               "test_loss": float(ev[0] / ev[3]), "test_top1": float(ev[1] / ev[3]), "test_top5": float(ev[2] / ev[3]),
               "lr": lr, "balance_eff": float(compute_total.mean() / max(compute_total.max(), 1e-12)),
               "steps": len(sizes), "samples": int(sizes.sum()), "global_batch": self.cfg.global_batch}
        self.history.append(row)
        if self.folder is None:
            return row
        ranks = [{"epoch": epoch, "rank": i, "share": float(sizes[:, i].mean() / self.cfg.global_batch),
                  "batch_size": int(sizes[-1, i]), "steps": len(sizes), "samples": int(sizes[:, i].sum()),
                  "compute_s": float(per_rank[i, 0].sum()), "wait_s": float(per_rank[i, 1].sum()),
                  "delay_s": float(per_rank[i, 2].sum())}
                 for i in range(self.world.world)]
        steps = [{"epoch": epoch, "step": s, "rank": i, "batch_size": int(sizes[s, i]),
                  "compute_s": float(per_rank[i, 0, s]), "wait_s": float(per_rank[i, 1, s]),
                  "delay_s": float(per_rank[i, 2, s])}
                 for s in range(len(sizes)) for i in range(self.world.world)]
        self.folder.append("epochs", [row])
        self.folder.append("ranks", ranks)
        self.folder.append("steps", steps)
        row["shares"] = [d["share"] for d in ranks]
        return row

    def _line(self, row: dict) -> str:
        shares = "/".join(f"{s:.2f}" for s in row["shares"])
        return (f"epoch {row['epoch']:>3}/{self.cfg.epochs} | train loss {row['train_loss']:.3f} "
                f"top1 {100 * row['train_top1']:5.1f}% | test loss {row['test_loss']:.3f} "
                f"top1 {100 * row['test_top1']:5.1f}% top5 {100 * row['test_top5']:5.1f}% | "
                f"{row['epoch_time_s']:.1f} s (+{row['eval_time_s']:.1f} s eval) | shares {shares} | "
                f"balance {row['balance_eff']:.2f}")

    def summary(self, status: str, error: str = "") -> dict:
        h = self.history
        return {"status": status, "error": error, "scheme": self.cfg.scheme, "model": self.cfg.model,
                "hetero": self.cfg.hetero, "world_size": self.world.world, "epochs_completed": self.epoch,
                "epochs": self.cfg.epochs, "train_time_s": self.train_time_s,
                "final_test_top1": h[-1]["test_top1"] if h else None,
                "best_test_top1": max(r["test_top1"] for r in h) if h else None,
                "final_test_loss": h[-1]["test_loss"] if h else None,
                "mean_balance_eff": float(np.mean([r["balance_eff"] for r in h])) if h else None}


def resolve_run_dir(cfg: Config) -> tuple[Config, bool]:
    """The run folder and whether to resume: explicit, or after a torchrun restart the same one again."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    run_dir = cfg.resume or cfg.run_dir
    if not run_dir:
        if run_id and run_id != "none":  # stable over torchrun restarts and the same on every node
            run_dir = str(Path("runs") / f"{cfg.model}-{cfg.scheme}-{run_id[:12]}")
        else:
            run_dir = str(default_run_dir(cfg, datetime.now().strftime("%Y%m%d-%H%M%S")))
    has_checkpoint = (Path(run_dir) / "checkpoint.pt").exists()
    resume = bool(cfg.resume) or (restarted and has_checkpoint)
    # a restart before the first checkpoint starts the run again in its own folder
    overwrite = cfg.overwrite or (restarted and not has_checkpoint)
    return Config(**{**cfg.to_dict(), "run_dir": run_dir, "overwrite": overwrite and not resume}), resume


# A rank other than its node's local rank 0 that fails a check waits this long (s) before exiting, since torchrun
# stops every worker as soon as one exits: the speaker, slower to import, would be stopped before it printed.
QUIET_WAIT_S = 60.0


def main(argv: list[str] | None = None) -> int:
    rank, world_size, local_rank = env_world()
    # Every rank checks the same things; one per node says so (the nodes' consoles are apart), before any group.
    say = (lambda msg: print(f"hetero: error: {msg}", file=sys.stderr, flush=True)) if local_rank == 0 \
        else (lambda m: None)
    lock = None  # rank 0's hold on the run folder (runlog.claim_run_dir), kept until this process ends
    try:
        cfg, ns = parse_args(argv)
        if cfg.resume:  # continue with the recorded configuration
            cfg = resumed_config(cfg, ns.given, world_size)
        cfg.check_world(world_size)
        first = rank - local_rank  # this node's ranks (under --check: LOCAL_WORLD_SIZE, else the whole world)
        cfg.check_host(range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", world_size))), world_size)
        cfg, resume = resolve_run_dir(cfg)
        saved_state = None
        if rank == 0:  # the folder's lock before anything is written into it; held until this process ends
            lock = claim_run_dir(Path(cfg.run_dir), resume, cfg.overwrite)
            if resume:  # loaded and checked now, so a bad checkpoint fails in one line before any process group
                saved_state = RunFolder(Path(cfg.run_dir)).load_trainer_checkpoint()
        data = load_data(cfg.data, cfg.data_dir, cfg.subset, cfg.test_subset)
        if cfg.global_batch > len(data.train_y):
            raise ConfigError(f"global batch {cfg.global_batch} exceeds the {len(data.train_y)} training samples")
        replay = load_replay(Path(cfg.replay), cfg, world_size) if cfg.replay else None
        steps = len(data.train_y) // cfg.global_batch
        missing = [e for e in range(1, cfg.epochs + 1) if replay is not None and len(replay.get(e, [])) != steps]
        if missing:
            raise ConfigError(f"cannot replay {cfg.replay}: it has no record of {steps} steps for epoch {missing[0]}")
        if ns.check:
            if lock is not None:
                lock.release(discard=True)  # a check leaves no empty folder behind
            return 0
    except (ConfigError, DataError) as e:
        if lock is not None:
            lock.release(discard=True)
        if local_rank != 0:  # the node's speaker fails the same check: let it print before torchrun stops it
            time.sleep(QUIET_WAIT_S)
            print(f"hetero: error: rank {rank}: {e}", file=sys.stderr, flush=True)  # it did not: say it here
        say(e)
        return 2
    device = cfg.for_rank("device", rank, world_size)
    own_cores = cfg.for_rank("affinity", rank, world_size) if cfg.affinity else ""
    cores = parse_cores(own_cores) if own_cores else None
    try:
        apply_cpu_budget(int(cfg.for_rank("threads", rank, world_size)), cores, device)
    except OSError as e:
        say(f"--affinity {cfg.affinity!r}: cannot pin rank {rank} to cores {sorted(cores)} ({e.strerror})")
        return 2

    def on_term(signum, frame):  # torchrun stops the other workers with SIGTERM when one dies
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(f"stopped by signal {signum} (another worker failed or the job was cancelled)")
    signal.signal(signal.SIGTERM, on_term)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_launcher(rank)

    trainer, ok, started = None, False, False
    try:
        try:
            world = setup([cfg.for_rank("device", r, world_size) for r in range(world_size)], cfg.backend,
                          cfg.timeout_s)
        except ConfigError as e:  # the backend cannot work where the ranks are: the same on every rank
            say(e)
            return 2
        run_dir = Path(cfg.run_dir)
        trainer = Trainer(cfg, world, data, run_dir, replay)
        if resume:
            state = [saved_state]
            dist.broadcast_object_list(state, src=0)
            trainer.load_state_dict(state[0])
            del saved_state, state
        meta = run_metadata(cfg, world, run_dir)
        limits = trainer.max_batches
        meta["max_batches"] = None if limits is None else [None if v == float("inf") else int(v) for v in limits]
        if world.is_main:
            if "probe" in cfg.max_batch:
                print(f"hetero: largest batch per rank (--max-batch {cfg.max_batch}): "
                      f"{limits_text(limits, world.world)} ('-': no limit; CPU ranks are not probed)", flush=True)
            trainer.folder.start(meta, trainer.epoch if resume else None, cfg.overwrite)
            started = True  # from here on a failure is this job's to record in the folder
            print(f"hetero: {cfg.model} {cfg.scheme} on {world.world} rank(s) ({world.backend}), run folder "
                  f"{run_dir}" + (f", resuming after epoch {trainer.epoch}" if resume else ""), flush=True)
        summary = trainer.fit()
        if world.is_main:
            trainer.folder.write_json("summary.json", summary)
            print(f"hetero: done in {summary['train_time_s']:.1f} s of training; final test top-1 "
                  f"{100 * summary['final_test_top1']:.2f}%; {run_dir}", flush=True)
        ok = True
        return 0
    except BaseException as e:  # noqa: BLE001 - mark the run failed whatever stopped it, then re-raise or exit
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        msg = str(e) if isinstance(e, (TrainingError, SystemExit, DiskError)) else f"{type(e).__name__}: {e}"
        if started and trainer is not None and trainer.folder is not None:  # rank 0, holding the lock
            try:
                trainer.folder.write_json("summary.json", trainer.summary("failed", msg))
            except DiskError:
                pass  # no room even for the summary: readers show the run as interrupted once this job is gone
        print(f"hetero: rank {rank}: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr,
              flush=True)
        return 1
    finally:
        del trainer  # DDP's reducer and hook futures go before the process group they use
        gc.collect()
        teardown(ok)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: a communication thread still being torn down there can abort the process
    # ("terminate called without an active exception") after all work is done and the group destroyed.
    os._exit(code)
