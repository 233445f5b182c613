"""The GPU check: one GPU, under 5 minutes, no internet (synthetic data only).

    python3 scripts/gpu_check.py --out gpu_check.json            # on the GPU machine, from the repository root
    python scripts/gpu_check.py --smoke --out /tmp/gpu_check.json # CPU, tiny sizes: does it run end to end?

1. throughput, VGG16 and ResNet50 (CIFAR form, batch 256, float32): samples/s of the raw training step measured
   here (the model, SGD, one fixed batch already on the device; no DDP, no data pipeline), the same with a
   device synchronisation after every step (the trainer reads its step clock every step), and the trainer on
   one rank (a world of one, synthetic data, no augmentation), median over the epochs after the first.
2. delay: two ranks on the one GPU, ResNet50, rank 1 delayed by a fixed 20 ms per step (`--hetero 1:delay=0.02`,
   sync, --backend auto: it must pick gloo, saying why): both ranks' mean compute_s per step, and whether rank 1's
   exceeds rank 0's by the delay within 10% (a delay slept while the rank's kernels are still queued is lost).
3. mixed: one job of one GPU rank and two CPU ranks with different thread budgets (--device cuda,cpu,cpu
   --threads 0,4,2, each CPU rank pinned to its own cores; gloo), tiny model, no emulated delay; sync, edp and
   affine: steady-state epoch time, shares, speedup over sync.
4. two ranks on the one GPU (gloo, since NCCL refuses two ranks on one device), rank 1 slowed, every scheme:
   steady-state epoch time, final shares, speedup over sync.
5. probe: the largest VGG16 training batch that fits (hetero.core.memory.probe_max_batch, as --max-batch probe), then
   a real training step (SGD with momentum) at that size, which must fit; the search has its own time limit.
6. tokens: the most tokens one forward of a causal language model (width 1024, 8 layers) holds, in rows of 4096
   (hetero.core.memory.probe_max_tokens, as max_tokens "probe"), then two real SGD steps at that many, which must fit.
7. if time is left: part 1 again on the GPU fast path (bf16 autocast, channels-last; the trainer's --bf16
   --channels-last).
The figures go to --out as JSON and, next to it, as a markdown table (.md), rewritten after every part so that
a run cut short still leaves what it measured. Parts (and fast-path rows) that the time did not allow are
reported as skipped, not failed: the exit status is 1 only for a real failure. Needs torch (2.4 or later),
numpy and torchvision; not pandas. The sizes, the trainer-free parts and the report are in gpu_parts.py.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hetero, wherever python started
from gpu_parts import GPU, SKIPPED, SMOKE, Sizes, markdown, probe, raw_samples_s, token_probe  # noqa: E402

from hetero.core.partition import SCHEMES  # noqa: E402
from hetero.lab.launch import ROOT, clean_env, torchrun_cmd  # noqa: E402
from hetero.lab.measure import (  # noqa: E402
    LaunchError,
    add_speedup_vs_sync,
    launch,
    read_rows,
    run_meta,
    steady_epoch_s,
    steady_epochs,
)
from hetero.trainer.cli import CliParser  # noqa: E402

# by importance: later ones may run out of time
PARTS = ("throughput", "delay", "mixed", "pair", "probe", "tokens", "fast")
EXTRA_PATH: list[str] = []  # a stand-in tqdm, when the GPU machine's python lacks it (see preflight)
TQDM_STAND_IN = """class tqdm:  # written by scripts/gpu_check.py: tqdm is missing here; the trainer only draws a bar
    def __init__(self, *args, **kwargs): pass
    def update(self, n=1): pass
    def close(self): pass
"""


def trainer(nproc: int, args: list[str], log: Path, left) -> None:
    """The trainer under torchrun with `left()` seconds to run; raises LaunchError (left() <= 0: out of time)."""
    launch(torchrun_cmd(nproc, args), log, left(), clean_env(EXTRA_PATH, threads="1"), tail=12)


def preflight(work: Path) -> list[str]:
    """The trainer's third-party modules missing here. numpy and torchvision are needed; tqdm only draws the
    progress bar, so a no-op stand-in goes on the trainer's path (no internet on the GPU machine to install it)."""
    import importlib.util

    missing = [m for m in ("numpy", "torchvision", "tqdm") if importlib.util.find_spec(m) is None]
    if "tqdm" in missing:
        (work / "stand-ins").mkdir(parents=True, exist_ok=True)
        (work / "stand-ins" / "tqdm.py").write_text(TQDM_STAND_IN)
        EXTRA_PATH.append(str(work / "stand-ins"))
    return missing


def common_args(s: Sizes, model: str, subset: int, epochs: int, run: Path) -> list[str]:
    args = ["--model", model, "--data", "synthetic", "--subset", str(subset), "--test-subset", str(s.test_subset),
            "--global-batch", str(s.batch), "--epochs", str(epochs), "--augment", "false", "--device", s.device,
            "--run-dir", str(run), "--overwrite"]
    return args + (["--threads", "1"] if s.device == "cpu" else [])


def throughput(s: Sizes, work: Path, left, fast: bool = False) -> list[dict]:
    out = []
    for name in s.models:
        row: dict = {"model": name, "batch": s.batch, "path": "bf16 + channels-last" if fast else "float32"}
        if left() < 30:
            row["error"] = f"{SKIPPED}out of time"
            out.append(row)
            continue
        try:
            row["raw_samples_s"] = raw_samples_s(name, s, sync_each=False, fast=fast)
            row["raw_synced_samples_s"] = raw_samples_s(name, s, sync_each=True, fast=fast)
            tag = f"single-{name}" + ("-fast" if fast else "")
            run = work / tag
            trainer(1, common_args(s, name, s.subset, s.epochs, run) + ["--scheme", "sync"] +
                    (["--bf16", "--channels-last"] if fast else []), work / "logs" / f"{tag}.log", left)
            first = read_rows(run / "epochs.csv")[0]
            row.update(trainer_samples_s=int(first["samples"]) / steady_epoch_s(run),
                       steps_per_epoch=int(first["steps"]), run_dir=str(run))
            row["trainer_over_raw"] = row["trainer_samples_s"] / row["raw_samples_s"]
            row["trainer_over_raw_synced"] = row["trainer_samples_s"] / row["raw_synced_samples_s"]
        except LaunchError as e:  # the fast path runs last, on what time is left: running out is no failure there
            row["error"] = (SKIPPED if fast and left() <= 0 else "") + f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - record it and go on with the next model
            row["error"] = f"{type(e).__name__}: {e}"
        out.append(row)
    return out


def compare(s: Sizes, work: Path, left, tag: str, nproc: int, model: str, subset: int, epochs: int,
            extra: list[str], schemes: tuple[str, ...]) -> list[dict]:
    """One trainer run per scheme (same data and sizes): steady-state epoch time, last epoch's shares, per-rank
    compute and wait, speedup over sync."""
    rows = []
    for scheme in schemes:
        row: dict = {"scheme": scheme}
        if left() < 20:
            row["error"] = f"{SKIPPED}out of time"
            rows.append(row)
            continue
        run = work / f"{tag}-{scheme}"
        try:
            trainer(nproc, common_args(s, model, subset, epochs, run) + ["--scheme", scheme] + extra,
                    work / "logs" / f"{tag}-{scheme}.log", left)
            epochs_rows = read_rows(run / "epochs.csv")
            row["epoch_s"], row["steps"] = steady_epoch_s(run), int(epochs_rows[0]["steps"])
            ranks = read_rows(run / "ranks.csv")
            last = [r for r in ranks if int(r["epoch"]) == max(int(r["epoch"]) for r in ranks)]
            row["shares"] = [round(float(r["share"]), 3) for r in last]
            row["compute_s"] = [float(r["compute_s"]) for r in last]
            row["wait_s"] = [float(r["wait_s"]) for r in last]
            row["balance_eff"] = float(epochs_rows[-1]["balance_eff"])
        except Exception as e:  # noqa: BLE001 - record it and go on with the next scheme
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    add_speedup_vs_sync(rows)
    return rows


def pair(s: Sizes, work: Path, left, schemes: tuple[str, ...]) -> dict:
    res = {"model": s.pair_model, "hetero": s.pair_hetero, "backend": "gloo", "ranks": 2}
    res["rows"] = compare(s, work, left, "pair", 2, s.pair_model, s.pair_subset, s.pair_epochs,
                          ["--hetero", s.pair_hetero, "--backend", "gloo"], schemes)
    return res


def delay(s: Sizes, work: Path, left) -> dict:
    """Two ranks on one device, rank 1 delayed (sync: equal batches): per rank, the mean compute_s and delay_s per
    step over the epochs after the first; rank 1's compute must exceed rank 0's by its delay (within 10%)."""
    res: dict = {"model": s.delay_model, "hetero": s.delay_hetero, "backend": "auto", "ranks": 2}
    if left() < 40:
        return {**res, "error": f"{SKIPPED}out of time"}
    run = work / "delay"
    log = work / "logs" / "delay.log"
    try:
        trainer(2, common_args(s, s.delay_model, s.delay_subset, s.delay_epochs, run) +
                ["--scheme", "sync", "--hetero", s.delay_hetero, "--backend", "auto"], log, left)
        later = steady_epochs(run, table="steps")
        mean = lambda k, rank: statistics.fmean(float(r[k]) for r in later if int(r["rank"]) == rank)
        res["compute_s"] = [mean("compute_s", r) for r in (0, 1)]
        res["wait_s"] = [mean("wait_s", r) for r in (0, 1)]
        res["delay_s"] = [mean("delay_s", r) for r in (0, 1)]
        res["steps"] = len(later) // 2
        res["excess_s"] = res["compute_s"][1] - res["compute_s"][0]
        want = res["delay_s"][1] - res["delay_s"][0]
        res["excess_over_delay"] = res["excess_s"] / want
        res["within_10pct"] = abs(res["excess_s"] - want) <= 0.1 * want
        res["backend_line"] = next((ln.strip() for ln in log.read_text(errors="replace").splitlines()
                                    if "using gloo" in ln or " rank(s) (" in ln), "")
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def mixed_affinity(s: Sizes) -> str:
    """Cores for the mixed part's ranks, consecutive and apart: as many as a rank's threads (four for a GPU rank's
    host work, its threads being 0); unpinned ("") when the host has too few."""
    if s.mixed_affinity != "auto":
        return s.mixed_affinity
    cores, spans, at = sorted(os.sched_getaffinity(0)), [], 0
    for t in s.mixed_threads.split(","):
        n = int(t) or 4
        if at + n > len(cores):
            return ""
        spans.append(f"{cores[at]}-{cores[at + n - 1]}")
        at += n
    return ",".join(spans)


def mixed(s: Sizes, work: Path, left) -> dict:
    res = {"model": "tiny", "devices": s.mixed_devices, "threads": s.mixed_threads, "affinity": mixed_affinity(s),
           "backend": "auto (gloo)", "ranks": len(s.mixed_devices.split(","))}
    res["rows"] = compare(s, work, left, "mixed", res["ranks"], "tiny", s.mixed_subset, s.mixed_epochs,
                          ["--device", s.mixed_devices, "--threads", s.mixed_threads, "--affinity", res["affinity"]],
                          ("sync", "edp", "affine"))
    return res


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the figures (a .md table is written next to it)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and sizes: checks that the script runs")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="schemes of the two-rank part")
    p.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)} (run in that order)")
    p.add_argument("--work-dir", default="", help="run folders and logs (default runs/gpu_check/<time>)")
    p.add_argument("--budget-s", type=float, help="stop starting new parts after this many seconds")
    p.add_argument("--pair-model", help="model of the two-rank part (default vgg16)")
    p.add_argument("--pair-hetero", help="--hetero of the two-rank part (default 1:slowdown=3)")
    ns = p.parse_args(argv)
    parts, schemes = ns.parts.split(","), tuple(ns.schemes.split(","))
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"unknown part {bad[0]!r}: choose from {', '.join(PARTS)}")
    if bad := [x for x in schemes if x not in SCHEMES]:
        p.error(f"unknown scheme {bad[0]!r}: choose from {', '.join(SCHEMES)}")
    import torch

    s = SMOKE if ns.smoke else GPU
    s = replace(s, **{k: getattr(ns, k) for k in ("budget_s", "pair_model", "pair_hetero") if getattr(ns, k)})
    if s.device == "cuda" and not torch.cuda.is_available():
        p.error("torch sees no GPU: run on the GPU machine, or pass --smoke for a CPU check")
    work = Path(ns.work_dir or ROOT / "runs" / "gpu_check" / datetime.now().strftime("%Y%m%d-%H%M%S"))
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    missing = preflight(work)
    if set(missing) - {"tqdm"}:
        p.error(f"this python lacks {', '.join(missing)}, which the trainer needs")
    t0 = time.perf_counter()
    left = lambda: s.budget_s - (time.perf_counter() - t0)
    command = "python3 scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = run_meta(command)
    meta.update(device_name=torch.cuda.get_device_name() if s.device == "cuda" else meta["cpu"], smoke=ns.smoke,
                sizes=asdict(s), stand_ins=missing)
    res: dict = {"meta": meta}

    def save() -> None:
        res["meta"]["wall_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))

    run_part = {"throughput": lambda: throughput(s, work, left), "delay": lambda: delay(s, work, left),
                "mixed": lambda: mixed(s, work, left),
                "pair": lambda: pair(s, work, left, schemes), "probe": lambda: probe(s, left),
                "tokens": lambda: token_probe(s, left),
                "fast": lambda: throughput(s, work, left, fast=True)}
    for part in PARTS:
        if part in parts:
            t_part = time.perf_counter()
            res[part] = run_part[part]()
            res["meta"].setdefault("part_s", {})[part] = round(time.perf_counter() - t_part, 1)
            save()
    print(markdown(res), end="")
    found = res.get("throughput", []) + res.get("fast", []) + [res[k] for k in ("probe", "tokens", "delay") if k in res]
    found += [r for k in ("mixed", "pair") for r in res.get(k, {}).get("rows", [])]
    failed = [r for r in found if "error" in r and not r["error"].startswith(SKIPPED)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
