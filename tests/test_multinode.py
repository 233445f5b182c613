"""Several nodes and real speed differences: roles follow the global rank; shares follow real CPU contention."""
import os
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, _env, read_run, run_train
from hetero.launch import free_port


def test_two_torchrun_nodes_on_one_machine(tmp_path):
    run, port = tmp_path / "run", free_port()
    args = [*TINY, "--epochs", "3", "--scheme", "dp", "--hetero", "1:slowdown=3", "--threads", "1",
            "--run-dir", str(run)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hetero-test", "-m", "hetero.train",
         *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
    r = read_run(run)
    assert r["epochs"].epoch.tolist() == [1, 2, 3]                  # written once, by global rank 0
    assert "run folder" in outs[0][0] and "run folder" not in outs[1][0]
    delayed = r["steps"].groupby("rank").delay_s.sum()
    assert delayed[0] == 0 and delayed[1] > 0                      # global rank 1 = node 1's local rank 0
    last = r["ranks"][r["ranks"].epoch == 3].set_index("rank").share
    assert last[1] < 0.35 < 0.65 < last[0]
    assert [x["host"] for x in r["config"]["ranks"]] == [socket.gethostname()] * 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores to pin one rank per core")
def test_real_cpu_contention_moves_shares_to_the_free_core(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cores[1]}))
    try:
        base = [*TINY, "--epochs", "3", "--affinity", f"{cores[0]},{cores[1]}", "--threads", "1"]
        for scheme in ("sync", "dp"):
            run_train([*base, "--scheme", scheme, "--run-dir", str(tmp_path / scheme)], nproc=2)
    finally:
        busy.kill()
    sync, dp = read_run(tmp_path / "sync"), read_run(tmp_path / "dp")
    last = dp["ranks"][dp["ranks"].epoch == 3].set_index("rank").share
    assert last[0] > 0.55, last                                     # work moved off the contended core
    assert dp["epochs"].epoch_time_s.iloc[-1] < sync["epochs"].epoch_time_s.iloc[-1]
    print(f"shares {last.round(3).tolist()}, last-epoch time dp/sync "
          f"{dp['epochs'].epoch_time_s.iloc[-1] / sync['epochs'].epoch_time_s.iloc[-1]:.2f}")
