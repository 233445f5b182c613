"""The Hugging Face Trainer with hetero over the plain Trainer (part "hf" of `make bench`): no heterogeneity, 2 CPU
ranks, the same tiny GPT-2, token rows and TrainingArguments; runs of the two take turns in the same processes, so
load from elsewhere falls on both alike. hetero runs edp, deciding every REBALANCE_EVERY steps (its gathers count).
The accumulation case, in the same turns: gradient_accumulation_steps ACCUM, micro-batches of PER_RANK // ACCUM,
the same global batch B; hetero with Balance(micro_batch=m) (each rank's own count k_i, even here) against the plain
Trainer's G.

    torchrun --standalone --nproc-per-node=2 -m hetero.lab.hfbench --out FILE --runs R --steps S
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..core import safeio
from ..trainer.cli import CliParser
from .launch import clean_env, torchrun_cmd
from .measure import launch

REBALANCE_EVERY = 10
KINDS = ("hetero", "plain", "hetero_accum", "plain_accum")
ACCUM = 4  # gradient_accumulation_steps of the accumulation case
LENGTH, VOCAB, PER_RANK, WARMUP = 32, 64, 16, 3  # tokens per row, ids, rows per rank and step, steps not timed


def worker(out: Path, runs: int, steps: int, seed: int = 0) -> None:
    """Run by torchrun: `runs` Trainer runs of each kind, `steps` optimizer steps each, in turn (which goes first
    alternates); rank 0 writes every run's median step time (s, between consecutive step ends) to `out`."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ..core.balance import Balance
    from ..integrations.hf import HeteroTrainer

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    ids = torch.randint(VOCAB, (steps * PER_RANK * world, LENGTH), generator=torch.Generator().manual_seed(seed))
    rows = [{"input_ids": r, "labels": r} for r in ids]

    class Clock(TrainerCallback):
        """perf_counter at every step's end."""
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    def one_run(kind: str, run: int) -> float:
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=2,
                                           bos_token_id=None, eos_token_id=None))
        model.loss_type = "ForCausalLM"
        g = ACCUM if kind.endswith("_accum") else 1
        args = TrainingArguments(output_dir=str(out.with_suffix("")), per_device_train_batch_size=PER_RANK // g,
                                 gradient_accumulation_steps=g, max_steps=steps, use_cpu=True, save_strategy="no",
                                 logging_strategy="no", report_to=[], disable_tqdm=True, seed=seed,
                                 ddp_find_unused_parameters=False)
        clock = Clock()
        common = dict(model=model, args=args, train_dataset=rows, callbacks=[clock])
        if kind.startswith("hetero"):
            bal = Balance(global_batch=PER_RANK * world, scheme="edp", rebalance_every=REBALANCE_EVERY, seed=seed,
                          micro_batch=PER_RANK // g if g > 1 else 0)
            trainer = HeteroTrainer(balance=bal, **common)
        else:
            trainer = Trainer(**common)
        trainer.train()
        return float(np.median(np.diff(clock.ends[WARMUP:])))

    step_s: dict[str, list[float]] = {k: [] for k in KINDS}
    for run in range(runs):
        for kind in (KINDS if run % 2 else KINDS[::-1]):  # back to back, in turn (each pair adjacent)
            step_s[kind].append(one_run(kind, run))
    if dist.get_rank() == 0:
        safeio.write_text(out, json.dumps({"step_s": step_s, "steps": steps, "world": world}))


def measure(out: Path, runs: int, steps: int, notes: list[str]) -> dict | None:
    """hetero's Trainer step time over the plain Trainer's, 2 ranks: the median of the back-to-back run pairs'
    ratios, and the ratio of the medians; None (with a note) without the [hf] extra."""
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        notes.append("hf: skipped, the [hf] extra (transformers, accelerate) is not installed")
        return None
    print("bench: hf trainer", flush=True)
    res = out / "runs" / "hf.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    env = {**clean_env(threads="1"), "HF_HUB_OFFLINE": "1"}
    launch(torchrun_cmd(2, ["--out", str(res), "--runs", str(runs), "--steps", str(steps)], "hetero.lab.hfbench"),
           out / "logs" / "hf.log", 900, env, done=res, notes=notes)
    d = json.loads(res.read_text())

    def ratio(het: np.ndarray, plain: np.ndarray) -> dict:
        return {"ratio": float(np.median(het / plain)), "ratio_of_medians": float(np.median(het) / np.median(plain)),
                "hetero_step_s": float(np.median(het)), "plain_step_s": float(np.median(plain)),
                "extra_ms_per_step": 1e3 * float(np.median(het) - np.median(plain)),
                "pair_ratios": (het / plain).tolist()}
    step_s = {k: np.array(v) for k, v in d["step_s"].items()}
    accum = {"gradient_accumulation_steps": ACCUM, "micro_batch": PER_RANK // ACCUM,
             **ratio(step_s["hetero_accum"], step_s["plain_accum"])}
    return {"world": d["world"], "global_batch": PER_RANK * d["world"], "steps": steps, "runs": runs,
            **ratio(step_s["hetero"], step_s["plain"]), "accumulation": accum, "step_s": d["step_s"],
            "rebalance_every": REBALANCE_EVERY}


def cli(argv: list[str] | None, module: str, doc: str, out_help: str, run) -> int:
    """A Trainer benchmark's command line (this one's and tokenbench's): --out, --runs, --steps, then run(out, runs,
    steps) in every rank torchrun started."""
    p = CliParser(prog=f"python -m {module}", description=doc.split("\n")[0])
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--runs", type=int, required=True, help="Trainer runs of each kind, taken in turn")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps per run")
    ns = p.parse_args(argv)
    if ns.runs < 1 or ns.steps < WARMUP + 2:
        p.error(f"need --runs >= 1 and --steps >= {WARMUP + 2}")
    run(Path(ns.out), ns.runs, ns.steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "hetero.lab.hfbench", __doc__, "JSON file for the step times (rank 0 writes it)", worker)


if __name__ == "__main__":
    sys.exit(main())
