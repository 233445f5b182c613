"""The HF Trainer on FSDP2 (TrainingArguments fsdp=True, fsdp_config fsdp_version 2: accelerate's plugin and its
fully_shard of the decoder layers, a tail group and the root) with hetero's weighted reduce-scatter, on 2 gloo ranks:
one optimizer step with unequal sizes equals one step of the plain single-process Trainer on the union, padded rows
included, in both loss conventions ((a) num_items_in_batch averaged across devices, (b) each rank's own count,
weighted by its share of the tokens), with accumulation (G = 2, k = [1, 3] micro-batches of 2) and without (sizes
[2, 6]); the weight doubled or removed is caught. Split by tokens (test_hf_tokens.py's documents: 16 a step in
micro-batches of 2 rows, and a token budget packed one row at a time), three steps equal the plain Trainer in one
process on each step's documents.

accelerate 1.15 keeps no FSDP plugin on CPU ranks (accelerate/state.py, AcceleratorState.__init__: the FSDP branch
sits under the accelerator device types; CPU ranks are MULTI_CPU) and the Trainer then trains DDP: HeteroTrainer
refuses that in one line, which this test checks first. The rest runs with that one assignment made after
AcceleratorState's own __init__ (`_fsdp_on_cpu`), the largest part of the path that runs on CPU: the Trainer's
FSDP2 prepare, its loop, and hetero's reduce-scatter, probe and micro-batch schedule."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
os.environ["HF_HUB_OFFLINE"] = "1"  # noqa: E402  (before transformers reads it)
import accelerate.state  # noqa: E402
import test_hf_tokens as docs  # noqa: E402
import transformers as tf  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from test_hf import TokenRows, llama  # noqa: E402
from test_hf_accumulation import Doubled, Removed, Union  # noqa: E402

import hetero  # noqa: E402
from hetero.integrations.hf import HeteroTrainer  # noqa: E402
from hetero.integrations.hf.fsdp import CPU_REFUSAL  # noqa: E402

from helpers import max_diff, spawned  # noqa: E402

pytestmark = [pytest.mark.launch, pytest.mark.slow]  # 6 FSDP2 Trainer runs in two processes and their references
B, LR, SEED = 8, 0.5, 3
FSDP = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}

# name: (micro-batch m, G, sizes, average_tokens_across_devices, trainer class)
CASES = {
    "a": (2, 2, [2, 6], True, HeteroTrainer),       # k = [1, 3]: the Trainer's gathered count, weight 1/world
    "b": (2, 2, [2, 6], False, HeteroTrainer),      # each rank's own count: its share of the step's tokens
    "b_whole": (4, 1, [2, 6], False, HeteroTrainer),  # no accumulation, unequal batches
    "a_doubled": (2, 2, [2, 6], True, Doubled),
    "b_doubled": (2, 2, [2, 6], False, Doubled),
    "b_removed": (2, 2, [2, 6], False, Removed),
}
# split by tokens (issue 49; test_hf_tokens.py's documents of 2-32 tokens, three steps split by the prior, equal
# cost, the same in every run), the Trainer's default where the lengths vary: name: (collator, token budget or None
# for the global batch 16, per_device_train_batch_size, G)
TOKENS = {"tokens-accumulated2-padded": ("padded", None, 2, 4),
          "budget-accumulated-packed": ("packed", docs.BUDGET, 1, 8)}


def _fsdp_on_cpu() -> None:
    """The plugin accelerate drops on CPU ranks kept, and the FSDP type set, after AcceleratorState's __init__."""
    init = accelerate.state.AcceleratorState.__init__

    def kept(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
    accelerate.state.AcceleratorState.__init__ = kept


def _args(out: str, m: int, g: int, average: bool, fsdp: bool) -> tf.TrainingArguments:
    return tf.TrainingArguments(output_dir=out, per_device_train_batch_size=m, gradient_accumulation_steps=g,
                                max_steps=1, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
                                max_grad_norm=0.0, average_tokens_across_devices=average, use_cpu=True,
                                fsdp=fsdp, fsdp_config=FSDP if fsdp else None, save_strategy="no",
                                logging_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False)


def _trainer(cls, out: str, m: int, g: int, sizes: list[int], average: bool) -> HeteroTrainer:
    bal = hetero.Balance(global_batch=B, micro_batch=m if g > 1 else 0, seed=SEED)
    bal.replay({0: [sizes]})
    return cls(model=llama(), args=_args(out, m, g, average, True), train_dataset=TokenRows(), balance=bal)


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    try:  # accelerate as installed: no FSDP on CPU ranks
        _trainer(HeteroTrainer, f"{out}/cpu", 2, 2, [2, 6], True).train()
    except ValueError as e:
        result["cpu"] = str(e)
    _fsdp_on_cpu()
    for name, (m, g, sizes, average, cls) in CASES.items():
        trainer = _trainer(cls, f"{out}/{name}", m, g, sizes, average)
        trainer.train()
        model = trainer.model_wrapped
        result[name] = {"fsdp": type(model).__name__, "sizes": trainer.balance.last_sizes,
                        "steps": trainer.state.global_step,
                        "params": [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]}
    for name, (collator, budget, m, g) in TOKENS.items():
        bal = hetero.Balance(global_batch=None if budget else docs.B, token_budget=budget, seed=docs.SEED,
                             collator=collator, micro_batch=m)  # the prior's split: the same every run
        trainer = HeteroTrainer(model=docs._model(), balance=bal, train_dataset=docs.Docs(),
                                data_collator=docs._collator(collator),
                                args=docs._args(f"{out}/{name}", m, gradient_accumulation_steps=g, fsdp=True,
                                                fsdp_config=FSDP))
        trainer.train()
        model = trainer.model_wrapped
        result[name] = {"fsdp": type(model).__name__, "steps": trainer.state.global_step,
                        "params": [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return spawned(_worker, tmp_path_factory.mktemp("hf_fsdp"))


@pytest.mark.parametrize("case", TOKENS)
def test_the_trainer_on_fsdp2_split_by_tokens_steps_as_one_process_on_each_steps_documents(trained, tmp_path, case):
    """Three steps of HeteroTrainer on FSDP2 with a collator (a global batch of 16 documents in micro-batches of 2
    rows, G = 4; a token budget's steps of 17, 15 and 16 documents packed one row at a time, G = 8): the parameters
    equal the plain Trainer in one process on each step's documents (test_hf_tokens.py's references)."""
    want = docs.budget_steps(Path(tmp_path)) if TOKENS[case][1] else docs.union_steps(str(tmp_path))
    for rank in trained:
        got = rank[case]
        assert got["fsdp"].startswith("FSDP") and got["steps"] == docs.STEPS
        assert max_diff(got["params"], want) < 1e-5, f"{case}: not each step's documents"


def test_fsdp_on_cpu_ranks_is_one_line(trained):
    assert [rank["cpu"] for rank in trained] == [CPU_REFUSAL] * 2


@pytest.mark.parametrize("case, wrongs", [("a", ["a_doubled"]), ("b", ["b_doubled", "b_removed"]),
                                          ("b_whole", [])])
def test_an_fsdp2_step_is_the_union_step_and_a_wrong_weight_is_caught(trained, tmp_path, case, wrongs):
    _, _, _, average, _ = CASES[case]
    args = _args(str(tmp_path), B, 1, average, False)
    reference = tf.Trainer(model=llama(), args=args, train_dataset=Union(TokenRows))
    reference.train()
    want = [p.detach().flatten() for p in reference.model.parameters()]
    for rank in trained:
        got = rank[case]
        assert got["fsdp"].startswith("FSDP") and got["sizes"] == CASES[case][2] and got["steps"] == 1
        assert max_diff(got["params"], want) < 1e-5, f"{case}: not the union's step"
        for wrong in wrongs:
            assert max_diff(rank[wrong]["params"], want) > 1e-3, f"{wrong}: not caught"
