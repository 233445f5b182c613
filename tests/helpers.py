"""Shared test helpers (`from helpers import ...`; pyproject puts tests/ on the path): run the real command line
(python -m hetero.trainer, under torchrun) in a subprocess, read a run folder back, replay its decisions."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from hetero.core.balancer import Balancer
from hetero.core.partition import SCHEMES

# the launch helpers the tests use, from here only (tests/*/ import them from helpers, not from hetero.lab)
from hetero.lab.launch import MARKER, ROOT, clean_env, free_port, launch_pids, start_time, torchrun_cmd  # noqa: F401
from hetero.trainer.config import Config
from hetero.trainer.run import main

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


# What every spawned rank imports, loaded once per test process into multiprocessing's fork server: each rank is then
# forked from that server without importing them again (about 2 s of CPU a rank under spawn, transformers' Trainer 4 s
# more). DDP's constructor imports torch._dynamo (with inductor, triton's stubs and sympy), FSDP2 and the ranks'
# collectives more: about 1 s of CPU in every forked rank until they were loaded here (0.2 s a rank after). The server
# must hold no thread when it forks (a lock another thread held would stay locked in the child): it starts with one
# BLAS/OpenMP thread, and nothing here starts one (pandas' allocator does: helpers imports it late)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp",
           "torch.distributed.nn", "sympy", "numpy", "hetero.core.balance", "hetero.core.tokens", "helpers", "tokenlm"]
PRELOAD_IF_INSTALLED = ["transformers", "accelerate"]


def _server() -> None:
    """Start this process's fork server (once; later calls return at once), single-threaded as above."""
    import importlib.util
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD + [m for m in PRELOAD_IF_INSTALLED if importlib.util.find_spec(m)])
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(dict.fromkeys(saved, "1"))
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _forked(rank: int, env: dict, cwd: str, worker, *args) -> None:
    """A rank forked from the server: the environment and working folder the test process had at the launch (the
    server's are from its own start), then the worker."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    worker(rank, *args)


def spawned(worker, out: Path, nprocs: int = 2, args: tuple = ()) -> list[dict]:
    """Run `worker(rank, str(out), *args)` in `nprocs` gloo ranks (torch.multiprocessing, a free port), each
    writing OUT/rank{r}.json; the ranks' results, in rank order (one launch, many checks). The ranks start from the
    fork server (_server) in this process's working folder and see its environment with MASTER_ADDR/MASTER_PORT set,
    which this process's own environment does not keep (a later test in the same process, or another pytest-xdist
    file, must not inherit them)."""
    import torch.multiprocessing as mp


    _server()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    mp.start_processes(_forked, args=(env, os.getcwd(), worker, str(out), *args), nprocs=nprocs, join=True,
                       start_method="forkserver")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nprocs)]


def _env() -> dict[str, str]:
    return clean_env(threads=os.environ.get("OMP_NUM_THREADS", "1"))


def bounded(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) in its own process group; past timeout, every process of the group (launcher, ranks,
    DataLoader workers) gets SIGABRT, so that faulthandler prints each one's Python stacks, and the test fails with
    them instead of an empty timeout."""
    p = subprocess.Popen(cmd, cwd=ROOT, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGABRT)
        try:
            out, err = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} ran past {timeout:g} s: every process aborted, their "
                             f"stacks below\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-20000:]}") from None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_train(args: list[str], nproc: int = 1, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m hetero.trainer ARGS` (nproc=0) or
    `torchrun --standalone --nproc-per-node=N -m hetero.trainer ARGS`."""
    cmd = [sys.executable, "-m", "hetero.trainer", *args] if nproc == 0 else torchrun_cmd(nproc, args)
    p = bounded(cmd, _env(), timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n"
                             f"--- stderr\n{p.stderr[-6000:]}")
    return p


def read_run(run_dir: Path) -> dict:
    """The run folder's tables and JSON files."""
    # floats read back exactly as written (Python's repr), so recorded times replay exactly: pandas 3 does so by
    # default (and deprecates the option); older pandas needs round_trip
    import pandas as pd  # here, not at the top: its allocator's thread must not be in the fork server (PRELOAD)

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


# -- in-process checks and make, shared by the input and adversarial tests ----------------------------------------
SMALL = ["--model", "tiny", "--data", "synthetic", "--subset", "512", "--test-subset", "256", "--global-batch", "128",
         "--threads", "1"]


def check(args: list[str], monkeypatch, capsys, world: int = 1, check_only: bool = True) -> tuple[int, list[str]]:
    """main() in this process (no torchrun, no process group): its exit status and its stderr lines."""
    for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        rc = main((["--check"] if check_only else []) + args)
    except SystemExit as e:  # argparse
        rc = e.code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return rc, err


def assert_one_line(rc: int, err: list[str], text: str) -> None:
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("hetero: error: ") and text in err[0], err[0]


def image_folder(root: Path) -> Path:
    """root/{train,test}/{cat,dog}/{0,1,2}.jpg: a tiny valid image folder (32 px, seeded)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for part in ("train", "test"):
        for c in ("cat", "dog"):
            (root / part / c).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / part / c / f"{i}.jpg")
    return root


VENV = Path(sys.executable).parents[1]


def run_make(*args: str) -> subprocess.CompletedProcess:
    """make in this checkout with this interpreter's venv, never (re)installing it."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    return subprocess.run(["make", "-s", f"VENV={VENV}", "-o", f"{VENV}/.installed", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)
