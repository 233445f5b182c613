"""#48 item 11: the paper's grid (notebooks/params/paper.yaml) runs the paper's rule as written. Its dp and edp
runs turn hetero's noise guards off, and a run with the grid's settings, on the command line, moves the sizes at
every epoch exactly as DP-SGD says: p_i <- (p_i / t_i) / sum_j (p_j / t_j), times B, rounded, from the previous
epoch's sizes and compute times in ranks.csv. (With the default significance 1 a run kept [44, 20] where the rule
said [45.55, 18.45].)"""
from __future__ import annotations

import numpy as np
import pytest

from hetero.core.cpuquota import own_quota
from hetero.lab.gridplan import plan_grid, read_parameters

from helpers import ROOT, read_run, run_train

pytestmark = [pytest.mark.launch, pytest.mark.slow]  # a torchrun run of about a minute on 2 busy cores

GUARDS = ("significance", "smoothing", "deadband")


def _paper_runs() -> list:
    params = read_parameters([str(ROOT / "notebooks/params/paper.yaml")], [], [])
    params.pop("device")  # checked against this host's GPUs otherwise; the rule does not depend on it
    return [r for r in plan_grid("paper", runs_root="/nonexistent", **params).runs if r.config.scheme in ("dp", "edp")]


def _paper_rule(sizes: np.ndarray, compute_s: np.ndarray, global_batch: int) -> np.ndarray:
    """DP-SGD's next sizes: throughput shares of the global batch, rounded (largest remainder: they sum to B)."""
    rate = sizes / compute_s
    exact = global_batch * rate / rate.sum()
    out = np.floor(exact).astype(int)
    for i in np.argsort(out - exact)[:global_batch - out.sum()]:  # the largest fractional parts round up
        out[i] += 1
    return out


def test_the_paper_grid_turns_the_noise_guards_off():
    runs = _paper_runs()
    assert len(runs) == 40  # 2 models x 2 delays x 5 seeds x {dp, edp}
    for r in runs:
        assert {g: getattr(r.config, g) for g in GUARDS} == dict.fromkeys(GUARDS, 0), r.name


def test_a_run_with_the_paper_grid_s_settings_follows_the_paper_s_rule_every_epoch(tmp_path):
    if np.isfinite(own_quota()[0]):
        pytest.skip("a CFS quota: the rules time a quota'd rank by the CPU it sustains (docs/balancers.md#quota)")
    cfg = _paper_runs()[0].config
    guards = [a for g in GUARDS for a in (f"--{g}", str(getattr(cfg, g)))]
    B = 128
    run = tmp_path / "dp"
    run_train(["--model", "tiny", "--data", "synthetic", "--subset", str(16 * B), "--test-subset", "256",
               "--global-batch", str(B), "--epochs", "3", "--scheme", "dp", "--hetero", "1:slowdown=3",
               "--threads", "1", "--device", "cpu", *guards, "--run-dir", str(run)], nproc=2)
    ranks = read_run(run)["ranks"].sort_values(["epoch", "rank"])
    epochs = [g for _, g in ranks.groupby("epoch")]
    moved = 0
    for before, after in zip(epochs, epochs[1:]):
        want = _paper_rule(before.batch_size.to_numpy(), before.compute_s.to_numpy(), B)
        got = after.batch_size.to_numpy()
        assert got.tolist() == want.tolist(), (before, after)
        moved += not np.array_equal(got, before.batch_size.to_numpy())
    # the rule was exercised: the first decision moved the sizes away from the even split (rank 1 is 3x slower);
    # later ones may keep them, when the split already matches the measured speeds (whether they move again is the
    # host's noise, not the rule)
    assert moved >= 1 and epochs[1].batch_size.to_numpy()[1] < B // 2
