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
import uuid

import pandas as pd
import psutil
import pytest
import torch

import hetero.trainer.runfolder as runfolder
from hetero.trainer import run as train
from hetero.trainer.runfolder import RunFolder, acquire_lock, status

from helpers import MARKER, ROOT, TINY, _env, launch_pids, read_run, run_train, start_time, torchrun_cmd

pytestmark = pytest.mark.launch

WATCHDOG_BOUND_S = 30  # README: a worker exits ~1 s after its launcher dies; the rest is margin for a loaded VM


def _cli(args):
    return subprocess.run([sys.executable, "-m", "hetero.trainer", *args], cwd=ROOT, env=_env(), capture_output=True,
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
    (dst / runfolder.LOCK).unlink(missing_ok=True)
    return dst


def test_checkpoint_holds_plain_data_only(done_run):
    state = torch.load(done_run / "checkpoint.pt", weights_only=True)
    b = state["balance"]  # the one position, the Balance's: epoch 1 complete
    assert (b["epoch"], b["step"]) == (1, b["steps_per_epoch"]) and isinstance(state["rng"]["numpy"][1], list)


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


@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
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
    before = set(_listening(os.getpid(), ports=True))  # what this pytest process had open already (another test's)

    def save(obj, fh):  # the second checkpoint hits a full disk half-way through
        # mid-run: the one-process path listens on loopback at most
        calls.append(set(_listening(os.getpid(), ports=True)) - before)
        if len(calls) == 2:
            fh.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, fh)
    monkeypatch.setattr(runfolder.torch, "save", save)
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
    # never more than the checkpoint holds (issue 23: it claimed the epoch whose checkpoint failed)
    assert summary["status"] == "failed" and "disk full" in summary["error"] and summary["epochs_completed"] == 1
    b = RunFolder(run).load_checkpoint()["balance"]
    assert (b["epoch"], b["step"]) == (1, b["steps_per_epoch"])  # epoch 1 complete
    assert not list(run.glob(".*.tmp"))
    assert not [ip for ip, _ in calls[0] if ip not in LOOPBACK], calls[0]


LOOPBACK = ("127.0.0.1", "::1")


def _listening(pid, ports=False):
    """The addresses process pid listens on (TCP), with their ports if asked."""
    return [tuple(c.laddr) if ports else c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def _workers(marker):
    return [pid for pid in launch_pids(marker) if "hetero.trainer" in open(f"/proc/{pid}/cmdline").read()]


@pytest.mark.slow
def test_killed_launcher_takes_its_workers_and_resume_never_runs_beside_them(tmp_path):
    run, marker = tmp_path / "run", f"orphan-test-{uuid.uuid4().hex}"  # unique: other suites may run at once
    args = [*TINY, "--epochs", "4", "--hetero", "1:delay=0.2", "--run-dir", str(run)]
    # setsid: the launcher leads its own group; torchrun puts the workers in sessions of their own
    proc = subprocess.Popen(torchrun_cmd(2, args), cwd=ROOT, env={**_env(), MARKER: marker},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    # epoch 1 saved: its row, then its checkpoint, then summary.json (the last of the three; killed between them, a
    # busy host showed, the folder has no summary yet, and the verdict below would rest on where the kill landed)
    while not ((run / "epochs.csv").exists() and len(pd.read_csv(run / "epochs.csv")) >= 1
               and (run / "summary.json").exists()):
        assert proc.poll() is None and time.time() - t0 < 240
        time.sleep(0.1)
    ranks = [p for p in _workers(marker) if p != proc.pid]
    assert len(ranks) == 2  # the two ranks (and torchrun itself)
    assert not [ip for p in ranks for ip in _listening(p) if ip not in LOOPBACK]  # one host: gloo on loopback
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group only
    proc.wait()
    t_kill = time.time()
    # at once: refused while the old workers live, or runs after they are gone; never beside them
    resume = subprocess.Popen(torchrun_cmd(2, ["--resume", str(run)]), cwd=ROOT, env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    while _workers(marker):
        assert time.time() - t_kill < WATCHDOG_BOUND_S, "workers outlived their launcher"
        time.sleep(0.2)
    # they were stopped, not done (the last 3 epochs need >= 9.6 s of injected delay alone); rank 0, still the
    # folder's owner, may have recorded its peer's exit as a failure before its own watchdog fired
    assert json.loads((run / "summary.json").read_text())["status"] in ("running", "failed")
    _, err = resume.communicate(timeout=600)
    if resume.returncode != 0:
        assert "is in use by another job" in err, err[-3000:]
        run_train(["--resume", str(run)], nproc=2)
    epochs = read_run(run)["epochs"].epoch.tolist()
    assert epochs == [1, 2, 3, 4], epochs
    assert read_run(run)["summary"]["status"] == "completed"


GRID = dict(model="tiny", data="synthetic", subset=256, test_subset=128, global_batch=64, device="cpu",
            scheme="sync", hetero="")


@pytest.mark.slow
def test_grid_timeout_ends_every_process_even_a_stopped_rank(tmp_path):
    import threading

    import hetero.lab.grid as hg

    # 30 s: the run's ranks exist within about 10 s on a loaded host, and rank 1 is stopped 3 s after it appears;
    # the run never ends by itself (1000 epochs), so the timeout is the whole wait (it was 60 s, half of it idle)
    g = hg.plan_grid(grid="t", runs_root=tmp_path, nproc=2, run_timeout_s=30, **{**GRID, "epochs": 1000})
    seen, stopped = {}, []

    def stop_rank_1():  # the run's processes carry its folder on their command line
        needle = str(g.runs[0].run_dir).encode()
        t0 = time.time()
        while not stopped and time.time() - t0 < 60:
            for entry in os.scandir("/proc"):
                try:
                    if entry.name.isdigit() and needle in open(f"/proc/{entry.name}/cmdline", "rb").read():
                        seen.setdefault(int(entry.name), start_time(int(entry.name)))
                        if b"RANK=1\0" in open(f"/proc/{entry.name}/environ", "rb").read() and not stopped:
                            time.sleep(3)  # past its start, into training
                            os.kill(int(entry.name), signal.SIGSTOP)
                            stopped.append(int(entry.name))
                except OSError:
                    continue
            time.sleep(0.2)
    watcher = threading.Thread(target=stop_rank_1)
    watcher.start()
    table = hg.run_grid(g, progress=False)
    watcher.join()
    assert stopped and len(seen) >= 3  # torchrun and both ranks were seen
    assert table.loc[0, "status"] == "timeout"
    # stop_launch waits until they are gone: nothing may be left once run_grid returns
    assert [pid for pid, t in seen.items() if t is not None and start_time(pid) == t] == []


@pytest.mark.slow
def test_two_identical_grids_at_once_train_each_run_once(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = (f"from hetero.lab.grid import plan_grid, run_grid; "
            f"run_grid(plan_grid(grid='x', runs_root={str(tmp_path)!r}, nproc=1, "
            f"seed=[0, 1], epochs=2, **{GRID!r}), progress=False)")
    env = {**_env(), "TMPDIR": str(tmp)}
    grids = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in grids]
    assert [p.returncode for p in grids] == [0, 0], outs
    root = tmp_path / "x"
    tables = [pd.read_csv(root / "grid.csv", keep_default_na=False)]  # the last grid's table (both write it)
    runs = sorted(p.parent for p in root.glob("*/config.json"))
    assert len(runs) == 2
    logs = sorted((root / "logs").glob("*.log"))
    for run in runs:
        r = read_run(run)
        assert r["epochs"].epoch.tolist() == [1, 2] and r["summary"]["status"] == "completed"
        assert r["summary"]["epochs_completed"] == 2
        trained = [log for log in logs if log.name.startswith(run.name) and "hetero: done" in log.read_text()]
        assert len(trained) == 1, [log.read_text()[-2000:] for log in logs]  # trained once, its log kept
    for log in logs:  # one launch per log: never two jobs' output in one file
        text = log.read_text()
        assert text.count("run folder") <= 1 and text.count("hetero: done") <= 1, text[-2000:]
    assert set(tables[0]["status"]) <= {"completed", "busy"}, tables[0][["status", "error"]].to_string()
    assert "failed" not in "".join(outs)
    assert not list(tmp.glob("torchelastic_*"))  # torchrun's log folders are not left in the temp directory
