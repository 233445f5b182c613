"""One real step through torchrun + DDP + the communication hook, against single-process SGD.

Unequal batch sizes come from a replayed record (the trainer's --replay), so the step under test is the real
trainer step with its real weights b_i/B (EDP) or 1/world (Sync, DP).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hetero.core.sampler import EpochPlan
from hetero.trainer.data import DeviceLoader, load_data
from hetero.trainer.models import build_model

from helpers import run_train

pytestmark = pytest.mark.launch

LR, SEED = 0.5, 3


def _replay_folder(path, sizes):
    path.mkdir()
    rows = ["epoch,step,rank,batch_size"] + [f"1,0,{r},{b}" for r, b in enumerate(sizes)]
    (path / "steps.csv").write_text("\n".join(rows) + "\n")
    return path


def _reference(sizes, weighted: bool) -> dict[str, torch.Tensor]:
    B = sum(sizes)
    data = load_data("synthetic", "data", subset=B)
    loader = DeviceLoader(data.train_x, data.train_y, data.mean, data.std, torch.device("cpu"), augment=False)
    window = EpochPlan(B, B, SEED, 1).perm[:B]
    torch.manual_seed(SEED)
    model = build_model("tiny_nobn")
    grads = None
    offsets = np.cumsum([0, *sizes])
    for r, b in enumerate(sizes):
        model.zero_grad()
        x, y = loader.batch(window[offsets[r]:offsets[r + 1]])
        F.cross_entropy(model(x), y).backward()
        w = b / B if weighted else 1 / len(sizes)
        g = [w * p.grad.clone() for p in model.parameters()]
        grads = g if grads is None else [a + c for a, c in zip(grads, g)]
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= LR * g
    return {k: v.clone() for k, v in model.state_dict().items()}


def _trained(tmp_path, sizes, scheme) -> dict[str, torch.Tensor]:
    B = sum(sizes)
    replay = _replay_folder(tmp_path / "record", sizes)
    run = tmp_path / "run"
    run_train(["--model", "tiny_nobn", "--data", "synthetic", "--subset", str(B), "--test-subset", "64",
               "--global-batch", str(B), "--epochs", "1", "--lr", str(LR), "--momentum", "0",
               "--weight-decay", "0", "--augment", "false", "--seed", str(SEED), "--scheme", scheme,
               "--replay", str(replay), "--run-dir", str(run)], nproc=len(sizes))
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("sizes", [[5, 27], pytest.param([3, 11, 18], marks=pytest.mark.slow)])  # 3 ranks: slow tier
def test_edp_step_equals_single_process_sgd_on_the_global_batch(tmp_path, sizes):
    got = _trained(tmp_path, sizes, "edp")
    exact, equal_mean = _reference(sizes, weighted=True), _reference(sizes, weighted=False)
    assert _max_diff(got, exact) < 1e-5
    assert _max_diff(exact, equal_mean) > 1e-3     # the test can tell the two apart


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["sync", "dp"])
def test_sync_and_dp_give_the_equal_weight_mean(tmp_path, scheme):
    sizes = [5, 27]
    got = _trained(tmp_path, sizes, scheme)
    assert _max_diff(got, _reference(sizes, weighted=False)) < 1e-5
    assert _max_diff(got, _reference(sizes, weighted=True)) > 1e-3


@pytest.mark.launch
@pytest.mark.slow
def test_the_trainer_accumulates_the_exact_global_batch_gradient(tmp_path):
    """The built-in trainer's step on 3 ranks, accumulating micro-batches of m = 4 samples (replayed counts [1, 2,
    5]), against single-process SGD."""
    m, b = 4, 32
    sizes = [m * k for k in (1, 2, 5)]
    run = tmp_path / "run"
    run_train(["--model", "tiny_nobn", "--data", "synthetic", "--subset", str(b), "--test-subset", "64",
               "--global-batch", str(b), "--micro-batch", str(m), "--epochs", "1", "--lr", str(LR), "--momentum", "0",
               "--weight-decay", "0", "--augment", "false", "--seed", str(SEED), "--scheme", "edp",
               "--replay", str(_replay_folder(tmp_path / "record", sizes)), "--run-dir", str(run)], nproc=3)
    got = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    assert _max_diff(got, _reference(sizes, weighted=True)) < 1e-5
    assert _max_diff(got, _reference(sizes, weighted=False)) > 1e-3
