"""The HF Trainer's gradient accumulation with hetero's per-rank micro-batch counts: `Balance(micro_batch=m)`,
m = per_device_train_batch_size, global_batch B = world x m x G (G = gradient_accumulation_steps: the plain Trainer's
B), and rank i runs k_i micro-batches per optimizer step (sum of k_i x m = B), decided by speed.

The Trainer's loop counts G entries per optimizer step: it calls on_step_begin at the first, runs all but the last
under no_sync and steps the optimizer after the last. hetero keeps that count and hands it, per step, G - 1 empty
placeholders and one last entry holding this rank's k_i micro-batches (`Micro`). HeteroTrainer.training_step does
nothing for a placeholder and runs the k_i micro-batches of the last entry, all but the last under DDP's no_sync: the
gradients are all-reduced once, on each rank's last micro-batch, and hetero's comm hook weights that one all-reduce.
The train DataLoader reports G entries per step (`StepLength`), so the Trainer's max_steps, LR schedule, logging
and save_steps count optimizer steps as the plain Trainer's do with the same B.
"""
from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

PLACEHOLDER: dict = {}  # an entry without samples: no forward, no backward, a loss of 0


class Micro(list):
    """One optimizer step's micro-batches on this rank (k_i dicts of m samples each), as one entry of the Trainer."""


def pack(batches: list, entries: int) -> list:
    """The Trainer's `entries` (G) for one step: G - 1 placeholders, then every micro-batch of the step."""
    return [PLACEHOLDER] * (entries - 1) + [Micro(batches)]


class StepLength(Sampler):
    """hetero's batch sampler, its length G entries per step (the Trainer sizes its epoch and schedule from it)."""

    def __init__(self, sampler, steps_per_epoch: int, entries: int):
        self.sampler, self.steps_per_epoch, self.entries = sampler, steps_per_epoch, entries

    def __len__(self) -> int:
        return self.steps_per_epoch * self.entries

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
