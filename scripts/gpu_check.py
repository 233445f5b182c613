"""The GPU check (issue 5): one GPU, under 5 minutes, no internet (synthetic data only).

    python3 scripts/gpu_check.py --out gpu_check.json            # on the GPU machine, from the repository root
    python scripts/gpu_check.py --smoke --out /tmp/gpu_check.json # CPU, tiny sizes: does it run end to end?

1. throughput, VGG16 and ResNet50 (CIFAR form, batch 256, float32): samples/s of the raw training step measured
   here (the model, SGD, one fixed batch already on the device; no DDP, no data pipeline), the same with a
   device synchronisation after every step (the trainer reads its step clock every step), and the trainer on
   one rank (`python -m hetero.train`, a world of one, synthetic data, no augmentation), median over the
   epochs after the first.
2. delay: two ranks on the one GPU, ResNet50, rank 1 delayed by a fixed 20 ms per step (`--hetero 1:delay=0.02`,
   sync, --backend auto: it must pick gloo, saying why): both ranks' mean compute_s per step, and whether rank 1's
   exceeds rank 0's by the delay within 10% (issue 16: a delay slept while the rank's kernels were still queued
   was lost).
3. mixed: one job of one GPU rank and two CPU ranks with different thread budgets (--device cuda,cpu,cpu
   --threads 0,4,2, each CPU rank pinned to its own cores; gloo), tiny model, no emulated delay; sync, edp and
   affine: steady-state epoch time, shares, speedup over sync.
4. two ranks on the one GPU (gloo, since NCCL refuses two ranks on one device), rank 1 slowed, every scheme:
   steady-state epoch time, final shares, speedup over sync.
5. probe: the largest VGG16 training batch that fits (hetero.memory.probe_max_batch, as --max-batch probe), then
   a real training step (SGD with momentum) at that size, which must fit; the search has its own time limit.
6. if time is left: part 1 again on the GPU fast path (bf16 autocast, channels-last; the trainer's --bf16
   --channels-last).
The figures go to --out as JSON and, next to it, as a markdown table (.md), rewritten after every part so that
a run cut short still leaves what it measured. Parts (and fast-path rows) that the time did not allow are
reported as skipped, not failed: the exit status is 1 only for a real failure. Needs torch (2.4 or later) and
torchvision; not pandas.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCHEMES = ("sync", "dp", "edp", "affine")
PARTS = ("throughput", "delay", "mixed", "pair", "probe", "fast")  # by importance: later ones may run out of time
EXTRA_PATH: list[str] = []  # a stand-in tqdm, when the GPU machine's python lacks it (see preflight)
TQDM_STAND_IN = """class tqdm:  # written by scripts/gpu_check.py: tqdm is missing here; the trainer only draws a bar
    def __init__(self, *args, **kwargs): pass
    def update(self, n=1): pass
    def close(self): pass
"""


@dataclass(frozen=True)
class Sizes:
    device: str
    models: tuple[str, ...]       # throughput part
    batch: int                    # global batch everywhere
    raw_steps: int                # timed raw steps (after `warmup`)
    warmup: int
    subset: int                   # training samples of a single-rank trainer run
    epochs: int
    pair_model: str               # two-rank part
    pair_subset: int
    pair_epochs: int
    pair_hetero: str
    test_subset: int
    mixed_devices: str            # the mixed part: --device, --threads, --affinity of its ranks
    mixed_threads: str
    mixed_affinity: str
    mixed_subset: int
    mixed_epochs: int
    probe_model: str
    probe_hi: int                 # the probe's largest try
    probe_limit_s: float          # the probe's own time limit (checked between its trials)
    delay_model: str              # the delay part: two ranks on one device, rank 1 delayed
    delay_subset: int
    delay_epochs: int
    delay_hetero: str
    budget_s: float               # the whole check stops starting new parts after this long


GPU = Sizes("cuda", ("vgg16", "resnet50"), 256, 40, 10, 12800, 3, "vgg16", 7680, 3, "1:slowdown=3", 1000,
            "cuda,cpu,cpu", "0,4,2", "auto", 10240, 4, "vgg16", 1 << 17, 45, "resnet50", 5120, 2, "1:delay=0.02", 270)
SMOKE = Sizes("cpu", ("tiny",), 32, 4, 2, 256, 2, "tiny", 256, 2, "1:slowdown=2", 64,
              "cpu,cpu", "1,1", "", 256, 2, "tiny", 64, 30, "tiny", 256, 1, "1:delay=0.02", 600)
SKIPPED = "skipped: "  # an error text starting so is a part the time did not allow, not a failure


class OutOfTime(RuntimeError):
    """A trainer run stopped at the check's time limit."""


def raw_samples_s(name: str, s: Sizes, sync_each: bool, fast: bool = False) -> float:
    """Samples/s of plain forward, backward and SGD step on one fixed batch held on the device (fast: bf16
    autocast and channels-last, as the trainer's --bf16 --channels-last)."""
    import torch
    import torch.nn.functional as F

    from hetero.models import build_model

    dev = torch.device(s.device)
    if dev.type == "cpu":  # as the trainer's CPU runs (--threads 1)
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fmt = torch.channels_last if fast else torch.contiguous_format
    torch.manual_seed(0)
    model = build_model(name).to(dev, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    x = torch.randn(s.batch, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (s.batch,), device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=fast)

    def step() -> None:
        with autocast:
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync_each:
            sync()
    for _ in range(s.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(s.raw_steps):
        step()
    sync()
    rate = s.batch * s.raw_steps / (time.perf_counter() - t0)
    del model, opt, x, y
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def trainer(nproc: int, args: list[str], log: Path, timeout_s: float) -> None:
    """The trainer: `python -m hetero.train` (nproc 1, a world of one) or under torchrun; raises on failure."""
    from hetero.launch import clean_env, run_logged, torchrun_cmd

    cmd = torchrun_cmd(nproc, args)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        rc = run_logged(cmd, fh, max(timeout_s, 1), clean_env(EXTRA_PATH, threads="1"))
    if rc is None:
        raise OutOfTime(f"ran past {max(timeout_s, 1):g} s and was stopped; log {log}")
    if rc:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-12:])
        raise RuntimeError(f"exit {rc}; log {log}:\n{tail}")


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


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _steady_epoch_s(run: Path) -> tuple[float, int, int]:
    """(median epoch_time_s over the epochs after the first, steps, samples per epoch)."""
    rows = _rows(run / "epochs.csv")
    later = [r for r in rows if int(r["epoch"]) >= 2] or rows
    return statistics.median(float(r["epoch_time_s"]) for r in later), int(rows[0]["steps"]), int(rows[0]["samples"])


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
                    (["--bf16", "--channels-last"] if fast else []), work / "logs" / f"{tag}.log", left())
            epoch_s, steps, samples = _steady_epoch_s(run)
            row.update(trainer_samples_s=samples / epoch_s, steps_per_epoch=steps, run_dir=str(run))
            row["trainer_over_raw"] = row["trainer_samples_s"] / row["raw_samples_s"]
            row["trainer_over_raw_synced"] = row["trainer_samples_s"] / row["raw_synced_samples_s"]
        except OutOfTime as e:  # the fast path runs last, on what time is left: running out is no failure there
            row["error"] = (SKIPPED if fast else "") + f"{type(e).__name__}: {e}"
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
                    work / "logs" / f"{tag}-{scheme}.log", left())
            row["epoch_s"], row["steps"], _ = _steady_epoch_s(run)
            ranks = _rows(run / "ranks.csv")
            last = max(int(r["epoch"]) for r in ranks)
            row["shares"] = [round(float(r["share"]), 3) for r in ranks if int(r["epoch"]) == last]
            row["compute_s"] = [float(r["compute_s"]) for r in ranks if int(r["epoch"]) == last]
            row["wait_s"] = [float(r["wait_s"]) for r in ranks if int(r["epoch"]) == last]
            row["balance_eff"] = float(_rows(run / "epochs.csv")[-1]["balance_eff"])
        except Exception as e:  # noqa: BLE001 - record it and go on with the next scheme
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    sync = next((r.get("epoch_s") for r in rows if r["scheme"] == "sync"), None)
    for r in rows:
        if sync and r.get("epoch_s"):
            r["speedup_vs_sync"] = sync / r["epoch_s"]
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
                ["--scheme", "sync", "--hetero", s.delay_hetero, "--backend", "auto"], log, left())
        rows = _rows(run / "steps.csv")
        later = [r for r in rows if int(r["epoch"]) >= 2] or rows
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


def probe(s: Sizes, left) -> dict:
    """The largest batch of probe_model that fits on the device (as --max-batch probe finds it, with hi = the
    largest try instead of the global batch), then one real SGD-with-momentum step at that batch."""
    import torch
    import torch.nn.functional as F

    from hetero.memory import probe_max_batch
    from hetero.models import build_model

    res: dict = {"model": s.probe_model, "hi": s.probe_hi}
    if left() < 30:
        return {**res, "error": f"{SKIPPED}out of time"}
    dev = torch.device(s.device)
    try:
        model = build_model(s.probe_model).to(dev)
        t0 = time.perf_counter()
        found = probe_max_batch(model, (3, 32, 32), 10, dev, lo=1, hi=s.probe_hi,
                                limit_s=min(s.probe_limit_s, max(left() - 10, 1)))
        res["probe_s"] = time.perf_counter() - t0
        res["max_batch"] = None if found == float("inf") else int(found)
        if dev.type == "cuda":
            res["total_gib"] = torch.cuda.get_device_properties(dev).total_memory / 2 ** 30
            torch.cuda.reset_peak_memory_stats(dev)
        b = res["max_batch"] or s.batch
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
        for _ in range(2):  # the second step has the momentum buffers: training's peak
            loss = F.cross_entropy(model(torch.zeros(b, 3, 32, 32, device=dev)), torch.arange(b, device=dev) % 10)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
        res["step_at_max_fits"] = True
        if dev.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
        del model, opt
    except TimeoutError as e:  # the search's own limit: out of time, not a fault
        res["error"] = f"{SKIPPED}{e}"
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# GPU check, {m['date']}, {m['host']}: {m['device_name']} (torch {m['torch']})", "",
             f"`{m['command']}`", "", "## Throughput, one rank (samples/s)", "",
             "| model | path | batch | raw step | raw, synced each step | trainer | trainer / raw | "
             "trainer / raw synced |", "|---|---|---|---|---|---|---|---|"]
    f = lambda r, k, fmt: format(r[k], fmt) if isinstance(r.get(k), float) else (r.get("error", "")[:60] or "-")
    for r in res.get("throughput", []) + res.get("fast", []):
        lines.append(f"| {r['model']} | {r['path']} | {r['batch']} | {f(r, 'raw_samples_s', '.0f')} | "
                     f"{f(r, 'raw_synced_samples_s', '.0f')} | {f(r, 'trainer_samples_s', '.0f')} | "
                     f"{f(r, 'trainer_over_raw', '.3f')} | {f(r, 'trainer_over_raw_synced', '.3f')} |")
    if p := res.get("delay"):
        lines += ["", f"## Delay counted as compute: two ranks on one device, {p['model']}, --hetero {p['hetero']}, "
                      f"sync, --backend {p['backend']}", ""]
        if "compute_s" not in p:
            lines.append(f"error: {p.get('error', '')}")
        else:
            lines += ["| rank | compute s/step | wait s/step | delay s/step |", "|---|---|---|---|"]
            lines += [f"| {r} | {p['compute_s'][r]:.4f} | {p['wait_s'][r]:.4f} | {p['delay_s'][r]:.4f} |"
                      for r in (0, 1)]
            lines += ["", f"rank 1 - rank 0: {p['excess_s'] * 1e3:.1f} ms per step over {p['steps']} steps = "
                          f"{p['excess_over_delay']:.2f} x the delay: "
                          f"{'within' if p['within_10pct'] else 'NOT within'} 10%. `{p['backend_line']}`"]
    if p := res.get("mixed"):
        lines += ["", f"## Mixed job: devices {p['devices']}, threads {p['threads']}, cores {p['affinity'] or '-'} "
                      f"({p['backend']}), {p['model']}, no emulated delay", ""] + _scheme_table(p["rows"])
    if p := res.get("pair"):
        lines += ["", f"## Two ranks on one GPU ({p['backend']}), {p['model']}, --hetero {p['hetero']}", ""] + \
            _scheme_table(p["rows"])
    if p := res.get("probe"):
        lines += ["", f"## Largest batch that fits ({p['model']}, float32; --max-batch probe)", ""]
        if "error" in p:
            lines.append(f"error: {p['error']}")
        elif p["max_batch"] is None:
            lines.append("not probed: a CPU device has no limit (host memory does not fail cleanly)")
        else:
            lines.append(f"{p['max_batch']} samples (90% of the largest that fit; tries up to {p['hi']}), found in "
                         f"{p['probe_s']:.1f} s; an SGD step at that size fits"
                         + (f" (peak {p['peak_gib']:.1f} of {p['total_gib']:.1f} GiB)" if "peak_gib" in p else ""))
    return "\n".join(lines) + "\n"


def _scheme_table(rows: list[dict]) -> list[str]:
    lines = ["| scheme | epoch s | speedup vs sync | shares | balance |", "|---|---|---|---|---|"]
    for r in rows:
        if "epoch_s" not in r:
            lines.append(f"| {r['scheme']} | {r.get('error', '')[:80]} | | | |")
            continue
        speedup = f"{r['speedup_vs_sync']:.2f}x" if "speedup_vs_sync" in r else "-"
        lines.append(f"| {r['scheme']} | {r['epoch_s']:.3f} | {speedup} | "
                     f"{'/'.join(f'{v:.2f}' for v in r['shares'])} | {r['balance_eff']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the figures (a .md table is written next to it)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and sizes: checks that the script runs")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="schemes of the two-rank part")
    p.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)} (run in that order)")
    p.add_argument("--work-dir", default="", help="run folders and logs (default runs/gpu_check/<time>)")
    p.add_argument("--budget-s", type=float, help="stop starting new parts after this many seconds")
    p.add_argument("--pair-model", help="model of the two-rank part (default vgg16)")
    p.add_argument("--pair-hetero", help="--hetero of the two-rank part (default 1:slowdown=3)")
    ns = p.parse_args(argv)
    import torch

    s = SMOKE if ns.smoke else GPU
    over = {k: getattr(ns, k) for k in ("budget_s", "pair_model", "pair_hetero") if getattr(ns, k)}
    s = Sizes(**{**asdict(s), **over})
    if s.device == "cuda" and not torch.cuda.is_available():
        p.error("torch sees no GPU: run on the GPU machine, or pass --smoke for a CPU check")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    work = Path(ns.work_dir or ROOT / "runs" / "gpu_check" / stamp)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    missing = preflight(work)
    if set(missing) - {"tqdm"}:
        p.error(f"this python lacks {', '.join(missing)}, which the trainer needs")
    t0 = time.perf_counter()
    left = lambda: s.budget_s - (time.perf_counter() - t0)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    res: dict = {"meta": {"date": datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
                          "device_name": torch.cuda.get_device_name() if s.device == "cuda" else platform.processor()
                          or "cpu", "torch": torch.__version__, "python": platform.python_version(),
                          "git_commit": commit or "unknown", "smoke": ns.smoke, "sizes": asdict(s),
                          "stand_ins": missing,
                          "command": "python3 scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv)}}

    def save() -> None:
        res["meta"]["wall_s"] = time.perf_counter() - t0
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))

    parts = ns.parts.split(",")
    if bad := [x for x in parts if x not in PARTS]:
        p.error(f"unknown part {bad[0]!r}: choose from {', '.join(PARTS)}")
    run_part = {"throughput": lambda: throughput(s, work, left), "delay": lambda: delay(s, work, left),
                "mixed": lambda: mixed(s, work, left),
                "pair": lambda: pair(s, work, left, tuple(ns.schemes.split(","))), "probe": lambda: probe(s, left),
                "fast": lambda: throughput(s, work, left, fast=True)}
    for part in PARTS:
        if part in parts:
            t_part = time.perf_counter()
            res[part] = run_part[part]()
            res["meta"].setdefault("part_s", {})[part] = round(time.perf_counter() - t_part, 1)
            save()
    print(markdown(res), end="")
    found = res.get("throughput", []) + res.get("fast", []) + [res[k] for k in ("probe", "delay") if k in res]
    found += [r for k in ("mixed", "pair") for r in res.get(k, {}).get("rows", [])]
    failed = [r for r in found if "error" in r and not r["error"].startswith(SKIPPED)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
