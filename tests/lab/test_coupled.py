"""Ranks sharing a CPU core: processor-sharing step times, their inverse, the fitted speeds and the exact optimum."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetero.core.partition import affine_batch_sizes, predicted_step_s
from hetero.lab.coupled import coupled_batch_sizes, finish_s, fit_scale, shared_walls, unshare
from hetero.lab.simulator import Scenario, simulate


def test_shared_walls_is_processor_sharing_and_unshare_inverts_it():
    # two equal works on one core: both end at 2w; a small one ends at 2 x small, the large one at the sum
    assert shared_walls([1.0, 1.0, 3.0], [0, 0, 1]).tolist() == [2.0, 2.0, 3.0]
    assert shared_walls([0.5, 2.0], ["a", "a"]).tolist() == [1.0, 2.5]
    assert shared_walls([0.0, 2.0], [0, 0]).tolist() == [0.0, 2.0]  # a rank sitting out takes nothing
    rng = np.random.default_rng(0)
    for cores in ([0, 0, 1, 1], [0, 0, 0, 1, 2, 2], [0, 1, 2]):
        w = rng.uniform(0.01, 1, (50, len(cores)))
        assert np.allclose(unshare(shared_walls(w, cores), cores), w)


def _brute(a, c, B, cores, f, d, lo, sit_out):
    best = np.inf
    for b in itertools.product(range(B + 1), repeat=len(a)):
        if sum(b) == B and all(x >= lo or (sit_out and x == 0) for x in b):
            best = min(best, finish_s(a, c, b, cores, f, d).max())
    return best


def test_coupled_optimum_is_exact_against_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(2, 5))
        B = int(rng.integers(n, 12))
        cores = [i // 2 for i in range(n)] if rng.random() < 0.7 else list(range(n))
        a, c = rng.uniform(0, 1, n) * (rng.random() < 0.5), rng.uniform(0.1, 1, n)
        f, d = rng.choice([1.0, 2.0, 4.0], n), rng.uniform(0, 2, n) * (rng.random(n) < 0.3)
        sit_out = bool(rng.random() < 0.3)
        got = coupled_batch_sizes(a, c, B, cores, f, d, sit_out=sit_out)
        assert got.sum() == B and (sit_out or got.min() >= 1)
        assert finish_s(a, c, got, cores, f, d).max() == pytest.approx(_brute(a, c, B, cores, f, d, 1, sit_out))


def test_without_sharing_the_optimum_is_the_affine_one():
    a, c = np.array([0.01, 0.0, 0.03]), np.array([1e-3, 2e-3, 5e-4])
    for B, m in ((255, 1), (96, 8)):
        got = coupled_batch_sizes(a, c, B, [0, 1, 2], granularity=m)
        assert got.sum() == B and not (got % m).any()
        assert predicted_step_s(a, c, got) == pytest.approx(predicted_step_s(a, c, affine_batch_sizes(a, c, B,
                                                                                                    granularity=m)))
    with pytest.raises(ValueError, match="at most 2 ranks per core"):
        coupled_batch_sizes(a, c, 30, [0, 0, 0])


def test_a_delayed_ranks_work_moves_to_its_core_mate():
    # ranks 0,1 share core 0; 2,3 share core 1; rank 3 sleeps 0.2 s per step. While it sleeps rank 2 has the core
    # alone, so core 1 does as much work as core 0 (rank 3 at most what it computes in (0.256 - 0.2) / 2 s), which no
    # per-rank model with rank 2 as fast as rank 0 would allow
    c, d = 1e-3, [0, 0, 0, 0.2]
    best = coupled_batch_sizes(np.zeros(4), np.full(4, c), 512, [0, 0, 1, 1], 1.0, d)
    assert 1 <= best[3] <= 28 and best[2] + best[3] == 256
    assert finish_s(np.zeros(4), np.full(4, c), best, [0, 0, 1, 1], 1.0, d).max() == pytest.approx(0.256)


def test_fitted_speeds_are_unbiased_where_unsharing_each_step_is_not():
    """Noisy walls of equal core-mates: unsharing step by step reads the noise as one small and one large work (a
    bias of about 10%); the fixed point matches the sums of the walls and recovers the true speeds."""
    rng = np.random.default_rng(2)
    cores, s_true = [0, 0, 1, 1], np.array([1.0, 1.0, 0.8, 1.6])
    sizes = np.tile([128, 128, 200, 56], (4000, 1))
    unit = 0.002 + 1e-3 * sizes
    walls = shared_walls(s_true * unit, cores) * np.exp(0.2 * rng.standard_normal(sizes.shape) - 0.02)
    naive = unshare(walls, cores).sum(0) / unit.sum(0)
    fitted = fit_scale(walls, unit, cores)
    assert np.abs(fitted / s_true - 1).max() < 0.02  # the sampling error of 4000 steps at 20% noise, amplified
    assert np.abs(naive[:2] / s_true[:2] - 1).min() > 0.08


def test_the_simulator_shares_cores_and_its_oracle_knows_it():
    sc = Scenario(np.zeros(4), np.full(4, 1e-3), cores=[0, 0, 1, 1], hetero="3:delay=0.2")
    r = simulate(sc, "sync", 512, 1, 4)
    assert r.step_s == pytest.approx([0.2 + 0.256] * 4)  # equal shares: rank 3 computes 2 x 128 ms, then sleeps
    assert r.optimum_s == pytest.approx([0.256] * 4)
    with pytest.raises(ValueError, match="cores"):
        Scenario(np.zeros(4), np.full(4, 1e-3), cores=[0, 0, 1])
