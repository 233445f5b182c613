"""The host's cost of a step (part `host` of `make bench`, issue 51): microseconds of Python per step that hetero
adds, on a model small enough that the step is mostly host time (Linear(8, 8), 4 samples per rank, 2 gloo ranks).

Per door (DDP through `with bal.step()`, FSDP2 through `with bal.step()`), the same loop runs twice in the same
processes, with hetero and without (plain DDP / plain FSDP2 over a DistributedSampler), taking turns step by step
(which goes first alternates), so load from elsewhere falls on both alike. Each variant (hetero, hetero weighing the
loss, and each of those doors' floors: torch's own Python comm hook, and LossFloor, the loss door's torch mechanisms
by hand) is its own such pair with a plain loop of its own: a loop's steps then have one
other loop's step between them, as in a training loop that does other work between steps, not three. Each step is
timed from fetching its batch to the optimizer's zero_grad, in wall time (perf_counter) and in the process's CPU time
(process_time: every thread, gloo's and hetero's peer watcher included) and the main thread's own (thread_time:
hetero's Python, without the other threads, which on a 2-core host contend with the ranks' main threads while they
wait in the all-reduce).
The added time per step is hetero's median less plain's, and the same for the fastest decile (10th percentile),
which load from elsewhere moves least.

Then a third loop with hetero, run alone, is timed by phase: each of hetero's calls on the step's path is wrapped in
a timer for that loop only (nothing is timed in the library itself, so the timers cost nothing when off):
- sampler: the batch sampler handing out a step's indices;
- begin: the step engine's begin (the step's sizes, weight, clock);
- ready: the comm hook's call at the last bucket (the checks, the `ready` mark);
- hook: the rest of the comm hook on the caller's thread (weighting the bucket, the all-reduce's future, the peer
  watcher);
- guard: the optimizer step's pre-hook and the forward pre-hook (counting forwards);
- end: the step engine's end, less the decision;
- decision: the decisions (collective, every REBALANCE_EVERY steps), per step;
- metrics: `bal.metrics()`, called once per step (a logger's call; not part of the step's time above);
- collective: the collectives themselves, called from hetero's comm hook or FSDP2 comms (plain DDP's reducer and
  plain FSDP2 issue the same ones): not hetero's cost, kept out of the hook's;
- backward: with weighting="loss", the backward that `bal.backward` runs (autograd, DDP's reducer: the plain loop's
  own work), kept out of the loss door's, which is counted as `hook` (its `ready` as `ready`).
The phases are exclusive, main thread only; what the other threads spend (gloo's callbacks) shows in the CPU time.

    torchrun --standalone --nproc-per-node=2 -m hetero.lab.host --out FILE --steps N
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from ..core import safeio
from .launch import clean_env, torchrun_cmd
from .measure import launch, markdown_table

REBALANCE_EVERY = 10  # decisions every 10 steps, as the overhead part's API loop
PER_RANK = 4
# hf: the HF Trainer's step path (HeteroTrainer against Trainer), with the [hf] extra; ddp_loss: DDP with
# Balance(weighting="loss") and bal.backward(loss), DDP's own C++ all-reduce (no comm hook), in the DDP door's turns
DOORS = ("ddp", "ddp_loss", "fsdp", "hf")
LABELS = {"ddp": "DDP", "ddp_loss": "DDP, weighting='loss'", "fsdp": "FSDP2", "hf": "HF Trainer"}
# the loops per door, each variant in turn step by step with a plain loop of its own: hetero, and (DDP) torch's own
# Python all-reduce comm hook, the floor of any comm hook written in Python (hetero's default weighting is one), and
# hetero weighing the loss
KINDS = {"ddp": ("plain", "torch_hook", "hetero", "hetero_loss", "loss_floor"), "fsdp": ("plain", "hetero"),
         "hf": ("plain", "hetero")}
FLOORS = {"ddp": "torch_hook", "ddp_loss": "loss_floor"}  # each DDP door's floor: what any implementation pays
PHASES = ("sampler", "begin", "ready", "hook", "guard", "end", "decision", "metrics", "collective", "backward")


class LossFloor:
    """The loss door's floor (issue 51): plain DDP with the torch mechanisms that door's checks stand on, written by
    hand at their least. A forward pre-hook counts the step's forwards; a gradient hook on the first parameter marks
    `ready`; the backward is seeded with the weight x world (one tensor, made once); the step reads the host's clock
    and the process's CPU time at its start and end, and checks the count at its end. What hetero adds beyond it is
    hetero's own Python: the schedule, the position, the refusals, the records."""

    def __init__(self, model):
        import torch

        self.forwards, self.marks, self.records = 0, {}, []
        self.seed = torch.tensor(1.0)  # w_i x world: plain's loader gives every rank an even share
        model.register_forward_pre_hook(self._forward)
        next(model.parameters()).register_hook(self._ready)

    def _forward(self, module, args) -> None:
        self.forwards += 1
        if self.forwards > 1:
            raise RuntimeError("a second forward in the step")

    def _ready(self, grad) -> None:
        self.marks["ready"] = time.perf_counter()

    def step(self):
        return self

    def __enter__(self):
        self.forwards, self.marks["start"], self.cpu = 0, time.perf_counter(), time.process_time()

    def __exit__(self, *exc) -> bool:
        end, cpu = time.perf_counter(), time.process_time()
        if self.forwards != 1:
            raise RuntimeError(f"{self.forwards} forwards in the step")
        self.records.append((self.marks["ready"] - self.marks["start"], end - self.marks["returned"], cpu - self.cpu))
        return False

    def backward(self, loss) -> None:
        loss.backward(self.seed)
        self.marks["returned"] = time.perf_counter()


class Phases:
    """Exclusive time per phase on the main thread: a phase entered inside another is taken out of the outer one."""

    def __init__(self):
        self.total = {p: 0.0 for p in PHASES}
        self._stack: list[list] = []  # [phase, start, time spent in inner phases]

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)  # DDP reads a comm hook's signature
        def timed(*args, **kwargs):
            self._stack.append([phase, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                name, t0, inner = self._stack.pop()
                spent = time.perf_counter() - t0
                self.total[name] += spent - inner
                if self._stack:
                    self._stack[-1][2] += spent
        return timed

    def generator(self, phase: str, it):
        nxt = self.wrap(phase, it.__next__)
        while True:
            try:
                yield nxt()
            except StopIteration:
                return


def _instrument(phases: Phases):
    """Wrap hetero's calls on the step's path (for models attached after this); returns the undo."""
    import torch.distributed as dist

    from ..core import attach, engine, guard, plan, sampler

    saved = []

    def patch(owner, name, phase):
        # kept as stored (a class's pybind method is a descriptor that getattr unwraps), restored as it was
        saved.append((owner, name, vars(owner)[name]))
        setattr(owner, name, phases.wrap(phase, getattr(owner, name)))

    patch(engine.Engine, "begin", "begin")
    patch(engine.Engine, "gradients_ready", "ready")
    from ..core import lossweight
    patch(lossweight.LossWeighting, "backward", "hook")
    patch(lossweight.LossWeighting, "_reached", "ready")
    import torch
    patch(torch.Tensor, "backward", "backward")
    patch(engine.Engine, "end", "end")
    patch(engine.Engine, "count_forward", "guard")
    patch(guard.OptimizerGuard, "__call__", "guard")
    patch(plan.Plan, "_decide", "decision")
    patch(attach, "balance_hook", "hook")
    from ..core import fsdp
    patch(fsdp.WeightedReduceScatter, "__call__", "hook")  # FSDP2's weighted reduce-scatter and timed all-gather
    patch(fsdp.TimedAllGather, "__call__", "hook")
    patch(fsdp, "_reduce_scatter", "collective")  # the collectives themselves (plain FSDP2 runs them too)
    patch(fsdp, "_all_gather", "collective")
    patch(dist.ProcessGroup, "allreduce", "collective")  # the comm hook's (plain DDP's reducer issues its own in C++)
    patch(fsdp.FSDPSchedule, "begin", "begin")
    orig_iter = vars(sampler.BalancedBatchSampler)["__iter__"]
    saved.append((sampler.BalancedBatchSampler, "__iter__", orig_iter))
    sampler.BalancedBatchSampler.__iter__ = lambda self: phases.generator("sampler", orig_iter(self))

    def undo():
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)
    return undo


HF_LENGTH, HF_VOCAB, HF_WARMUP = 8, 32, 3  # tokens per row, ids, steps of each run not timed


def hf_door(runs: int, steps: int, seed: int, scratch: Path) -> dict:
    """The HF Trainer's step path: `runs` runs each of the plain Trainer and the HeteroTrainer (edp, deciding every
    REBALANCE_EVERY steps), in turn, on a one-layer GPT-2 of width 8 (PER_RANK rows of HF_LENGTH tokens per
    rank); every step's wall and CPU time between consecutive step ends (a callback), then one more HeteroTrainer run
    by phase. Per run, its steps after the first HF_WARMUP."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ..core.balance import Balance
    from ..integrations.hf import HeteroTrainer

    world = dist.get_world_size()
    ids = torch.randint(HF_VOCAB, (steps * PER_RANK * world, HF_LENGTH), generator=torch.Generator().manual_seed(seed))
    rows = [{"input_ids": r, "labels": r} for r in ids]

    class Clock(TrainerCallback):
        def __init__(self):
            self.wall, self.cpu = [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    def one_run(kind: str) -> dict:
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=HF_VOCAB, n_positions=HF_LENGTH, n_embd=8, n_layer=1, n_head=1,
                                           bos_token_id=None, eos_token_id=None))
        model.loss_type = "ForCausalLM"
        args = TrainingArguments(output_dir=str(scratch), per_device_train_batch_size=PER_RANK, max_steps=steps,
                                 use_cpu=True, save_strategy="no", logging_strategy="no", report_to=[],
                                 disable_tqdm=True, seed=seed, ddp_find_unused_parameters=False)
        clock = Clock()
        common = dict(model=model, args=args, train_dataset=rows, callbacks=[clock])
        if kind == "hetero":
            bal = Balance(global_batch=PER_RANK * world, scheme="edp", rebalance_every=REBALANCE_EVERY, seed=seed)
            HeteroTrainer(balance=bal, **common).train()
        else:
            Trainer(**common).train()
        return {"wall_s": np.diff(clock.wall[HF_WARMUP:]).tolist(), "cpu_s": np.diff(clock.cpu[HF_WARMUP:]).tolist()}

    times = {k: {"wall_s": [], "cpu_s": []} for k in ("plain", "hetero")}
    for run in range(runs):
        for kind in (("plain", "hetero") if run % 2 else ("hetero", "plain")):
            for clock, v in one_run(kind).items():
                times[kind][clock] += v
    phases = Phases()
    undo = _instrument(phases)
    try:
        one_run("hetero")
    finally:
        undo()
    return {**times, "phases_s": {p: v / steps for p, v in phases.total.items()}}


def worker(out: Path, steps: int, seed: int = 0, hf_runs: int = 0, hf_steps: int = 0) -> None:
    """Run by torchrun: per door, plain and hetero in turn step by step, then hetero alone by phase; rank 0 writes
    the per-step times (s) to `out` as JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ..core.balance import Balance

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    B = PER_RANK * world
    gen = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(steps * B, 8, generator=gen), torch.randint(0, 8, (steps * B,), generator=gen))

    def model(door: str):
        torch.manual_seed(seed)
        m = torch.nn.Linear(8, 8)
        if door == "ddp":
            return DDP(m)
        fully_shard(m)
        return m

    def loop(door: str, kind: str):
        m = model(door)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        bal = None
        if kind == "torch_hook":  # torch's own Python all-reduce hook: what any Python comm hook costs
            m.register_comm_hook(None, default_hooks.allreduce_hook)
        backward = torch.Tensor.backward  # loss.backward()
        if kind == "loss_floor":  # the loss door's floor: the plain loop's loader, the mechanisms by hand
            bal = LossFloor(m)
            backward = bal.backward
        if kind.startswith("hetero"):
            bal = Balance(global_batch=B, scheme="edp", rebalance_every=REBALANCE_EVERY, seed=seed,
                          weighting="loss" if kind == "hetero_loss" else "hook")
            bal.attach(m)
            loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)))
            if kind == "hetero_loss":
                backward = bal.backward
        else:
            loader = DataLoader(ds, batch_size=PER_RANK, drop_last=True,
                                sampler=DistributedSampler(ds, shuffle=True, seed=seed, drop_last=True))
        return m, opt, bal, loader, backward

    def start(lp, epoch):
        m, opt, bal, loader, _ = lp
        if isinstance(bal, Balance):
            bal.set_epoch(epoch)
        else:
            loader.sampler.set_epoch(epoch)
        return iter(loader)

    def one(lp, it) -> tuple[float, float, float]:
        m, opt, bal, _, backward = lp
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        x, y = next(it)
        with bal.step() if bal is not None else nullcontext():
            backward(F.cross_entropy(m(x), y))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0

    res: dict = {"steps": steps, "world": world, "per_rank": PER_RANK, "rebalance_every": REBALANCE_EVERY}
    def pair(door: str, kind: str) -> dict:
        """plain and `kind` in turn step by step (which goes first alternates), two epochs (the first warms up): the
        pair only, so no third loop's code runs between a loop's steps (issue 51: with every kind in one round,
        each loop's code came back from the caches evicted by two others, which no training loop meets)."""
        loops = {"plain": loop(door, "plain"), kind: loop(door, kind)}
        times = {k: {"wall_s": [], "cpu_s": [], "main_s": []} for k in loops}
        for epoch in range(2):
            its = {k: start(lp, epoch) for k, lp in loops.items()}
            for step in range(steps):
                for k in (list(loops) if step % 2 else list(loops)[::-1]):
                    wall, cpu, main = one(loops[k], its[k])
                    if epoch:
                        times[k]["wall_s"].append(wall)
                        times[k]["cpu_s"].append(cpu)
                        times[k]["main_s"].append(main)
        return times

    for door in ("ddp", "fsdp"):
        paired = {k: pair(door, k) for k in KINDS[door][1:]}
        for kind in (k for k in paired if k.startswith("hetero")):
            phases = Phases()
            undo = _instrument(phases)  # before attach: the hook and the bound pre-hooks are the wrapped ones
            try:
                lp = loop(door, kind)
                wall_s, cpu_s = [], []
                for epoch in range(2):
                    it = start(lp, epoch)
                    if epoch:
                        phases.total = {p: 0.0 for p in PHASES}
                    for _ in range(steps):
                        wall, cpu, _ = one(lp, it)
                        t0 = time.perf_counter()
                        lp[2].metrics()
                        phases.total["metrics"] += time.perf_counter() - t0
                        if epoch:
                            wall_s.append(wall)
                            cpu_s.append(cpu)
            finally:
                undo()
            own = {"plain": paired[kind]["plain"], "hetero": paired[kind][kind]}  # each against its own plain
            name = door if kind == "hetero" else f"{door}_loss"
            if (floor := FLOORS.get(name)) in paired:
                own["floor"], own["plain_floor"] = paired[floor][floor], paired[floor]["plain"]
            res[name] = {
                **own, "phased": {"wall_s": wall_s, "cpu_s": cpu_s},
                "phases_s": {p: v / steps for p, v in phases.total.items()}}
        dist.barrier()
    if hf_runs:
        res["hf"] = hf_door(hf_runs, hf_steps, seed, out.with_suffix(""))  # the Trainer's folder (nothing saved)
    if rank == 0:
        safeio.write_text(out, json.dumps(res))
    dist.destroy_process_group()


def _added(d: dict, kind: str, base: str, clock: str) -> tuple[float, float]:
    """kind's host time per step over base's (µs): the difference of the medians and of the fastest deciles."""
    h, p = np.array(d[kind][clock]), np.array(d[base][clock])
    return 1e6 * float(np.median(h) - np.median(p)), 1e6 * float(np.percentile(h, 10) - np.percentile(p, 10))


def _between(d: dict, every: int) -> float:
    """The added CPU time's median (µs) over the steps between decisions: neither a deciding step (the last of each
    `every`) nor the one after it, which a pause of any kind on this host slows too (docs/benchmarks.md#host); the
    same steps of the plain loop, its neighbours in turn. At the default cadence, a decision at each epoch's end,
    nearly every step is such a step."""
    h, p = np.array(d["hetero"]["cpu_s"]), np.array(d["plain"]["cpu_s"])
    i = np.arange(min(len(h), len(p)))
    keep = (i % every != every - 1) & (i % every != 0)
    return 1e6 * float(np.median(h[i][keep]) - np.median(p[i][keep]))


def summary(d: dict) -> dict:
    """Per door: hetero's added host time per step (µs) in wall and CPU time, median and fastest decile, over plain
    and (DDP's two doors) over the door's floor (FLOORS: torch's own Python comm hook; the loss door's mechanisms by
    hand, LossFloor); the median CPU between decisions (_between); the mean added CPU time (decisions included);
    the phases' µs per step."""
    out, every = {}, d.get("rebalance_every", REBALANCE_EVERY)
    for door in DOORS:
        if door not in d:
            continue
        r, row = d[door], {}
        for clock in ("wall_s", "cpu_s", "main_s"):
            if clock not in r["plain"]:  # the HF door: no main-thread clock
                continue
            c = clock[:-2]
            row[f"plain_{c}_us"] = 1e6 * float(np.median(r["plain"][clock]))
            row[f"added_{c}_us"], row[f"added_{c}_p10_us"] = _added(r, "hetero", "plain", clock)
            # the door's floor against its own pair's plain loop (older files: torch's hook, or the one round's)
            floor = "floor" if "floor" in r else "torch_hook" if "torch_hook" in r else None
            if floor is not None:
                base = f"plain_{floor}" if f"plain_{floor}" in r else "plain"
                row[f"floor_{c}_us"], _ = _added(r, floor, base, clock)
                row[f"beyond_floor_{c}_us"] = row[f"added_{c}_us"] - row[f"floor_{c}_us"]
        row["added_cpu_mean_us"] = 1e6 * float(np.mean(r["hetero"]["cpu_s"]) - np.mean(r["plain"]["cpu_s"]))
        if door != "hf":  # the Trainer's runs decide at their own cadence
            row["added_cpu_between_us"] = _between(r, every)
        row["phases_us"] = {k: 1e6 * v for k, v in r["phases_s"].items()}
        out[door] = row
    return out


FLOOR_US = -150  # the figure's left edge: a noisier (negative) difference is drawn to it, its value written
STEP_PHASES = ("sampler", "begin", "ready", "hook", "guard", "end", "decision")  # on the step's path (not metrics)


def figure(summ: dict, path: Path) -> Path | None:
    """Per door, hetero's phases (main thread, µs per step, stacked) beside the measured added CPU and wall time
    (medians, and the mean CPU with the decisions), and torch's own Python comm hook over plain DDP."""
    doors = [d for d in DOORS if d in summ]
    if not doors:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.6, 1.2 + 1.5 * len(doors)), dpi=120)
    ys = np.arange(len(doors)) * 2.0
    for y, door in zip(ys, doors):
        left, ph = 0.0, summ[door]["phases_us"]
        for i, name in enumerate(STEP_PHASES):
            v = max(ph.get(name, 0.0), 0.0)
            ax.barh(y + 0.45, v, left=left, height=0.7, color=f"C{i}", label=name if y == ys[0] else None)
            left += v
        row = summ[door]
        measured = [("added CPU (median)", row["added_cpu_us"], "k"),  # the HF door has no main-thread clock
                    ("added main-thread CPU (median)", row.get("added_main_us"), "navy"),
                    ("added CPU (median between decisions)", row.get("added_cpu_between_us"), "tab:olive"),
                    ("added wall (median)", row["added_wall_us"], "0.45"),
                    ("added CPU (mean)", row["added_cpu_mean_us"], "0.75")]
        if "floor_cpu_us" in row:
            measured.append(("its floor, CPU (median)", row["floor_cpu_us"], "tab:cyan"))
        for j, (label, v, colour) in enumerate(measured):
            if v is None:  # not measured for this door: no bar, rather than one of 0
                continue
            at = y - 0.2 - 0.2 * j  # a run's noise can make a difference negative: drawn to FLOOR_US, its value written
            ax.barh(at, max(v, FLOOR_US), height=0.18, color=colour, label=label if y == ys[0] else None)
            if v < FLOOR_US:
                ax.text(FLOOR_US + 5, at, f"{v:+.0f}", va="center", fontsize=6,
                        bbox={"facecolor": "w", "lw": 0, "pad": 0.3})
    ax.axvline(100, color="tab:red", ls="--", lw=0.8)
    ax.set_xlim(left=FLOOR_US - 10)
    ax.set_yticks(ys, [LABELS[d] for d in doors])
    ax.invert_yaxis()
    ax.set_xlabel("µs per step (2 gloo ranks; DDP, FSDP2: Linear(8, 8), 4 samples per rank; HF: a tiny GPT-2)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Host time hetero adds per step: its phases (stacked) and the measured totals; dashed: 100 µs",
                 fontsize=9)
    fig.tight_layout()
    safeio.atomic_write(path, lambda fh: fig.savefig(fh, format="png"))  # never through a planted link
    plt.close(fig)
    return path


def section(summ: dict) -> list[str]:
    """The report's lines: the added host time per door, then its breakdown by phase."""
    doors = [d for d in DOORS if d in summ]
    steps = summ.get("steps")
    hf = f"; HF Trainer: a one-layer GPT-2 of width 8, {summ['hf_steps']} steps a run" if summ.get("hf_steps") else ""
    lines = [f"## Host time per step (2 ranks, Linear(8, 8), {PER_RANK} samples per rank, {steps} steps of each loop "
             f"in turn{hf}; µs per step, hetero less plain)", ""]
    f = lambda v: f"{v:+.0f}" if v is not None else ""  # noqa: E731
    lines += markdown_table(
        ["door", "plain step (wall / CPU)", "added wall, median", "added CPU, median", "added main-thread CPU, median",
         "added CPU, median between decisions", "fastest decile (wall / CPU)", "added CPU, mean", "its floor (CPU)",
         "beyond it (CPU)"],
        [[LABELS[d], f"{summ[d]['plain_wall_us']:.0f} / {summ[d]['plain_cpu_us']:.0f}", f(summ[d]["added_wall_us"]),
          f(summ[d]["added_cpu_us"]), f(summ[d].get("added_main_us")), f(summ[d].get("added_cpu_between_us")),
          f"{f(summ[d]['added_wall_p10_us'])} / {f(summ[d]['added_cpu_p10_us'])}",
          f(summ[d]["added_cpu_mean_us"]), f(summ[d].get("floor_cpu_us")),
          f(summ[d].get("beyond_floor_cpu_us"))] for d in doors]) + [""]
    lines += ["Its floor: what any implementation of the door pays over plain DDP, measured in its own pair (the comm "
              "hook's: torch's own Python all-reduce hook; the loss door's: a forward pre-hook counting, a gradient "
              "hook marking, a seeded backward and a step clock, by hand, LossFloor). Beyond it: hetero's own "
              "Python. Between decisions: the median over the steps that neither decide nor follow a decision "
              f"(one in {REBALANCE_EVERY} decides here; by default only each epoch's last step does).", ""]
    lines += ["By phase (main thread, µs per step; decisions every "
              f"{REBALANCE_EVERY} steps, per step; metrics: one bal.metrics() call, not in the step):", ""]
    lines += markdown_table(["door", *PHASES], [[LABELS[d], *(f"{summ[d]['phases_us'].get(p, 0.0):.1f}"
                                                              for p in PHASES)] for d in doors]) + [""]
    return lines


def measure(out: Path, steps: int, notes: list[str], hf_runs: int = 4, hf_steps: int = 0) -> dict:
    """One launch of 2 ranks; its summary per door (and `steps`), with the raw times kept in out/runs/host.json.
    The HF Trainer's door runs `hf_runs` runs of each kind of `hf_steps` steps (default steps // 10), with the [hf]
    extra only (else a note)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        notes.append("host: the HF Trainer's door was skipped, the [hf] extra (transformers) is not installed")
        hf_runs = 0
    hf_steps = hf_steps or max(steps // 10, HF_WARMUP + 3)
    res = out / "runs" / "host.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    print("bench: host", flush=True)
    launch(torchrun_cmd(2, ["--out", str(res), "--steps", str(steps), "--hf-runs", str(hf_runs), "--hf-steps",
                            str(hf_steps)], "hetero.lab.host"), out / "logs" / "host.log", 900,
           {**clean_env(threads="1"), "HF_HUB_OFFLINE": "1"}, done=res, notes=notes)
    return {**summary(json.loads(res.read_text())), "steps": steps, "hf_steps": hf_steps if hf_runs else 0}


def main(argv: list[str] | None = None) -> int:
    from ..trainer.cli import CliParser
    p = CliParser(prog="python -m hetero.lab.host", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the per-step times (rank 0 writes it)")
    p.add_argument("--steps", type=int, required=True, help="steps per epoch of each loop (the first epoch warms up)")
    p.add_argument("--hf-runs", type=int, default=0, help="HF Trainer runs of each kind (0: no HF door)")
    p.add_argument("--hf-steps", type=int, default=0, help="optimizer steps per HF Trainer run")
    ns = p.parse_args(argv)
    if ns.steps < 2 or ns.hf_runs < 0 or (ns.hf_runs and ns.hf_steps < HF_WARMUP + 3):
        p.error(f"need --steps >= 2, --hf-runs >= 0 and with HF runs --hf-steps >= {HF_WARMUP + 3}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(Path(ns.out), ns.steps, hf_runs=ns.hf_runs, hf_steps=ns.hf_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
