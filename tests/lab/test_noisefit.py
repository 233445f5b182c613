"""The noise fit recovers known jitter parameters from steps.csv-like frames, its draws keep what was fitted, and a
replayed scenario gives the bench's epoch/ideal: exactly 1 for dp on a steady 2x case without noise, more with it."""
import json

import numpy as np
import pandas as pd
import pytest

from hetero.core.partition import batch_sizes, predicted_step_s
from hetero.lab.noisefit import fit_jitter, fit_steps, ideal_costs, over_ideal, replay

SIGMA, PHI, RHO = np.array([0.05, 0.10, 0.20]), 0.6, 0.5


def synthetic_jitter(epochs=50, steps=40, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """[T, 3] lognormal jitter: log an AR(1) (coefficient PHI, restarted each epoch) per rank, ranks 0 and 1
    correlated RHO at each step (a shared core), rank 2 independent; std SIGMA."""
    rng = np.random.default_rng(seed)
    cov = np.array([[1, RHO, 0], [RHO, 1, 0], [0, 0, 1.0]])
    e = rng.standard_normal((epochs, steps, 3)) @ np.linalg.cholesky(cov).T
    z = np.empty_like(e)
    z[:, 0] = e[:, 0]
    for t in range(1, steps):
        z[:, t] = PHI * z[:, t - 1] + np.sqrt(1 - PHI ** 2) * e[:, t]
    return np.exp(SIGMA * z.reshape(-1, 3)), np.repeat(np.arange(1, epochs + 1), steps)


def check_recovered(fit):
    assert fit.sigma == pytest.approx(SIGMA, rel=0.1)
    assert fit.phi == pytest.approx([PHI] * 3, abs=0.06)
    assert fit.corr[0, 1] == pytest.approx(RHO, abs=0.08)
    assert abs(fit.corr[0, 2]) < 0.08 and abs(fit.corr[1, 2]) < 0.08
    assert fit.jitter.mean(0) == pytest.approx([1, 1, 1])


def test_fit_recovers_sigma_ar_coefficient_and_cross_rank_correlation():
    check_recovered(fit_jitter(*synthetic_jitter()))


def test_fit_from_a_steps_frame_divides_out_each_ranks_cost():
    """steps.csv rows in any order; rank i costs s_i (a + c b) with its own batch sizes; rank 2 is 2x slower."""
    jitter, epoch = synthetic_jitter()
    fixed, per = np.array([0.01, 0.01, 0.02]), np.array([1e-3, 1e-3, 2e-3])
    rng = np.random.default_rng(1)
    batch = rng.integers(40, 120, jitter.shape)
    step = np.tile(np.arange(40), 50)
    rows = pd.DataFrame({"epoch": np.repeat(epoch, 3), "step": np.repeat(step, 3),
                         "rank": np.tile([0, 1, 2], len(epoch)), "batch_size": batch.ravel(),
                         "compute_s": ((fixed + per * batch) * jitter).ravel()})
    fit = fit_steps(rows.sample(frac=1, random_state=0), fixed, per)
    check_recovered(fit)
    assert fit_steps(rows, fixed, per, steady_from=26).jitter.shape == (25 * 40, 3)


def test_preemption_spikes_show_as_skew_and_the_bootstrap_keeps_the_tail():
    rng = np.random.default_rng(2)
    jitter = np.exp(0.02 * rng.standard_normal((2000, 2)))
    jitter[rng.random((2000, 2)) < 0.03] *= 1.5  # the scheduler takes the core for a third of a step
    fit = fit_jitter(jitter, np.repeat(np.arange(100), 20))
    assert (fit.skew > 2).all()
    draw = fit.sample(np.random.default_rng(3), 20000)
    assert np.quantile(draw, 0.99, axis=0) == pytest.approx(np.quantile(fit.jitter, 0.99, axis=0), rel=0.03)
    # the lognormal AR(1) alternative has the same spread but no tail
    assert (np.quantile(fit.ar1(np.random.default_rng(3), 20000), 0.99, axis=0)
            < np.quantile(fit.jitter, 0.99, axis=0) - 0.1).all()


def test_bootstrap_draws_keep_cross_rank_correlation_and_never_join_two_epochs():
    fit = fit_jitter(*synthetic_jitter())
    draw = fit.sample(np.random.default_rng(4), 4000, block=4)
    assert draw.shape == (4000, 3) and draw.mean(0) == pytest.approx([1, 1, 1], abs=0.01)
    assert np.corrcoef(np.log(draw).T)[0, 1] == pytest.approx(fit.corr[0, 1], abs=0.05)
    # one value per epoch: a block of 4 drawn from 6-step epochs is constant
    marked = fit_jitter(np.repeat(np.arange(1.0, 21.0), 6)[:, None] * [1, 1], np.repeat(np.arange(20), 6))
    blocks = marked.sample(np.random.default_rng(5), 400, block=4)[:, 0].reshape(-1, 4)
    assert (blocks == blocks[:, :1]).all()
    # epoch_steps: every simulated epoch of 10 steps draws from one measured epoch (the load of that epoch), and
    # the epochs drawn differ
    epochs = marked.sample(np.random.default_rng(6), 400, block=4, epoch_steps=10)[:, 0].reshape(-1, 10)
    assert (epochs == epochs[:, :1]).all() and len(np.unique(epochs[:, 0])) > 10


def test_fit_rejects_empty_or_nonpositive_steps_and_takes_a_single_one():
    with pytest.raises(ValueError):
        fit_jitter(np.ones((0, 2)), [])
    one = fit_jitter(np.ones((1, 2)), [1])  # a bench with one steady step: no lag, no correlation to fit
    assert one.phi.tolist() == [0, 0] and one.corr.tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ValueError):
        fit_jitter(np.zeros((5, 2)), [1] * 5)


def cost_model(fixed, per, B, allreduce_s=0.004) -> dict:
    """The bench's cost model dict for known per-rank costs, with the sync bound."""
    m = ideal_costs(fixed, per, B, allreduce_s)
    return {**m, "sync_step_s": predicted_step_s(fixed, per, batch_sizes(np.ones(len(fixed)), B))}


STEADY_2X = cost_model(np.zeros(2), np.array([1e-3, 2e-3]), 255)  # T* splits 255 exactly 170 / 85


def test_ideal_costs_is_the_optimal_integer_split():
    assert STEADY_2X["ideal_sizes"] == [170, 85] and STEADY_2X["ideal_step_s"] == pytest.approx(0.17)


def test_replay_without_noise_is_ideal_for_dp_and_the_sync_bound_for_sync():
    run = dict(global_batch=255, epochs=4, steps_per_epoch=16, cost_model=STEADY_2X, noise=0.0, steady_from=3,
               seeds=2)
    assert over_ideal("dp", **run) == pytest.approx([1.0, 1.0], abs=1e-12)
    m = STEADY_2X
    bound = (m["sync_step_s"] + m["allreduce_s"]) / (m["ideal_step_s"] + m["allreduce_s"])
    assert bound > 1.4 and over_ideal("sync", **run) == pytest.approx([bound] * 2, abs=1e-12)


def test_replay_with_fitted_noise_costs_more_than_the_ideal():
    fit = fit_jitter(*synthetic_jitter())
    two = fit_jitter(fit.jitter[:, :2], fit.epoch)
    got = over_ideal("dp", 255, 4, 16, STEADY_2X, _Process(two), 3, seeds=8)
    assert got.mean() > 1.01  # E[max of two noisy ranks] > the max of their means (exactly 1.0 without noise)


class _Process:
    def __init__(self, fit):
        self.fit = fit

    def sample(self, rng, steps):
        return self.fit.sample(rng, steps)


def test_replay_of_a_recorded_run_folder(tmp_path):
    """A run folder written as the trainer writes one (dp, 2 ranks, rank 1 2x slower, no jitter, all-reduce 4 ms,
    1 ms of loop overhead per step): the replay measures 1 + overhead and predicts the same."""
    B, steps, epochs = 255, 16, 4
    sizes = {1: [128, 127], 2: [170, 85], 3: [170, 85], 4: [170, 85]}
    rows, eps = [], []
    for e in range(1, epochs + 1):
        comp = np.asarray(STEADY_2X["per_sample_s"]) * sizes[e]
        for s in range(steps):
            for r in range(2):
                rows.append({"epoch": e, "step": s, "rank": r, "batch_size": sizes[e][r], "compute_s": comp[r],
                             "wait_s": 0.004 + comp.max() - comp[r], "delay_s": 0.0})
        eps.append({"epoch": e, "epoch_time_s": steps * (comp.max() + 0.004 + 0.001), "steps": steps})
    pd.DataFrame(rows).to_csv(tmp_path / "steps.csv", index=False)
    pd.DataFrame(eps).to_csv(tmp_path / "epochs.csv", index=False)
    (tmp_path / "config.json").write_text(json.dumps({"config": {
        "scheme": "dp", "global_batch": B, "epochs": epochs, "rebalance_every": 0, "smoothing": 0.0, "deadband": 0.0,
        "min_batch": 1, "sit_out": False}}))
    got = replay(tmp_path, STEADY_2X, 3, seeds=2)
    expect = 1 + 0.001 / (STEADY_2X["ideal_step_s"] + 0.004)
    assert got["measured"] == pytest.approx(expect) and got["simulated"] == pytest.approx(expect)
    assert got["rest_per_step_s"] == pytest.approx(0.001) and got["noise"]["sigma"] == pytest.approx([0, 0], abs=1e-9)
