"""Sampler: disjoint slices, equal steps, sizes sum to B, every sample at most once, fewer than B left out."""
import numpy as np
import pytest
import torch

from hetero.core.partition import batch_sizes
from hetero.core.sampler import EpochPlan


def _epoch_indices(plan: EpochPlan, sizes_per_step, world: int):
    per_rank = [[] for _ in range(world)]
    for step in range(plan.steps):
        for r in range(world):
            idx = plan.indices(step, sizes_per_step[step], r)
            assert len(idx) == sizes_per_step[step][r]
            per_rank[r].append(idx)
    return [torch.cat(x) if x else torch.empty(0, dtype=torch.long) for x in per_rank]


def test_random_world_shares_n_b():
    rng = np.random.default_rng(1)
    for trial in range(300):
        world = int(rng.integers(1, 9))
        B = int(rng.integers(world, 300))
        N = int(rng.integers(B, 5000))
        plan = EpochPlan(N, B, seed=trial, epoch=int(rng.integers(1, 5)))
        assert plan.steps == N // B
        # shares may change at any step (mid-epoch rebalancing) and are arbitrary
        sizes = [batch_sizes(rng.dirichlet(np.ones(world)), B, 1) for _ in range(plan.steps)]
        per_rank = _epoch_indices(plan, sizes, world)
        allidx = torch.cat(per_rank)
        assert len(allidx) == plan.steps * B
        assert len(torch.unique(allidx)) == len(allidx)          # disjoint, no repeats within the epoch
        assert N - len(allidx) < B                                # all but fewer than B samples seen
        assert allidx.min() >= 0 and allidx.max() < N


def test_same_permutation_on_every_rank_and_new_one_each_epoch():
    a, b = EpochPlan(1000, 100, seed=3, epoch=2), EpochPlan(1000, 100, seed=3, epoch=2)
    assert torch.equal(a.perm, b.perm)
    assert not torch.equal(a.perm, EpochPlan(1000, 100, seed=3, epoch=3).perm)


def test_bad_sizes_are_refused():
    plan = EpochPlan(1000, 100, seed=0, epoch=1)
    with pytest.raises(ValueError, match="do not sum"):
        plan.indices(0, [50, 49], 0)
    with pytest.raises(IndexError):
        plan.indices(10, [50, 50], 0)
    with pytest.raises(ValueError, match="exceeds"):
        EpochPlan(10, 100, 0, 1)
