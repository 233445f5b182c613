"""Shared test helpers: run the real command line (python -m hetero.trainer, under torchrun) in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import Dataset

from hetero.core.balancer import Balancer
from hetero.trainer.config import Config
from hetero.lab.launch import ROOT, clean_env, torchrun_cmd
from hetero.core.partition import SCHEMES

CIFAR_JPG = ROOT.parent / "shared" / "data" / "cifar10-jpg"

# Small, fast defaults for CPU runs: tiny model, synthetic data, no augmentation noise in timing.
TINY = ["--model", "tiny", "--data", "synthetic", "--subset", "2048", "--test-subset", "512",
        "--global-batch", "128", "--epochs", "2"]


class Indexed(Dataset):
    """n random 8-vectors with labels i % 3 and their own index (the tests record which samples a rank saw)."""
    def __init__(self, n: int):
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i % 3, i


def sgd_step(model, lr: float = 0.5) -> list[torch.Tensor]:
    """One plain SGD step on the gradients already in `model`; its parameters, flattened (reference updates)."""
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return [p.detach().flatten() for p in model.parameters()]


def max_diff(got: list, want: list[torch.Tensor]) -> float:
    """Largest absolute difference between parameters as lists (from a rank's JSON) and as tensors."""
    return max((torch.tensor(g) - w).abs().max().item() for g, w in zip(got, want))


def _env() -> dict[str, str]:
    return clean_env(threads=os.environ.get("OMP_NUM_THREADS", "1"))


def run_train(args: list[str], nproc: int = 1, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m hetero.trainer ARGS` (nproc=0) or `torchrun --standalone --nproc-per-node=N -m hetero.trainer ARGS`."""
    cmd = [sys.executable, "-m", "hetero.trainer", *args] if nproc == 0 else torchrun_cmd(nproc, args)
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n"
                             f"--- stderr\n{p.stderr[-6000:]}")
    return p


def read_run(run_dir: Path) -> dict:
    """The run folder's tables and JSON files."""
    # floats read back exactly as written (Python's repr), so recorded times replay exactly: pandas 3 does so by
    # default (and deprecates the option); older pandas needs round_trip
    exact = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
    out = {t: pd.read_csv(run_dir / f"{t}.csv", **exact) for t in ("epochs", "ranks", "steps")}
    out["summary"] = json.loads((run_dir / "summary.json").read_text())
    out["config"] = json.loads((run_dir / "config.json").read_text())
    return out


def replay_decisions(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(recorded, replayed) batch sizes [epochs * steps, world]: a fresh Balancer is fed the run's own recorded
    per-step compute times at the trainer's decision points (every REBALANCE_EVERY steps and at epoch ends). Equal
    arrays prove the trainer decides from what it measured, whatever the machine's speed or noise."""
    r = read_run(run_dir)
    cfg, world = Config(**r["config"]["config"]), r["config"]["world_size"]
    bal = Balancer(SCHEMES[cfg.scheme].rule, world, cfg.global_batch, cfg.min_batch, cfg.max_batches(world),
                   cfg.smoothing, cfg.deadband, cfg.significance, sit_out=cfg.sit_out)
    recorded, replayed = [], []
    for _, ep in r["steps"].groupby("epoch"):
        sizes = ep.pivot(index="step", columns="rank", values="batch_size").to_numpy()
        times = ep.pivot(index="step", columns="rank", values="compute_s").to_numpy()
        last = 0
        for step in range(len(sizes)):
            if cfg.rebalance_every and step and step % cfg.rebalance_every == 0:
                bal.observe(sizes[last:step], times[last:step])
                bal.decide()
                last = step
            replayed.append(np.array(bal.sizes_for_step(step)))
        bal.observe(sizes[last:], times[last:])
        bal.decide()
        recorded.append(sizes)
    return np.concatenate(recorded), np.stack(replayed)


@pytest.fixture
def env() -> dict[str, str]:
    return _env()


# The slow tier (make test-all, .ci/run): end-to-end launches (torchrun, papermill, make) of a minute or more
# on 2 cores, beyond the few the fast tier keeps (one shared trainer launch, the EDP exactness launch, the
# API's spawned exactness step). Whole modules and single tests, by name.
SLOW_MODULES = {"test_notebooks", "test_multinode", "test_api_examples", "test_affine_real", "test_sim_vs_real",
                "test_rebalance", "test_hf_examples"}
SLOW_TESTS = {
    "test_memory.py::test_probe_on_cpu_ranks_means_no_limit_and_limits_still_hold",
    "test_reliability.py::test_replay_then_resume_reproduces_the_original_bit_for_bit",
    "test_reliability.py::test_killed_worker_fails_fast_and_resume_completes",
    "test_reliability.py::test_torchrun_restart_resumes_from_the_last_checkpoint",
    "test_ownership.py::test_killed_launcher_takes_its_workers_and_resume_never_runs_beside_them",
    "test_ownership.py::test_grid_timeout_ends_every_process_even_a_stopped_rank",
    "test_ownership.py::test_two_identical_grids_at_once_train_each_run_once",
    "test_inputs.py::test_grid_check_prints_plain_lines",
    "test_inputs.py::test_make_variable_with_a_quote_runs_no_shell_code",
    "test_inputs.py::test_resume_under_torchrun_with_another_world_is_one_line",
    "test_api.py::test_decisions_reach_every_rank_at_the_same_step_with_loader_workers",
    "test_api.py::test_a_fixed_lag_shorter_than_the_prefetch_stops_every_rank",
    "test_exactness.py::test_sync_and_dp_give_the_equal_weight_mean",
    "test_accumulation.py::test_the_trainer_accumulates_the_exact_global_batch_gradient",
    "test_gpu_path.py::test_delayed_rank_records_its_delay_as_compute_in_a_real_run",
    "test_simulator.py::test_balancers_notebook_runs",
    "test_fsdp.py::test_the_example_balances_a_slow_rank_and_covers_every_sample",
    "test_fsdp.py::test_the_example_in_micro_batches_learns_like_the_plain_fsdp2_script",
    "test_fsdp.py::test_a_resume_from_the_checkpoint_continues_with_the_same_sizes_and_loss",
}


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.path.stem
        if module in SLOW_MODULES or f"{item.path.name}::{item.originalname}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
