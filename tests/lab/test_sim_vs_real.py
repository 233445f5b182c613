"""The simulator agrees with a real 2-rank CPU run of the same scenario: shares within 0.05 in every epoch. The
delay (0.2 s per step) is far above the tiny model's compute on a busy 2-core host, so the path does not hang on
timing noise."""
import numpy as np
import pandas as pd
import pytest

from hetero.core.partition import fit_affine
from hetero.lab.simulator import Scenario, simulate

from helpers import read_run, run_train

pytestmark = [pytest.mark.launch, pytest.mark.slow]  # a torchrun run of a minute or more

HETERO = "1:delay=0.2"
EPOCHS, GLOBAL_BATCH, SUBSET = 3, 64, 1024  # 16 steps per epoch; shares move in steps of 1/64
# The delayed rank's balanced batch is below 12, so both end at the bound (shares 0.81 / 0.19) however the shared
# CPU's speed drifts during the run; the epochs before show the rule's path, which the simulator must follow.
MIN_BATCH = 12


def test_simulator_reproduces_a_real_dp_run(tmp_path):
    run = tmp_path / "real"
    run_train(["--model", "tiny", "--data", "synthetic", "--subset", str(SUBSET), "--test-subset", "256",
               "--global-batch", str(GLOBAL_BATCH), "--epochs", str(EPOCHS), "--scheme", "dp", "--augment", "false",
               "--min-batch", str(MIN_BATCH), "--hetero", HETERO, "--run-dir", str(run)], nproc=2)
    r = read_run(run)
    steps, ranks = r["steps"], r["ranks"]
    # Each rank's own cost, measured in the first two epochs (two batch sizes: equal, then the first decision's),
    # with the emulated delay taken out again: the simulator adds it back from the same --hetero spec.
    first = steps[steps["epoch"] <= 2]
    costs = [fit_affine(g["batch_size"].to_numpy(), (g["compute_s"] - g["delay_s"]).to_numpy())
             for _, g in first.groupby("rank")]
    fixed, per_sample = np.array(costs).T
    sc = Scenario(np.maximum(fixed, 0), np.maximum(per_sample, 1e-7), hetero=HETERO)
    sim = simulate(sc, "dp", global_batch=GLOBAL_BATCH, epochs=EPOCHS, steps_per_epoch=SUBSET // GLOBAL_BATCH,
                   min_batch=MIN_BATCH)
    both = pd.merge(ranks[["epoch", "rank", "share"]], sim.shares_frame(), on=["epoch", "rank"],
                    suffixes=("_real", "_sim")).drop(columns="scheme")
    assert len(both) == 2 * EPOCHS
    print(both.to_string(index=False))
    # The paper's rule moves work off the delayed rank over several epochs, and the simulator follows every step.
    assert both.query("rank == 0")["share_real"].iloc[1] > 0.6
    assert np.abs(both["share_real"] - both["share_sim"]).max() < 0.05
