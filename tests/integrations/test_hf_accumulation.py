"""The HF Trainer with gradient_accumulation_steps G = 2 and hetero's per-rank micro-batch counts k = [1, 3]
(micro_batch m = per_device_train_batch_size = 2, global batch 8 = 2 ranks x m x G): one optimizer step equals one
step of the plain single-process Trainer on the union of the micro-batches, padded rows included, in each loss
convention; the weighting doubled or removed is caught. Removed (each rank's own mean over its k_i micro-batches,
the ranks weighted alike) is also what treating the counts as equal gives: equal counts weight every micro-batch
of m samples alike, which is exact, so no wrong result stems from the counts alone."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
os.environ["HF_HUB_OFFLINE"] = "1"  # noqa: E402  (before transformers reads it)
import transformers as tf  # noqa: E402
from test_hf import MeanLoss, Points, TokenRows, llama  # noqa: E402
from test_hf_losses import own_mean  # noqa: E402

import hetero  # noqa: E402
from hetero.core.sampler import EpochPlan  # noqa: E402
from hetero.integrations.hf import HeteroTrainer  # noqa: E402

from helpers import max_diff, spawned  # noqa: E402

# 2 x 9 Trainer steps in two processes and their references: about a minute
pytestmark = [pytest.mark.launch, pytest.mark.slow]
B, M, G, SIZES, LR, SEED = 8, 2, 2, [2, 6], 0.5, 3  # k = [1, 3] micro-batches of 2


class Doubled(HeteroTrainer):
    def gradient_weight(self, inputs, num_items_in_batch) -> float:
        return super().gradient_weight(inputs, num_items_in_batch) * 2


class Removed(HeteroTrainer):
    def gradient_weight(self, inputs, num_items_in_batch) -> float:
        return 1.0 / self.balance.world  # DDP's plain mean of what each rank accumulated


# name: (model, data, average_tokens_across_devices, compute_loss_func, trainer class)
CASES = {
    "a": (llama, TokenRows, True, None, HeteroTrainer),          # the Trainer's count, gathered: weight 1/world
    "b": (llama, TokenRows, False, None, HeteroTrainer),         # the Trainer's count per rank: its share
    "rows": (MeanLoss, Points, False, None, HeteroTrainer),      # a per-sample mean: b_i/B, m/b_i per micro-batch
    "shifted": (llama, TokenRows, True, own_mean, HeteroTrainer),  # a token mean of its own, scaled by the Trainer
    "a_doubled": (llama, TokenRows, True, None, Doubled),
    "rows_doubled": (MeanLoss, Points, False, None, Doubled),
    "rows_removed": (MeanLoss, Points, False, None, Removed),
    "shifted_removed": (llama, TokenRows, True, own_mean, Removed),
}


def _args(out: str, average: bool, batch: int, accumulate: int) -> tf.TrainingArguments:
    return tf.TrainingArguments(output_dir=out, per_device_train_batch_size=batch,
                                gradient_accumulation_steps=accumulate, max_steps=1, optim="sgd", learning_rate=LR,
                                lr_scheduler_type="constant", max_grad_norm=0.0, average_tokens_across_devices=average,
                                use_cpu=True,
                                save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True,
                                remove_unused_columns=False, ddp_find_unused_parameters=False)


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    for name, (make, data, average, func, cls) in CASES.items():
        bal = hetero.Balance(global_batch=B, micro_batch=M, seed=SEED)
        bal.replay({0: [SIZES]})
        trainer = cls(model=make(), args=_args(f"{out}/{name}", average, M, G), train_dataset=data(),
                      compute_loss_func=func, balance=bal, loss_mean="rows" if data is Points else None)
        try:
            trainer.train()
        except (RuntimeError, ValueError) as e:
            result[name] = str(e).splitlines()[0]
            continue
        result[name] = {"sizes": bal.last_sizes, "steps": trainer.state.global_step,
                        "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()]}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return spawned(_worker, tmp_path_factory.mktemp("hf_accumulation"))


class Union(torch.utils.data.Dataset):
    def __init__(self, data):
        ds, self.rows = data(), EpochPlan(B, B, SEED, 0).perm.tolist()
        self.items = [ds[i] for i in self.rows]

    def __len__(self):
        return B

    def __getitem__(self, i):
        return self.items[i]


def _reference(make, data, average, func, out) -> list[torch.Tensor]:
    """The plain transformers.Trainer in one process, one SGD step on the union (all 8 rows at once)."""
    trainer = tf.Trainer(model=make(), args=_args(str(out), average, B, 1), train_dataset=Union(data),
                         compute_loss_func=func)
    trainer.train()
    return [p.detach().flatten() for p in trainer.model.parameters()]


@pytest.mark.parametrize("case, wrongs", [("a", ["a_doubled"]), ("b", []),
                                          ("rows", ["rows_doubled", "rows_removed"]),
                                          ("shifted", ["shifted_removed"])])
def test_an_accumulated_step_is_the_union_step_and_a_wrong_weight_or_count_is_caught(trained, tmp_path, case, wrongs):
    make, data, average, func, _ = CASES[case]
    want = _reference(make, data, average, func, tmp_path)
    for rank in trained:
        got = rank[case]
        assert got["sizes"] == SIZES and got["steps"] == 1
        assert max_diff(got["params"], want) < 1e-5, f"{case}: not the union's step"
        for wrong in wrongs:
            bad = rank[wrong]
            assert isinstance(bad, str) or max_diff(bad["params"], want) > 1e-3, f"{wrong}: not caught"
