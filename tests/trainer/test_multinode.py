"""Two torchrun nodes on one machine: roles follow the global rank, and the balancer sees the right rank's speed.
(How shares follow real CPU contention depends on the host's topology: a hardware figure for make bench, not a
test; here the emulated slowdown, 8x, is far larger than anything a shared 2-core host does to one rank.)"""
import socket
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, TINY, _env, free_port, read_run, replay_decisions

pytestmark = [pytest.mark.launch, pytest.mark.slow]  # two torchrun nodes on one machine


def test_two_torchrun_nodes_on_one_machine(tmp_path):
    run, port = tmp_path / "run", free_port()
    args = [*TINY, "--epochs", "3", "--scheme", "dp", "--hetero", "1:slowdown=8", "--threads", "1",
            "--run-dir", str(run)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hetero-test", "-m", "hetero.trainer",
         *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
    r = read_run(run)
    assert r["epochs"].epoch.tolist() == [1, 2, 3]                  # written once, by global rank 0
    assert "run folder" in outs[0][0] and "run folder" not in outs[1][0]
    delayed = r["steps"].groupby("rank").delay_s.sum()
    assert delayed[0] == 0 and delayed[1] > 0                      # global rank 1 = node 1's local rank 0
    last = r["ranks"][r["ranks"].epoch == 3].set_index("rank").share
    assert last[1] < 0.35 < 0.65 < last[0]                         # 1/9 and 8/9 without noise
    np.testing.assert_array_equal(*replay_decisions(run))          # decided from what both nodes measured
    assert [x["host"] for x in r["config"]["ranks"]] == [socket.gethostname()] * 2
