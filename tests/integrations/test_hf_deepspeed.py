"""The HF Trainer with a DeepSpeed config (TrainingArguments(deepspeed=...): accelerate's DeepSpeed plugin, the
engine hetero's DeepSpeed door attaches to) on 2 CPU ranks (gloo, DS_ACCELERATOR=cpu), ZeRO-2 and ZeRO-3, with
gradient_accumulation_steps G = 4 and per_device_train_batch_size 1 (the common LLM setting): hetero's per-rank
micro-batch counts k = [2, 6] (global batch 8 = 2 ranks x 1 x 4). One optimizer step equals one step of the plain
single-process Trainer on the union with the same DeepSpeed config (world 1, per_device_train_batch_size 8, G = 1),
in every loss convention HeteroTrainer handles; the weight doubled or removed is caught, and the two ranks'
parameters stay identical. The reference runs in a process of its own (accelerate's state is a singleton).

The same launch runs Accelerate's DeepSpeed plugin in a plain loop (hetero.integrations.accelerate.prepare, each
micro-batch in `with bal.step():`, the optimizer stepped where bal.sync_now), micro-batches of 2 with counts [1, 3]
on ZeRO-2 and ZeRO-3: one step equals the single-process run with the same plugin on the union, and a doubled
weight is caught. And the Trainer split by tokens (test_hf_tokens.py's documents, a global batch or a token budget,
micro-batches accumulated): three steps equal the plain Trainer in one process on each step's documents."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
os.environ["HF_HUB_OFFLINE"] = "1"  # noqa: E402  (before transformers reads it)
os.environ["DS_ACCELERATOR"] = "cpu"  # noqa: E402  (before deepspeed picks its accelerator; spawned ranks too)
import test_hf_tokens as docs  # noqa: E402
import transformers as tf  # noqa: E402
from test_hf import MeanLoss, Points, TokenRows, llama  # noqa: E402
from test_hf_accumulation import Doubled, Removed, Union  # noqa: E402
from test_hf_losses import own_mean  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hetero  # noqa: E402
from hetero.integrations.accelerate import prepare  # noqa: E402
from hetero.integrations.hf import HeteroTrainer  # noqa: E402

from helpers import max_diff, spawned  # noqa: E402

# a dozen DeepSpeed Trainer runs in two processes and their references
pytestmark = [pytest.mark.launch, pytest.mark.slow]
B, M, G, SIZES, LR, SEED = 8, 1, 4, [2, 6], 0.5, 3  # k = [2, 6] micro-batches of 1

# name: (ZeRO stage, model, data, average_tokens_across_devices, compute_loss_func, trainer class)
CASES = {
    "2:a": (2, llama, TokenRows, True, None, HeteroTrainer),         # the Trainer's count, gathered: 1/world
    "2:b": (2, llama, TokenRows, False, None, HeteroTrainer),        # the Trainer's count per rank: its share
    "2:rows": (2, MeanLoss, Points, False, None, HeteroTrainer),     # a per-sample mean: 1/B per micro-batch of 1
    "2:shifted": (2, llama, TokenRows, True, own_mean, HeteroTrainer),  # a token mean of its own
    "3:a": (3, llama, TokenRows, True, None, HeteroTrainer),
    "3:b": (3, llama, TokenRows, False, None, HeteroTrainer),
    "3:rows": (3, MeanLoss, Points, False, None, HeteroTrainer),
    "3:shifted": (3, llama, TokenRows, True, own_mean, HeteroTrainer),
    "2:a_doubled": (2, llama, TokenRows, True, None, Doubled),
    "2:rows_removed": (2, MeanLoss, Points, False, None, Removed),
    "3:b_doubled": (3, llama, TokenRows, False, None, Doubled),
}
# ZeRO-3 partitions every parameter (none kept whole for being small): each forward and backward gathers them
PARTITIONED = {"stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0}
WRONGS = {"2:a": ["2:a_doubled"], "2:rows": ["2:rows_removed"], "3:b": ["3:b_doubled"]}
# split by tokens (issue 49), test_hf_tokens.py's documents of 2-32 tokens, three steps split by the prior (equal
# cost), the same in every run (a split the clock times moves with the host's load, and with it the counts):
# name: (ZeRO stage, collator, token budget or None for its global batch 16, per_device_train_batch_size, G).
# ZeRO-3 in micro-batches of 2 rows: the ranks' counts of them differ in a step, and every rank must run the most
TOKENS = {"3:tokens-accumulated2-padded": (3, "padded", None, 2, 4),
          "2:budget-accumulated-packed": (2, "packed", docs.BUDGET, 1, 8),
          "3:budget-accumulated2-padded": (3, "padded", docs.BUDGET, 2, 4)}


def config(stage: int) -> dict:
    """The DeepSpeed config as HF users write it: the batch numbers "auto" (the Trainer fills them)."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, **(PARTITIONED if stage == 3 else {})}}


def _args(out: str, stage: int, average: bool, batch: int, accumulate: int) -> tf.TrainingArguments:
    return tf.TrainingArguments(output_dir=out, per_device_train_batch_size=batch,
                                gradient_accumulation_steps=accumulate, max_steps=1, optim="sgd", learning_rate=LR,
                                lr_scheduler_type="constant", max_grad_norm=0.0, average_tokens_across_devices=average,
                                use_cpu=True, deepspeed=config(stage), save_strategy="no", logging_strategy="no",
                                report_to=[], disable_tqdm=True, remove_unused_columns=False)


def _params(trainer) -> list[list[float]]:
    return _params_of(trainer.model)


# Accelerate's DeepSpeed plugin: name: (ZeRO stage, weight factor); micro-batches of 2, counts k = [1, 3]
LOOPS = {"acc2": (2, 1), "acc3": (3, 1), "acc2_doubled": (2, 2)}
LOOP_M, LOOP_SIZES = 2, [2, 6]


def _accelerator(stage: int, micro: int):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state()  # a plugin per Accelerator in one process, as accelerate's own tests do

    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                                           "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
                                           "zero_optimization": {"stage": stage,
                                                                 **(PARTITIONED if stage == 3 else {})}})
    return Accelerator(deepspeed_plugin=plugin)  # not cpu=True: accelerate drops the plugin then (DS_ACCELERATOR)


def _loop(stage: int, factor: float) -> dict:
    """One optimizer step of docs/deepspeed.md's Accelerate loop, k = [1, 3] micro-batches of 2."""
    bal = hetero.Balance(global_batch=B, micro_batch=LOOP_M, seed=SEED)
    bal.replay({0: [LOOP_SIZES]})
    accelerator = _accelerator(stage, B // 2)  # the config's nominal micro-batch: train_batch_size is then B
    model = MeanLoss()
    model, opt = prepare(accelerator, bal, model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = DataLoader(Points(), batch_sampler=bal.batch_sampler(B))
    bal.set_epoch(0)
    micro = []
    for batch in loader:
        with bal.step():
            if factor != 1:
                bal.set_weight(bal.engine.running().weight * factor)
            accelerator.backward(model(**batch)["loss"])
            micro.append(len(batch["x"]))
            if bal.sync_now:
                opt.step()
                opt.zero_grad()
    return {"engine": type(model).__name__, "micro": micro, "ds_steps": model.global_steps,
            "ds_samples": model.global_samples, "params": _params_of(model.module)}


def _params_of(module) -> list[list[float]]:
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):  # ZeRO-3: whole
        return [p.detach().float().flatten().tolist() for p in params]


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    for name, (stage, make, data, average, func, cls) in CASES.items():
        bal = hetero.Balance(global_batch=B, micro_batch=M, seed=SEED)
        bal.replay({0: [SIZES]})
        trainer = cls(model=make(), args=_args(f"{out}/{name}", stage, average, M, G), train_dataset=data(),
                      compute_loss_func=func, balance=bal, loss_mean="rows" if data is Points else None)
        trainer.train()
        engine = trainer.model_wrapped
        result[name] = {"engine": type(engine).__name__, "stage": engine.zero_optimization_stage(),
                        "sizes": bal.last_sizes, "steps": trainer.state.global_step,
                        "ds_steps": engine.global_steps, "ds_samples": engine.global_samples,
                        "params": _params(trainer)}
    for name, (stage, factor) in LOOPS.items():
        result[name] = _loop(stage, factor)
    for name, (stage, collator, budget, m, g) in TOKENS.items():
        bal = hetero.Balance(global_batch=None if budget else docs.B, token_budget=budget, seed=docs.SEED,
                             collator=collator, micro_batch=m)  # the prior's split: the same every run
        sizes = Sizes(bal)
        trainer = HeteroTrainer(model=docs._model(), balance=bal, train_dataset=docs.Docs(), callbacks=[sizes],
                                data_collator=docs._collator(collator),
                                args=docs._args(f"{out}/{name}", m, gradient_accumulation_steps=g,
                                                deepspeed=config(stage)))
        trainer.train()
        result[name] = {"engine": type(trainer.model_wrapped).__name__, "sizes": sizes.seen,
                        "params": _params(trainer)}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


class Sizes(tf.TrainerCallback):
    """Every step's sizes, in documents per rank."""

    def __init__(self, bal):
        self.bal, self.seen = bal, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append([int(b) for b in self.bal.last_sizes])


def _reference(rank: int, out: str) -> None:
    """The plain Trainer with the same DeepSpeed config in one process: one step on the union (all 8 rows)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    for name, (stage, make, data, average, func, _) in CASES.items():
        if name in result or "_" in name.split(":")[1]:
            continue
        trainer = tf.Trainer(model=make(), args=_args(f"{out}/ref-{name}", stage, average, B, 1),
                             train_dataset=Union(data), compute_loss_func=func)
        trainer.train()
        result[name] = _params(trainer)
    for name, (stage, factor) in LOOPS.items():
        if factor == 1:  # the plugin's one process, all 8 rows in one backward
            accelerator = _accelerator(stage, B)
            model = MeanLoss()
            model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
            data = Points()
            accelerator.backward(model(data.x, data.y)["loss"])
            opt.step()
            result[name] = _params_of(model.module)
    # split by tokens: the plain Trainer without DeepSpeed, one process, each step's documents in one padded batch
    result["union"] = [p.tolist() for p in docs.union_steps(f"{out}/union")]
    result["budget"] = [p.tolist() for p in docs.budget_steps(Path(out) / "budget")]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[list[dict], dict]:
    ranks = spawned(_worker, tmp_path_factory.mktemp("hf_deepspeed"))
    ref, = spawned(_reference, tmp_path_factory.mktemp("hf_deepspeed_ref"), nprocs=1)
    return ranks, ref


@pytest.mark.parametrize("case", [c for c in CASES if "_" not in c.split(":")[1]])
def test_a_deepspeed_trainer_step_is_the_union_step_on_zero_2_and_3_and_a_wrong_weight_is_caught(trained, case):
    ranks, ref = trained
    r0, r1 = (rank[case] for rank in ranks)
    assert r0["engine"] == "DeepSpeedEngine" and r0["stage"] == int(case[0])
    assert r0["params"] == r1["params"], "the replicas drifted apart"
    for got in (r0, r1):
        assert got["sizes"] == SIZES and got["steps"] == 1
        assert got["ds_steps"] == 1 and got["ds_samples"] == B  # DeepSpeed counts the true global batch
    assert max_diff(r0["params"], [torch.tensor(p) for p in ref[case]]) < 1e-5, f"{case}: not the union's step"
    for wrong in WRONGS.get(case, []):
        assert max_diff(ranks[0][wrong]["params"], [torch.tensor(p) for p in ref[case]]) > 1e-3, f"{wrong}: missed"


@pytest.mark.parametrize("case", [c for c in LOOPS if "_" not in c])
def test_accelerates_deepspeed_plugin_in_a_plain_loop_is_the_union_step_and_a_doubled_weight_is_caught(trained,
                                                                                                       case):
    ranks, ref = trained
    assert ranks[0][case]["params"] == ranks[1][case]["params"], "the replicas drifted apart"
    for rank, got in enumerate(rank[case] for rank in ranks):
        assert got["engine"] == "DeepSpeedEngine" and got["micro"] == [LOOP_M] * (LOOP_SIZES[rank] // LOOP_M)
        assert got["ds_steps"] == 1 and got["ds_samples"] == B
        assert max_diff(got["params"], [torch.tensor(p) for p in ref[case]]) < 1e-6, f"{case}: not the union's step"
    if case == "acc2":
        assert max_diff(ranks[0]["acc2_doubled"]["params"], [torch.tensor(p) for p in ref[case]]) > 1e-3


def _example(tmp_path, name: str, *extra: str) -> list[dict]:
    """examples/hf_trainer.py under torchrun on 2 CPU ranks, rank 1 emulated 3x slower and 0.1 s a step."""
    import subprocess
    import sys

    from helpers import ROOT, bounded, clean_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--log-dir=/dev/null",
           str(ROOT / "examples" / "hf_trainer.py"), "--text", str(ROOT / "docs" / "huggingface.md"), "--subset",
           "320", "--global-batch", "32", "--epochs", "2", "--hetero", "1:slowdown=3,1:delay=0.1",
           "--rebalance-every", "5", "--out", str(tmp_path / "out"), *extra, "--record", str(tmp_path / name)]
    p: subprocess.CompletedProcess = bounded(cmd, {**clean_env(threads="1"), "HF_HUB_OFFLINE": "1",
                                                   "DS_ACCELERATOR": "cpu"}, timeout=420)
    assert p.returncode == 0, p.stderr[-6000:]
    return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(2)]


def test_the_trainer_example_on_zero_3_resumes_from_its_checkpoint_with_its_counts_and_coverage(tmp_path):
    """examples/hf_trainer.py --deepspeed 3 --grad-accum 4 (micro-batches of 4, k_i per rank): stopped at the
    checkpoint after step 6 (DeepSpeed's files and hetero's in checkpoint-6) and resumed from it. The resumed run's
    micro-batch counts at step 6 are the ones in force before the stop (decided at step 4, the slow rank's fewer than
    the even 4), and epoch 0, counted over both runs, and epoch 1 cover every row once."""
    first = _example(tmp_path, "first", "--deepspeed", "3", "--grad-accum", "4", "--max-steps", "6",
                     "--save-steps", "6")
    assert (tmp_path / "out" / "checkpoint-6" / "hetero_balance.pt").is_file()
    assert (tmp_path / "out" / "checkpoint-6" / "global_step6").is_dir()  # DeepSpeed's own checkpoint
    second = _example(tmp_path, "second", "--deepspeed", "3", "--grad-accum", "4", "--resume")

    def counts(run: dict) -> dict[int, int]:  # step -> this rank's micro-batches in it
        out: dict[int, int] = {}
        for step, _ in run["batches"]:
            out[step] = out.get(step, 0) + 1
        return out
    for rank in range(2):
        before, after = counts(first[rank]), counts(second[rank])
        assert sorted(after) == list(range(6, 20)) and after[6] == before[5]
    assert counts(second[1])[6] < 4 < counts(second[0])[6]  # the slow rank's fewer, carried over the stop
    epoch0 = [i for run in (first, second) for rank in run for i in rank["seen"].get("0", [])]
    assert sorted(epoch0) == list(range(320))
    assert sorted(second[0]["seen"]["1"] + second[1]["seen"]["1"]) == list(range(320))


@pytest.mark.parametrize("case", TOKENS)
def test_the_trainer_split_by_tokens_on_zero_2_and_3_steps_as_one_process_on_each_steps_documents(trained, case):
    """Three steps of HeteroTrainer with a DeepSpeed config and a collator (a token budget too), the common setting
    of micro-batches accumulated: the parameters equal the plain Trainer in one process on each step's documents
    (test_hf_tokens.py's references, no DeepSpeed), and the two ranks' stay identical. With micro-batches of 2 rows on
    ZeRO-3 the prior's split gives the ranks different counts of them in some step (9 and 7 rows: 5 and 4; the
    budget's 5 and 12 rows: 3 and 6), so the padding ran."""
    ranks, ref = trained
    r0, r1 = (rank[case] for rank in ranks)
    assert r0["engine"] == "DeepSpeedEngine" and r0["params"] == r1["params"], "the replicas drifted apart"
    budget, m = TOKENS[case][2], TOKENS[case][3]
    want = ref["budget" if budget else "union"]
    assert [sum(s) for s in r0["sizes"]] == ([17, 15, 16] if budget else [docs.B] * docs.STEPS)
    assert max_diff(r0["params"], [torch.tensor(p) for p in want]) < 1e-5, f"{case}: not each step's documents"
    if m > 1:
        assert any(-(-a // m) != -(-b // m) for a, b in r0["sizes"]), r0["sizes"]
