"""hetero in a plain Accelerate loop: `prepare` is `accelerator.prepare` for the model, optimizer and LR scheduler,
with the Balance attached and the scheduler stepped once per optimizer step.

    model, opt, sched = hetero.integrations.accelerate.prepare(accelerator, bal, model, opt, sched)
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)))   # not prepared

Why the scheduler: accelerate's prepared scheduler (AcceleratedScheduler) steps the wrapped scheduler
num_processes times per optimizer step, because accelerate expects a schedule sized by the unsharded loader, whose
length is world times the steps per epoch. hetero's loader is never sharded: a schedule sized by its steps per epoch
(`bal.position.steps_per_epoch`; `len(loader)` equals it only without micro_batch, and with it is an upper bound on
a rank's micro-batches) times the epochs would reach its end after 1/world of training (LR 0 at the end of epoch 1
of 2 on two ranks). `prepare` sets the prepared
scheduler's `split_batches`, accelerate's own switch for "one scheduler step per optimizer step", and keeps
everything else of AcceleratedScheduler (no step when the optimizer step was skipped).

Accumulation: `accelerator.accumulate(model)` counts a fixed `gradient_accumulation_steps` on every rank, and
`accelerator.backward` divides each loss by it; hetero's ranks run their own counts k_i. So the Accelerator keeps
gradient_accumulation_steps=1 (prepare refuses another value in one line) and hetero's own context takes the place
of accelerate's, as short (docs/huggingface.md#accelerate-accumulation):

    for batch in loader:                       # Balance(micro_batch=m): micro-batches of m, k_i per rank and step
        with bal.step():                       # in place of accelerator.accumulate(model): no_sync but the last
            accelerator.backward(model(**batch).loss)
            if bal.sync_now:                   # the step's last micro-batch: gradients summed over the ranks
                opt.step(); sched.step(); opt.zero_grad()

accelerator.sync_gradients is then true on every micro-batch (gradient_accumulation_steps is 1): a loop that counts
optimizer steps counts where bal.sync_now is true, or reads bal.position.global_step.

An FSDP2 model (FullyShardedDataParallelPlugin(fsdp_version=2)) attaches the same way: prepare returns the
fully_shard'ed root, and attach installs hetero's weighted reduce-scatter on it (hetero.core.fsdp). So does
Accelerate's DeepSpeed plugin (DeepSpeedPlugin, gradient_accumulation_steps 1): prepare returns the DeepSpeed engine,
and attach installs hetero's DeepSpeed door on it (hetero.core.deepspeed): accelerator.backward runs the engine's
backward, which hetero weights, and its step, a no-op before the rank's last micro-batch; the prepared optimizer's
step and zero_grad are accelerate's no-ops, so the same loop runs unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

from ..core.balance import Balance


def prepare(accelerator: Accelerator, balance: Balance, *objects: Any) -> Any:
    """accelerator.prepare(*objects) (a model, optimizers, LR schedulers; never a DataLoader), then
    balance.attach(the prepared model) and one scheduler step per optimizer step. Returns what prepare returns.
    Collective (attach): call it on every rank.

    Raises:
        ValueError: in one line: a DataLoader among the objects, gradient_accumulation_steps other than 1,
            not exactly one model, or several CPU ranks without Accelerator(cpu=True)
            (accelerate would wrap no DDP).
    """
    if not isinstance(balance, Balance):
        raise TypeError(f"hetero: prepare(accelerator, balance, ...) takes a hetero.Balance, not "
                        f"{type(balance).__name__}")
    if any(isinstance(o, DataLoader) for o in objects):
        raise ValueError("hetero: leave hetero's DataLoader out of prepare: accelerate would shard its batch sampler "
                         "again (BatchSamplerShard) and hand this rank every world-th of its own batches")
    if (g := accelerator.gradient_accumulation_steps) != 1:
        raise ValueError(f"hetero: Accelerator(gradient_accumulation_steps={g}) accumulates the same count on every "
                         f"rank (and accelerator.backward divides by it): keep it 1 and accumulate per rank with "
                         f"Balance(micro_batch=m), each micro-batch in `with bal.step():`, stepping the optimizer "
                         f"where bal.sync_now")
    if (n := sum(isinstance(o, torch.nn.Module) for o in objects)) != 1:
        raise ValueError(f"hetero: prepare takes exactly one model ({n} given): the one whose gradient hetero weights")
    if accelerator.distributed_type == DistributedType.NO and balance.world > 1:
        # under torchrun on CPU ranks accelerate finds no accelerator and, without cpu=True, runs no DDP at all
        raise ValueError(f"hetero: accelerate runs no DDP on these {balance.world} ranks ({accelerator.device} "
                         f"without cpu=True): build Accelerator(cpu=True) or set ACCELERATE_USE_CPU=1, so that "
                         f"prepare wraps the model in DistributedDataParallel, whose all-reduce hetero weights")
    prepared = accelerator.prepare(*objects)
    out = tuple(prepared) if isinstance(prepared, (tuple, list)) else (prepared,)  # FSDP2's prepare: a list
    balance.attach(next(p for o, p in zip(objects, out) if isinstance(o, torch.nn.Module)))
    for sched in out:
        if isinstance(sched, AcceleratedScheduler):
            sched.split_batches = True  # one step per optimizer step: hetero's loader counts global steps
    return prepared
