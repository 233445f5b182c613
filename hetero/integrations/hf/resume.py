"""hetero's part of a Hugging Face Trainer checkpoint: the Balance's state, mid-epoch position included, and the
sizes already fixed for the steps just ahead. Every use of Balance members beyond its user verbs for resuming is here.

Semantics: `Balance.state_dict()` holds the position (`step`: steps ended in the epoch) and `load_state_dict` makes
hetero's sampler start there, so the resumed epoch's remaining windows are cut from the same permutation and every
sample of the epoch is consumed once. The Trainer must then not skip batches itself (its `skip_first_batches`
would skip them a second time): HeteroTrainer resumes with `ignore_data_skip=True`, transformers' own switch for it.

A decision made after step s takes effect at the first step no rank's sampler has handed out (DataLoader workers
run ahead), e.g. decided at 22, in force from 27. A checkpoint at 25 keeps the sizes of 25 and 26, which were fixed
before the decision: the Balance's state holds the regimes still in force (plan.py), so nothing here reaches into it.
"""
from __future__ import annotations

import os

import torch

from ...core.balance import Balance

STATE_NAME = "hetero_balance.pt"  # in each checkpoint-N folder, beside trainer_state.json


def checkpoint(bal: Balance) -> dict:
    """Collective, between steps, on every rank: plain lists for torch.save (loaded with weights_only=True)."""
    return {"balance": bal.state_dict()}


def read(folder: str) -> dict:
    """hetero's state from a checkpoint folder; one-line ValueError where there is none (a plain Trainer's)."""
    path = os.path.join(folder, STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"hetero: {folder} has no {STATE_NAME}: it was not saved by HeteroTrainer")
    saved = torch.load(path, weights_only=True)
    return saved if "balance" in saved else {"balance": saved}  # the earlier format: the state alone


def restore(bal: Balance, saved: dict) -> None:
    """Load the state (after attach and batch_sampler: the identities and the epoch length are known)."""
    state = saved["balance"]
    spe, old = state.get("steps_per_epoch"), state.get("version", 1) < 3
    # a state of format 2 (before Balance states told a complete epoch apart) saved at an epoch's end reads "step 0
    # of that epoch"; the Trainer's steps count whole epochs from 0, so its global step tells which it was
    if old and not state.get("step") and spe and state["global_step"] == (state["epoch"] + 1) * spe:
        state = {**state, "version": 3, "step": spe}
    bal.load_state_dict(state)
