"""The built-in trainer: one user of the public API (hetero.Balance), on its own on-device data path.

Read `train_epoch` top to bottom for one step: `bal.begin_step()` gives every rank's batch sizes for the step
(replayed, probed or decided), this rank cuts its slice of the epoch's shared permutation (own_samples: the
sampler's plan, on the device) from the device-resident data (data.DeviceLoader), and runs each micro-batch in
`with bal.step():` as a plain loop does: forward and backward (the Balance's DDP communication hook sums
weight_i * g_i and spends an emulated delay when the gradients are ready; with --micro-batch m the slice runs as
k_i micro-batches of m, all but the last under no_sync), the optimiser step where `bal.sync_now`, and the step's
end, which every `rebalance_every` steps and at the epoch's end gathers the compute times and decides: the new
sizes take effect at the next step (lag 0). The command-line life cycle is in run.py.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.agree import gather_rows, sum_all
from ..core.balance import Balance
from ..core.emulator import within
from ..core.records import Position
from ..core.sampler import EpochPlan
from ..core.seeding import AUGMENT, epoch_seed
from .board import Board, progress
from .checkpoint import balance_world
from .config import Config
from .data import DataSet, DeviceLoader
from .dist import World, average_buffers, wrap_ddp
from .models import build_model
from .resume import relay_cosine
from .runfolder import RunFolder


class TrainingError(RuntimeError):
    """A fault during training (non-finite loss, bad replay): one clear line, the run marked failed."""


@dataclass
class EpochResult:
    """One epoch's training, gathered from every rank: sizes [steps, world]; times [world, steps] in seconds."""
    sizes: np.ndarray
    compute_s: np.ndarray
    wait_s: np.ndarray
    delay_s: np.ndarray
    cpu_s: np.ndarray    # the CPU each rank's process was charged per step (every thread)
    train_s: float       # wall time of the epoch's steps on this rank
    train_loss: float    # sample-weighted mean over every rank
    train_top1: float
    first_step: int = 0  # the step `sizes` starts at: > 0 when the epoch began in another world (earlier rows)
    earlier: list = field(default_factory=list)  # steps.csv rows of the epoch's steps run by another world


@dataclass
class Segment:
    """Steps first_step.. of an epoch run by one world, gathered: sizes [steps, world]; times [world, steps] (s)."""
    first_step: int
    sizes: np.ndarray
    compute_s: np.ndarray
    wait_s: np.ndarray
    delay_s: np.ndarray
    cpu_s: np.ndarray

    def plain(self) -> dict:
        return {"first_step": self.first_step, "sizes": self.sizes.tolist(),
                **{k: getattr(self, k).tolist() for k in TIMES}}

    @staticmethod
    def of(d: dict) -> Segment:
        sizes = np.asarray(d["sizes"], np.int64).reshape(len(d["sizes"]), -1)
        nan = np.full((sizes.shape[1], len(sizes)), np.nan).tolist()  # a checkpoint from before cpu_s was kept
        times = [np.asarray(d.get(k, nan), float).reshape(sizes.shape[1], len(sizes)) for k in TIMES]
        return Segment(int(d["first_step"]), sizes, *times)

    def rows(self, epoch: int) -> list[dict]:
        return [{"epoch": epoch, "step": self.first_step + s, "rank": i, "batch_size": int(self.sizes[s, i]),
                 **{k: float(getattr(self, k)[i, s]) for k in TIMES}}
                for s in range(len(self.sizes)) for i in range(self.sizes.shape[1])]


TIMES = ("compute_s", "wait_s", "delay_s", "cpu_s")  # a step's times per rank, as steps.csv has them


def joined(segments: list[Segment]) -> Segment:
    """Consecutive segments of one world as one."""
    return Segment(segments[0].first_step, np.concatenate([g.sizes for g in segments]),
                   *(np.concatenate([getattr(g, k) for g in segments], axis=1) for k in TIMES))


@dataclass
class EpochRow:
    """One line of epochs.csv (and of the checkpoint's history, which also keeps the shares)."""
    epoch: int
    train_time_s: float
    epoch_time_s: float
    eval_time_s: float
    train_loss: float
    train_top1: float
    test_loss: float
    test_top1: float
    test_top5: float
    lr: float
    balance_eff: float
    steps: int
    samples: int
    global_batch: int
    shares: list[float] = field(default_factory=list)


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


def limits_text(limits: list[float] | None, world: int) -> str:
    """Per-rank maximum batch sizes as "512,-" ('-': no limit)."""
    return ",".join("-" if v == float("inf") else str(int(v)) for v in (limits or [float("inf")] * world))


def make_balance(cfg: Config, rank: int, world_size: int, replay: dict | None = None) -> Balance:
    """The run's Balance: the config's settings, its emulated slow ranks and, for a replay, the recorded sizes.
    Lag 0: the trainer cuts each step's batches when it runs it, so a decision takes effect at the next step."""
    bal = Balance(global_batch=cfg.global_batch, scheme=cfg.scheme, rebalance_every=cfg.rebalance_every,
                  smoothing=cfg.smoothing, deadband=cfg.deadband, significance=cfg.significance,
                  min_batch=cfg.min_batch, seed=cfg.seed, lag=0, sit_out=cfg.sit_out, micro_batch=cfg.micro_batch,
                  max_batch=["probe" if s.probe else None if s.max_batch == float("inf") else int(s.max_batch)
                             for s in cfg.rank_settings(world_size)])
    bal.set_world(rank, world_size)
    if spec := within(cfg.hetero, world_size):  # all of it but under an elastic restart onto fewer ranks
        bal.emulate(spec)
    if replay is not None:
        bal.replay(replay)
    return bal


def optimiser(cfg: Config, model: torch.nn.Module) -> tuple[torch.optim.SGD,
                                                          torch.optim.lr_scheduler.CosineAnnealingLR]:
    """The run's SGD and its cosine schedule over --epochs."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0,
                          weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)


def done_at(p: Position | None) -> tuple[int, int]:
    """(epochs completed, steps of the next epoch ended) at a Balance position. The trainer numbers its epochs from
    1, so a fresh Balance (epoch 0, nothing run) and None (nothing saved yet) are (0, 0)."""
    if p is None:
        return 0, 0
    return (p.epoch, 0) if p.epoch_complete else (max(p.epoch - 1, 0), p.step)


def restore(s: dict, cfg: Config, model: torch.nn.Module, opt: torch.optim.Optimizer,
            sched: torch.optim.lr_scheduler.CosineAnnealingLR, bal: Balance) -> list[EpochRow]:
    """A checkpoint in the current layout loaded into a run's parts: weights, optimiser, schedule (re-laid when
    --epochs changed), the Balance (its position is the run's), the RNGs; returns the history. The Trainer resumes
    through it, and fit.check_checkpoint runs the very same reads on CPU stand-ins before any process group."""
    model.load_state_dict(s["model"])
    opt.load_state_dict(s["optimizer"])
    sched.load_state_dict(s["scheduler"])
    part = s.get("partial")
    if part is not None:
        [Segment.of(g) for g in part["segments"]]  # noqa: B018 - a malformed record fails here, not at the end
    bal.load_state_dict(s["balance"])
    if sched.T_max != cfg.epochs:  # --epochs changed on resume
        relay_cosine(opt, sched, done_at(bal.position)[0], cfg.epochs)
    history = [EpochRow(**r) for r in s["history"]]
    torch.set_rng_state(s["rng"]["torch"])
    name, keys, pos, has_gauss, cached = s["rng"]["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))
    return history


def own_samples(plan: EpochPlan, step: int, sizes: np.ndarray, rank: int) -> tuple[torch.Tensor, float]:
    """This rank's sample indices at the step and how much they count: 1, or 0 for a rank sitting out (batch 0,
    affine's sit_out). Such a rank still runs forward and backward, since DDP's all-reduce needs every rank: it
    borrows two of rank 0's samples, and counting 0 makes its loss, gradient and metrics nothing."""
    if sizes[rank]:
        return plan.indices(step, sizes, rank), 1.0
    return plan.indices(step, sizes, 0)[:2], 0.0


def _float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers each rank keeps apart during an epoch (batch-norm statistics; dist.average_buffers)."""
    return [b for b in model.buffers() if b.is_floating_point()]


def _numpy_rng_plain(state: tuple) -> list:
    """numpy's legacy RNG state as plain lists and numbers, so the checkpoint loads with weights_only=True."""
    name, keys, pos, has_gauss, cached = state
    return [str(name), np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]


class Trainer:
    def __init__(self, cfg: Config, world: World, data: DataSet, run_dir: Path, replay: dict | None):
        self.cfg, self.world = cfg, world
        dev = world.device
        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        self.model = build_model(cfg.model, len(data.classes)).to(dev, memory_format=self.memory_format)
        self.autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16)
        self.train_loader = DeviceLoader(data.train_x, data.train_y, data.mean, data.std, dev, cfg.augment,
                                         memory_format=self.memory_format)  # batches come in the model's format
        lo, hi = (len(data.test_y) * world.rank) // world.size, (len(data.test_y) * (world.rank + 1)) // world.size
        self.test_loader = DeviceLoader(data.test_x[lo:hi], data.test_y[lo:hi], data.mean, data.std, dev,
                                        augment=False, memory_format=self.memory_format)
        self.balance = make_balance(cfg, world.rank, world.size, replay)
        self.max_batches = cfg.max_batches(world.size)
        # collective: GPU ranks find their largest batch on the bare model, before DDP
        if any(s.probe for s in cfg.rank_settings(world.size)):
            self.max_batches = self.balance.probe(self.model, tuple(data.train_x.shape[1:]), len(data.classes), dev,
                                                  autocast=self.autocast, memory_format=self.memory_format,
                                                  gpu=world.gpu)
        self.sampler = self.balance.batch_sampler(len(self.train_loader))  # the epoch's length; cut on the device
        self.ddp = wrap_ddp(self.model, dev)
        self.balance.attach(self.ddp)  # the weighting hook, with the step clock and the emulated delay
        self.opt, self.sched = optimiser(cfg, self.model)
        self.folder = RunFolder(run_dir) if world.is_main else None
        # --tensorboard: event files beside the tables, from the same rows (board.py)
        self.board = Board(run_dir, len(self.train_loader) // cfg.global_batch) if cfg.tensorboard and \
            world.is_main else None
        self.train_time_s = 0.0
        self.history: list[EpochRow] = []
        # where the run is: the Balance's position alone (bal.position); the checkpoint on disk holds `saved`, the
        # position it was taken at (what a summary may claim), None before the first
        self.saved: Position | None = None
        # a step checkpoint's record of the running epoch (--checkpoint-every): what ran, beyond the Balance's state
        self.partial: dict | None = None
        self.first_step_time: float | None = None  # Unix time (s) at the end of this process's first step
        self.resumed_from: tuple[list[str] | None, int] | None = None  # the checkpoint's world: identities, size

    # -- checkpoint (plain data: loadable with weights_only=True) ---------------------------------------------
    def state_dict(self, partial: dict | None = None) -> dict:
        """Collective (every rank, between steps; rank 0 saves it). balance: the Balance's own state_dict, the one
        position (`step` steps of its `epoch` ended); partial (a step checkpoint): the running epoch's steps so far,
        its metric totals, time and every rank's augmentation RNG and batch-norm buffers."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "balance": self._balance_state(),
                "emulator": {"spec": self.cfg.hetero, "seed": self.cfg.seed},
                "train_time_s": self.train_time_s, "history": [asdict(r) for r in self.history], "partial": partial,
                "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_rng_plain(np.random.get_state())}}

    def _balance_state(self) -> dict:
        """Collective: Balance.state_dict(), complete mid-epoch too (its position, the steps since the last
        decision): the one place the trainer takes the Balance's state."""
        return self.balance.state_dict()

    def load_state_dict(self, s: dict) -> None:
        """A checkpoint in the current layout (runfolder.RunFolder.load_trainer_checkpoint, checked by
        fit.check_checkpoint): the run goes on from the Balance's position as saved."""
        self.history = restore(s, self.cfg, self.model, self.opt, self.sched, self.balance)
        self.train_time_s, self.partial = s["train_time_s"], s.get("partial")
        self.saved, self.resumed_from = self.balance.position, balance_world(s["balance"])

    # -- one epoch --------------------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, bar=None) -> EpochResult:
        cfg, w, bal = self.cfg, self.world, self.balance
        plan = self.sampler.plan(epoch, w.device)
        bal.set_epoch(epoch)  # the emulator's draws follow the epoch; an epoch resumed mid-way stays where it is
        start = bal.position.step  # > 0: a step checkpoint's epoch goes on, from its record
        part = self.partial if start else None
        self.train_loader.seed(epoch_seed(cfg.seed, epoch, AUGMENT + w.rank))
        if part and self.resumed_from[0] == bal.workers and part.get("loader"):  # the same workers: exact
            self.train_loader.gen.set_state(part["loader"][w.rank])
            with torch.no_grad():  # each rank's own batch-norm statistics (averaged only at the epoch's end)
                for b, saved in zip(_float_buffers(self.model), part["buffers"][w.rank]):
                    b.copy_(saved)
        elif part:  # another world: fresh augmentation draws for the rest of the epoch, from (epoch, step, rank)
            self.train_loader.seed(epoch_seed(cfg.seed, epoch, AUGMENT + w.rank + 1000 * start))
        # Metric sums and the first non-finite step stay on the device: no host sync inside the step.
        sums = torch.zeros(2, dtype=torch.float64, device=w.device)  # loss sum, correct
        first_bad = torch.tensor(-1, device=w.device)
        t0 = time.perf_counter()
        if bar is not None and start:
            bar.update(start)
        for step in range(start, plan.steps):
            sizes = bal.begin_step(step)  # every rank's batch size; this rank's gradient weight; the clock starts
            idx, counts = own_samples(plan, step, sizes, w.rank)  # counts 0: this rank sits out the step
            m = cfg.micro_batch or len(idx)  # --micro-batch: k_i = b / m micro-batches, all but the last no_sync
            for lo in range(0, len(idx), m):
                x, y = self.train_loader.batch(idx[lo:lo + m])
                with bal.step():  # the step's last micro-batch syncs; its end ends the step and may decide
                    with self.autocast:
                        out = self.ddp(x.contiguous(memory_format=self.memory_format))  # no-op: loader's format
                        loss = F.cross_entropy(out.float(), y) * counts
                    loss.backward()  # the hook all-reduces weight_i * g_i; an emulated delay is spent in it
                    if bal.sync_now:
                        bal.mark_backward()
                        self.opt.step()
                        self.opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    sums += torch.stack([loss.detach().double() * len(y), (out.argmax(1) == y).sum().double() * counts])
                    first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss.detach()),
                                            torch.full_like(first_bad, step), first_bad)
            if bar is not None:
                bar.set_postfix_str(progress(bal), refresh=False)  # shares and predicted speedup
                bar.update(1)
            if self.first_step_time is None:  # a restart's recovery ends here (make bench: recovery)
                self.first_step_time = time.time()
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < plan.steps:
                part = self._step_checkpoint(epoch, start, part, sums, first_bad, t0)
                start, t0 = step + 1, time.perf_counter()  # the next segment of the epoch
        self._check_finite(epoch, first_bad)
        segments, totals, train_s = self._gathered(start, part, sums, t0)
        self.partial = None
        first = max((i for i, g in enumerate(segments) if g.sizes.shape[1] != w.size), default=-1) + 1
        earlier = [row for g in segments[:first] for row in g.rows(epoch)]  # the epoch's steps in another world
        g = joined(segments[first:]) if segments[first:] else Segment(start, np.zeros((0, w.size), np.int64),
                                                          *(np.zeros((w.size, 0)),) * len(TIMES))
        return EpochResult(g.sizes, g.compute_s, g.wait_s, g.delay_s, g.cpu_s, train_s, float(totals[0] / totals[2]),
                           float(totals[1] / totals[2]), g.first_step, earlier)

    def _check_finite(self, epoch: int, first_bad: torch.Tensor) -> None:
        bad = gather_rows(first_bad.reshape(1), self.world.coll_device).flatten()
        if (bad >= 0).any():
            step = int(bad[bad >= 0].min())
            kept = f"epochs 1..{epoch - 1} and their checkpoint are kept" if epoch > 1 else "no epoch had completed"
            raise TrainingError(f"non-finite loss at epoch {epoch} step {step}: stopping (lower --lr?); {kept}")

    def _gathered(self, start: int, part: dict | None, sums: torch.Tensor, t0: float
                  ) -> tuple[list[Segment], np.ndarray, float]:
        """Collective: the epoch's steps so far as segments (the saved ones, then this world's since `start`), the
        metric totals [loss sum, correct, samples] over every rank, and the epoch's training seconds so far."""
        w, recs = self.world, [r for r in self.balance.epoch_records() if r.step >= start]
        own = torch.tensor([[getattr(r, k) for k in TIMES] for r in recs],
                           dtype=torch.float64).reshape(-1, len(TIMES)).T
        per_rank = gather_rows(own, w.coll_device).numpy()  # [world, len(TIMES), steps]
        sizes = np.stack([r.sizes for r in recs]) if recs else np.zeros((0, w.size), np.int64)
        count = torch.tensor([float(sizes[:, w.rank].sum())], dtype=torch.float64, device=w.device)
        totals = sum_all(torch.cat([sums, count]), w.coll_device).numpy()
        segments = [Segment.of(g) for g in part["segments"]] if part else []
        if part:
            totals = totals + np.asarray(part["totals"], float)
        if len(sizes):
            segments.append(Segment(start, sizes, *(per_rank[:, j] for j in range(len(TIMES)))))
        return segments, totals, (part["train_s"] if part else 0.0) + time.perf_counter() - t0

    def _step_checkpoint(self, epoch: int, start: int, part: dict | None, sums: torch.Tensor,
                         first_bad: torch.Tensor, t0: float) -> dict:
        """Collective, between steps: the checkpoint at the Balance's position inside `epoch` (rank 0 writes it).
        Only the checkpoint holds the partial epoch; its rows go to the tables when the epoch ends."""
        w, bal = self.world, self.balance
        self._check_finite(epoch, first_bad)
        segments, totals, train_s = self._gathered(start, None, sums, t0)
        loaders, buffers = [None] * w.size, [None] * w.size
        dist.all_gather_object(loaders, self.train_loader.gen.get_state().cpu())
        dist.all_gather_object(buffers, [b.detach().cpu() for b in _float_buffers(self.model)])
        new = {"loader": loaders, "buffers": buffers,
               "segments": (part["segments"] if part else []) + [g.plain() for g in segments],
               "totals": (np.asarray(part["totals"], float) + totals if part else totals).tolist(),
               "train_s": train_s + (part["train_s"] if part else 0.0)}
        state = self.state_dict(new)  # collective
        if w.is_main:
            self.folder.save_checkpoint(state)
        del state
        self.saved = bal.position
        if w.is_main:
            self.folder.write_json("summary.json", self.summary("running"))
        sums.zero_()  # the totals so far are in `new`; the next segment's start from 0
        return new

    # -- the run ----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, w = self.cfg, self.world
        from tqdm import tqdm

        for epoch in range(max(self.balance.position.next_epoch, 1), cfg.epochs + 1):  # a fresh Balance is at 0
            lr = self.opt.param_groups[0]["lr"]
            steps = len(self.train_loader) // cfg.global_batch
            # a step-by-step bar on a terminal only: in a log file each refresh is a line; the epoch line follows
            bar = tqdm(total=steps, desc=f"epoch {epoch}/{cfg.epochs}", leave=False, dynamic_ncols=True,
                       file=sys.stderr) if w.is_main and sys.stderr.isatty() else None
            r = self.train_epoch(epoch, bar)
            if bar is not None:
                bar.close()
            t_eval = time.perf_counter()
            average_buffers(self.model)
            ev = sum_all(evaluate(self.model, self.test_loader, cfg.eval_batch), w.coll_device)
            eval_s = time.perf_counter() - t_eval
            self.sched.step()
            self.train_time_s += r.train_s
            row = self._record(epoch, r, ev, eval_s, lr)
            state = self.state_dict()  # collective
            if w.is_main:
                self.folder.save_checkpoint(state)
            del state
            self.saved = self.balance.position  # rank 0 saved it (else it raised: a summary claims less)
            if w.is_main:
                self.folder.write_json("summary.json", self.summary("running"))
                print(self._line(row), flush=True)
        if self.board is not None:
            self.board.close()
        return self.summary("completed")

    def _record(self, epoch: int, r: EpochResult, ev: torch.Tensor, eval_s: float, lr: float) -> EpochRow:
        # shares, balance and ranks.csv describe this world's steps (all of the epoch's unless it began in another)
        sizes, B, n = r.sizes, self.cfg.global_batch, self.world.size
        compute_total = r.compute_s.sum(1)
        row = EpochRow(epoch, self.train_time_s, r.train_s, eval_s, r.train_loss, r.train_top1,
                       float(ev[0] / ev[3]), float(ev[1] / ev[3]), float(ev[2] / ev[3]), lr,
                       float(compute_total.mean() / max(compute_total.max(), 1e-12)),
                       len(sizes) + len({x["step"] for x in r.earlier}),
                       int(sizes.sum()) + sum(x["batch_size"] for x in r.earlier), B,
                       [float(sizes[:, i].mean() / B) for i in range(n)])
        self.history.append(row)
        if self.folder is None:
            return row
        ranks = [{"epoch": epoch, "rank": i, "share": row.shares[i], "batch_size": int(sizes[-1, i]),
                  "steps": len(sizes), "samples": int(sizes[:, i].sum()), "compute_s": float(r.compute_s[i].sum()),
                  "wait_s": float(r.wait_s[i].sum()), "delay_s": float(r.delay_s[i].sum())} for i in range(n)]
        steps = r.earlier + [{"epoch": epoch, "step": r.first_step + s, "rank": i, "batch_size": int(sizes[s, i]),
                  **{k: float(getattr(r, k)[i, s]) for k in TIMES}} for s in range(len(sizes)) for i in range(n)]
        line = asdict(row)
        del line["shares"]  # epochs.csv has one column per scalar; the shares are in ranks.csv
        self.folder.append("epochs", [line])
        self.folder.append("ranks", ranks)
        self.folder.append("steps", steps)
        if self.board is not None:
            self.board.epoch(epoch, line, ranks, steps, self.balance)
        return row

    def _line(self, row: EpochRow) -> str:
        shares = "/".join(f"{s:.2f}" for s in row.shares)
        return (f"epoch {row.epoch:>3}/{self.cfg.epochs} | train loss {row.train_loss:.3f} "
                f"top1 {100 * row.train_top1:5.1f}% | test loss {row.test_loss:.3f} "
                f"top1 {100 * row.test_top1:5.1f}% top5 {100 * row.test_top5:5.1f}% | "
                f"{row.epoch_time_s:.1f} s (+{row.eval_time_s:.1f} s eval) | shares {shares} | "
                f"balance {row.balance_eff:.2f}")

    def summary(self, status: str, error: str = "") -> dict:
        """The run's summary.json: never more completed epochs (nor their results) than the checkpoint holds."""
        done, step = done_at(self.saved)
        h = [r for r in self.history if r.epoch <= done]
        return {"status": status, "error": error, "scheme": self.cfg.scheme, "model": self.cfg.model,
                "hetero": self.cfg.hetero, "world_size": self.world.size, "epochs_completed": done,
                "checkpoint_step": step, "first_step_time": self.first_step_time,
                "epochs": self.cfg.epochs, "train_time_s": self.train_time_s,
                "final_test_top1": h[-1].test_top1 if h else None,
                "best_test_top1": max(r.test_top1 for r in h) if h else None,
                "final_test_loss": h[-1].test_loss if h else None,
                "mean_balance_eff": float(np.mean([r.balance_eff for r in h])) if h else None}
