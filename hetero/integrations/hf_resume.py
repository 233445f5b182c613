"""hetero's part of a Hugging Face Trainer checkpoint: the Balance's state, mid-epoch position included, and the
sizes already fixed for the steps just ahead. Every use of Balance members beyond its user verbs for resuming is here.

Semantics: `Balance.state_dict()` holds the position (`step`: steps ended in the epoch) and `load_state_dict` makes
hetero's sampler start there, so the resumed epoch's remaining windows are cut from the same permutation and every
sample of the epoch is consumed once. The Trainer must then not skip batches itself (its `skip_first_batches`
would skip them a second time): HeteroTrainer resumes with `ignore_data_skip=True`, transformers' own switch for it.

A decision made after step s takes effect at the first step no rank's sampler has handed out (DataLoader workers
run ahead), e.g. decided at 22, in force from 27. A checkpoint at 25 must keep the sizes of 25 and 26: they were
fixed before the decision and their samples were cut by them. `pending` lists those sizes, and `restore` fixes them
again in the resumed schedule.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..core.balance import Balance

STATE_NAME = "hetero_balance.pt"  # in each checkpoint-N folder, beside trainer_state.json


def checkpoint(bal: Balance, next_step: int, fixed_until: int) -> dict:
    """Collective, between steps, on every rank: plain lists for torch.save (loaded with weights_only=True).
    next_step: the Trainer's global_step (steps ended, the next step's position: every epoch has
    bal.steps_per_epoch of them); fixed_until: the first position whose sizes no decision has fixed yet."""
    bal.observe_now()  # on main's Balance this makes state_dict() keep the mid-epoch position; later it is a no-op
    state = bal.state_dict()
    until = max([fixed_until, *(d.effective for d in bal.decisions)])
    spe = bal.steps_per_epoch
    pending = [[p // spe, p % spe, bal.sizes_at(p // spe, p % spe).tolist()] for p in range(next_step, until)]
    return {"balance": state, "pending": pending}


def read(folder: str) -> dict:
    """hetero's state from a checkpoint folder; one-line ValueError where there is none (a plain Trainer's)."""
    path = os.path.join(folder, STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"hetero: {folder} has no {STATE_NAME}: it was not saved by HeteroTrainer")
    saved = torch.load(path, weights_only=True)
    return saved if "balance" in saved else {"balance": saved, "pending": []}  # the earlier format: the state alone


def restore(bal: Balance, saved: dict) -> int:
    """Load the state and fix the pending sizes again (after batch_sampler: the epoch length is known); returns the
    first position whose sizes are not fixed by the checkpoint."""
    bal.load_state_dict(saved["balance"])
    schedule, spe, until = bal.schedule, bal.steps_per_epoch, 0  # the schedule's sizes per position (schedule.py)
    for epoch, step, sizes in saved["pending"]:
        pos = epoch * spe + step
        schedule.planned[pos] = np.asarray(sizes, np.int64)  # as a sampler's first ask would fix them
        until = max(until, pos + 1)
    return until
