"""Issue 23 (Reliability III), the trainer's and the lab's side: the data set is what is on disk, writers never
follow a link they did not create, every bad input is one line (exit 2) before any process group, a full disk
says so, and nothing hangs. Each case goes through the command line (`--check`, make, the grid check) or the
public API, as a user would meet it; a case that could hang runs in a subprocess with a timeout.
Here the cases that launch processes; those in one process: tests/unit/test_adversarial.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import psutil
import pytest
import torch

import hetero.trainer.runfolder as runfolder
from hetero.lab.launch import MARKER, launch_pids, torchrun_cmd
from hetero.trainer.checkpoint import sealed

from helpers import ROOT, SMALL, _env, assert_one_line, check, image_folder, run_make

BOUND_S = 120  # no case may take longer (a hang would block for ever)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))


def _cli(args: list[str], env_extra: dict | None = None, module: str = "hetero.trainer") -> subprocess.CompletedProcess:
    env = {**_env(), "WORLD_SIZE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BOUND_S)


def _one_line(p: subprocess.CompletedProcess, text: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("hetero: error: ") and text in lines[0], lines[0]


# -- 1. the data set is what is on disk -------------------------------------------------------------------------
IMAGES = ["--model", "tiny", "--data", "imagefolder", "--global-batch", "2", "--threads", "1"]


def test_a_fifo_in_an_image_folder_is_refused_without_opening_it(tmp_path):
    root = image_folder(tmp_path / "images")
    os.mkfifo(root / "train" / "cat" / "f.jpg")
    p = _cli(["--check", *IMAGES, "--data-dir", str(root)], {"HETERO_CACHE": str(tmp_path / "cache")})
    _one_line(p, f"{root}/train/cat/f.jpg is a FIFO, not a regular file")


# -- 3. everything checkable is checked before the process group ------------------------------------------------
@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    """A completed one-process run of SMALL (copied by each test that changes it)."""
    run = tmp_path_factory.mktemp("done") / "run"
    p = subprocess.run([sys.executable, "-m", "hetero.trainer", *SMALL, "--epochs", "1", "--run-dir", str(run)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    (dst / runfolder.LOCK).unlink(missing_ok=True)
    return dst


def _set(*path, value):
    def edit(state):
        d = state
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return edit


CHECKPOINTS = [
    ("shapes", _set("model", "fc.weight", value=lambda t: torch.zeros(3, 3))),
    ("model={}", _set("model", value={})),
    ("history='abc'", _set("history", value="abc")),
    ("torch rng", _set("rng", "torch", value=torch.zeros(7, dtype=torch.uint8))),
    ("numpy rng", _set("rng", "numpy", value=["MT19937", [1, 2], 0, 0, 0.0])),
    ("balancer", _set("balance", "balancer", "shares", value=[0.2, 0.3, 0.5])),
    ("balancer sizes", _set("balance", "balancer", "sizes", value=[7])),
    ("epoch=True", _set("balance", "epoch", value=True)),  # the position is the Balance's (checkpoint format 3)
    ("epoch=10**18", _set("balance", "epoch", value=10**18)),
    ("momentum", _set("optimizer", "state", 0, "momentum_buffer", value=lambda t: torch.zeros(5))),
]


@pytest.mark.parametrize("name,edit", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_a_checkpoint_that_does_not_fit_is_one_line_at_check(name, edit, done_run, tmp_path, monkeypatch, capsys):
    run = _copy(done_run, tmp_path)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["sha256"]
    if name == "shapes":
        key = next(k for k, v in state["model"].items() if v.ndim == 2)
        edit = _set("model", key, value=lambda t: torch.zeros(t.shape[0] + 1, t.shape[1]))
    edit(state)
    torch.save(sealed(state), run / "checkpoint.pt")  # resealed: the content checks, not the digest, refuse it
    rc, err = check(["--resume", str(run)], monkeypatch, capsys)
    assert_one_line(rc, err, "cannot resume")
    assert "integrity" not in err[0]


def test_the_sound_checkpoint_passes_the_same_check(done_run, tmp_path, monkeypatch, capsys):
    rng = torch.get_rng_state()
    assert check(["--resume", str(_copy(done_run, tmp_path)), "--epochs", "2"], monkeypatch, capsys) == (0, [])
    assert torch.equal(torch.get_rng_state(), rng)  # the check left this process's RNG as it was


def _steps(run: Path, edit) -> None:
    df = pd.read_csv(run / "steps.csv")
    out = edit(df)
    (run / "steps.csv").write_text(out if isinstance(out, str) else out.to_csv(index=False))


def _negative(df):
    df.loc[0, "batch_size"], df.loc[1, "batch_size"] = -64, df.loc[1, "batch_size"] + 64 + df.loc[0, "batch_size"]
    return df


REPLAYS = [
    ("empty", lambda df: "", "its steps.csv is unreadable"),
    ("no rank", lambda df: df.drop(columns="rank"), "has no column rank"),
    ("duplicate rows", lambda df: pd.concat([df, df.iloc[:1]]), "lists epoch 1 step 0 rank 0 twice"),
    ("text sizes", lambda df: df.astype({"batch_size": str}).assign(batch_size="many"), "column batch_size holds"),
    ("negative sizes", _negative, "column batch_size holds -64"),
]


@pytest.mark.parametrize("name,edit,text", REPLAYS, ids=[r[0] for r in REPLAYS])
def test_a_bad_replay_file_is_one_line(name, edit, text, done_run, tmp_path, monkeypatch, capsys):
    run = _copy(done_run, tmp_path)
    _steps(run, edit)
    rc, err = check([*SMALL, "--epochs", "1", "--replay", str(run)], monkeypatch, capsys)
    assert_one_line(rc, err, text)


# -- 4. grids and reports ---------------------------------------------------------------------------------------
def test_make_report_of_a_missing_grid_and_sim_bench_nan_are_one_line():
    for args, text in ((("report", "GRID=nope"), "runs/nope holds no run folders"),
                       (("sim-bench", "NOISE=nan"), "0 <= --noise <= 10")):
        p = run_make(*args)
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: error:")]
        assert p.returncode == 2 and len(lines) == 1 and text in lines[0], p.stderr
        assert "Traceback" not in p.stderr and "papermill" not in p.stderr.lower()


# -- 5. make values reach the recipes literally -----------------------------------------------------------------
def test_make_refuses_make_syntax_and_keeps_a_dollar_literally(tmp_path):
    marker = tmp_path / "ran"
    p = run_make("experiment", f"MODEL=$(shell touch {marker})")
    assert p.returncode == 2 and not marker.exists() and "MODEL holds make syntax" in p.stderr, p.stderr
    p = run_make("experiment", "MODEL=tiny", "DATA=synthetic", f"REPLAY={tmp_path}/done$X2")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and f"cannot replay {tmp_path}/done$X2: it has no steps.csv" in lines[0], p.stderr


# -- 7. no hangs -------------------------------------------------------------------------------------------------
def test_a_fifo_as_the_checkpoint_is_refused_without_opening_it(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    (run / "checkpoint.pt").unlink()
    os.mkfifo(run / "checkpoint.pt")
    _one_line(_cli(["--check", "--resume", str(run)]), "checkpoint.pt is a FIFO")


@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stopped_worker_dies_with_its_launcher_and_frees_the_folder(tmp_path):
    run = tmp_path / "run"
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(torchrun_cmd(1, [*SMALL, "--epochs", "1000", "--run-dir", str(run)]), cwd=ROOT,
                            env={**_env(), MARKER: marker}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + BOUND_S
        while not (run / "epochs.csv").exists():  # training: the lock is held
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        (worker,) = [p for p in launch_pids(marker) if p != proc.pid]
        assert runfolder.is_busy(run)
        os.kill(worker, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15  # the kernel's SIGKILL is at once; exiting a big process takes a moment
        while (psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE
               or runfolder.is_busy(run)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not launch_pids(marker) and not runfolder.is_busy(run)
    finally:
        for pid in launch_pids(marker):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
