"""Every random stream of a run, derived from (run seed, epoch, purpose): a resumed run needs no saved RNG
state, every rank draws the same permutation without communicating, and no two purposes share a stream."""
from __future__ import annotations

import numpy as np
import torch

PERMUTATION = 0        # the epoch's shared sample order (same on every rank)
SUBSET = 7             # which training samples a --subset keeps (with seed 0: independent of the run seed)
EMULATOR = 1000        # + global rank: random per-step delays
AUGMENT = 2000         # + global rank: crops and flips


def epoch_seed(seed: int, epoch: int, purpose: int = PERMUTATION) -> int:
    """A 32-bit seed for one (run seed, epoch, purpose)."""
    return int(np.random.SeedSequence([seed, epoch, purpose]).generate_state(1)[0])


def permutation(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's shared sample order: the same on every rank, drawn on the CPU."""
    gen = torch.Generator().manual_seed(epoch_seed(seed, epoch, PERMUTATION))
    return torch.randperm(n_samples, generator=gen)
