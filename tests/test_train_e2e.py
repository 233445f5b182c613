"""End to end through torchrun: the paper's DP rule moves work off a 3x slower rank, the run folder is complete,
compute time excludes waiting, and the distributed evaluation is exact."""

import pytest
import torch

from hetero.data import DeviceLoader, load_data
from hetero.models import build_model
from hetero.train import evaluate

from conftest import read_run, run_train

# A large global batch keeps the per-step fixed cost small against the per-sample work, so the paper's rule (which
# assumes step time proportional to batch) has its textbook fixed point: a 3x slower rank gets 1/4.
ARGS = ["--model", "tiny", "--data", "synthetic", "--subset", "8192", "--test-subset", "1000",
        "--global-batch", "512", "--epochs", "3", "--threads", "1"]

EPOCH_COLS = {"epoch", "train_time_s", "epoch_time_s", "eval_time_s", "train_loss", "train_top1", "test_loss",
              "test_top1", "test_top5", "lr"}
RANK_COLS = {"epoch", "rank", "share", "batch_size", "steps", "samples", "compute_s", "wait_s"}
SUMMARY_KEYS = {"train_time_s", "final_test_top1", "best_test_top1", "scheme", "model", "hetero", "world_size",
                "mean_balance_eff", "status"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    out = {}
    for name, extra in {"slow": ["--scheme", "dp", "--hetero", "1:slowdown=3"],
                        "even": ["--scheme", "dp"]}.items():
        run_train([*ARGS, *extra, "--run-dir", str(base / name)], nproc=2)
        out[name] = base / name
    return out


def test_dp_moves_share_to_a_quarter(runs):
    r = read_run(runs["slow"])
    last = r["ranks"][r["ranks"].epoch == 3].set_index("rank")
    assert abs(last.loc[1, "share"] - 0.25) < 0.05, last
    assert r["ranks"][r["ranks"].epoch == 1].share.tolist() == [0.5, 0.5]   # starts equal
    assert r["summary"]["status"] == "completed"


def test_run_folder_has_every_file_and_column(runs):
    r = read_run(runs["slow"])
    assert EPOCH_COLS <= set(r["epochs"].columns) and r["epochs"].epoch.tolist() == [1, 2, 3]
    assert RANK_COLS <= set(r["ranks"].columns) and len(r["ranks"]) == 6
    assert SUMMARY_KEYS <= set(r["summary"])
    assert r["summary"]["world_size"] == 2 and r["summary"]["hetero"] == "1:slowdown=3"
    cfg = r["config"]
    assert {"config", "git_commit", "versions", "host", "world_size", "backend"} <= set(cfg)
    assert cfg["config"]["scheme"] == "dp" and cfg["backend"] == "gloo"
    e = r["epochs"]
    assert (e.train_time_s.diff().dropna() - e.epoch_time_s.iloc[1:].to_numpy()).abs().max() < 1e-9
    steps = r["steps"].groupby(["epoch", "rank"]).agg(batch=("batch_size", "sum"), n=("step", "count"))
    ranks = r["ranks"].set_index(["epoch", "rank"])
    assert (steps.batch == ranks.samples).all() and (steps.n == ranks.steps).all()
    assert (r["ranks"].groupby("epoch").samples.sum() == 8192 // 512 * 512).all()


def test_fast_rank_compute_excludes_waiting(runs):
    slow, even = read_run(runs["slow"])["ranks"], read_run(runs["even"])["ranks"]
    per_sample = lambda df: (df[df["rank"] == 0].compute_s.sum() / df[df["rank"] == 0].samples.sum())
    # rank 0 waits a lot for rank 1 in epoch 1 of the slow run, yet its compute per sample does not grow
    assert per_sample(slow[slow.epoch == 1]) < 1.5 * per_sample(even[even.epoch == 1])
    first = slow[slow.epoch == 1].set_index("rank")
    assert first.loc[0, "wait_s"] > first.loc[0, "compute_s"]        # it did wait: the slow rank is 3x slower
    assert first.loc[1, "compute_s"] > 2 * first.loc[0, "compute_s"]


def test_distributed_evaluation_equals_single_process(runs):
    run = runs["slow"]
    r = read_run(run)
    model = build_model("tiny")
    model.load_state_dict(torch.load(run / "checkpoint.pt", weights_only=False)["model"])
    data = load_data("synthetic", "data", subset=8192, test_subset=1000)
    loader = DeviceLoader(data.test_x, data.test_y, data.mean, data.std, torch.device("cpu"), augment=False)
    loss, top1, top5, n = evaluate(model, loader, batch=333).tolist()
    last = r["epochs"].iloc[-1]
    assert n == 1000
    assert last.test_top1 == top1 / n and last.test_top5 == top5 / n     # exact: counts of the same samples
    assert last.test_loss == pytest.approx(loss / n, rel=1e-6)
