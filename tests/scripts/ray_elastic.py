"""An elastic Ray Train group (num_workers=(1, 2)) that grows and shrinks on one machine: two Ray nodes of one CPU
each on this host (ray.cluster_utils.Cluster, Ray's own tool for this), the training function examples/ray_train.py's.
The group starts on the head node alone (1 worker); a second node joins and Ray grows the group to 2 at its next
resize check (every 5 s here); then that node is removed (its raylet and its worker die: a node lost) and Ray goes on
with 1 worker from the last checkpoint. Each node's workers are named by HETERO_WORKER_ID (two nodes on one host
have the same host and local rank). Each start writes its steps (RECORD.startS.rankR.jsonl) and this driver the times
of its events (events.json); tests/integrations/test_ray.py checks them.

    PYTHONPATH=tests/raystub:.:examples python tests/scripts/ray_elastic.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray_train import train_fn  # examples/ on PYTHONPATH: the workers import it by name too

EPOCHS = 8


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _until(found, timeout_s: float = 900):
    deadline = time.monotonic() + timeout_s
    while not (got := found()):
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there")
        time.sleep(0.05)
    return got


def conduct(cluster: Cluster, out: Path, events: list) -> None:
    """The cluster's part: a node joins once the 1-worker group runs; it is removed once a 2-worker group runs."""
    try:
        _until(lambda: len(_rows(out / "rec.start0.rank0.jsonl")) >= 6)
        node = cluster.add_node(num_cpus=1, include_dashboard=False, env_vars={"HETERO_WORKER_ID": "node-b"})
        events.append({"event": "joined", "t": time.time()})
        grown = _until(lambda: [f for f in sorted(out.glob("rec.start*.rank1.jsonl")) if len(_rows(f)) >= 6])
        cluster.remove_node(node)
        last = _rows(grown[0])[-1]
        events.append({"event": "removed", "t": time.time(), "start": last["start"], "epoch": last["epoch"],
                       "step": last["step"]})
    except Exception as e:  # noqa: BLE001 - reported in the events, which the test reads
        events.append({"event": "error", "what": repr(e)})


def main(out: Path) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                             "env_vars": {"HETERO_WORKER_ID": "node-a"}})
    events: list[dict] = []
    result = None
    try:
        ray.init(address=cluster.address)
        cfg = {"samples": 1024, "global_batch": 64, "epochs": EPOCHS, "lr": 0.05, "seed": 0, "scheme": "edp",
               "rebalance_every": 5, "checkpoint_every": 4, "hetero": "0:delay=0.15", "record": str(out / "rec"),
               "record_params": 0}
        trainer = TorchTrainer(
            train_fn, train_loop_config=cfg,
            scaling_config=ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=5.0),
            run_config=RunConfig(name="elastic", storage_path=str(out / "storage"),
                                 failure_config=FailureConfig(max_failures=1)))
        done: list = []  # fit in a thread: adding a node installs signal handlers, which needs the main thread
        fit = threading.Thread(target=lambda: done.append(trainer.fit()), daemon=True)
        fit.start()
        conduct(cluster, out, events)
        fit.join()
        result = done[0] if done else None
    finally:
        (out / "events.json").write_text(json.dumps(events))
        ray.shutdown()
        cluster.shutdown()
    if result is None or result.error is not None:
        print(f"error: the Ray run failed: {result and result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
