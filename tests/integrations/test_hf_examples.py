"""The Hugging Face examples under torchrun on 2 CPU ranks (gloo), a tiny GPT-2 on the characters of
docs/huggingface.md (the page of these examples; they need 12,288 characters, docs/trainer.md lacks them), rank 1
emulated 3x slower plus 0.1 s a step and rebalancing every 5 steps (the Trainer's with 2 DataLoader workers):
every sample of each epoch is consumed exactly once across the ranks, the slow rank's share falls well below a half,
and the loss falls as the same script's without hetero. A Trainer run stopped after a save_steps checkpoint resumes
with hetero's sizes and coverage intact; with --grad-accum 4 the slow rank runs fewer micro-batches and the loss
falls as the plain Trainer's with the same B and G; the ported run_clm.py accumulates per rank and learns. (The
exact gradient in both loss conventions is proved in test_hf.py, test_hf_accumulation.py and test_hf_fsdp.py.)"""
from __future__ import annotations

import json
import math
import sys

import pytest

from helpers import ROOT, bounded, clean_env

pytestmark = [pytest.mark.launch, pytest.mark.slow]  # the Hugging Face examples under torchrun and accelerate launch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
SUBSET, B, STEPS = 320, 32, 10  # steps per epoch
TEXT = ROOT / "docs" / "huggingface.md"
ARGS = ["--text", str(TEXT), "--subset", str(SUBSET), "--global-batch", str(B), "--epochs", "2"]
# rank 1 3x slower and 0.1 s more per step: a signal no busy host hides (with the 3x alone, a loaded 2-core VM kept
# the even split at the first decision, 2026-12-05), so no verdict below rests on the host's speed
HETERO = ["--hetero", "1:slowdown=3,1:delay=0.1", "--rebalance-every", "5"]


def _launch(script: str, tmp_path, *extra: str, name: str = "rec", launcher: list[str] | None = None) -> list[dict]:
    env = {**clean_env(threads="1"), "HF_HUB_OFFLINE": "1"}
    cmd = [*(launcher or [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--log-dir=/dev/null"]), str(ROOT / "examples" / script), *ARGS, *extra,
           "--record", str(tmp_path / name)]
    p = bounded(cmd, env, timeout=420)  # 10-30 s here: past it, every process's stacks
    assert p.returncode == 0, f"{script} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(2)]


def _check(ranks: list[dict], base: list[dict]) -> None:
    for epoch in ("0", "1"):
        seen = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(seen) == list(range(SUBSET)), f"epoch {epoch}: not every sample exactly once"
    d = ranks[0]["decisions"]
    assert d == ranks[1]["decisions"] and len(d) == 4            # steps 4 and 9 of each epoch, the same on both
    assert d[-1]["shares"][1] < 0.4 and d[-1]["sizes"][1] < B // 2 - 4   # the slow rank: well below a half
    losses, baseline = ranks[0]["losses"], base[0]["losses"]
    assert losses[-1] < 0.9 * losses[0] and baseline[-1] < 0.9 * baseline[0]
    assert abs(losses[-1] - baseline[-1]) < 0.1 * baseline[-1], f"loss {losses} against the baseline's {baseline}"


def test_trainer_example_covers_every_sample_moves_shares_and_learns_like_the_trainer(tmp_path):
    """With 2 DataLoader workers running ahead (a decision takes effect at the first step no sampler has handed
    out) and the Trainer's evaluation every 5 steps (eval_strategy="steps"), between hetero's steps."""
    both = ["--eval-every", "5", "--workers", "2"]
    ranks = _launch("hf_trainer.py", tmp_path, *HETERO, "--out", str(tmp_path / "out"), *both)
    base = _launch("hf_trainer_baseline.py", tmp_path, "--out", str(tmp_path / "base"), *both, name="base")
    _check(ranks, base)
    evals, baseline = ranks[0]["eval_losses"], base[0]["eval_losses"]
    assert len(evals) == len(baseline) == 2 * STEPS // 5 and evals[-1] < evals[0]
    assert abs(evals[-1] - baseline[-1]) < 0.1 * baseline[-1]


def test_accelerate_example_covers_every_sample_moves_shares_and_learns_like_the_loop(tmp_path):
    """Both size a linear LR schedule as upstream does; hetero's prepare steps it once per optimizer step, so it
    is half-way after epoch 1 of 2, as the baseline's (accelerate's prepare alone would be at 0 there)."""
    ranks, base = _launch("accelerate_loop.py", tmp_path, *HETERO), _launch("accelerate_loop_baseline.py", tmp_path,
                                                                         name="base")
    _check(ranks, base)
    for run in (ranks, base):
        assert [r["lrs"] for r in run] == [pytest.approx([1.5e-3, 0.0])] * 2


def test_accelerate_example_runs_under_accelerate_launch(tmp_path):
    """`accelerate launch --multi_gpu` is accelerate's torchrun launcher; on CPU the script's Accelerator(cpu=True)
    makes gloo ranks (`--cpu` would start one process)."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    ranks = _launch("accelerate_loop.py", tmp_path, *HETERO, "--epochs", "1", launcher=launcher)
    assert sorted(ranks[0]["seen"]["0"] + ranks[1]["seen"]["0"]) == list(range(SUBSET))
    assert ranks[0]["decisions"] == ranks[1]["decisions"] and len(ranks[0]["decisions"]) == 2


def test_a_resumed_trainer_run_keeps_hetero_sizes_and_coverage(tmp_path):
    """With 2 DataLoader workers running ahead, the first decision, after step 4, takes effect a few steps later
    (about 9). Stopped at the checkpoint at step 6, before that, and resumed from it: steps 6 up to the effective
    step keep the even split in force at the checkpoint, the decision's sizes apply from then on, and every sample
    of the interrupted epoch is consumed once (hetero's sampler starts at the saved step; the Trainer does not skip
    batches itself)."""
    out = ["--out", str(tmp_path / "out"), *HETERO, "--workers", "2"]
    first = _launch("hf_trainer.py", tmp_path, *out, "--max-steps", "6", "--save-steps", "6", name="first")
    assert (tmp_path / "out" / "checkpoint-6" / "hetero_balance.pt").is_file()
    second = _launch("hf_trainer.py", tmp_path, *out, "--resume", name="second")
    epoch0 = [i for run in (first, second) for rank in run for i in rank["seen"].get("0", [])]
    assert sorted(epoch0) == list(range(SUBSET)), "the resumed epoch: not every sample exactly once"
    assert sorted(second[0]["seen"]["1"] + second[1]["seen"]["1"]) == list(range(SUBSET))
    [decided] = first[0]["decisions"]
    effective, even = decided["effective"], [B // 2, B // 2]
    assert (decided["epoch"], decided["step"]) == (0, 4) and decided["sizes"] != even
    assert 6 < effective < STEPS, f"the decision took effect at {effective}: the checkpoint is not before it"
    for rank, run in enumerate(second):
        sizes = dict(map(tuple, run["batches"]))  # step -> this rank's batch size
        assert sorted(sizes) == list(range(6, 2 * STEPS))
        assert [sizes[s] for s in range(6, effective)] == [even[rank]] * (effective - 6)
        assert sizes[effective] == decided["sizes"][rank]


def test_trainer_example_accumulates_per_rank_counts_and_covers_every_sample(tmp_path):
    """--grad-accum 4: micro-batches of 32 / (2 x 4) = 4 samples; the slow rank runs far fewer of them per step, and
    the loss falls as the plain Trainer's with the same B = 32 and G = 4 (hf_trainer_baseline.py --grad-accum 4)."""
    ranks = _launch("hf_trainer.py", tmp_path, *HETERO, "--grad-accum", "4", "--out", str(tmp_path / "out"))
    base = _launch("hf_trainer_baseline.py", tmp_path, "--grad-accum", "4", "--out", str(tmp_path / "base"),
                   name="base")
    for epoch in ("0", "1"):
        assert sorted(ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]) == list(range(SUBSET))
    d = ranks[0]["decisions"]
    assert d == ranks[1]["decisions"] and len(d) == 4
    fast, slow = (size // 4 for size in d[-1]["sizes"])
    assert fast + slow == 8 and slow <= fast / 2, f"micro-batch counts {fast} and {slow}"
    assert all(size == 4 for rank in ranks for _, size in rank["batches"])  # every forward one micro-batch of 4
    losses, baseline = ranks[0]["losses"], base[0]["losses"]
    assert len(losses) == len(baseline) == 2 * STEPS // 5  # the Trainer logs at the same optimizer steps
    assert losses[-1] < 0.9 * losses[0] and baseline[-1] < 0.9 * baseline[0]
    assert abs(losses[-1] - baseline[-1]) < 0.1 * baseline[-1], f"loss {losses} against the baseline's {baseline}"


def test_the_ported_run_clm_accumulates_per_rank_and_learns(tmp_path):
    """examples/run_clm.py (transformers' run_clm.py ported): a config-built GPT-2, a BPE tokenizer trained on the
    local text, G = 2 micro-batches of 4 on average per rank; the slow rank ends with fewer micro-batches, the
    Trainer counts the plain Trainer's optimizer steps (2 epochs of 256 // 16) and the loss falls."""
    out = tmp_path / "clm"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--log-dir=/dev/null",
           str(ROOT / "examples" / "run_clm.py"), "--train_file", str(TEXT), "--model_type", "gpt2",
           "--config_overrides", "n_embd=64,n_layer=2,n_head=2,n_positions=64,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
           "--block_size", "32", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
           "--num_train_epochs", "2", "--max_train_samples", "256", "--learning_rate", "3e-3", "--do_train",
           "--do_eval", "--output_dir", str(out), "--use_cpu", "--hetero", "1:slowdown=3,1:delay=0.05",
           "--rebalance_every", "5",
           "--logging_steps", "4", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    p = bounded(cmd, {**clean_env(threads="1"), "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert p.returncode == 0, f"run_clm.py exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 * 256 // 16
    logs = [h for h in state["log_history"] if "loss" in h]
    assert logs[-1]["loss"] < 0.9 * logs[0]["loss"]
    assert logs[-1]["hetero/rank1/batch_size"] < logs[-1]["hetero/rank0/batch_size"] / 2  # in samples: 4 k_i
    assert json.loads((out / "eval_results.json").read_text())["perplexity"] < math.exp(logs[0]["loss"])
