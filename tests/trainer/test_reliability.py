"""Reliability: bad input gives one line and exit 2; a dying worker never hangs the others; checkpoints are
atomic; --resume continues without duplicated or missing epochs; --replay reproduces a run bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import psutil
import pytest
import torch

from hetero.trainer.runfolder import RunFolder

from helpers import ROOT, TINY, _env, read_run, run_train, torchrun_cmd

BAD = [
    (["--model", "alexnet"], "unknown model 'alexnet'"),
    (["--scheme", "fast"], "unknown scheme 'fast'"),
    (["--data", "mnist"], "unknown data set 'mnist'"),
    (["--hetero", "1:delay"], "bad --hetero"),
    (["--hetero", "1:delay=-0.1"], "non-negative"),
    (["--hetero", "1:delay=inf"], "finite"),
    (["--hetero", "2:delay=0.1"], "rank 2 is not below the world size 2"),
    (["--global-batch", "3", "--min-batch", "2"], "smaller than 2 ranks x min batch"),
    (["--subset", "100"], "--subset 100 is smaller than the global batch 128"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--lr", "-0.1"], "--lr must be positive"),
    (["--lr", "nan"], "--lr must be positive"),
    (["--epochs", "two"], "invalid int value"),
    (["--run-dir", "/proc/hetero-run"], "is not writable"),
    (["--resume", "/nonexistent/run"], "cannot resume"),
    (["--data", "imagefolder", "--data-dir", "/nonexistent"], "has no train/ subfolder"),
    (["--min-batch", "0"], "--min-batch must be at least 1"),
    (["--device", "tpu"], "unknown device"),
]


def _main(argv: list[str]) -> int:
    """hetero.trainer.run.main in this process (no torch import per case); an argparse error exits like the CLI."""
    from hetero.trainer.run import main
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("extra,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_one_line_exit_2(extra, message, monkeypatch, capsys):
    for var in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _main([*TINY, *extra, "--check"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetero: error: ") and message in lines[0], lines


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    folder = RunFolder(tmp_path)
    folder.save_checkpoint({"epoch": 1, "w": torch.ones(3)})
    real_save = torch.save

    def dies_half_way(obj, fh):  # a process killed while writing: half a file, then the error
        real_save(obj, fh)
        raise RuntimeError("killed while writing")
    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(RuntimeError):
        folder.save_checkpoint({"epoch": 2, "w": torch.zeros(1000)})
    monkeypatch.setattr(torch, "save", real_save)
    state = folder.load_checkpoint()
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(3)) and not list(tmp_path.glob(".*.tmp"))


# the cases that launch processes
def _cli(args, world=1, env_extra=None):
    env = {**_env(), "WORLD_SIZE": str(world), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "hetero.trainer", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.launch
def test_bad_input_through_the_command_line():
    # the same code as above, once through the real command line: exit status and stderr as a user sees them
    for extra, message in [(["--model", "alexnet"], "unknown model 'alexnet'"), (["--epochs", "two"], "invalid int")]:
        p = _cli([*TINY, *extra, "--check"], world=2)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("hetero: error: ") and \
            message in lines[0], p.stderr


@pytest.mark.launch
def test_run_folder_holding_a_run_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text("{}")
    p = _cli([*TINY, "--run-dir", str(tmp_path / "r"), "--check"])
    assert p.returncode == 2 and "already holds a run" in p.stderr
    assert _cli([*TINY, "--run-dir", str(tmp_path / "r"), "--overwrite", "--check"]).returncode == 0


@pytest.mark.launch
@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
def test_check_and_a_failed_data_load_leave_no_run_folder(tmp_path):
    new = tmp_path / "a" / "run"
    assert _cli([*TINY, "--run-dir", str(new), "--check"]).returncode == 0
    p = _cli(["--data", "imagefolder", "--data-dir", str(tmp_path / "none"), "--run-dir", str(new)])  # a real run
    assert p.returncode == 2 and "has no train/ subfolder" in p.stderr
    assert list(tmp_path.iterdir()) == []
    before = set((ROOT / "runs").iterdir()) if (ROOT / "runs").exists() else set()
    assert _cli([*TINY, "--check"]).returncode == 0  # the default run folder, under the checkout's runs/
    assert (set((ROOT / "runs").iterdir()) if (ROOT / "runs").exists() else set()) == before


@pytest.mark.launch
def test_missing_cifar10_offline_says_what_to_do(tmp_path):
    # a dead proxy makes the download fail at once, online or not
    p = _cli(["--data", "cifar10", "--data-dir", str(tmp_path / "data"), "--check"],
             env_extra={"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"})
    assert p.returncode == 2
    assert "CIFAR-10 is not in" in p.stderr and "Fix:" in p.stderr and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.launch
@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
def test_non_finite_loss_stops_naming_epoch_and_step(tmp_path):
    bad = tmp_path / "bad"
    p = run_train([*TINY, "--lr", "1e12", "--run-dir", str(bad)], nproc=2, check=False)
    assert p.returncode != 0
    assert "non-finite loss at epoch 1 step" in p.stderr
    s = json.loads((bad / "summary.json").read_text())
    assert s["status"] == "failed" and "non-finite loss" in s["error"]


def _launch(args, nproc):
    return subprocess.Popen(torchrun_cmd(nproc, args), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_epochs(run, n, proc, limit=600):
    """Until the run reports n completed epochs in summary.json, which is written after that epoch's rows and
    checkpoint: the kill point is a state the run has reached, not a time (limit: only a guard against a hang)."""
    t0 = time.time()
    while time.time() - t0 < limit:
        try:
            if json.loads((run / "summary.json").read_text())["epochs_completed"] >= n:
                return
        except (OSError, ValueError, KeyError):
            pass  # not written yet (it is replaced atomically, so never half-written)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{run} never reported {n} completed epochs")


def _rank_pid(proc, rank):
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "hetero.trainer" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            pass
    raise AssertionError(f"rank {rank} not found")


@pytest.mark.launch
@pytest.mark.slow
def test_killed_worker_fails_fast_and_resume_completes(tmp_path):
    run = tmp_path / "run"
    timeout_s = 20
    # epoch 2 lasts at least 16 steps x 0.25 s: the kill lands in it, however slow the host
    args = [*TINY, "--epochs", "3", "--scheme", "dp", "--hetero", "1:delay=0.25", "--timeout-s", str(timeout_s),
            "--run-dir", str(run)]
    proc = _launch(args, 2)
    _wait_epochs(run, 1, proc)
    os.kill(_rank_pid(proc, 1), signal.SIGKILL)
    try:  # torchrun stops rank 0 at once; the collective timeout would too. A wait past both is a hang.
        proc.wait(timeout=timeout_s + 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    r = read_run(run)
    assert r["epochs"].epoch.tolist() == [1] and r["summary"]["status"] == "failed"
    assert r["summary"]["epochs_completed"] == 1
    run_train(["--resume", str(run)], nproc=2)
    r = read_run(run)
    assert r["epochs"].epoch.tolist() == [1, 2, 3] and r["summary"]["status"] == "completed"
    assert sorted(r["ranks"][["epoch", "rank"]].itertuples(index=False)) == [(e, k) for e in (1, 2, 3) for k in (0, 1)]
    assert r["steps"].groupby("epoch").size().tolist() == [16 * 2] * 3


@pytest.mark.launch
@pytest.mark.slow
def test_replay_then_resume_reproduces_the_original_bit_for_bit(tmp_path):
    base = [*TINY, "--subset", "1024", "--epochs", "4", "--scheme", "dp", "--hetero", "1:slowdown=2"]
    run_train([*base, "--run-dir", str(tmp_path / "orig")], nproc=2)
    orig = read_run(tmp_path / "orig")
    # a replay of it, with another emulation (slow, so the kill lands mid-run), killed after its second epoch and
    # resumed: one launch tests both, since the replay must equal the original and the resumed run the replay
    part = tmp_path / "part"
    proc = _launch([*base, "--replay", str(tmp_path / "orig"), "--hetero", "1:delay=0.25", "--run-dir", str(part)], 2)
    _wait_epochs(part, 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert len(pd.read_csv(part / "epochs.csv")) < 4
    run_train(["--resume", str(part)], nproc=2)
    resumed = read_run(part)
    assert resumed["epochs"].epoch.tolist() == [1, 2, 3, 4]
    cols = ["train_loss", "test_loss", "test_top1"]
    assert resumed["epochs"][cols].equals(orig["epochs"][cols])                      # bit-identical
    assert resumed["steps"].batch_size.equals(orig["steps"].batch_size)
    a = RunFolder(part).load_checkpoint()["model"]
    b = RunFolder(tmp_path / "orig").load_checkpoint()["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.launch
@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "--subset", "1024", "--epochs", "3", "--hetero", "1:delay=0.1", "--timeout-s", "60",
            "--run-dir", str(run)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
           "-m", "hetero.trainer", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_epochs(run, 1, proc)  # epoch 1 checkpointed: the restart resumes after it
    os.kill(_rank_pid(proc, 1), signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    r = read_run(run)
    assert r["epochs"].epoch.tolist() == [1, 2, 3] and r["summary"]["status"] == "completed"
    assert "resuming after epoch" in out
