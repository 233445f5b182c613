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
import torch.nn.functional as F

from ..core.agree import gather_rows, sum_all
from ..core.balance import Balance
from ..core.sampler import EpochPlan
from ..core.seeding import AUGMENT, epoch_seed
from .config import Config, ConfigError, shown
from .data import DataSet, DeviceLoader
from .dist import World, average_buffers, wrap_ddp
from .models import build_model
from .resume import relay_cosine
from .runlog import RunFolder


class TrainingError(RuntimeError):
    """A fault during training (non-finite loss, bad replay): one clear line, the run marked failed."""


@dataclass
class EpochResult:
    """One epoch's training, gathered from every rank: sizes [steps, world]; times [world, steps] in seconds."""
    sizes: np.ndarray
    compute_s: np.ndarray
    wait_s: np.ndarray
    delay_s: np.ndarray
    train_s: float       # wall time of the epoch's steps on this rank
    train_loss: float    # sample-weighted mean over every rank
    train_top1: float


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


def check_checkpoint(cfg: Config, world_size: int, n_classes: int, state: dict, path: Path) -> None:
    """Trainer.load_state_dict tried on CPU stand-ins (model, optimiser, schedule, Balance) before any process group:
    a checkpoint of plain data but the wrong content (tensor shapes, model={}, history="abc", a bad RNG or balancer
    state, epoch=True or 10**18) is one ConfigError here, not a traceback on every rank after the group starts."""
    where = f"cannot resume: {path} does not fit this run"
    epoch, step = state.get("epoch"), state.get("global_step")
    if not (type(epoch) is int and 1 <= epoch <= cfg.epochs):
        raise ConfigError(f"{where}: its epoch {shown(epoch)} is not a whole number in 1..{cfg.epochs} (--epochs)")
    if not (type(step) is int and 0 <= step <= 2**62):
        raise ConfigError(f"{where}: its global_step {shown(step)} is not a whole number >= 0")
    t = state.get("train_time_s")
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and np.isfinite(t) and t >= 0):
        raise ConfigError(f"{where}: its train_time_s {shown(t)} is not a number of seconds")
    if not (isinstance(state["history"], list) and len(state["history"]) == epoch):
        raise ConfigError(f"{where}: its history is not a list of its {epoch} epochs (got {shown(state['history'])})")
    torch_rng, numpy_rng = torch.get_rng_state(), np.random.get_state()  # the stand-ins' init draws from them
    try:
        stand_in = _StandIn(cfg, world_size, n_classes)
        Trainer.load_state_dict(stand_in, state)  # the very reads the run will do
        for p, st in stand_in.opt.state.items():  # SGD checks these only at its first step
            buf = st.get("momentum_buffer")
            if buf is not None and (not isinstance(buf, torch.Tensor) or buf.shape != p.shape):
                raise ValueError(f"a momentum buffer of shape {tuple(getattr(buf, 'shape', ()))} for a parameter of "
                                 f"shape {tuple(p.shape)}")
        b = stand_in.balance.balancer
        if b.shares.shape != (world_size,) or b.sizes.shape != (world_size,) or not np.all(np.isfinite(b.shares)) \
                or int(b.sizes.sum()) != cfg.global_batch or np.any(b.sizes < 0):
            raise ValueError(f"balancer shares {shown(b.shares.tolist())} and sizes {shown(b.sizes.tolist())} are not "
                             f"{world_size} ranks' splits of the global batch {cfg.global_batch}")
        if [r.epoch for r in stand_in.history] != list(range(1, epoch + 1)):
            raise ValueError("its history does not list epochs 1.." + str(epoch))
    except Exception as e:  # noqa: BLE001 - load_state_dict raises RuntimeError, KeyError, TypeError, ValueError...
        line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise ConfigError(f"{where} (model {cfg.model}, {world_size} rank(s)): {type(e).__name__}"
                          f"{': ' + shown(line, 160)[1:-1] if line else ''}") from None
    finally:
        torch.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)


class _StandIn:
    """What Trainer.load_state_dict touches, built on the CPU without a process group (check_checkpoint)."""

    def __init__(self, cfg: Config, world_size: int, n_classes: int):
        self.cfg = cfg
        self.model = build_model(cfg.model, n_classes)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                   nesterov=cfg.momentum > 0, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.epochs)
        self.balance = make_balance(cfg, 0, world_size)


def make_balance(cfg: Config, rank: int, world_size: int, replay: dict | None = None) -> Balance:
    """The run's Balance: the config's settings, its emulated slow ranks and, for a replay, the recorded sizes.
    Lag 0: the trainer cuts each step's batches when it runs it, so a decision takes effect at the next step."""
    bal = Balance(global_batch=cfg.global_batch, scheme=cfg.scheme, rebalance_every=cfg.rebalance_every,
                  smoothing=cfg.smoothing, deadband=cfg.deadband, significance=cfg.significance,
                  min_batch=cfg.min_batch, seed=cfg.seed, lag=0, sit_out=cfg.sit_out, micro_batch=cfg.micro_batch,
                  max_batch=["probe" if s.probe else None if s.max_batch == float("inf") else int(s.max_batch)
                             for s in cfg.rank_settings(world_size)])
    bal.set_world(rank, world_size)
    if cfg.hetero:
        bal.emulate(cfg.hetero)
    if replay is not None:
        bal.replay(replay)
    return bal


def own_samples(plan: EpochPlan, step: int, sizes: np.ndarray, rank: int) -> tuple[torch.Tensor, float]:
    """This rank's sample indices at the step and how much they count: 1, or 0 for a rank sitting out (batch 0,
    affine's sit_out). Such a rank still runs forward and backward, since DDP's all-reduce needs every rank: it
    borrows two of rank 0's samples, and counting 0 makes its loss, gradient and metrics nothing."""
    if sizes[rank]:
        return plan.indices(step, sizes, rank), 1.0
    return plan.indices(step, sizes, 0)[:2], 0.0


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
        if any(self.balance.probes):  # collective: GPU ranks find their largest batch on the bare model, before DDP
            self.max_batches = self.balance.probe(self.model, tuple(data.train_x.shape[1:]), len(data.classes), dev,
                                                  autocast=self.autocast, memory_format=self.memory_format,
                                                  gpu=world.gpu)
        self.sampler = self.balance.batch_sampler(len(self.train_loader))  # the epoch's length; cut on the device
        self.ddp = wrap_ddp(self.model, dev)
        self.balance.attach(self.ddp)  # the weighting hook, with the step clock and the emulated delay
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                   nesterov=cfg.momentum > 0, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.epochs)
        self.folder = RunFolder(run_dir) if world.is_main else None
        self.epoch, self.train_time_s = 0, 0.0
        self.saved_epoch = 0  # the last epoch in the checkpoint: what a summary may claim as completed
        self.history: list[EpochRow] = []

    # -- checkpoint (plain data: loadable with weights_only=True) ---------------------------------------------
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "balancer": self.balance.balancer.state_dict(),
                "emulator": {"spec": self.cfg.hetero, "seed": self.cfg.seed}, "epoch": self.epoch,
                "train_time_s": self.train_time_s, "global_step": self.balance.global_step,
                "history": [asdict(r) for r in self.history],
                "rng": {"torch": torch.get_rng_state(), "numpy": _numpy_rng_plain(np.random.get_state())}}

    def load_state_dict(self, s: dict) -> None:
        self.model.load_state_dict(s["model"])
        self.opt.load_state_dict(s["optimizer"])
        self.sched.load_state_dict(s["scheduler"])
        if self.sched.T_max != self.cfg.epochs:  # --epochs changed on resume
            relay_cosine(self.opt, self.sched, s["epoch"], self.cfg.epochs)
        self.balance.load_state_dict({"balancer": s["balancer"], "epoch": s["epoch"], "global_step": s["global_step"]})
        self.epoch, self.train_time_s = s["epoch"], s["train_time_s"]
        self.saved_epoch = self.epoch
        self.history = [EpochRow(**r) for r in s["history"]]
        torch.set_rng_state(s["rng"]["torch"])
        name, keys, pos, has_gauss, cached = s["rng"]["numpy"]
        np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))

    # -- one epoch --------------------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, bar=None) -> EpochResult:
        cfg, w, bal = self.cfg, self.world, self.balance
        plan = self.sampler.plan(epoch, w.device)
        self.train_loader.seed(epoch_seed(cfg.seed, epoch, AUGMENT + w.rank))
        bal.set_epoch(epoch)  # the emulator's draws follow the epoch
        # Metric sums and the first non-finite step stay on the device: no host sync inside the step.
        sums = torch.zeros(2, dtype=torch.float64, device=w.device)  # loss sum, correct
        first_bad = torch.tensor(-1, device=w.device)
        t0 = time.perf_counter()
        for step in range(plan.steps):
            sizes = bal.begin_step()  # every rank's batch size; this rank's gradient weight; the clock starts
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
                bar.update(1)
        bad = gather_rows(first_bad.reshape(1), w.coll_device).flatten()
        if (bad >= 0).any():
            step = int(bad[bad >= 0].min())
            kept = f"epochs 1..{epoch - 1} and their checkpoint are kept" if epoch > 1 else "no epoch had completed"
            raise TrainingError(f"non-finite loss at epoch {epoch} step {step}: stopping (lower --lr?); {kept}")
        recs = bal.epoch_records()
        own = torch.tensor([[r.compute_s, r.wait_s, r.delay_s] for r in recs], dtype=torch.float64).T
        per_rank = gather_rows(own, w.coll_device).numpy()  # [world, 3, steps]
        sizes = np.stack([r.sizes for r in recs])
        train_s = time.perf_counter() - t0
        count = torch.tensor([float(sizes[:, w.rank].sum())], dtype=torch.float64, device=w.device)
        totals = sum_all(torch.cat([sums, count]), w.coll_device)
        return EpochResult(sizes, per_rank[:, 0], per_rank[:, 1], per_rank[:, 2], train_s,
                           float(totals[0] / totals[2]), float(totals[1] / totals[2]))

    # -- the run ----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, w = self.cfg, self.world
        from tqdm import tqdm

        while self.epoch < cfg.epochs:
            epoch = self.epoch + 1
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
            self.epoch, self.train_time_s = epoch, self.train_time_s + r.train_s
            row = self._record(epoch, r, ev, eval_s, lr)
            if w.is_main:
                self.folder.save_checkpoint(self.state_dict())
            self.saved_epoch = epoch  # rank 0 saved it (else it raised, and a failed summary claims the one before)
            if w.is_main:
                self.folder.write_json("summary.json", self.summary("running"))
                print(self._line(row), flush=True)
        return self.summary("completed")

    def _record(self, epoch: int, r: EpochResult, ev: torch.Tensor, eval_s: float, lr: float) -> EpochRow:
        sizes, B, n = r.sizes, self.cfg.global_batch, self.world.size
        compute_total = r.compute_s.sum(1)
        row = EpochRow(epoch, self.train_time_s, r.train_s, eval_s, r.train_loss, r.train_top1,
                       float(ev[0] / ev[3]), float(ev[1] / ev[3]), float(ev[2] / ev[3]), lr,
                       float(compute_total.mean() / max(compute_total.max(), 1e-12)), len(sizes), int(sizes.sum()), B,
                       [float(sizes[:, i].mean() / B) for i in range(n)])
        self.history.append(row)
        if self.folder is None:
            return row
        ranks = [{"epoch": epoch, "rank": i, "share": row.shares[i], "batch_size": int(sizes[-1, i]),
                  "steps": len(sizes), "samples": int(sizes[:, i].sum()), "compute_s": float(r.compute_s[i].sum()),
                  "wait_s": float(r.wait_s[i].sum()), "delay_s": float(r.delay_s[i].sum())} for i in range(n)]
        steps = [{"epoch": epoch, "step": s, "rank": i, "batch_size": int(sizes[s, i]),
                  "compute_s": float(r.compute_s[i, s]), "wait_s": float(r.wait_s[i, s]),
                  "delay_s": float(r.delay_s[i, s])} for s in range(len(sizes)) for i in range(n)]
        line = asdict(row)
        del line["shares"]  # epochs.csv has one column per scalar; the shares are in ranks.csv
        self.folder.append("epochs", [line])
        self.folder.append("ranks", ranks)
        self.folder.append("steps", steps)
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
        h = [r for r in self.history if r.epoch <= self.saved_epoch]
        return {"status": status, "error": error, "scheme": self.cfg.scheme, "model": self.cfg.model,
                "hetero": self.cfg.hetero, "world_size": self.world.size, "epochs_completed": self.saved_epoch,
                "epochs": self.cfg.epochs, "train_time_s": self.train_time_s,
                "final_test_top1": h[-1].test_top1 if h else None,
                "best_test_top1": max(r.test_top1 for r in h) if h else None,
                "final_test_loss": h[-1].test_loss if h else None,
                "mean_balance_eff": float(np.mean([r.balance_eff for r in h])) if h else None}
