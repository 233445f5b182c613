"""The benchmark suite on CPU ranks, measured side by side in one run (docs/benchmarks.md, for the method):
balance efficiency against each run's own ideal, the trainer's overhead over a plain DDP loop, the API's FSDP2
step over plain FSDP2's (docs/fsdp.md), the time of one rebalancing decision for 2 to 4096 workers, and the
Hugging Face Trainer with hetero over the plain one (docs/huggingface.md), the seconds from a lost node to the
survivor's first step under torchrun's elastic agent (docs/elastic.md), and the host time hetero adds per step in
microseconds, by phase (host.py).

    make bench [QUICK=1]             # = python -m hetero.lab.bench [--quick]; runs/bench/<time>/bench.json, table.md
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

from ..core import safeio
from ..trainer.cli import CliParser
from . import (
    deepspeed_overhead,
    efficiency,
    fsdp_overhead,
    hfbench,
    host,
    outside,
    overhead,
    recovery,
    simbench,
    tokenbench,
)
from .launch import root
from .measure import LaunchError, markdown_table, run_meta
from .suite import PARTS, QUICK, Suite


# -- the report -----------------------------------------------------------------------------------------------
def _replayed(rows: list[dict], tolerance: float, target: str) -> list[dict]:
    """The simulator's replay against the measured epoch / ideal: the worst row, if any row was replayed."""
    if not (sim := [r for r in rows if r.get("simulated") is not None]):
        return []
    worst = max(sim, key=lambda r: abs(r["simulated"] - r["over_ideal"]))
    gap = worst["simulated"] - worst["over_ideal"]
    return [{"target": target, "value": gap, "pass": abs(gap) <= tolerance}]


def _affine_vs_dp(cmp: list[dict], target: str) -> dict:
    """affine behind dp by no more than dp's spread in every row: the worst margin."""
    worst = max(cmp, key=lambda r: r["affine"] - r["dp"] - r["dp_spread"])
    return {"target": target, "value": worst["affine"] - worst["dp"] - worst["dp_spread"],
            "pass": all(r["within"] for r in cmp)}


def checks(res: dict) -> list[dict]:
    """The suite's targets (docs/benchmarks.md), each with the measured value and whether it passes; balance rows
    by their median over the repeats."""
    out = []
    summ = res.get("balance_summary", [])
    for world in sorted({r["world"] for r in summ}):
        if dp := [r["over_ideal"] for r in summ
                  if r["scheme"] in ("dp", "edp") and r["world"] == world and r.get("kind", "slowdown") == "slowdown"]:
            out.append({"target": f"dp/edp steady epoch time <= 1.10 x ideal, {world} ranks, slowdowns",
                        "value": max(dp), "pass": max(dp) <= 1.10})
    if sy := [r["over_sync_bound"] for r in summ if r["scheme"] == "sync"]:
        worst = max(sy, key=lambda v: abs(v - 1))
        out.append({"target": "sync epoch time within 10% of the slowest-rank bound", "value": worst,
                    "pass": abs(worst - 1) <= 0.10})
    out += _replayed(summ, 0.03, "simulated epoch / ideal within 0.03 of the measured, every row (worst difference)")
    if cmp := res.get("affine_vs_dp"):
        out.append(_affine_vs_dp(cmp, "affine <= dp + dp's run-to-run spread, every row (worst margin)"))
        if delay := [r for r in cmp if r["kind"] == "delay"]:
            out.append({"target": "affine ahead of dp in the constant-delay rows (largest affine - dp)",
                        "value": max(r["affine"] - r["dp"] for r in delay), "pass": all(r["ahead"] for r in delay)})
    out += outside_checks(res)
    if ov := res.get("overhead"):
        out.append({"target": "trainer step <= 1.03 x plain DDP step", "value": ov["ratio"],
                    "pass": ov["ratio"] <= 1.03})
        out.append({"target": "api step <= 1.01 x plain DDP step (same DataLoader)", "value": ov["api_ratio"],
                    "pass": ov["api_ratio"] <= 1.01})
        if "metrics_call_fraction" in ov:
            out.append({"target": "metrics(bal) <= 1% of an API step (the call's own time)",
                        "value": ov["metrics_call_fraction"], "pass": ov["metrics_call_fraction"] <= 0.01})
    if fs := res.get("fsdp_overhead"):
        out.append({"target": "api step <= 1.01 x plain FSDP2 step (same DataLoader)", "value": fs["ratio"],
                    "pass": fs["ratio"] <= 1.01})
    if ds := res.get("deepspeed_overhead"):  # a figure: the target is stated, the suite's tests do not gate on it
        out.append({"target": "api step <= 1.01 x plain DeepSpeed step (ZeRO-2, same DataLoader)", "value": ds["ratio"],
                    "pass": ds["ratio"] <= 1.01})
    if hf := res.get("hf"):  # a figure: the target is stated, the suite's tests do not gate on it
        out.append({"target": "hf Trainer step with hetero <= 1.01 x plain Trainer step", "value": hf["ratio"],
                    "pass": hf["ratio"] <= 1.01})
        if acc := hf.get("accumulation"):
            out.append({"target": f"hf Trainer step with hetero <= 1.01 x plain Trainer step, gradient accumulation "
                                  f"{acc['gradient_accumulation_steps']}", "value": acc["ratio"],
                        "pass": acc["ratio"] <= 1.01})
    if tk := res.get("tokens"):  # figures: stated, not gated by the tests
        out += tk["checks"]
    if (rec := res.get("recovery")) and rec["first_step_s"] is not None:  # a figure: stated, not gated by the tests
        out.append({"target": "lost node to the new world's first step <= 10 s (torchrun, 2 agents, median)",
                    "value": rec["first_step_s"], "pass": rec["first_step_s"] <= 10})
    for door, how in (("ddp", "the comm hook"), ("ddp_loss", "weighting='loss'")):  # figures, not gated by tests
        if (hs := res.get("host")) and door in hs:
            for clock, what in (("cpu", "CPU time"), ("main", "the main thread's CPU time")):
                if (v := hs[door].get(f"added_{clock}_us")) is not None:
                    out.append({"target": f"host time hetero adds per DDP step, {how}, <= 100 µs (median, {what})",
                                "value": v, "pass": v <= 100})
    for r in res.get("balancer", []):
        if r["workers"] == 4096:
            out.append({"target": f"one {r['rule']} decision for 4096 workers < 10 ms", "value": r["decision_ms"],
                        "pass": r["decision_ms"] < 10})
    return out


def outside_checks(res: dict) -> list[dict]:
    """The outside part's targets (docs/benchmarks.md): each balancing scheme within 1.10 of its ideal and
    misallocated by at most 0.02, the replay within 0.05, affine within dp's spread, the come-and-go neighbour
    followed within 3 decisions each way."""
    out = []
    summ = [r for r in res.get("outside_summary", []) if r["scheme"] != "sync"]
    if summ:
        worst = max(summ, key=lambda r: r["over_ideal"])
        out.append({"target": f"outside: dp/edp/affine steady epoch <= 1.10 x ideal (worst: {worst['scheme']}, "
                              f"{worst['effect']})", "value": worst["over_ideal"], "pass": worst["over_ideal"] <= 1.10})
        worst = max(summ, key=lambda r: r["misallocation"])
        out.append({"target": f"outside: misallocation <= 0.02 (worst: {worst['scheme']}, {worst['effect']})",
                    "value": worst["misallocation"], "pass": worst["misallocation"] <= 0.02})
        worst = max(summ, key=lambda r: r["size_changes"])
        out.append({"target": "outside: <= 3 size changes in the steady epochs (worst row)",
                    "value": worst["size_changes"], "pass": worst["size_changes"] <= 3})
    out += _replayed(res.get("outside_summary", []), 0.05,
                     "outside: simulated epoch / ideal within 0.05 of the measured (worst difference)")
    if cmp := res.get("outside_vs_dp"):
        out.append(_affine_vs_dp(cmp, "outside: affine <= dp + dp's spread (worst margin)"))
    for r in res.get("come_and_go", []):
        for way in ("fall", "recover"):
            n = r[f"{way}_decisions"]
            out.append({"target": f"come-and-go neighbour, {r['scheme']}: share {way}s within 3 decisions",
                        "value": float("nan") if n is None else n, "pass": n is not None and n <= 3})
    return out


def _simulated(row: dict) -> str:
    """The replays' epoch / ideal (median over the repeats of each run's mean over seeds) and the seeds' spread
    ("" for a row without a replay)."""
    return f"{row['simulated']:.3f} ± {row['simulated_sd']:.3f}" if row.get("simulated") is not None else ""


def table(res: dict) -> str:
    """The markdown report of one benchmark run."""
    m = res["meta"]
    lines = [f"# hetero benchmarks, {m['date']}, {m['host']} ({m['cpu']}, {m['cores']} cores, load average "
             f"{m['load_avg_start'][0]:.1f} at start, {m['load_avg_end'][0]:.1f} at end)", "", f"`{m['command']}`", ""]
    if summ := res.get("balance_summary"):
        n = max(r["repeats"] for r in summ)
        lines += [f"## Balance efficiency (steady-state epoch time over ideal = steps x (T* + all-reduce); median of "
                  f"{n} run{'s' * (n > 1)}, [min-max])", ""]
        lines += markdown_table(
            ["ranks", "B", "last rank", "scheme", "/ ideal", "simulated", "/ sync bound", "speedup vs sync",
             "predicted", "jitter", "misallocation", "size changes", "shares"],
            [[r["world"], r["global_batch"], r["effect"], r["scheme"],
              f"{r['over_ideal']:.3f}" + (f" [{r['min']:.3f}-{r['max']:.3f}]" if r["repeats"] > 1 else ""),
              _simulated(r), f"{r['over_sync_bound']:.3f}",
              "" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x",
              f"{r['predicted_speedup']:.2f}x", f"{r['jitter']:.3f}", f"{r['misallocation']:.3f}",
              f"{r['size_changes']:g}", "/".join(f"{s:.2f}" for s in r["shares"])]
             for r in summ])
        pinned = sorted({(r["world"], r["affinity"]) for r in summ if r["affinity"]})
        lines += [""] + [f"{w} ranks pinned to cores {a} (--affinity); the cost model shares each core between its "
                         f"ranks (hetero.lab.coupled)." for w, a in pinned] + [""]
    if cmp := res.get("affine_vs_dp"):
        lines += ["## affine against dp (median epoch / ideal; spread = max - min over the repeats)", ""]
        lines += markdown_table(
            ["ranks", "last rank", "dp", "dp spread", "affine", "affine spread", "affine - dp", "within dp's spread"],
            [[r["world"], r["effect"], f"{r['dp']:.3f}", f"{r['dp_spread']:.3f}", f"{r['affine']:.3f}",
              f"{r['affine_spread']:.3f}", f"{r['affine'] - r['dp']:+.3f}", "yes" if r["within"] else "no"]
             for r in cmp]) + [""]
    lines += outside_section(res)
    if ov := res.get("overhead"):
        lines += ["## Overhead (no heterogeneity, 2 ranks)", "",
                  f"trainer {1e3 * ov['trainer_step_s']:.2f} ms/step, plain DDP {1e3 * ov['plain_step_s']:.2f} "
                  f"ms/step: ratio {ov['ratio']:.3f} (median of {len(ov['pair_ratios'])} back-to-back epoch pairs; "
                  f"of medians {ov['ratio_of_medians']:.3f}, of minima {ov['ratio_of_minima']:.3f}), "
                  f"{ov['extra_ms_per_step']:+.2f} ms per step", "",
                  f"API (hetero.Balance, edp, rebalancing every {ov['api_rebalance_every']} steps) "
                  f"{1e3 * ov['api_step_s']:.2f} ms/step, plain DDP through the same DataLoader "
                  f"{1e3 * ov['ddp_loader_step_s']:.2f} ms/step: ratio {ov['api_ratio']:.3f} (median of "
                  f"{len(ov['api_pair_ratios'])} pairs; of medians {ov['api_ratio_of_medians']:.3f}), "
                  f"{ov['api_extra_ms_per_step']:+.2f} ms per step", ""]
        if "metrics_ratio" in ov:
            lines += [f"The read-out (metrics(bal), docs/metrics.md) on every other API step: steps with it / steps "
                      f"without {ov['metrics_ratio']:.3f} (medians of {ov['metrics_steps']} interleaved steps each), "
                      f"the call itself {1e6 * ov['metrics_call_s']:.0f} us = "
                      f"{100 * ov['metrics_call_fraction']:.2f}% of a step", ""]
    if fs := res.get("fsdp_overhead"):
        lines += ["## FSDP2 overhead (no heterogeneity, 2 ranks, docs/fsdp.md)", "",
                  f"API (hetero.Balance on an FSDP2 root, edp, rebalancing every {fs['rebalance_every']} steps) "
                  f"{1e3 * fs['api_step_s']:.2f} ms/step, plain FSDP2 through the same DataLoader settings "
                  f"{1e3 * fs['plain_step_s']:.2f} ms/step: ratio {fs['ratio']:.3f} (median of "
                  f"{len(fs['pair_ratios'])} back-to-back step pairs; of medians {fs['ratio_of_medians']:.3f}), "
                  f"{fs['extra_ms_per_step']:+.2f} ms per step", ""]
    if ds := res.get("deepspeed_overhead"):
        lines += [f"## DeepSpeed overhead (ZeRO-{ds['zero_stage']}, no heterogeneity, 2 ranks, docs/deepspeed.md)", "",
                  f"API (hetero.Balance on a DeepSpeed engine, edp, rebalancing every {ds['rebalance_every']} steps) "
                  f"{1e3 * ds['api_step_s']:.2f} ms/step, plain DeepSpeed through the same DataLoader settings "
                  f"{1e3 * ds['plain_step_s']:.2f} ms/step: ratio {ds['ratio']:.3f} (median of "
                  f"{len(ds['pair_ratios'])} back-to-back step pairs; of medians {ds['ratio_of_medians']:.3f}), "
                  f"{ds['extra_ms_per_step']:+.2f} ms per step", ""]
    if hf := res.get("hf"):
        lines += ["## Hugging Face Trainer (no heterogeneity, 2 ranks, tiny GPT-2)", "",
                  f"HeteroTrainer (edp, rebalancing every {hf['rebalance_every']} steps) "
                  f"{1e3 * hf['hetero_step_s']:.2f} ms/step, "
                  f"transformers.Trainer {1e3 * hf['plain_step_s']:.2f} ms/step: ratio {hf['ratio']:.3f} "
                  f"(median of {len(hf['pair_ratios'])} back-to-back run pairs of {hf['steps']} steps; of medians "
                  f"{hf['ratio_of_medians']:.3f}), {hf['extra_ms_per_step']:+.2f} ms per step", ""]
        if acc := hf.get("accumulation"):
            lines += [f"With gradient accumulation {acc['gradient_accumulation_steps']} (micro-batches of "
                      f"{acc['micro_batch']}, the same global batch; per-rank counts with hetero): "
                      f"{1e3 * acc['hetero_step_s']:.2f} ms/step against {1e3 * acc['plain_step_s']:.2f}: ratio "
                      f"{acc['ratio']:.3f} (of medians {acc['ratio_of_medians']:.3f})", ""]
    if tk := res.get("tokens"):
        lines += tokenbench.section(tk)
        if any(f.endswith("tokens.png") for f in res.get("figures", [])):
            lines += ["![epoch time over the ideal by column, the replay's simulated figure marked](tokens.png)", ""]
    if res.get("balancer"):
        rules = ("proportional", "affine")
        lines += ["## One rebalancing decision (median ms)", ""] + markdown_table(
            ["workers"] + [str(r["workers"]) for r in res["balancer"] if r["rule"] == rules[0]],
            [[rule] + [f"{r['decision_ms']:.2f}" for r in res["balancer"] if r["rule"] == rule] for rule in rules])
        lines.append("")
    if rec := res.get("recovery"):
        lines += recovery_section(rec)
    if hs := res.get("host"):
        lines += host.section(hs) + ["![host time per step by phase](host_breakdown.png)", ""]
    if res.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    if res.get("checks"):
        lines += ["## Targets", ""] + [f"- {'PASS' if c['pass'] else 'FAIL'} {c['target']}: {c['value']:.3f}"
                                       for c in res["checks"]]
    return "\n".join(lines) + "\n"


def recovery_section(rec: dict) -> list[str]:
    """The recovery figure: the median seconds, each phase's median, the agent settings used."""
    n, ph = len(rec["runs"]), rec["phases_s"]
    if not n:
        return ["## Recovery under torchrun's elastic agent", "", "every run failed (see Notes)", ""]
    fmt = {k: f"{ph[k]:.1f} s" if k in ph else "-" for k in ("notice", "rendezvous", "start", "first_step", "import_s")}
    return ["## Recovery under torchrun's elastic agent (2 agents, one SIGKILLed mid-epoch; median of "
            f"{n} kill{'s' * (n > 1)})", "",
            f"first step of the new world {fmt['first_step']} after the kill: the agent saw its worker fail at "
            f"{fmt['notice']}, the rendezvous completed at {fmt['rendezvous']}, the restarted worker printed its start "
            f"at {fmt['start']} (a fresh `import torch, torch._dynamo` took {fmt['import_s']} here); each run: "
            + ", ".join(f"{r['first_step']:.1f} s" for r in rec["runs"]), "",
            f"torchrun {' '.join(rec['torchrun_args'])}", "", *recovery.phase_lines(rec)]


def run(suite: Suite, out: Path, command: str) -> dict:
    """Every part of the suite, then bench.json and table.md in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"meta": {**run_meta(command), "suite": asdict(suite)}, "notes": []}
    t0 = time.perf_counter()
    if "balance" in suite.parts:
        calib = efficiency.calibrate(suite.global_batch(max(suite.worlds)))
        res["calibration"] = {"fixed_s": calib[0], "per_sample_s": calib[1]}
        res["balance"] = efficiency.balance(suite, out, calib, res["notes"])
        res["balance_summary"] = efficiency.summary(res["balance"])
        res["affine_vs_dp"] = efficiency.affine_vs_dp(res["balance_summary"])
    if "outside" in suite.parts:
        run_outside(suite, out, res)
    if "overhead" in suite.parts:
        res["overhead"] = overhead.measure(out, suite.overhead_launches, suite.subset(2), suite.global_batch(2),
                                           suite.overhead_epochs, res["notes"])
    if "fsdp" in suite.parts:
        res["fsdp_overhead"] = fsdp_overhead.measure(out, suite.subset(2), suite.global_batch(2),
                                                     suite.overhead_epochs, res["notes"])
    if "deepspeed" in suite.parts and (ds := deepspeed_overhead.measure(out, suite.subset(2), suite.global_batch(2),
                                                                         suite.overhead_epochs, res["notes"])):
        res["deepspeed_overhead"] = ds
    if "balancer" in suite.parts:
        print("bench: balancer decisions", flush=True)
        res["balancer"] = simbench.balancer_cost(suite.workers)
    if "hf" in suite.parts and (hf := hfbench.measure(out, suite.hf_runs, suite.hf_steps, res["notes"])):
        res["hf"] = hf
    if "tokens" in suite.parts and (tk := tokenbench.measure(out, suite.tokens_runs, suite.tokens_steps,
                                                             res["notes"])):
        res["tokens"] = tk
        if fig := tokenbench.figure(tk, out / "tokens.png"):
            res["figures"] = [*res.get("figures", []), str(fig)]
    if "recovery" in suite.parts:
        res["recovery"] = recovery.measure(out, suite.recovery_kills, notes=res["notes"])
    if "host" in suite.parts:
        res["host"] = host.measure(out, suite.host_steps, res["notes"], hf_runs=suite.hf_runs)
        if fig := host.figure(res["host"], out / "host_breakdown.png"):
            res["figures"] = [*res.get("figures", []), str(fig)]
    res["meta"].update(wall_s=time.perf_counter() - t0, load_avg_end=os.getloadavg())
    res["checks"] = checks(res)
    safeio.write_text(out / "bench.json", json.dumps(res, indent=1))  # never through a planted link
    safeio.write_text(out / "table.md", table(res))
    return res


def run_outside(suite: Suite, out: Path, res: dict) -> None:
    """The outside part into res: its rows (like the balance part's), the come-and-go runs and their figure, and
    what its teardown left behind (nothing, when it works)."""
    calib = res.get("calibration")
    calib = (calib["fixed_s"], calib["per_sample_s"]) if calib else efficiency.calibrate(suite.global_batch(2))
    res.setdefault("calibration", {"fixed_s": calib[0], "per_sample_s": calib[1]})
    tag = os.environ.setdefault(outside.TAG, f"{os.getpid()}-{time.time_ns()}")  # what its neighbours carry
    with outside.bench_cgroup() as (group, why):
        if group is None and any(map(outside.needs_cgroup, suite.outside)):
            res["notes"].append(f"outside: the quota rows were skipped: {why}")
        res["outside"] = outside.rows(suite, out, calib, group, res["notes"])
        res["come_and_go"] = outside.come_and_go(suite, out, res["notes"])
    res["outside_summary"] = efficiency.summary(res["outside"])
    res["outside_vs_dp"] = efficiency.affine_vs_dp(res["outside_summary"])
    for fig in (outside.figure(res["come_and_go"], out / "outside_come_and_go.png"),
                outside.staircase(res["outside"], suite.steady_from, out / "outside_quota_steps.png"),
                outside.optimum_drift(res["outside"], out / "outside_optimum_drift.png")):
        if fig:
            res["figures"] = [*res.get("figures", []), str(fig)]
    res["outside_teardown"] = outside.leftovers(None if group is None else str(group), tag)


def _moves(move, z) -> str:
    """Each rank's largest epoch-to-epoch cost move and its z, as "12% (9) / 30% (14)"."""
    if not move:
        return ""
    return " / ".join("" if m is None else f"{m:.0%}" + ("" if v is None else f" ({v:.0f})")
                      for m, v in zip(move, z or [None] * len(move)))


def outside_section(res: dict) -> list[str]:
    """The outside part's tables: its rows like the balance part's, affine against dp, the come-and-go runs."""
    lines = []
    if summ := res.get("outside_summary"):
        n = max(r["repeats"] for r in summ)
        lines += [f"## Outside stragglers (2 ranks pinned one per core, the last under the straggler; steady epoch "
                  f"time over the ideal of each run's own fitted cost model; median of {n} run{'s' * (n > 1)}, "
                  f"[min-max])", ""]
        lines += markdown_table(
            ["last rank", "scheme", "/ ideal", "simulated", "speedup vs sync", "predicted", "jitter",
             "misallocation", "optimum moves (own / last / pooled)", "cost moves (z)", "size changes", "shares"],
            [[r["effect"], r["scheme"],
              f"{r['over_ideal']:.3f}" + (f" [{r['min']:.3f}-{r['max']:.3f}]" if r["repeats"] > 1 else ""),
              _simulated(r), "" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x",
              f"{r['predicted_speedup']:.2f}x", f"{r['jitter']:.3f}", f"{r['misallocation']:.3f}",
              " / ".join("" if r.get(k) is None else f"{r[k]:.3f}"
                         for k in ("epoch_optimum", "lagged_optimum", "pooled_optimum")),
              _moves(r.get("cost_move"), r.get("cost_move_z")),
              f"{r['size_changes']:g}", "/".join(f"{s:.2f}" for s in r["shares"])] for r in summ]) + [""]
        lines += ["Optimum moves: the misallocation of each steady epoch sized at the best of the model fitted to its "
                  "own steps, to the epoch's before it (a rule deciding at epoch ends with no estimation noise), and "
                  "to every epoch's before it (such a rule with unbounded memory): how far the run's cost moved the "
                  "optimum from epoch to epoch. Cost moves: each rank's largest change of its fitted cost between "
                  "consecutive epochs, and (z) that change in standard errors of the two epochs' means.", ""]
    if cmp := res.get("outside_vs_dp"):
        lines += markdown_table(
            ["last rank", "dp", "dp spread", "affine", "affine - dp", "within dp's spread"],
            [[r["effect"], f"{r['dp']:.3f}", f"{r['dp_spread']:.3f}", f"{r['affine']:.3f}",
              f"{r['affine'] - r['dp']:+.3f}", "yes" if r["within"] else "no"] for r in cmp]) + [""]
    if any(outside.needs_cgroup(r["kind"]) for r in res.get("outside", [])):
        lines += ["![the quota's rank: compute per step against its batch](outside_quota_steps.png)", ""]
    if any("outside_optimum_drift.png" in f for f in res.get("figures", [])):
        lines += ["![the slow rank's best size in each epoch, less its best over the steady epochs]"
                  "(outside_optimum_drift.png)", ""]
    if cg := res.get("come_and_go"):
        lines += [f"## A neighbour that comes and goes (busy process on rank 1's core from step {cg[0]['on_step']} "
                  f"to step {cg[0]['off_step']}; decisions every {cg[0]['every']} steps)", ""]
        lines += markdown_table(
            ["scheme", "neighbour's slowdown", "share before", "share with neighbour", "share after",
             "decisions to fall", "decisions to recover", "size changes after"],
            [[r["scheme"], f"{r['neighbour_slowdown']:.2f}x",
              f"{r['share_before']:.3f}", f"{r['share_during']:.3f}", f"{r['share_after']:.3f}",
              r["fall_decisions"], r["recover_decisions"], r["changes_after"]] for r in cg])
        lines += ["", "![shares over steps](outside_come_and_go.png)", ""]
    if (td := res.get("outside_teardown")) is not None:
        lines += [f"Teardown: cgroups left below {td['cgroup']}: {len(td['cgroups_left'])}; busy neighbours still "
                  f"running: {len(td['busy_left'])}.", ""]
    return lines


def listed(kind: type):
    """An argparse type for comma-separated values of `kind`: "2,4" -> (2, 4)."""
    def parse(text: str) -> tuple:
        return tuple(kind(v) for v in text.split(",") if v)
    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog="python -m hetero.lab.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="2 ranks, sync/dp/edp, slowdowns only, one run each, shorter runs, one overhead launch")
    p.add_argument("--out", default="", help="output folder (default runs/bench/<time>)")
    p.add_argument("--worlds", type=listed(int), help="rank counts, e.g. 2,4")
    p.add_argument("--slowdowns", type=listed(float), help="e.g. 2,4")
    p.add_argument("--schemes", type=listed(str), help="e.g. sync,dp,edp,affine")
    p.add_argument("--parts", type=listed(str), help=",".join(PARTS))
    p.add_argument("--epochs", type=int)
    p.add_argument("--steady-from", type=int)
    p.add_argument("--batch-per-rank", type=int, help="global batch = this x ranks")
    p.add_argument("--steps", type=int, help="steps per epoch")
    p.add_argument("--delays", type=listed(float), help="constant-delay rows, in equal-share steps, e.g. 2")
    p.add_argument("--repeats", type=int, help="runs of every balance row")
    p.add_argument("--overhead-launches", type=int)
    p.add_argument("--overhead-epochs", type=int)
    p.add_argument("--micro-batch", type=int, help="the trainer's --micro-batch in the balance part (0: off)")
    p.add_argument("--hf-runs", type=int, help="HF Trainer runs of each kind (the hf part)")
    p.add_argument("--hf-steps", type=int, help="optimizer steps per HF Trainer run of the hf part (the host part's "
                   "HF runs take --host-steps / 10)")
    p.add_argument("--tokens-runs", type=int, help="runs of each column of the tokens part (variable lengths)")
    p.add_argument("--tokens-steps", type=int, help="optimizer steps per run of the tokens part")
    p.add_argument("--max-workers", type=int, help="largest balancer size (powers of two from 2)")
    p.add_argument("--recovery-kills", type=int, help="two-agent runs that lose a node (the recovery part)")
    p.add_argument("--host-steps", type=int, help="steps of each loop in the host part (Linear(8, 8), 2 ranks)")
    p.add_argument("--outside", type=listed(str),
                   help="outside stragglers of the outside part: quota,quota-10ms,neighbour")
    p.add_argument("--come-and-go", type=listed(str), help="schemes run with a neighbour that comes and goes")
    p.add_argument("--no-pin", dest="pin", action="store_false", default=None,
                   help="leave ranks unpinned even when there are more ranks than cores")
    ns = p.parse_args(argv)
    over = {k: getattr(ns, k) for k in ("worlds", "slowdowns", "schemes", "parts", "epochs", "steady_from",
                                        "batch_per_rank", "steps", "repeats", "overhead_launches", "overhead_epochs",
                                        "pin", "delays", "micro_batch", "hf_runs", "hf_steps", "recovery_kills",
                                        "outside", "come_and_go", "host_steps", "tokens_runs", "tokens_steps")
            if getattr(ns, k) is not None}
    if ns.max_workers:
        over["workers"] = tuple(2 ** k for k in range(1, 13) if 2 ** k <= ns.max_workers)
    try:
        base = Suite(**QUICK) if ns.quick else Suite()
        if "epochs" in over and "steady_from" not in over:
            over["steady_from"] = min(base.steady_from, over["epochs"])
        suite = replace(base, **over)
    except ValueError as e:
        p.error(str(e))
    out = Path(ns.out or root() / "runs" / "bench" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    try:
        res = run(suite, out, "python -m hetero.lab.bench " + " ".join(sys.argv[1:] if argv is None else argv))
    except LaunchError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1
    print(table(res), end="")
    print(f"bench: {out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
