"""Smoke tests of the benchmark suite (python -m hetero.bench) and the GPU check (scripts/gpu_check.py --smoke)
at their smallest sizes on CPU: they run, write their files, and their ratios are sane. No absolute times; the
emulated slowdown (8x) is far larger than what a busy 2-core host does to one rank. Slow tier (make test-all)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, _env

pytestmark = pytest.mark.slow


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def test_bench_quickest(tmp_path):
    out = tmp_path / "bench"
    p = _run([sys.executable, "-m", "hetero.bench", "--quick", "--out", str(out), "--worlds", "2", "--slowdowns", "8",
              "--schemes", "edp", "--epochs", "2", "--steps", "8", "--batch-per-rank", "32",
              "--overhead-epochs", "2", "--max-workers", "16"], timeout=240)
    res = json.loads((out / "bench.json").read_text())
    assert "Balance efficiency" in p.stdout and (out / "table.md").exists()
    assert res["meta"]["plan"]["worlds"] == [2] and res["meta"]["command"].startswith("python -m hetero.bench")

    (r,) = res["balance"]
    assert (r["world"], r["slowdown"], r["scheme"], r["speedup_vs_sync"]) == (2, 8.0, "edp", None)
    assert (r["global_batch"], r["steps"]) == (64, 8)
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("over_ideal", "over_sync_bound")) and r["jitter"] >= 0
    assert abs(sum(r["shares"]) - 1) < 0.01  # over_ideal, over_sync_bound: hardware figures, only finite
    assert r["shares"][1] < 0.5  # the slowed rank (the last) was given less work
    m = r["cost_model"]
    assert m["scale"][1] > m["scale"][0] and m["ideal_sizes"][1] < m["ideal_sizes"][0]
    assert m["ideal_step_s"] < m["sync_step_s"] and sum(m["ideal_sizes"]) == 64
    assert r["predicted_speedup"] > 1.1  # an 8x slower rank: balancing must be predicted to pay

    ov = res["overhead"]
    assert math.isfinite(ov["ratio"]) and ov["ratio"] > 0 and len(ov["pair_ratios"]) == len(ov["step_s"]["plain"]) == 1

    dec = res["balancer"]
    assert {(r["rule"], r["workers"]) for r in dec} == {(rule, n) for rule in ("proportional", "affine")
                                                        for n in (2, 4, 8, 16)}
    assert all(r["decision_ms"] > 0 for r in dec)
    assert {c["target"].split()[0] for c in res["checks"]} == {"dp/edp", "trainer"}
    assert (r["affinity"] == "") == (len(os.sched_getaffinity(0)) >= 2)  # pinned only when oversubscribed


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu" / "check.json"
    _run([sys.executable, "scripts/gpu_check.py", "--smoke", "--schemes", "edp", "--pair-hetero", "1:slowdown=8",
          "--out", str(out),
          "--work-dir", str(tmp_path / "work")], timeout=300)
    res = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# GPU check")
    for part in ("throughput", "fast"):  # float32, then bf16 autocast + channels-last
        (tp,) = res[part]
        assert "error" not in tp and tp["model"] == "tiny"
        assert all(tp[k] > 0 for k in ("raw_samples_s", "raw_synced_samples_s", "trainer_samples_s",
                                        "trainer_over_raw"))
    (edp,) = res["pair"]["rows"]
    assert "error" not in edp and edp["scheme"] == "edp" and len(edp["shares"]) == 2
    assert edp["shares"][1] < edp["shares"][0]  # rank 1 is the slowed one
    mixed = res["mixed"]["rows"]  # on the CPU: two CPU ranks stand in for the GPU + CPU job
    assert [r["scheme"] for r in mixed] == ["sync", "edp", "affine"] and not any("error" in r for r in mixed)
    assert mixed[1]["speedup_vs_sync"] > 0 and abs(sum(mixed[2]["shares"]) - 1) < 0.01
    assert res["probe"] == {**res["probe"], "max_batch": None, "step_at_max_fits": True}  # CPU: no limit
