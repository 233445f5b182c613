"""What one benchmark run measures (bench.py runs it): the Suite of sizes, schemes and parts, its --quick variant,
and the outside stragglers it may put on the last rank. Its own module so that the parts that take a Suite
(efficiency.py, outside.py) need not import bench.py, which imports them."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.partition import SCHEMES
from . import hfbench


def kinds(world: int) -> dict[str, tuple[str, str]]:
    """(label, --straggler) of each outside straggler on the last rank."""
    last = world - 1
    return {"quota": ("1/3 core (CFS quota, 100 ms periods)", f"{last}:quota=0.33"),
            "quota-10ms": ("1/3 core (CFS quota, 10 ms periods)", f"{last}:quota=0.33@10ms"),
            "neighbour": ("busy neighbour on its core", f"{last}:neighbour=busy")}


PARTS = ("balance", "outside", "overhead", "fsdp", "deepspeed", "balancer", "hf", "recovery", "host", "tokens")


@dataclass(frozen=True, kw_only=True)
class Suite:
    """What one benchmark run measures (the full suite; --quick shrinks it)."""
    worlds: tuple[int, ...] = (2, 4)            # CPU ranks, gloo, one torch thread each
    slowdowns: tuple[float, ...] = (2.0, 4.0)   # the last rank computes this many times slower
    delays: tuple[float, ...] = (2.0,)          # or sleeps this many equal-share steps per step (constant delay)
    schemes: tuple[str, ...] = tuple(SCHEMES)
    epochs: int = 6
    steady_from: int = 3                        # first steady-state epoch (1-based)
    batch_per_rank: int = 128                   # global batch = this x ranks: steps long against host noise
    steps: int = 16                             # steps per epoch (synthetic samples = steps x global batch)
    repeats: int = 3                            # runs of every balance row (the spread is their range)
    overhead_launches: int = 2
    overhead_epochs: int = 12                   # trainer and plain epochs per launch, in turn; the first warm up
    workers: tuple[int, ...] = tuple(2 ** k for k in range(1, 13))  # balancer sizes, 2..4096
    hf_runs: int = 8                            # HF Trainer runs with hetero and without, in turn
    hf_steps: int = 40                          # optimizer steps per HF Trainer run
    tokens_runs: int = 9                        # runs of each column of the tokens part (tokenbench.py), in turn
    #                                             (9: 16 minutes; medians of 3 did not repeat, benchmarks.md#tokens)
    tokens_steps: int = 80                      # optimizer steps per run of it
    recovery_kills: int = 3                     # two-agent runs, each losing one agent mid-epoch (median of these)
    host_steps: int = 3000                      # steps of each loop in turn in the host part (Linear(8, 8))
    pin: bool = True                            # more ranks than cores: pin them in blocks (see affinity())
    micro_batch: int = 0                        # the trainer's --micro-batch (0: per-rank batch sizes)
    outside: tuple[str, ...] = ("quota", "quota-10ms", "neighbour")  # stragglers on the last of 2 ranks (--straggler)
    come_and_go: tuple[str, ...] = ("dp", "edp", "affine")  # schemes run with a neighbour that comes and goes
    come_epochs: tuple[int, int, int] = (3, 6, 9)  # its busy neighbour: on after epoch A, off after B, of C epochs
    come_busy: int = 2                          # spinning processes the neighbour runs (1: rank 1 keeps 1/2 its core)
    parts: tuple[str, ...] = PARTS

    def global_batch(self, world: int) -> int:
        return self.batch_per_rank * world

    def subset(self, world: int) -> int:
        return self.steps * self.global_batch(world)

    def __post_init__(self):
        if not 1 <= self.steady_from <= self.epochs or self.overhead_epochs < 2:
            raise ValueError("need 1 <= steady_from <= epochs and overhead_epochs >= 2")
        if self.batch_per_rank < 4 or self.steps < 1 or self.repeats < 1 or self.overhead_launches < 1:
            raise ValueError("need batch_per_rank >= 4, steps >= 1, repeats >= 1 and overhead_launches >= 1")
        if self.recovery_kills < 1:
            raise ValueError("need recovery_kills >= 1")
        if self.host_steps < 20:
            raise ValueError("need host_steps >= 20")
        if self.hf_runs < 1 or self.hf_steps < hfbench.WARMUP + 2:
            raise ValueError(f"need hf_runs >= 1 and hf_steps >= {hfbench.WARMUP + 2}")
        if self.tokens_runs < 1 or self.tokens_steps < hfbench.WARMUP + 2:
            raise ValueError(f"need tokens_runs >= 1 and tokens_steps >= {hfbench.WARMUP + 2}")
        if not self.worlds or min(self.worlds) < 2 or not (self.slowdowns or self.delays):
            raise ValueError("need worlds of at least 2 ranks and a slowdown or a delay")
        if min(self.slowdowns, default=1) < 1 or min(self.delays, default=1) <= 0:
            raise ValueError("need slowdowns of at least 1 and delays above 0")
        if bad := [s for s in self.schemes if s not in SCHEMES]:
            raise ValueError(f"unknown scheme {bad[0]!r}: choose from {', '.join(SCHEMES)}")
        if self.micro_batch < 0 or (self.micro_batch and self.batch_per_rank % self.micro_batch):
            raise ValueError("need micro_batch >= 0 dividing batch_per_rank")
        if bad := [k for k in self.outside if k not in kinds(2)]:
            raise ValueError(f"unknown outside straggler {bad[0]!r}: choose from {', '.join(kinds(2))}")
        if bad := [s for s in self.come_and_go if s not in SCHEMES]:
            raise ValueError(f"unknown scheme {bad[0]!r} in come_and_go: choose from {', '.join(SCHEMES)}")
        if self.come_busy < 1:
            raise ValueError("need come_busy >= 1")
        if not 1 <= self.come_epochs[0] < self.come_epochs[1] < self.come_epochs[2]:
            raise ValueError("need come_epochs A, B, C with 1 <= A < B < C")
        if bad := [p for p in self.parts if p not in PARTS]:
            raise ValueError(f"unknown part {bad[0]!r}: choose from {', '.join(PARTS)}")
        if self.pin and "balance" in self.parts and max(self.worlds) > 2 * len(os.sched_getaffinity(0)):
            raise ValueError(f"{max(self.worlds)} pinned ranks put more than 2 on a core, beyond the shared-core cost "
                             f"model (hetero.lab.coupled): use fewer ranks or --no-pin")


QUICK = dict(worlds=(2,), schemes=("sync", "dp", "edp"), delays=(), epochs=4, repeats=1, overhead_launches=1,
             overhead_epochs=8, hf_runs=2, hf_steps=20, recovery_kills=1, host_steps=300, tokens_runs=1,
             tokens_steps=16,
             outside=("quota", "neighbour"), come_and_go=("dp",), come_epochs=(2, 4, 6))
