"""The floor of a comm hook written in Python (issue 51, docs/benchmarks.md#host): CPU and wall µs per step that
torch's own Python all-reduce hook and a once-per-step scaling of the loss's gradient add to DDP's built-in C++
all-reduce, on a step that is mostly host time (Linear(8, 8), 4 samples a rank, gloo). The three DDP models take
turns step by step in the same two processes (the order alternating), so load from elsewhere falls on each alike.

    torchrun --standalone --nproc-per-node=2 scripts/weighting_floor.py [--steps 3000] [--warmup 500]

Rank 0 prints each one's median CPU and wall time per step, and the fastest decile of its CPU time.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


class _Scale(torch.autograd.Function):
    """The gradient flowing back into the output, times s; one callback queued at the backward's end (where
    hetero's `ready` mark would go)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: None)
        return g * ctx.s, None


def _model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Linear(8, 8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=500)
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    models = {"plain DDP": _model(), "torch's Python hook": _model(), "scaled once a step": _model()}
    models["torch's Python hook"].register_comm_hook(None, default_hooks.allreduce_hook)
    models["scaled once a step"].module.register_forward_hook(lambda mod, args, out: _Scale.apply(out, 1.0))
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    spent: dict[str, list] = {k: [] for k in models}
    for i in range(a.steps):
        for k in (list(models) if i % 2 else list(models)[::-1]):
            c0, w0 = time.process_time(), time.perf_counter()
            torch.nn.functional.mse_loss(models[k](x), y).backward()
            opts[k].step()
            opts[k].zero_grad()
            spent[k].append((time.process_time() - c0, time.perf_counter() - w0))
    if dist.get_rank() == 0:
        base = np.median(np.array(spent["plain DDP"][a.warmup:])[:, 0]) * 1e6
        for k, v in spent.items():
            t = np.array(v[a.warmup:]) * 1e6
            cpu = np.median(t[:, 0])
            print(f"{k:22s} CPU median {cpu:6.0f} µs ({cpu - base:+5.0f}), fastest decile "
                  f"{np.percentile(t[:, 0], 10):6.0f}, wall median {np.median(t[:, 1]):6.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
