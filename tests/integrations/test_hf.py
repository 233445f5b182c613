"""The Hugging Face integration (hetero.integrations.hf): one HeteroTrainer step with unequal sizes equals one
single-process step on the union of the batches, in both loss conventions, and a deliberately wrong weight (hetero's
b_i/B on top of the Trainer's token averaging; no weight at all; samples where tokens count) is caught. Two gloo
processes started by torch.multiprocessing.spawn, tiny models built from configs (no downloads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.launch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
os.environ["HF_HUB_OFFLINE"] = "1"  # noqa: E402  (before transformers reads it)
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

import hetero  # noqa: E402
from hetero.core.sampler import EpochPlan  # noqa: E402
from hetero.integrations.hf import HeteroTrainer  # noqa: E402

from helpers import ROOT, clean_env, max_diff, spawned  # noqa: E402  # noqa: E402

B, SIZES, T, VOCAB, LR, SEED = 8, [6, 2], 12, 16, 0.5, 3
VALID = [3 + (7 * i) % 10 for i in range(B)]  # valid label tokens per row: unequal, so token and sample shares differ


class TokenRows(torch.utils.data.Dataset):
    """B rows of T token ids; row i's labels past VALID[i] are padding (-100)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(VOCAB, (B, T), generator=g)
        self.labels = torch.where(torch.arange(T) < torch.tensor(VALID)[:, None], self.ids, -100)

    def __len__(self):
        return B

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Points(torch.utils.data.Dataset):
    """B points in 4 dimensions with a target each (a per-sample mean loss)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(B, 4, generator=g), torch.randn(B, generator=g)

    def __len__(self):
        return B

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class MeanLoss(torch.nn.Module):
    """A model whose loss is its batch's own mean, with no num_items_in_batch: convention (b)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": F.mse_loss(self.lin(x).squeeze(-1), labels)}


def llama() -> LlamaForCausalLM:
    """A one-layer Llama of width 16 (a *ForCausalLM class: the Trainer counts its shifted labels, as its loss does;
    for GPT2LMHeadModel transformers 5 counts every label, a constant off the model's own mean)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T))


# name: (model, data, average_tokens_across_devices, wrong weight or None)
CASES = {
    "a": (llama, TokenRows, True, None),                # the Trainer's token averaging: hetero weights 1/world
    "a_doubled": (llama, TokenRows, True, "samples"),   # b_i/B on top of it: weighted twice
    "b": (MeanLoss, Points, False, None),              # a per-rank mean: hetero weights b_i/B
    "b_removed": (MeanLoss, Points, False, "mean"),    # no weight: DDP's plain mean
    "b_tokens": (llama, TokenRows, False, None),        # per-rank token means: the valid-token share
    "b_tokens_samples": (llama, TokenRows, False, "samples"),  # the sample share where tokens count
}


class WrongWeight(HeteroTrainer):
    """A deliberately wrong weight, to show that the exactness test tells it apart."""
    wrong = "samples"

    def gradient_weight(self, inputs, num_items_in_batch) -> float:
        bal = self.balance
        return bal.last_sizes[bal.rank] / bal.settings.global_batch if self.wrong == "samples" else 1.0 / bal.world


def _exact_worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    for name, (make, data, average, wrong) in CASES.items():
        bal = hetero.Balance(global_batch=B, seed=SEED)
        bal.replay({0: [SIZES]})
        args = TrainingArguments(output_dir=f"{out}/{name}", per_device_train_batch_size=B // 2, max_steps=1,
                                 optim="sgd", learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0,
                                 average_tokens_across_devices=average, use_cpu=True, save_strategy="no",
                                 logging_strategy="no", report_to=[], disable_tqdm=True,
                                 ddp_find_unused_parameters=False)
        cls = HeteroTrainer if wrong is None else type("Wrong", (WrongWeight,), {"wrong": wrong})
        # a per-sample mean over one label per row: its count (rows = tokens) is said, never told (hf_loss)
        trainer = cls(model=make(), args=args, train_dataset=data(), balance=bal,
                      loss_mean="rows" if data is Points else None)
        trainer.train()
        result[name] = [p.detach().flatten().tolist() for p in trainer.model.parameters()]
        result["sizes"] = bal.last_sizes
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _reference(make, data) -> list[torch.Tensor]:
    """One single-process SGD step on the union of the two ranks' batches (the global batch's loss)."""
    window = EpochPlan(B, B, SEED, 0).perm.tolist()
    ds = data()
    batch = {k: torch.stack([ds[i][k] for i in window]) for k in ds[0]}
    model = make()
    model(**batch)["loss"].backward()  # Llama: the mean over every valid (shifted) label token of the batch
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return [p.detach().flatten() for p in model.parameters()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return spawned(_exact_worker, tmp_path_factory.mktemp("hf_exact"))


@pytest.mark.parametrize("case, wrong", [("a", "a_doubled"), ("b", "b_removed"), ("b_tokens", "b_tokens_samples")])
def test_a_trainer_step_is_the_global_batch_step_and_a_wrong_weight_is_caught(trained, case, wrong):
    make, data, _, _ = CASES[case]
    want = _reference(make, data)
    for rank in trained:
        assert rank["sizes"] == SIZES
        assert max_diff(rank[case], want) < 1e-5, f"{case}: not the global batch's step"
        assert max_diff(rank[wrong], want) > 1e-3, f"{wrong}: the test would not catch this weight"


@pytest.mark.parametrize("setting, line", [
    ({"gradient_accumulation_steps": 2}, "hetero: gradient_accumulation_steps 2 needs Balance(micro_batch="
                                         "per_device_train_batch_size=4): hetero then decides each rank's count of "
                                         "micro-batches (got micro_batch=0)"),
    ({"per_device_train_batch_size": 3}, "hetero: per_device_train_batch_size x gradient_accumulation_steps x world "
                                         "(3 x 1 x 2) must equal the Balance's global_batch 8: the plain Trainer's "
                                         "batch, which it logs and schedules with; hetero decides each rank's share"),
    ({"train_sampling_strategy": "group_by_length"}, "hetero: train_sampling_strategy='group_by_length' asks for "
                                                     "batches by length, and hetero splits this run by counts (the "
                                                     "items have no 'input_ids' to measure): leave it 'random'"),
    ({"world": 1}, "hetero: HeteroTrainer needs several processes (torchrun --nproc-per-node=N); one process has "
                   "nothing to balance: use transformers.Trainer"),
])
def test_a_trainer_setting_hetero_cannot_honour_is_one_line(monkeypatch, tmp_path, setting, line):
    """Refused in train() before anything runs, alike on every rank (here one process plays rank 0 of two)."""
    setting = dict(setting)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(setting.pop("world", 2)))
    bal = hetero.Balance(global_batch=B)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")  # the Trainer itself stays one process
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             **{"per_device_train_batch_size": B // 2, **setting})
    trainer = HeteroTrainer(model=MeanLoss(), args=args, train_dataset=Points(), balance=bal)
    with pytest.raises(ValueError) as e:
        trainer.train()
    assert str(e.value) == line


@pytest.mark.parametrize("context", ["forkserver", "spawn", None])
def test_the_train_loader_starts_its_workers_as_the_trainer_says(monkeypatch, tmp_path, context):
    """dataloader_multiprocessing_context reaches hetero's train DataLoader as the Trainer's own (None: torch's)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=B)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=B // 2,
                             dataloader_num_workers=2, dataloader_multiprocessing_context=context)
    trainer = HeteroTrainer(model=MeanLoss(), args=args, train_dataset=Points(), balance=bal)
    method = lambda loader: loader.multiprocessing_context and loader.multiprocessing_context.get_start_method()  # noqa
    assert method(trainer.get_train_dataloader()) == context == method(trainer.get_eval_dataloader(Points()))


@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
def test_a_download_while_offline_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--pretrained", "gpt2"], cwd=ROOT,
                       env={**clean_env(), "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "hetero: error: --pretrained gpt2: not in the local Hugging Face cache and downloads are off "
        "(HF_HUB_OFFLINE=1): build the model from a config or fill the cache first"]


def test_set_weight_replaces_the_step_weight_and_needs_a_step(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=B)
    bal.replay({0: [SIZES]})
    bal.batch_sampler(B)
    bal.set_epoch(0)
    with pytest.raises(RuntimeError, match="outside `with bal.step"):
        bal.set_weight(0.5)
    bal.begin_step(0)
    assert bal.engine.running().weight == SIZES[1] / B      # b_i/B, replaced below for this step only
    bal.set_weight(0.5)
    assert bal.engine.running().weight == 0.5


@pytest.mark.parametrize("balance", ["edp", None, 32])
def test_a_balance_that_is_not_a_balance_is_one_line(tmp_path, balance):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError) as e:
        HeteroTrainer(model=MeanLoss(), args=args, train_dataset=Points(), balance=balance)
    assert str(e.value) == (f"hetero: HeteroTrainer(balance=...) takes a hetero.Balance, not {type(balance).__name__} "
                            f"{balance!r}: build one, e.g. hetero.Balance(scheme=\"edp\", global_batch=32)")


@pytest.mark.parametrize("loss_mean", ["mean", "samples", 1])
def test_a_loss_mean_that_is_none_of_the_kinds_is_one_line(tmp_path, loss_mean):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError) as e:
        HeteroTrainer(model=MeanLoss(), args=args, train_dataset=Points(), balance=hetero.Balance(global_batch=B),
                      loss_mean=loss_mean)
    assert str(e.value) == (f"hetero: HeteroTrainer(loss_mean={loss_mean!r}) takes one of 'trainer', 'tokens', "
                            f"'shifted', 'rows' or None (found from the loss)")
