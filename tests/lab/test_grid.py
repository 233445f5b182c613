"""hetero.lab.grid: expansion, validation before any launch, skip/resume/failure bookkeeping, per-run timeout."""
from __future__ import annotations

import json
import sys
import time

import pandas as pd
import psutil
import pytest

from hetero.lab import grid as hg
from hetero.trainer.cli import parse_args
from hetero.trainer.config import Config

TINY = dict(model="tiny", data="synthetic", subset=256, test_subset=128, global_batch=64, epochs=1, device="cpu")


def test_product_names_and_per_model_hetero(tmp_path):
    g = hg.plan_grid(grid="g", runs_root=tmp_path, model=["vgg16", "resnet50"], scheme=["sync", "edp"],
                hetero={"vgg16": ["1:delay=0.01", "1:delay=0.02"], "resnet50": "1:delay=0.1"}, seed=[0, 1],
                lr=[0.1, 0.05], epochs=3)
    assert len(g.runs) == 2 * (2 + 1) * 2 * 2  # seeds x (vgg16 levels + resnet50 levels) x schemes x lrs
    names = [r.name for r in g.runs]
    assert len(set(names)) == len(names)
    assert names[0] == "vgg16-sync-1-delay0.01-s0-lr0.1"
    assert all(r.run_dir == tmp_path / "g" / r.name and r.config.run_dir == str(r.run_dir) for r in g.runs)
    assert {r.config.hetero for r in g.runs if r.config.model == "resnet50"} == {"1:delay=0.1"}
    assert [r.config.seed for r in g.runs[:12]] == [0] * 12  # seed outermost: a partial grid compares schemes
    assert not (tmp_path / "g").exists()  # planning writes nothing


def test_every_bad_run_is_reported_before_anything_starts(tmp_path):
    with pytest.raises(hg.GridError) as e:
        hg.plan_grid(grid="g", runs_root=tmp_path, nproc=2, scheme=["sync", "nope"],
                     hetero=["1:delay=0.1", "2:delay=0.1"], **{k: v for k, v in TINY.items()})
    lines = str(e.value).splitlines()
    assert len(lines) == 3  # nope x 2 specs, and rank 2 on a world of 2
    assert any("unknown scheme 'nope'" in ln for ln in lines)
    assert any("rank 2 is not below the world size 2" in ln for ln in lines)
    assert not (tmp_path / "g").exists()
    for bad, match in [({"run_dir": "x"}, "set by the grid"), ({"learning_rate": 0.1}, "unknown parameter"),
                       ({"hetero": {"vgg16": "1:delay=0.1"}}, "no heterogeneity for model"),
                       ({"grid": "a/b"}, "grid name")]:
        with pytest.raises(hg.GridError, match=match):
            hg.plan_grid(**{"grid": "g", "runs_root": tmp_path, "model": "tiny", **bad})


def test_yaml_numbers_reach_string_and_float_fields(tmp_path):
    cfg = hg.plan_grid(grid="g", runs_root=tmp_path, threads=1, lr=1, **TINY).runs[0].config
    assert cfg.threads == "1" and cfg.lr == 1.0 and isinstance(cfg.lr, float)


def test_train_args_give_back_the_config(tmp_path):
    cfg = Config(**TINY, scheme="dp", hetero="1:slowdown=3", augment=False, lr=0.05, run_dir=str(tmp_path / "r"))
    assert parse_args(hg.train_args(cfg))[0] == cfg


def test_folder_of_another_configuration_is_refused(tmp_path):
    g = hg.plan_grid(grid="g", runs_root=tmp_path, scheme="sync", **TINY)
    run = g.runs[0]
    run.run_dir.mkdir(parents=True)
    other = {**run.config.to_dict(), "epochs": 7}
    (run.run_dir / "config.json").write_text(json.dumps({"config": other}))
    with pytest.raises(hg.GridError, match="another configuration .*epochs 7 != 1"):
        hg.plan_grid(grid="g", runs_root=tmp_path, scheme="sync", **TINY)


def test_command_resumes_an_interrupted_run_and_overwrites_a_broken_one(tmp_path):
    run = hg.plan_grid(grid="g", runs_root=tmp_path, scheme="sync", **TINY).runs[0]
    assert "--overwrite" not in hg.command(run, 2) and "--resume" not in hg.command(run, 2)
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.json").write_text(json.dumps({"config": run.config.to_dict()}))
    assert "--overwrite" in hg.command(run, 2)  # claimed but never checkpointed
    (run.run_dir / "checkpoint.pt").write_bytes(b"")
    (run.run_dir / "summary.json").write_text(json.dumps({"status": "running"}))
    cmd = hg.command(run, 2)
    assert cmd[cmd.index("--resume") + 1] == str(run.run_dir) and "--nproc-per-node=2" in cmd


def test_error_is_the_root_cause_line(tmp_path):
    log = tmp_path / "log"
    log.write_text("Traceback (most recent call last):\n  File x\nValueError: bad thing\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert hg._error(tmp_path, log, 1, 10) == "ValueError: bad thing"
    log.write_text("hetero: error: --subset 10 is smaller than the global batch 64\nValueError: other\n")
    assert hg._error(tmp_path, log, 2, 10).startswith("hetero: error: --subset 10")
    assert "timed out after 10 s" in hg._error(tmp_path, log, None, 10)


# a launch's process that drops its marker once signalled: on SIGTERM it ignores SIGTERM and replaces itself by a
# sleeper whose environment lacks the marker (exec keeps its pid and start time); it sits in a session of its own,
# as torchrun's workers do, so the launcher's process group does not reach it either
CHILD = """
import os, signal, sys, time
def drop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env = {k: v for k, v in os.environ.items() if k != sys.argv[1]}
    os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)"], env)
signal.signal(signal.SIGTERM, drop)
open(sys.argv[2], "w").write(str(os.getpid()))
time.sleep(600)
"""
LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], start_new_session=True)
time.sleep(600)
"""


def test_a_stopped_launch_leaves_no_process_even_one_that_dropped_its_marker(tmp_path):
    """stop_launch waits for every process it found, by pid and start time, not only for those that still carry the
    marker: a dying process loses its environment before it is gone (the grid timeout test once saw a rank alive
    after run_grid returned), and one that drops the marker is killed all the same."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from hetero.lab.launch import MARKER, launch_pids, start_time, stop_launch

    from helpers import clean_env

    marker, pidfile = uuid.uuid4().hex, tmp_path / "child.pid"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, MARKER, str(pidfile)],
                            env={**clean_env(), MARKER: marker}, start_new_session=True)
    child = None
    try:
        t0 = time.time()
        while not pidfile.exists() or not pidfile.read_text():
            assert time.time() - t0 < 60 and proc.poll() is None
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert child in launch_pids(marker)
        stop_launch(proc, marker, grace_s=3, kill_wait_s=20)
        assert proc.poll() is not None and start_time(child) is None
    finally:
        for pid in (proc.pid, child):
            if pid is not None and start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)


# the cases that launch processes
@pytest.mark.launch
def test_timeout_stops_the_whole_process_group(tmp_path):
    # the child starts a grandchild and reports its pid; both would sleep for 10 minutes
    child = "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; " \
            "time.sleep(600)']); print('started', g.pid, flush=True); time.sleep(600)"
    assert hg.launch([sys.executable, "-c", child], tmp_path / "log", timeout_s=5) is None  # time to start python
    words = (tmp_path / "log").read_text().split()
    assert words[0] == "started"
    # The grandchild was stopped with its launch: it is gone, or a zombie its new parent has yet to reap. A process
    # tearing itself down already has no readable environment (so the launch no longer counts it) but is not a
    # zombie yet: give that teardown a bounded moment (a hang guard, not a timing assertion).
    deadline = time.monotonic() + 30
    while True:
        try:
            if psutil.Process(int(words[1])).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        assert time.monotonic() < deadline, "the grandchild outlived its launch's timeout"
        time.sleep(0.1)


@pytest.mark.launch
def test_grid_records_a_failure_carries_on_and_skips_completed_runs(tmp_path, monkeypatch):
    # imagefolder with no folder passes Config validation and fails inside the worker: a real runtime failure.
    # The synthetic run is made to look completed (the notebook test trains real ones): it must be skipped.
    params = dict(grid="g", runs_root=tmp_path, nproc=1, scheme="sync", hetero="", run_timeout_s=240,
                  **{**TINY, "data": ["imagefolder", "synthetic"]}, data_dir=str(tmp_path / "missing"))
    done = hg.plan_grid(**params).runs[1]
    done.run_dir.mkdir(parents=True)
    (done.run_dir / "config.json").write_text(json.dumps({"config": done.config.to_dict()}))
    (done.run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
    table = hg.run_grid(hg.plan_grid(**params), progress=False)
    assert list(table["status"]) == ["failed", "completed"] and list(table["launched"]) == [True, False]
    assert "image folder" in table.loc[0, "error"] and str(tmp_path / "missing") in table.loc[0, "error"]
    assert table.loc[0, "returncode"] != 0 and "hetero: error:" in (tmp_path / "g" / "logs" /
                                                                      f"{table.loc[0, 'run']}.log").read_text()
    saved = pd.read_csv(tmp_path / "g" / "grid.csv", keep_default_na=False)
    assert list(saved["status"]) == ["failed", "completed"] and saved.loc[0, "error"] == table.loc[0, "error"]

    launched = []
    monkeypatch.setattr(hg, "launch", lambda cmd, log, timeout_s: launched.append(cmd) or None)
    again = hg.run_grid(hg.plan_grid(**params), progress=False)
    assert len(launched) == 1 and "imagefolder" in launched[0] and "--nproc-per-node=1" in launched[0]
    assert list(again["status"]) == ["timeout", "completed"] and list(again["launched"]) == [True, False]
    assert "timed out after 240 s" in again.loc[0, "error"]
