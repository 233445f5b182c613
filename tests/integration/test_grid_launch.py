"""hetero.lab.grid: expansion, validation before any launch, skip/resume/failure bookkeeping, per-run timeout.
Here the cases that launch processes; those in one process: tests/unit/test_grid.py."""
from __future__ import annotations

import json
import sys
import time

import pandas as pd
import psutil

from hetero.lab import grid as hg

TINY = dict(model="tiny", data="synthetic", subset=256, test_subset=128, global_batch=64, epochs=1, device="cpu")


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
