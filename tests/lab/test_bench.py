"""The measurement toolkit (hetero.lab.measure), and smoke tests of the benchmark suite (python -m hetero.lab.bench)
and the GPU check (scripts/gpu_check.py --smoke) at their smallest sizes on CPU: they run, write their files, and their
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

from hetero.lab import measure
from hetero.lab.simbench import decision_times

from helpers import ROOT, _env


def test_gpu_check_report_marks_missing_figures(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from gpu_parts import markdown

    meta = {"date": "d", "host": "h", "device_name": "GPU", "versions": {"torch": "2.x"}, "command": "c"}
    rows = [{"scheme": "edp", "epoch_s": 2.0, "shares": [0.6, 0.4], "balance_eff": 0.9, "speedup_vs_sync": None},
            {"scheme": "affine", "error": "LaunchError: exited 1"}]
    text = markdown({"meta": meta, "pair": {"backend": "gloo", "model": "tiny", "hetero": "1:slowdown=8", "rows": rows},
                     "throughput": [{"model": "tiny", "path": "float32", "batch": 32,
                                     "error": "skipped: out of time"}]})
    assert text.startswith("# GPU check, d, h: GPU (torch 2.x)")
    assert "| edp | 2.000 | - | 0.60/0.40 | 0.90 |" in text and "| affine | LaunchError: exited 1 |" in text
    assert "| tiny | float32 | 32 | skipped: out of time |" in text


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


def test_the_optimum_moves_as_the_cost_moves_between_epochs():
    """A rank whose per-sample cost is 2c, 1.5c, c in epochs 1-3 (steady from 2): each epoch's own optimum, and the
    optimum of the epoch before it, are scored by the model of the steady epochs together, exactly; with one cost
    in every epoch both are 0."""
    import pandas as pd

    from hetero.lab.coupled import coupled_batch_sizes, finish_s
    from hetero.lab.efficiency import cost_model

    a, c, B = 0.0, 0.001, 128

    def frame(per_epoch):
        return pd.concat([_steps_frame([a, a], [c, c * k], [0.0, 0.0], [64, 64]).assign(epoch=e)
                          for e, k in per_epoch.items()])

    still = cost_model(frame({1: 1.5, 2: 1.5, 3: 1.5}), (a, c), B, 2)
    assert still["epoch_optimum_s"] == pytest.approx(0, abs=1e-12)
    assert still["lagged_optimum_s"] == pytest.approx(0, abs=1e-12)
    m = cost_model(frame({1: 2.0, 2: 1.5, 3: 1.0}), (a, c), B, 2)
    assert m["per_sample_s"] == pytest.approx([c, 1.25 * c])  # the steady epochs' mean
    T = lambda b: finish_s(m["fixed_s"], m["per_sample_s"], b, [0, 1]).max()  # noqa: E731
    best = {k: coupled_batch_sizes([a, a], [c, c * k], B, [0, 1]) for k in (1.0, 1.5, 2.0)}
    ideal = m["ideal_step_s"]
    assert m["epoch_optimum_s"] == pytest.approx((T(best[1.5]) + T(best[1.0])) / 2 - ideal)
    assert m["lagged_optimum_s"] == pytest.approx((T(best[2.0]) + T(best[1.5])) / 2 - ideal)
    assert m["lagged_optimum_s"] > m["epoch_optimum_s"] > 0.001
    # with every epoch before pooled (1 alone for 2; 1 and 2 at equal sizes for 3: the mean cost, 1.75c)
    best[1.75] = coupled_batch_sizes([a, a], [c, c * 1.75], B, [0, 1])
    assert m["pooled_optimum_s"] == pytest.approx((T(best[2.0]) + T(best[1.75])) / 2 - ideal)
    assert m["pooled_optimum_s"] > m["lagged_optimum_s"]  # a cost that keeps moving one way: memory lags it more
    assert m["cost_move"] == pytest.approx([0.0, 1 / 3])  # rank 1: 2 -> 1.5 -> 1, its largest move 1.5 -> 1
    assert m["epoch_best"] == {str(e): best[k].tolist() for e, k in ((1, 2.0), (2, 1.5), (3, 1.0))}
    first = cost_model(frame({2: 1.5, 3: 1.0}), (a, c), B, 2)  # no epoch before the first steady one
    assert first["lagged_optimum_s"] == pytest.approx(T(best[1.5]) - ideal)
    assert first["pooled_optimum_s"] == pytest.approx(T(best[1.5]) - ideal)


def test_a_cost_move_is_counted_in_standard_errors_of_the_epochs_means():
    """Rank 1's cost 1.5c then c, each step 1% over or under it in turn (rank 0: c throughout, the same scatter):
    its move is 1/3 and its z the move over the standard error of the difference of the two epochs' means."""
    import pandas as pd

    from hetero.lab.efficiency import cost_model

    c, n = 0.001, 8
    rows = [{"epoch": e, "step": t, "rank": i, "batch_size": 64, "delay_s": 0.0, "wait_s": 0.001,
             "compute_s": c * k[i] * 64 * (1 + 0.01 * (-1) ** t)}
            for e, k in ((1, (1.0, 1.5)), (2, (1.0, 1.0))) for t in range(n) for i in (0, 1)]
    m = cost_model(pd.DataFrame(rows), (0.0, c), 128, 2)
    se = lambda k: k * 0.01 * np.sqrt(n / (n - 1)) / np.sqrt(n)  # noqa: E731  (std with ddof 1, over sqrt(n))
    assert m["cost_move"] == pytest.approx([0.0, 1 / 3])
    assert m["cost_move_z"] == pytest.approx([0.0, 0.5 / np.hypot(se(1.5), se(1.0))])


def test_the_target_band_is_the_sizes_within_the_misallocation_target_and_the_drift_is_drawn(tmp_path):
    """Rank 1 3x rank 0's cost per sample, no fixed part, 256 samples: the best gives rank 1 64; within 0.02 of
    the ideal step (192c) a sample more on rank 1 costs 3c, one fewer c, so the band is 61-65 (64 - 3.84, 64 +
    1.28). The drift figure is drawn from runs whose cost models hold each epoch's best."""
    from hetero.lab import outside
    from hetero.lab.efficiency import cost_model

    c = 0.001
    m = {"fixed_s": [0.0, 0.0], "per_sample_s": [c, 3 * c], "cores": [0, 1], "factor": [1.0, 1.0],
         "delay_s": [0.0, 0.0], "ideal_sizes": [192, 64], "ideal_step_s": 192 * c, "allreduce_s": 0.0}
    assert outside.target_band(m) == (61, 65)
    assert outside.target_band({**m, "allreduce_s": 192 * c}) == (57, 66)  # 0.02 of twice the step: twice the band
    frame = _steps_frame([0.0, 0.0], [c, 3 * c], [0.0, 0.0], [128, 128])
    run = {"effect": "3x", "scheme": "dp", "cost_model": cost_model(frame, (0.0, c), 256, 2)}
    assert run["cost_model"]["epoch_best"] == {"1": [192, 64], "2": [192, 64]}
    assert outside.optimum_drift([run], tmp_path / "drift.png") == tmp_path / "drift.png"
    assert (tmp_path / "drift.png").stat().st_size > 0
    assert outside.optimum_drift([{**run, "cost_model": {}}], tmp_path / "none.png") is None


def test_host_part_reports_medians_deciles_the_hook_floor_and_phases(tmp_path):
    """The host part's summary from constructed per-step times: hetero less plain at the median and the fastest
    decile, in wall, CPU and main-thread CPU time; each DDP door's floor (torch's own Python hook; the loss door's
    mechanisms by hand), against its own pair's plain loop; the mean over every step (a
    decision's steps included); the phases per step; the loss-weighting row against plain DDP. Its table and figure
    are written from that summary."""
    from hetero.lab import host

    steps = np.arange(100.0)
    plain = {"wall_s": (1000 + steps) * 1e-6, "cpu_s": (800 + steps) * 1e-6, "main_s": (500 + steps) * 1e-6}
    hook = {k: v + 60e-6 for k, v in plain.items()}
    het = {k: v + 150e-6 for k, v in plain.items()}
    het["cpu_s"] = het["cpu_s"].copy()
    het["cpu_s"][::10] += 1000e-6  # a decision every 10 steps: the mean moves by 100 µs, the median not at all
    phases = {p: 1e-6 for p in host.PHASES}
    raw = {"ddp": {"plain": {k: v.tolist() for k, v in plain.items()},
                   "torch_hook": {k: (v + 7e-6).tolist() for k, v in hook.items()},  # its own plain: 7 µs slower
                   "plain_torch_hook": {k: (v + 7e-6).tolist() for k, v in plain.items()},
                   "hetero": {k: v.tolist() for k, v in het.items()}, "phases_s": phases},
           "ddp_loss": {"plain": {k: v.tolist() for k, v in plain.items()},
                        "floor": {k: (v + 25e-6).tolist() for k, v in plain.items()},  # its own plain: the same
                        "plain_floor": {k: v.tolist() for k, v in plain.items()},
                        "hetero": {k: (v + 90e-6).tolist() for k, v in plain.items()}, "phases_s": phases},
           "fsdp": {"plain": {k: v.tolist() for k, v in plain.items()},
                    "hetero": {k: (v + 40e-6).tolist() for k, v in plain.items()}, "phases_s": phases}}
    s = host.summary(raw)
    ddp, fsdp, loss = s["ddp"], s["fsdp"], s["ddp_loss"]
    assert loss["added_main_us"] == pytest.approx(90) and loss["floor_main_us"] == pytest.approx(25)
    assert loss["beyond_floor_cpu_us"] == pytest.approx(65)
    assert ddp["added_wall_us"] == pytest.approx(150) and ddp["added_wall_p10_us"] == pytest.approx(150)
    assert ddp["added_cpu_us"] == pytest.approx(150, abs=10)  # the decisions' tenth of the steps shifts it a little
    assert ddp["added_cpu_mean_us"] == pytest.approx(250)
    assert ddp["added_cpu_between_us"] == pytest.approx(150)  # the deciding steps and those after them left out
    assert loss["added_cpu_between_us"] == pytest.approx(90) and "added_cpu_between_us" in fsdp
    assert ddp["floor_cpu_us"] == pytest.approx(60) and ddp["beyond_floor_wall_us"] == pytest.approx(90)
    assert fsdp["added_cpu_us"] == pytest.approx(40) and "floor_cpu_us" not in fsdp
    assert ddp["phases_us"]["hook"] == pytest.approx(1.0)
    text = "\n".join(host.section({**s, "steps": 100}))
    assert "| DDP | 1050 / 850 | +150 |" in text and "| FSDP2 |" in text and "| DDP, weighting='loss' |" in text
    assert "between decisions" in text
    assert host.figure(s, tmp_path / "host.png") == tmp_path / "host.png" and (tmp_path / "host.png").stat().st_size
    assert host.figure({}, tmp_path / "none.png") is None


def test_the_tokens_part_measures_a_split_against_the_best_split_of_each_step(tmp_path):
    """tokenbench.summarise on made-up runs whose step times are exactly the slowest predicted compute plus 5 ms: the
    column given the best split of every step reads 1.000 of the ideal with misallocation 1; one that gives rank 1
    (3x slower per token) half the samples by count reads well above, with the wait it makes; the targets follow."""
    from hetero.core.tokens import Cost, split
    from hetero.lab import tokenbench

    rng = np.random.default_rng(0)
    fits = [[0.001, 1e-5, 0.0], [0.001, 3e-5, 0.0]]
    cost = Cost("padded")
    steps = [rng.integers(2, 400, 16) for _ in range(tokenbench.WARMUP + 6)]
    a, c, _ = np.array(fits).T

    def run(parts_of):
        ends, t, lens = [0.0], 0.0, [[], []]
        for L in steps:
            parts = parts_of(L)
            for r in range(2):
                lens[r].append(L[parts[r]].tolist())
            t += max(a[r] + c[r] * cost.work(L[parts[r]]) for r in range(2)) + 0.005
            ends.append(t)
        return [{"ends": ends[1:], "lengths": lens[r]} for r in range(2)]
    best = run(lambda L: split(L, a, c, cost))
    halves = run(lambda L: [np.arange(8), np.arange(8, 16)])
    ranks = [{"fits": {"padded/rank 1 3x slower": fits[r]},
              "runs": {"padded/rank 1 3x slower": {"tokens": [best[r]], "plain": [halves[r]]}}} for r in range(2)]
    rows = {r["column"]: r for r in tokenbench.summarise(ranks)}
    assert rows["tokens"]["over_ideal"] == pytest.approx(1.0) and rows["tokens"]["misallocation"] == pytest.approx(1)
    assert rows["tokens"]["overhead_ms"] == pytest.approx(5.0) and rows["tokens"]["cost_ratio"] == pytest.approx(3)
    assert rows["plain"]["over_ideal"] > 1.3 and rows["plain"]["wait_ms"] > rows["tokens"]["wait_ms"]
    # the replay in the simulator (tokensim.replay): no jitter in these steps, so the equal split of each step's
    # samples (the plain Trainer's) replays to its measured figure exactly; the tokens column here was given the best
    # split from its first step, which hetero's learner cannot do (it splits by the prior until its first decision,
    # at step 4, while step 3 is timed), so its replay reads above the measured and the replay's target fails
    assert abs(rows["plain"]["noise"]) < 1e-9 and abs(rows["tokens"]["noise"]) < 1e-9
    assert rows["plain"]["simulated"] == pytest.approx(rows["plain"]["over_ideal"], rel=1e-9)
    assert rows["tokens"]["simulated"] > rows["tokens"]["over_ideal"] + 0.05
    verdict = {c["target"]: c["pass"] for c in tokenbench.checks(list(rows.values()))}
    assert verdict == {"tokens <= 1.10 x ideal (padded, rank 1 3x slower)": True,
                       "tokens ahead of every other column (padded, rank 1 3x slower; next: plain)": True,
                       "tokens: simulated time / ideal within 0.05 of the measured, every cell (worst)": False}
    text = "\n".join(tokenbench.section({"table": list(rows.values()), "per_rank": 8, "median_length": 64,
                                          "longest": 1024, "runs": 1, "steps": len(steps)}))
    assert "measured / simulated time over the ideal" in text and "| padded | rank 1 3x slower | 0.000 |" in text
    # a calibration that recorded each rank's jitter (its batches' log sd over its fit): the replay draws that
    for r in ranks:
        r["fits"]["padded/rank 1 3x slower"] = [*r["fits"]["padded/rank 1 3x slower"], 0.1]
    again = {r["column"]: r for r in tokenbench.summarise(ranks)}
    assert again["plain"]["noise"] == pytest.approx(0.1) and again["plain"]["over_ideal"] == rows["plain"]["over_ideal"]
    assert again["plain"]["simulated"] > rows["plain"]["simulated"]  # a step waits for its slowest rank
    assert tokenbench.spread(np.array([1.0, 2.0, -1.0]), np.array([1.0, 1.0, 1.0])) == pytest.approx(np.log(2) / 2)
    tk = {"table": list(rows.values()), "median_length": 64, "runs": 1, "steps": len(steps)}
    assert tokenbench.figure(tk, tmp_path / "t.png").stat().st_size > 0 and tokenbench.figure({}, tmp_path) is None


# the cases that launch processes
def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.launch
@pytest.mark.slow
def test_bench_quickest(tmp_path):
    out = tmp_path / "bench"
    p = _run([sys.executable, "-m", "hetero.lab.bench", "--quick", "--out", str(out), "--worlds", "2",
              "--slowdowns", "8", "--schemes", "edp", "--epochs", "2", "--steps", "8", "--batch-per-rank", "32",
              "--overhead-epochs", "2", "--max-workers", "16", "--hf-runs", "1", "--hf-steps", "6",
              "--host-steps", "40", "--parts", "balance,overhead,fsdp,deepspeed,balancer,hf,recovery,host"],
             timeout=420)  # outside: its own test below
    res = json.loads((out / "bench.json").read_text())
    assert "Balance efficiency" in p.stdout and (out / "table.md").exists()
    assert res["meta"]["suite"]["worlds"] == [2] and res["meta"]["command"].startswith("python -m hetero.lab.bench")

    (r,) = res["balance"]
    assert (r["world"], r["kind"], r["hetero"], r["scheme"], r["speedup_vs_sync"]) == (2, "slowdown", "1:slowdown=8",
                                                                                         "edp", None)
    assert ([(s["scheme"], s["repeats"], s["over_ideal"]) for s in res["balance_summary"]]
            == [("edp", 1, r["over_ideal"])])
    assert (r["global_batch"], r["steps"]) == (64, 8)
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("over_ideal", "over_sync_bound")) and r["jitter"] >= 0
    assert abs(sum(r["shares"]) - 1) < 0.01  # over_ideal, over_sync_bound: hardware figures, only finite
    assert r["shares"][1] < 0.5  # the slowed rank (the last) was given less work
    m = r["cost_model"]
    # the emulated slowdown is measured as the slowed rank's sleeps over its compute (factor); `scale` is each rank's
    # own compute speed with the sleeps taken out, which is the host's: a neighbour on rank 0's core (a Ray test in
    # the other xdist process) made it the slower one, so no order of the scales is asserted (issue 47)
    assert m["factor"][1] > 4 and m["factor"][0] == 1 and m["ideal_sizes"][1] < m["ideal_sizes"][0]
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
    if importlib.util.find_spec("deepspeed") is not None:  # the [deepspeed] extra: its part runs, or is noted
        ds = res["deepspeed_overhead"]
        assert ds["zero_stage"] == 2 and math.isfinite(ds["ratio"]) and ds["ratio"] > 0 and len(ds["pair_ratios"]) == 8
        assert "## DeepSpeed overhead (ZeRO-2" in (out / "table.md").read_text()
    else:
        assert any(n.startswith("deepspeed part skipped") for n in res["notes"])
    dec = res["balancer"]
    assert {(r["rule"], r["workers"]) for r in dec} == {(rule, n) for rule in ("proportional", "affine")
                                                        for n in (2, 4, 8, 16)}
    assert all(r["decision_ms"] > 0 for r in dec)
    hf = importlib.util.find_spec("transformers") is not None  # the [hf] extra: its part runs, or is noted
    if hf:
        assert res["hf"]["ratio"] > 0 and len(res["hf"]["pair_ratios"]) == 1
    rec = res["recovery"]  # one two-agent run that loses a node: the survivor's first new step, after the kill
    assert rec["kills"] == 1 and len(rec["runs"]) == 1 and rec["torchrun_args"][0].startswith("--rdzv-conf=")
    run = rec["runs"][0]
    assert 0 < run["notice"] <= run["rendezvous"] <= run["start"] <= run["first_step"] and run["import_s"] > 0
    assert "Recovery under torchrun" in (out / "table.md").read_text()
    hs = res["host"]  # the host part: every door's added µs per step, and hetero's phases (all measured, finite)
    assert hs["steps"] == 40 and set(hs) == {"steps", "hf_steps", "ddp", "ddp_loss", "fsdp", *["hf"] * hf}
    assert hs["hf_steps"] == (6 if hf else 0)  # the HF Trainer's door: 1 run of each kind of max(40 // 10, 6) steps
    if hf:
        assert math.isfinite(hs["hf"]["added_cpu_us"]) and hs["hf"]["phases_us"]["begin"] > 0
    assert all(math.isfinite(hs[d][k]) for d in ("ddp", "ddp_loss", "fsdp")
               for k in ("added_cpu_us", "added_main_us", "added_wall_p10_us", "plain_cpu_us", "added_cpu_mean_us"))
    assert math.isfinite(hs["ddp"]["floor_cpu_us"]) and hs["ddp"]["plain_cpu_us"] > 0
    assert math.isfinite(hs["ddp_loss"]["floor_cpu_us"])  # the loss door's floor ran in its own pair
    ph = hs["ddp"]["phases_us"]
    assert ph["begin"] > 0 and ph["hook"] > 0 and ph["end"] > 0 and ph["sampler"] > 0 and ph["metrics"] > 0
    assert hs["fsdp"]["phases_us"]["collective"] > 0 and (out / "host_breakdown.png").stat().st_size > 0
    lp = hs["ddp_loss"]["phases_us"]  # the loss door: its own Python, the backward apart, no collective of hetero's
    assert lp["hook"] > 0 and lp["ready"] > 0 and lp["backward"] > 0 and lp["collective"] == 0
    assert "Host time per step" in (out / "table.md").read_text()
    assert {c["target"].split()[0] for c in res["checks"]} == {"dp/edp", "simulated", "trainer", "api", "lost",
                                                               "metrics(bal)", "host", *["hf"] * hf}
    assert (r["affinity"] == "") == (len(os.sched_getaffinity(0)) >= 2)  # pinned only when oversubscribed


@pytest.mark.launch
@pytest.mark.slow
def test_bench_outside_quick_rows_teardown_and_figures(tmp_path):
    """make bench QUICK=1's outside part, smaller: its rows exist (read like the balance part's), it leaves no cgroup
    below its own and no busy process behind, and its figures are drawn. What the host's real contention did (the
    straggler's share, how fast the come-and-go neighbour was followed) is the bench's measurement, not a verdict
    here: it rests on this host's cores (issue 47). The balancer following a neighbour that comes and goes is
    tested on recorded step times (tests/core/test_bursty.py)."""
    from hetero.lab import outside
    from hetero.trainer import straggler

    out = tmp_path / "bench"
    _run([sys.executable, "-m", "hetero.lab.bench", "--quick", "--parts", "outside", "--schemes", "dp",
          "--epochs", "3", "--batch-per-rank", "64", "--out", str(out)], timeout=600)
    res = json.loads((out / "bench.json").read_text())
    try:
        straggler.check_cgroups({})
        kinds = {"quota", "neighbour"}
    except straggler.StragglerError:
        kinds = {"neighbour"}  # no writable cgroup: the quota rows are skipped, with a note
    assert {r["kind"] for r in res["outside"]} == kinds and {r["scheme"] for r in res["outside"]} == {"dp"}
    for r in res["outside_summary"]:
        assert math.isfinite(r["over_ideal"]) and r["simulated"] is not None and abs(sum(r["shares"]) - 1) < 0.01
    td = res["outside_teardown"]
    assert td["cgroups_left"] == [] and not td["cgroup_exists"] and td["busy_left"] == []
    assert td["tag"] and outside.leftovers(None, td["tag"])["busy_left"] == []  # none now, after the bench exited
    # (by its tag: a busy neighbour of a test in another xdist process is not the bench's)
    (cg,) = res["come_and_go"]
    assert cg["neighbour_epochs"] == [2, 4]  # started after epoch 2, stopped after epoch 4 (quick form)
    assert (out / "outside_come_and_go.png").stat().st_size > 0 and "comes and goes" in (out / "table.md").read_text()
    assert (out / "outside_quota_steps.png").exists() == ("quota" in kinds)  # the quota's steps against its batch
    assert (out / "outside_optimum_drift.png").stat().st_size > 0  # each epoch's best size against the target band
    assert {"share_before", "share_during", "share_after", "fall_decisions", "recover_decisions"} <= set(cg)


@pytest.mark.launch
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
    assert res["tokens"] == {**res["tokens"], "max_tokens": None, "step_at_max_fits": True, "rows": [1, 64]}
    d = res["delay"]  # two ranks, rank 1 delayed 20 ms a step: the delay is part of its recorded compute
    assert "error" not in d and d["delay_s"][0] == 0 and math.isclose(d["delay_s"][1], 0.02) and d["steps"] == 8
    assert d["compute_s"][1] >= d["delay_s"][1]


@pytest.mark.launch
@pytest.mark.parametrize("argv", [["--schemes", "edp,nope"], ["--parts", "pair,x"]])
def test_gpu_check_bad_input_is_one_line_and_status_2(argv, tmp_path):
    p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(tmp_path / "x.json"), *argv],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("hetero: error: unknown ") and p.stderr.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


@pytest.mark.launch
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


@pytest.mark.launch
@pytest.mark.parametrize("argv", [["hetero.lab.bench", "--worlds", "1"], ["hetero.lab.bench", "--parts", "x"],
                                  ["hetero.lab.bench", "--slowdowns", "two"], ["hetero.lab.simbench", "--noise", "-1"],
                                  ["hetero.lab.overhead", "--out", "x", "--subset", "1", "--global-batch", "4",
                                   "--epochs", "3"]])
def test_bad_input_is_one_line_and_status_2(argv):
    p = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("hetero: error: ") and p.stderr.count("\n") == 1


@pytest.mark.launch
@pytest.mark.parametrize("target,knobs,module", [("bench", {"QUICK": "1", "OUT": "x"}, "hetero.lab.bench"),
                                                 ("sim-bench", {"NOISE": "0.02"}, "hetero.lab.simbench")])
def test_make_knobs_are_the_flags_of_the_same_name(target, knobs, module):
    make = subprocess.run(["make", "-n", target, "STAMP=", *(f"{k}={v}" for k, v in knobs.items())], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout
    helptext = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=60).stdout
    for k in knobs:
        flag = "--" + k.lower().replace("_", "-")
        # values reach the shell through the environment (a quote in a value runs nothing), flags keep the names
        assert (f'{flag} "${k}"' in make or f'{flag} "${k}"' in make.replace("${" + k + ":+", "")
                if k != "QUICK" else flag in make) and flag in helptext


def test_the_tokens_calibration_is_one_attention_weight_and_a_positive_per_unit_cost_per_rank():
    """tokenbench.calibrated: padded rows make the per-token and per-squared-length terms nearly collinear, so one
    rank's fit can put its cost in either, or a term below 0 (a run of 2026-12-06 fitted -9.8e-7 per token on the
    slow rank, which crashed the summary). The shared weight comes from the ranks' sums, and each rank's per-unit cost
    gives its own fitted cost of the mean batch, positive."""
    from hetero.lab import tokenbench

    fitted = np.array([[0.003, 2.2e-6, 2.9e-8], [0.02, -9.8e-7, 9.4e-8]])
    parts = np.array([[512.0, 40000.0], [1024.0, 130000.0]])
    cost, fits = tokenbench.calibrated(fitted, "padded", parts)
    assert cost.attention == pytest.approx((2.9e-8 + 9.4e-8) / (2.2e-6 - 9.8e-7)) and np.all(fits[:, 1] > 0)
    t, q = parts.mean(0)
    for r in range(2):  # each rank's cost of the mean batch, as fitted
        assert fits[r, 1] * (t + cost.attention * q) == pytest.approx(fitted[r, 1] * t + fitted[r, 2] * q)
    assert fits[1, 1] / fits[0, 1] > 1.5  # the slow rank is the slower per unit
    assert tokenbench.calibrated(np.array([[0.0, -1e-6, 1e-8]] * 2), "padded", parts)[0].attention == 0.0


def test_the_tokens_calibration_fits_no_negative_cost():
    """tokenbench.nonnegative_fit: least squares with every coefficient >= 0. On costs that are (fixed, per token,
    per squared length) >= 0 it is plain least squares; where plain least squares goes below 0 on nearly collinear
    terms (padded rows) it fits the best non-negative model, which is no worse than any other non-negative one."""
    from hetero.lab import tokenbench

    rng = np.random.default_rng(3)
    rows, longest = rng.integers(1, 16, 64), rng.integers(8, 1024, 64)
    x = np.column_stack([np.ones(64), rows * longest, rows * longest ** 2.0])
    true = np.array([0.004, 2e-6, 3e-9])
    y = x @ true * np.exp(rng.normal(0, 0.05, 64))
    free = np.linalg.lstsq(x, y, rcond=None)[0]
    assert np.all(free >= 0) and np.allclose(tokenbench.nonnegative_fit(x, y), free)  # nothing to constrain
    y = x @ np.array([0.02, -1e-6, 4e-9])  # times a fit would put a negative cost per token on
    free, got = np.linalg.lstsq(x, y, rcond=None)[0], tokenbench.nonnegative_fit(x, y)
    assert np.any(free < 0) and np.all(got >= 0)

    def err(c):
        return float(np.sum((x @ c - y) ** 2))
    assert np.all(y > 0) and free[1] == pytest.approx(-1e-6)
    for other in (np.array([0.02, 0, 4e-9]), np.array([0.0, 0.0, got[2]]), np.maximum(free, 0), got * 1.01):
        assert err(got) <= err(other) + 1e-15


def test_the_tokens_ideal_is_fitted_on_what_the_runs_own_batches_took():
    """tokenbench.in_situ: each rank's cost fitted on its batches' fwd + bwd inside the runs (every column's, after
    the warm-up) recovers the costs those batches were timed with, and summarise reads the ideal from it, not from the
    calibration before the runs (here made 3x off on rank 1). Runs recorded without their batches' times fall back
    to that calibration."""
    from hetero.core.tokens import Cost
    from hetero.lab import tokenbench

    rng, cost, key = np.random.default_rng(1), Cost("padded"), "padded/rank 1 3x slower"
    true = np.array([[0.002, 1e-5, 3e-9], [0.004, 3e-5, 9e-9]])
    n = tokenbench.WARMUP + 40

    def rank_runs(r):
        lens = [rng.integers(2, 400, int(rng.integers(1, 9))).tolist() for _ in range(n)]
        took = [true[r, 0] + true[r, 1:] @ np.array(cost.parts(x)) for x in lens]
        took[:tokenbench.WARMUP] = [1.0] * tokenbench.WARMUP  # the warm-up's slow first steps are left out
        return {"ends": list(np.arange(1.0, n + 1)), "lengths": lens, "compute": took}
    ranks = [{"fits": {key: [0.002, 1e-5, 3e-9, 0.0] if r == 0 else [0.004, 1e-5, 3e-9, 0.0]},
              "runs": {key: {"tokens": [rank_runs(r)], "plain": [rank_runs(r)]}}} for r in range(2)]
    got = tokenbench.in_situ(ranks, key, cost)
    assert np.allclose(got[:, :3], true, rtol=1e-6, atol=1e-12) and np.all(got[:, 3] < 1e-6)
    (row, _) = tokenbench.summarise(ranks)
    assert row["cost_ratio"] == pytest.approx(3.0, rel=0.05)  # in situ; the calibration before said 1
    # the measured balance, from the times alone: rank 1's batches took about 2.9x rank 0's here (the same split)
    mean = [np.mean(r["runs"][key]["tokens"][0]["compute"][tokenbench.WARMUP:]) for r in ranks]
    assert row["measured_balance"] == pytest.approx(max(mean) / np.mean(mean)) and 1.4 < row["measured_balance"] < 1.6
    assert tokenbench.measured_balance([ranks[0], ranks[0]], key, "tokens", 0) == 1.0
    for r in ranks:
        del r["runs"][key]["plain"][0]["compute"]
    assert tokenbench.in_situ(ranks, key, cost) is None
    assert np.isnan(tokenbench.measured_balance(ranks, key, "plain", 0))
    assert tokenbench.summarise(ranks)[0]["cost_ratio"] < 1.5


def test_the_jitter_no_split_removes_is_largest_where_the_ranks_are_level():
    """tokenbench.jitter_cost: two ranks level at 1 s with log sd 0.2 each are slowest at 1 + 0.2 / sqrt(pi) on
    average (the expected maximum of two such draws), one rank far ahead of the other costs next to nothing, and no
    jitter costs nothing."""
    from hetero.lab import tokenbench

    level, apart = np.array([[1.0, 1.0]]), np.array([[1.0, 0.1]])
    assert tokenbench.jitter_cost(level, np.array([0.2, 0.2]), draws=200_000)[0] == pytest.approx(0.2 / np.pi ** 0.5,
                                                                                                 rel=0.03)
    assert tokenbench.jitter_cost(apart, np.array([0.2, 0.2]))[0] < 0.01
    assert tokenbench.jitter_cost(level, np.zeros(2))[0] == pytest.approx(0.0, abs=1e-12)
