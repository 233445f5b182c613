"""The measurement toolkit (hetero.lab.measure), and smoke tests of the benchmark suite (python -m hetero.lab.bench) and the
GPU check (scripts/gpu_check.py --smoke) at their smallest sizes on CPU: they run, write their files, and their
ratios are sane. No absolute times; the emulated slowdown (8x) is far larger than what a busy 2-core host does to
one rank. The two smoke runs are in the slow tier (make test-all)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, _env

from hetero.lab import measure
from hetero.lab.simbench import decision_times


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_bench_quickest(tmp_path):
    out = tmp_path / "bench"
    p = _run([sys.executable, "-m", "hetero.lab.bench", "--quick", "--out", str(out), "--worlds", "2", "--slowdowns", "8",
              "--schemes", "edp", "--epochs", "2", "--steps", "8", "--batch-per-rank", "32",
              "--overhead-epochs", "2", "--max-workers", "16", "--hf-runs", "1", "--hf-steps", "6"], timeout=360)
    res = json.loads((out / "bench.json").read_text())
    assert "Balance efficiency" in p.stdout and (out / "table.md").exists()
    assert res["meta"]["suite"]["worlds"] == [2] and res["meta"]["command"].startswith("python -m hetero.lab.bench")

    (r,) = res["balance"]
    assert (r["world"], r["kind"], r["hetero"], r["scheme"], r["speedup_vs_sync"]) == (2, "slowdown", "1:slowdown=8",
                                                                                         "edp", None)
    assert [(s["scheme"], s["repeats"], s["over_ideal"]) for s in res["balance_summary"]] == [("edp", 1, r["over_ideal"])]
    assert (r["global_batch"], r["steps"]) == (64, 8)
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("over_ideal", "over_sync_bound")) and r["jitter"] >= 0
    assert abs(sum(r["shares"]) - 1) < 0.01  # over_ideal, over_sync_bound: hardware figures, only finite
    assert r["shares"][1] < 0.5  # the slowed rank (the last) was given less work
    m = r["cost_model"]
    assert m["scale"][1] > m["scale"][0] and m["ideal_sizes"][1] < m["ideal_sizes"][0]
    assert m["ideal_step_s"] < m["sync_step_s"] and sum(m["ideal_sizes"]) == 64
    assert r["predicted_speedup"] > 1.1  # an 8x slower rank: balancing must be predicted to pay
    rep = r["replay"]  # the run replayed in the simulator with its own jitter: same measured figure, a finite guess
    assert rep["measured"] == pytest.approx(r["over_ideal"]) and math.isfinite(r["simulated"]) and r["simulated"] > 0.9
    assert len(rep["noise"]["sigma"]) == 2 and "simulated" in (out / "table.md").read_text()

    ov = res["overhead"]
    assert math.isfinite(ov["ratio"]) and ov["ratio"] > 0 and len(ov["pair_ratios"]) == len(ov["step_s"]["plain"]) == 1
    assert math.isfinite(ov["api_ratio"]) and ov["api_ratio"] > 0
    assert len(ov["api_pair_ratios"]) == len(ov["step_s"]["ddp_loader"]) == 1

    fs = res["fsdp_overhead"]
    assert math.isfinite(fs["ratio"]) and fs["ratio"] > 0 and len(fs["pair_ratios"]) == 8  # epoch 1's steps
    dec = res["balancer"]
    assert {(r["rule"], r["workers"]) for r in dec} == {(rule, n) for rule in ("proportional", "affine")
                                                        for n in (2, 4, 8, 16)}
    assert all(r["decision_ms"] > 0 for r in dec)
    hf = importlib.util.find_spec("transformers") is not None  # the [hf] extra: its part runs, or is noted
    if hf:
        assert res["hf"]["ratio"] > 0 and len(res["hf"]["pair_ratios"]) == 1
    assert {c["target"].split()[0] for c in res["checks"]} == {"dp/edp", "simulated", "trainer", "api", *["hf"] * hf}
    assert (r["affinity"] == "") == (len(os.sched_getaffinity(0)) >= 2)  # pinned only when oversubscribed


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu" / "check.json"
    _run([sys.executable, "scripts/gpu_check.py", "--smoke", "--schemes", "edp", "--pair-hetero", "1:slowdown=8",
          "--out", str(out), "--work-dir", str(tmp_path / "work")], timeout=900)  # a hang guard (slow when loaded)
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
    d = res["delay"]  # two ranks, rank 1 delayed 20 ms a step: the delay is part of its recorded compute
    assert "error" not in d and d["delay_s"][0] == 0 and math.isclose(d["delay_s"][1], 0.02) and d["steps"] == 8
    assert d["compute_s"][1] >= d["delay_s"][1]


@pytest.mark.parametrize("argv", [["--schemes", "edp,nope"], ["--parts", "pair,x"]])
def test_gpu_check_bad_input_is_one_line_and_status_2(argv, tmp_path):
    p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(tmp_path / "x.json"), *argv],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("hetero: error: unknown ") and p.stderr.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


def test_gpu_check_report_marks_missing_figures(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from gpu_parts import markdown

    meta = {"date": "d", "host": "h", "device_name": "GPU", "versions": {"torch": "2.x"}, "command": "c"}
    rows = [{"scheme": "edp", "epoch_s": 2.0, "shares": [0.6, 0.4], "balance_eff": 0.9, "speedup_vs_sync": None},
            {"scheme": "affine", "error": "LaunchError: exited 1"}]
    text = markdown({"meta": meta, "pair": {"backend": "gloo", "model": "tiny", "hetero": "1:slowdown=8", "rows": rows},
                     "throughput": [{"model": "tiny", "path": "float32", "batch": 32, "error": "skipped: out of time"}]})
    assert text.startswith("# GPU check, d, h: GPU (torch 2.x)")
    assert "| edp | 2.000 | - | 0.60/0.40 | 0.90 |" in text and "| affine | LaunchError: exited 1 |" in text
    assert "| tiny | float32 | 32 | skipped: out of time |" in text


def test_launch_keeps_the_log_and_names_it_with_its_tail(tmp_path):
    log, py = tmp_path / "logs" / "x.log", sys.executable
    with pytest.raises(measure.LaunchError, match=r"exited 3 \(log .*x.log\):\n(.|\n)*out of cheese"):
        measure.launch([py, "-c", "print('hello'); print('out of cheese'); raise SystemExit(3)"], log, 60)
    assert log.read_text().splitlines()[1:] == ["hello", "out of cheese"] and log.read_text().startswith(py)
    done, notes = tmp_path / "done.json", []
    done.write_text(json.dumps({"status": "completed"}))
    measure.launch([py, "-c", "raise SystemExit(1)"], log, 60, done=done, notes=notes)  # work done: kept
    assert len(notes) == 1 and "exited 1 after finishing" in notes[0]
    with pytest.raises(measure.LaunchError, match="ran past 1 s"):
        measure.launch([py, "-c", "import time; time.sleep(30)"], log, 1)


def test_steady_epochs_speedup_and_tables(tmp_path):
    (tmp_path / "epochs.csv").write_text("epoch,epoch_time_s,steps\n1,9.0,4\n2,2.0,4\n3,4.0,4\n4,3.0,4\n")
    assert [r["epoch"] for r in measure.steady_epochs(tmp_path, 3)] == ["3", "4"]
    (tmp_path / "steps.csv").write_text("epoch,step,rank\n1,0,0\n2,0,0\n2,0,1\n")
    assert len(measure.steady_epochs(tmp_path, table="steps")) == 2
    assert measure.steady_epoch_s(tmp_path) == 3.0 and measure.steady_epoch_s(tmp_path, 9) == 3.5  # short: all
    rows = [{"scheme": "dp", "epoch_s": 2.0}, {"scheme": "sync", "epoch_s": 3.0}, {"scheme": "edp"}]
    measure.add_speedup_vs_sync(rows)
    assert [r["speedup_vs_sync"] for r in rows] == [1.5, 1.0, None]
    no_sync = [{"scheme": "dp", "epoch_s": 2.0}]
    measure.add_speedup_vs_sync(no_sync)
    assert no_sync[0]["speedup_vs_sync"] is None
    assert measure.markdown_table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]


def test_run_meta_names_the_commit_and_versions():
    meta = measure.run_meta("cmd")
    assert meta["command"] == "cmd" and len(meta["git_commit"]) == 40
    assert {"python", "hetero", "numpy"} <= set(meta["versions"]) and meta["cores"] >= 1


def test_decision_times_repeat_within_their_bounds():
    times = decision_times("affine", 64, steps=8, repeats=(2, 4), budget_s=1e-9)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert len(decision_times("proportional", 8, repeats=(3, 3))) == 3


@pytest.mark.parametrize("argv", [["hetero.lab.bench", "--worlds", "1"], ["hetero.lab.bench", "--parts", "x"],
                                  ["hetero.lab.bench", "--slowdowns", "two"], ["hetero.lab.simbench", "--noise", "-1"],
                                  ["hetero.lab.overhead", "--out", "x", "--subset", "1", "--global-batch", "4",
                                   "--epochs", "3"]])
def test_bad_input_is_one_line_and_status_2(argv):
    p = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("hetero: error: ") and p.stderr.count("\n") == 1


@pytest.mark.parametrize("target,knobs,module", [("bench", {"QUICK": "1", "OUT": "x"}, "hetero.lab.bench"),
                                                 ("sim-bench", {"NOISE": "0.02"}, "hetero.lab.simbench")])
def test_make_knobs_are_the_flags_of_the_same_name(target, knobs, module):
    make = subprocess.run(["make", "-n", target, "STAMP=", *(f"{k}={v}" for k, v in knobs.items())], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout
    helptext = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=60).stdout
    for k, v in knobs.items():
        flag = "--" + k.lower().replace("_", "-")
        # values reach the shell through the environment (a quote in a value runs nothing), flags keep the names
        assert (f'{flag} "${k}"' in make or f'{flag} "${k}"' in make.replace("${" + k + ":+", "")
                if k != "QUICK" else flag in make) and flag in helptext


def _steps_frame(fixed, per, delay, sizes, steps=8):
    """A steps.csv-like frame with exact times: rank i computes fixed_i + per_i x b plus delay_i (its delay_s)."""
    import pandas as pd

    rows = [{"epoch": e, "step": s, "rank": i, "batch_size": sizes[i], "delay_s": delay[i],
             "compute_s": fixed[i] + per[i] * sizes[i] + delay[i], "wait_s": 0.001 + 0.01 * (i == 0)}
            for e in (1, 2) for s in range(steps) for i in range(len(sizes))]
    return pd.DataFrame(rows)


def test_cost_model_separates_a_constant_delay_and_a_slowdown_from_the_work():
    from hetero.lab.efficiency import cost_model

    a, c = 0.004, 0.0005
    # rank 1 sleeps 0.05 s per step: its own work is like rank 0's, the sleep is its delay
    m = cost_model(_steps_frame([a, a], [c, c], [0.0, 0.05], [96, 32]), (a, c), 128, 2, hetero="1:delay=0.05")
    assert m["scale"] == pytest.approx([1.0, 1.0]) and m["fixed_s"] == pytest.approx([a, a])
    assert m["factor"] == [1.0, 1.0] and m["delay_s"] == pytest.approx([0.0, 0.05])
    assert m["allreduce_s"] == pytest.approx(0.001)
    assert sum(m["ideal_sizes"]) == 128 and m["ideal_sizes"][1] < 32  # the delay must cost it samples
    assert m["size_changes"] == 0 and m["misallocation_s"] == pytest.approx(  # [96, 32] is not the optimum
        max(a + c * 96, a + 0.05 + c * 32) - m["ideal_step_s"]) and m["misallocation_s"] > 0.001
    # rank 1 3x slower: it slept 2 x its own compute; the factor is measured, its work is still rank 0's
    own = a + c * 32
    s = cost_model(_steps_frame([a, a], [c, c], [0.0, 2 * own], [96, 32]), (a, c), 128, 2, hetero="1:slowdown=3")
    assert s["scale"] == pytest.approx([1.0, 1.0]) and s["factor"] == pytest.approx([1.0, 3.0])
    assert s["delay_s"] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert s["ideal_step_s"] == pytest.approx(max(a + c * s["ideal_sizes"][0], 3 * (a + c * s["ideal_sizes"][1])))


def test_cost_model_of_ranks_sharing_a_core():
    """4 ranks on 2 cores (0,0,1,1), rank 3 delayed: times made by processor sharing are read back exactly, and the
    ideal moves rank 3's work to its core-mate, which a per-rank model cannot see."""
    import pandas as pd

    from hetero.lab.coupled import coupled_batch_sizes, finish_s, shared_walls
    from hetero.lab.efficiency import cost_model

    a, c, d, cores = 0.002, 0.001, 0.3, ["0", "0", "1", "1"]
    sizes = np.array([[128, 128, 128, 128], [140, 120, 200, 52], [100, 150, 230, 32]] * 4)
    walls = shared_walls(a + c * sizes, cores)
    rows = [{"epoch": 1, "step": t, "rank": i, "batch_size": int(sizes[t, i]), "delay_s": d * (i == 3),
             "compute_s": walls[t, i] + d * (i == 3), "wait_s": 0.001} for t in range(len(sizes)) for i in range(4)]
    m = cost_model(pd.DataFrame(rows), (a, c), 512, 1, hetero="3:delay=0.3", cores=cores)
    assert m["scale"] == pytest.approx([1, 1, 1, 1]) and m["delay_s"] == pytest.approx([0, 0, 0, d])
    best = coupled_batch_sizes([a] * 4, [c] * 4, 512, cores, 1.0, [0, 0, 0, d])
    assert m["ideal_step_s"] == pytest.approx(finish_s([a] * 4, [c] * 4, best, cores, 1.0, [0, 0, 0, d]).max())
    assert m["ideal_sizes"][3] == best[3] == 1 and m["ideal_sizes"][2] > 256  # core 1 does more than core 0
    assert m["misallocation_s"] == pytest.approx(
        finish_s([a] * 4, [c] * 4, sizes, cores, 1.0, [0, 0, 0, d]).max(1).mean() - m["ideal_step_s"])
    alone = cost_model(pd.DataFrame(rows), (a, c), 512, 1, hetero="3:delay=0.3")  # the sharing ignored
    assert alone["scale"][0] > 1.5  # ranks 0 and 1 look twice as slow as they are


def test_summary_and_affine_against_dp_over_repeats():
    from hetero.lab.efficiency import affine_vs_dp, summary

    def row(scheme, effect, kind, ratio, rep):
        return {"world": 2, "effect": effect, "kind": kind, "scheme": scheme, "repeat": rep, "global_batch": 256,
                "over_ideal": ratio, "over_sync_bound": 0.7, "speedup_vs_sync": None, "predicted_speedup": 1.5,
                "jitter": 0.02, "shares": [0.6, 0.4], "affinity": ""}
    rows = [row("dp", "2x slower", "slowdown", v, i) for i, v in enumerate((1.02, 1.05, 1.03))]
    rows += [row("affine", "2x slower", "slowdown", v, i) for i, v in enumerate((1.06, 1.07, 1.05))]
    rows += [row("dp", "+60 ms (2x)", "delay", v, i) for i, v in enumerate((1.10, 1.12, 1.11))]
    rows += [row("affine", "+60 ms (2x)", "delay", v, i) for i, v in enumerate((1.02, 1.03, 1.01))]
    summ = summary(rows)
    assert [(r["scheme"], r["repeats"], r["over_ideal"], r["min"], r["max"]) for r in summ[:2]] == [
        ("dp", 3, 1.03, 1.02, 1.05), ("affine", 3, 1.06, 1.05, 1.07)]
    slow, delay = affine_vs_dp(summ)
    assert slow["dp_spread"] == pytest.approx(0.03) and slow["within"] and not slow["ahead"]  # 1.06 <= 1.03 + 0.03
    assert delay["ahead"] and delay["within"] and delay["kind"] == "delay"
    rows[3]["over_ideal"] = rows[4]["over_ideal"] = 1.07  # affine's median 1.07 > 1.03 + 0.03: outside the spread
    assert not affine_vs_dp(summary(rows))[0]["within"]
