"""One job owns a run folder (a flock that SIGKILL releases); no worker outlives its launcher or a grid timeout;
checkpoints load without running code; a full disk gives one line and keeps the previous checkpoint."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

import hetero.runlog as runlog
from hetero import train
from hetero.launch import MARKER, launch_pids, torchrun_cmd
from hetero.runlog import RunFolder, acquire_lock, status

from conftest import ROOT, TINY, _env, read_run, run_train

WATCHDOG_BOUND_S = 30  # README: a worker exits ~1 s after its launcher dies; the rest is margin for a loaded VM


def _cli(args):
    return subprocess.run([sys.executable, "-m", "hetero.train", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=180)


def _one_line(p, text):
    lines = p.stderr.strip().splitlines()
    return p.returncode == 2 and len(lines) == 1 and lines[0].startswith("hetero: error: ") and text in lines[0]


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A completed one-process run (copied by each test that changes it)."""
    run = tmp_path_factory.mktemp("done") / "run"
    run_train([*TINY, "--epochs", "1", "--run-dir", str(run)], nproc=0)
    return run


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    (dst / runlog.LOCK).unlink(missing_ok=True)
    return dst


def test_checkpoint_holds_plain_data_only(done_run):
    state = torch.load(done_run / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 1 and isinstance(state["rng"]["numpy"][1], list)


def test_crafted_checkpoint_is_refused_and_runs_nothing(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    torch.save({**state, "history": [Evil()]}, run / "checkpoint.pt")
    summary = (run / "summary.json").read_text()
    for extra in (["--check"], []):
        p = _cli(["--resume", str(run), *extra])
        assert _one_line(p, "it could run code"), p.stderr
    assert not marker.exists()
    assert (run / "summary.json").read_text() == summary  # the completed run's summary is untouched


def test_corrupt_checkpoint_fails_check_and_leaves_the_summary(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    data = (run / "checkpoint.pt").read_bytes()
    (run / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    summary = (run / "summary.json").read_text()
    for extra in (["--check"], []):
        p = _cli(["--resume", str(run), *extra])
        assert _one_line(p, "is corrupt or truncated"), p.stderr
    assert (run / "summary.json").read_text() == summary


def test_a_held_folder_is_refused_and_a_free_one_cleaned(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    lock = acquire_lock(run)  # this test process plays the live job
    try:
        for args in (["--resume", str(run)], [*TINY, "--run-dir", str(run), "--overwrite", "--check"]):
            p = _cli(args)
            assert _one_line(p, f"run folder {run} is in use by another job (pid {os.getpid()} on host"), p.stderr
        assert status(run) == "running"
    finally:
        lock.release()
    # a job killed mid-write left temporary files and a summary saying running: the folder reads interrupted,
    # and the next job that holds the lock removes the leftovers
    (run / ".checkpoint.pt.tmp").write_bytes(b"half")
    (run / "summary.json").write_text(json.dumps({**json.loads((run / "summary.json").read_text()),
                                                  "status": "running"}))
    assert status(run) == "interrupted"
    assert _cli(["--resume", str(run), "--check"]).returncode == 0
    assert not list(run.glob(".*.tmp"))


def test_disk_full_is_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    real_save, calls = torch.save, []

    def save(obj, fh):  # the second checkpoint hits a full disk half-way through
        calls.append(1)
        if len(calls) == 2:
            fh.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, fh)
    monkeypatch.setattr(runlog.torch, "save", save)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    term = signal.getsignal(signal.SIGTERM)
    try:
        assert train.main([*TINY, "--epochs", "3", "--run-dir", str(run)]) == 1
    finally:
        signal.signal(signal.SIGTERM, term)
    errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(errors) == 1 and "disk full writing" in errors[0] and "checkpoint.pt" in errors[0], errors
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "disk full" in summary["error"] and summary["epochs_completed"] == 2
    assert RunFolder(run).load_checkpoint()["epoch"] == 1
    assert not list(run.glob(".*.tmp"))


def _workers(marker):
    return [pid for pid in launch_pids(marker) if "hetero.train" in open(f"/proc/{pid}/cmdline").read()]


def test_killed_launcher_takes_its_workers_and_resume_never_runs_beside_them(tmp_path):
    run, marker = tmp_path / "run", "orphan-test"
    args = [*TINY, "--epochs", "4", "--hetero", "1:delay=0.2", "--run-dir", str(run)]
    # setsid: the launcher leads its own group; torchrun puts the workers in sessions of their own
    proc = subprocess.Popen(torchrun_cmd(2, args), cwd=ROOT, env={**_env(), MARKER: marker},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    while not ((run / "epochs.csv").exists() and len(pd.read_csv(run / "epochs.csv")) >= 1):
        assert proc.poll() is None and time.time() - t0 < 240
        time.sleep(0.1)
    assert len([p for p in _workers(marker) if p != proc.pid]) == 2  # the two ranks (and torchrun itself)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group only
    proc.wait()
    t_kill = time.time()
    # at once: refused while the old workers live, or runs after they are gone; never beside them
    resume = subprocess.Popen(torchrun_cmd(2, ["--resume", str(run)]), cwd=ROOT, env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    while _workers(marker):
        assert time.time() - t_kill < WATCHDOG_BOUND_S, "workers outlived their launcher"
        time.sleep(0.2)
    # they were stopped, not done: the last 3 epochs need >= 9.6 s of injected delay alone
    assert json.loads((run / "summary.json").read_text())["status"] == "running"
    _, err = resume.communicate(timeout=600)
    if resume.returncode != 0:
        assert "is in use by another job" in err, err[-3000:]
        run_train(["--resume", str(run)], nproc=2)
    epochs = read_run(run)["epochs"].epoch.tolist()
    assert epochs == [1, 2, 3, 4], epochs
    assert read_run(run)["summary"]["status"] == "completed"
