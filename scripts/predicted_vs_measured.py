"""The read-out's predicted speedup against the measured one: one hetero run and one sync run of the built-in
trainer with the same settings (2 CPU ranks, a constant delay on rank 1, where the affine cost model is exact),
both with --tensorboard. Prints a Markdown table row for docs/metrics.md and writes RESULT.json.

    python scripts/predicted_vs_measured.py --out runs/metrics-demo [--delay 0.05 --epochs 4]

measured speedup: the sync run's mean step time over the hetero run's, over the epochs after the first (a step's
time is a rank's compute + wait, the same on every rank up to the clock's resolution; rank 0's is taken).
predicted: hetero/predicted_speedup at the last epoch's end, read back from the event files; it is compute only,
so it is also given with the sync run's all-reduce time (the fast rank 0's wait, less the delay it waits out)
added to both sides.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero.lab.launch import clean_env, torchrun_cmd  # noqa: E402


def run(out: Path, scheme: str, args: argparse.Namespace) -> Path:
    folder = out / scheme
    cmd = torchrun_cmd(2, ["--model", "tiny", "--data", "synthetic", "--subset", str(args.subset), "--test-subset",
                           "512", "--global-batch", str(args.global_batch), "--epochs", str(args.epochs),
                           "--scheme", scheme, "--hetero", f"1:delay={args.delay}", "--rebalance-every",
                           str(args.rebalance_every), "--threads", "1", "--augment", "false", "--tensorboard",
                           "--run-dir", str(folder), "--overwrite"])
    subprocess.run(cmd, cwd=ROOT, env=clean_env(threads="1"), check=True)
    return folder


def step_s(folder: Path) -> pd.Series:
    """Per step (epochs after the first): rank 0's compute + wait (s)."""
    s = pd.read_csv(folder / "steps.csv")
    s = s[(s["epoch"] > 1) & (s["rank"] == 0)]
    return s["compute_s"] + s["wait_s"]


def last_scalar(folder: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return float(acc.Scalars(tag)[-1].value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/metrics-demo")
    p.add_argument("--scheme", default="affine")
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--subset", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--rebalance-every", type=int, default=8)
    args = p.parse_args()
    out = Path(args.out)
    hetero, sync = run(out, args.scheme, args), run(out, "sync", args)
    t_h, t_s = step_s(hetero), step_s(sync)
    measured = t_s.mean() / t_h.mean()
    # the measured ratio's standard error, from the scatter of each run's steps (independent runs)
    err = measured * ((t_s.std() / t_s.mean()) ** 2 / len(t_s) + (t_h.std() / t_h.mean()) ** 2 / len(t_h)) ** 0.5
    predicted = last_scalar(hetero, "hetero/predicted_speedup")
    chosen, even = (last_scalar(hetero, f"hetero/{k}") for k in ("predicted_step_s", "predicted_even_step_s"))
    s = pd.read_csv(sync / "steps.csv")
    comm = float((s[(s["epoch"] > 1) & (s["rank"] == 0)]["wait_s"]).mean()
                 - (s[(s["epoch"] > 1) & (s["rank"] == 1)]["compute_s"]
                    - s[(s["epoch"] > 1) & (s["rank"] == 0)]["compute_s"].to_numpy()).mean())
    with_comm = (even + comm) / (chosen + comm)
    res = {"scheme": args.scheme, "delay_s": args.delay, "sync_step_s": float(t_s.mean()),
           "hetero_step_s": float(t_h.mean()), "measured": float(measured), "measured_se": float(err),
           "predicted": predicted, "predicted_step_s": chosen, "predicted_even_step_s": even,
           "allreduce_s": comm, "predicted_with_allreduce": with_comm, "steps": [len(t_s), len(t_h)]}
    (out / "RESULT.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    print(f"| 2 CPU ranks, tiny, rank 1 +{1e3 * args.delay:.0f} ms/step | {args.scheme} | "
          f"{1e3 * t_s.mean():.1f} | {1e3 * t_h.mean():.1f} | {measured:.3f} ± {err:.3f} | {predicted:.3f} | "
          f"{with_comm:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
