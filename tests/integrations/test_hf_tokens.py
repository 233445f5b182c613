"""The HF Trainer split by tokens (issue 49): HeteroTrainer on a Balance with a collator reads the samples' lengths
from the data set (as transformers' batch_rebalance does), and three SGD steps on 2 gloo ranks of a tiny Llama, each
rank's rows chosen by their fitted cost, equal three steps of the plain single-process Trainer on the unpacked union
of each step's window (padded rows): with rows padded, and packed by DataCollatorWithFlattening, in one batch per
rank and in micro-batches of one row (per_device_train_batch_size=1, gradient_accumulation_steps=8) (transformers keeps
the packed samples apart by their position_ids, on CPU too). A model that drops the position_ids (no document
mask) misses it: the negative control. Under a token budget (steps of 17, 15 and 16 documents) the same Trainer, in
one batch per rank and accumulating rows one at a time, equals the plain Trainer run step by step on each step's
documents. Packed batches without position_ids are refused in one line. A Balance built
without a collator splits by tokens all the same (the Trainer's default where the lengths vary), with the
Trainer's collator's layout; where they do not vary, or a replay fixes the sizes, it splits by counts. A run by
tokens is replayed from its decisions (through JSON): every forward gets the run's rows, on every rank."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.launch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
os.environ["HF_HUB_OFFLINE"] = "1"  # noqa: E402  (before transformers reads it)
import transformers as tf  # noqa: E402

import hetero  # noqa: E402
from hetero.core.sampler import EpochPlan  # noqa: E402
from hetero.integrations.hf import HeteroTrainer  # noqa: E402

from helpers import max_diff, spawned  # noqa: E402

N, B, T, VOCAB, LR, SEED, STEPS = 48, 16, 32, 16, 0.5, 5, 3
CASES = {"padded": "padded", "packed": "packed", "packed-without-document-mask": "packed",
         "accumulated-padded": "padded", "accumulated-packed": "packed",  # per_device_train_batch_size 1, G = 8
         "default-padded": None, "default-packed": None,  # a Balance without a collator: the Trainer's default
         "capped-accumulated-padded": "padded",  # rank 1 holds rows of at most CAP tokens (max_tokens)
         "capped-padded": "padded",  # no accumulation: rank 1's whole step (rows x the longest) within STEP_CAP
         "budget-padded": "padded", "budget-accumulated-packed": "packed"}  # Balance(token_budget=BUDGET)
CAP, STEP_CAP = 16, 64
BUDGET = 260  # the 757 tokens in 3 steps of about 252


def _longest(model) -> list[int]:
    """The longest row and the most padded tokens (rows x the longest) of any forward of `model`, kept in the list
    returned (a forward pre-hook: the model's signature, which the Trainer reads, stays the Llama's)."""
    seen = [0, 0]

    def hook(module, args, kwargs):
        seen[0] = max(seen[0], int(kwargs["attention_mask"].sum(1).max()))
        seen[1] = max(seen[1], int(kwargs["input_ids"].numel()))
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


class Unmasked(tf.LlamaForCausalLM):
    """A Llama that drops the packed row's position_ids: its samples attend to each other (the negative control)."""

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


def _model(cls=tf.LlamaForCausalLM):
    torch.manual_seed(0)
    return cls(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T))


class Docs(torch.utils.data.Dataset):
    """N token sequences of 2..T tokens (labels: the tokens; the model shifts them), in the order `only` gives."""

    def __init__(self, only: list[int] | None = None):
        rng = np.random.default_rng(0)
        ids = [rng.integers(1, VOCAB, int(n)).tolist() for n in rng.integers(2, T + 1, N)]
        self.items = [{"input_ids": ids[i], "labels": ids[i]} for i in (only if only is not None else range(N))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def padded(items: list[dict]) -> dict:
    """Rows padded on the right to the longest (labels -100 there), with the attention mask."""
    top = max(len(x["input_ids"]) for x in items)
    pad = [top - len(x["input_ids"]) for x in items]
    return {"input_ids": torch.tensor([x["input_ids"] + [0] * p for x, p in zip(items, pad)]),
            "attention_mask": torch.tensor([[1] * len(x["input_ids"]) + [0] * p for x, p in zip(items, pad)]),
            "labels": torch.tensor([x["labels"] + [-100] * p for x, p in zip(items, pad)])}


def _collator(case: str):
    return padded if case.endswith("padded") else tf.DataCollatorWithFlattening(return_position_ids=True)


def _args(out: str, batch: int, **kw) -> tf.TrainingArguments:
    return tf.TrainingArguments(**{"output_dir": out, "per_device_train_batch_size": batch, "max_steps": STEPS,
                                   "optim": "sgd", "learning_rate": LR, "lr_scheduler_type": "constant",
                                   "max_grad_norm": 0.0, "use_cpu": True, "save_strategy": "no",
                                   "logging_strategy": "no", "report_to": [], "disable_tqdm": True,
                                   "remove_unused_columns": False, "ddp_find_unused_parameters": False, **kw})


def _forwards(model, bal: hetero.Balance) -> list:
    """Every training forward's step (counted over the run) and input_ids as the model gets them (a forward pre-hook),
    kept in the list returned. The forwards in eval mode are left out: those of the first step's loss probe
    (hetero/integrations/hf/loss.py), which a run and its resume each make before their first step."""
    seen = []

    def hook(module, args, kwargs):
        if module.training:
            seen.append([bal.position.global_step, kwargs["input_ids"].tolist()])
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _swapped(decisions: list[dict]) -> list[dict]:
    """The record with the two ranks' fitted costs swapped: rank 0 the slower (the replay's negative control)."""
    return [{**d, "fixed_s": d["fixed_s"][::-1], "per_unit_s": d["per_unit_s"][::-1]} for d in decisions]


def _train(case: str, out: str, record: list[dict] | None = None, resume: str | None = None) -> dict:
    """One HeteroTrainer run of a case on this rank; with a record, bal.replay(record) of a run by tokens; the
    RESUMED cases save a checkpoint after step SAVED, which `resume` (a checkpoint folder) resumes from."""
    collator = CASES[case]
    micro = "accumulated" in case  # the common LLM setting: rows one at a time, accumulated
    budget = BUDGET if case.startswith("budget") else None
    bal = hetero.Balance(global_batch=None if budget else B, token_budget=budget, seed=SEED, collator=collator,
                         rebalance_every=1, micro_batch=int(micro),
                         max_tokens=[None, CAP if micro else STEP_CAP] if case.startswith("capped") else None)
    bal.emulate("1:delay=0.02")  # rank 1 slower per step: the fitted costs move the split
    if record is not None:
        bal.replay(json.loads(json.dumps(record)))  # as a run's decisions come back from a JSON file
    model = _model(Unmasked if case == "packed-without-document-mask" else
                   tf.LlamaForCausalLM)
    saves = {"save_strategy": "steps", "save_steps": SAVED} if case in RESUMED else {}
    args = _args(f"{out}/{case}", 1, gradient_accumulation_steps=B // 2, **saves) if micro else \
        _args(f"{out}/{case}", B // 2, **saves)
    trainer = HeteroTrainer(model=model, args=args, train_dataset=Docs(),
                            data_collator=_collator(case), balance=bal)
    longest = _longest(model) if case.startswith("capped") else [None, None]
    forwards = _forwards(model, bal) if case in REPLAYED or case in RESUMED else []
    trainer.train(resume_from_checkpoint=resume)
    return {"params": [p.detach().flatten().tolist() for p in trainer.model.parameters()],
            "sizes": bal.last_sizes, "kind": trainer._loss_kind, "collator": bal.settings.collator,
            "longest": longest[0], "held": longest[1], "forwards": forwards,
            "decisions": [dataclasses.asdict(d) for d in bal.decisions]}


REPLAYED = ("padded", "accumulated-packed")  # replayed from their decisions (bal.replay of a run by tokens)
RESUMED, SAVED = ("padded", "accumulated-packed"), 2  # saved after step 2 of 3, and resumed from it


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {case: _train(case, out) for case in CASES}
    for case in REPLAYED:
        run = result[case]["decisions"]
        result[f"replay-{case}"] = _train(case, f"{out}/replay", run)
        result[f"swapped-{case}"] = _train(case, f"{out}/swapped", _swapped(run))
    for case in RESUMED:
        result[f"resumed-{case}"] = _train(case, f"{out}/resumed", resume=f"{out}/{case}/checkpoint-{SAVED}")
    bal = hetero.Balance(global_batch=B, seed=SEED, collator="packed")
    trainer = HeteroTrainer(model=_model(), args=_args(f"{out}/unnumbered", B // 2), train_dataset=Docs(),
                            data_collator=tf.DataCollatorWithFlattening(return_position_ids=False), balance=bal)
    try:
        trainer.train()
    except ValueError as e:
        result["no-position-ids"] = str(e)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return spawned(_worker, tmp_path_factory.mktemp("hf_tokens"))


def union_steps(out: str) -> list[torch.Tensor]:
    """The plain Trainer in one process: each step the whole window of the shared permutation, padded."""
    order = EpochPlan(N, B, SEED, 0).perm[:STEPS * B].tolist()
    trainer = tf.Trainer(model=_model(), args=_args(out, B, train_sampling_strategy="sequential"),
                         train_dataset=Docs(order), data_collator=padded)
    trainer.train()
    return [p.detach().flatten() for p in trainer.model.parameters()]


def budget_steps(out: Path) -> list[torch.Tensor]:
    """Under BUDGET, steps of 17, 15 and 16 documents (the permutation's runs of about a third of its tokens): the
    plain Trainer run one step at a time on each step's documents, in one batch."""
    from hetero.core.tokens import budget_cuts

    lengths = np.array([len(x["input_ids"]) for x in Docs().items])
    perm = EpochPlan(N, B, SEED, 0).perm.numpy()
    cuts = budget_cuts(lengths[perm], BUDGET)
    assert np.diff(cuts).tolist() == [17, 15, 16]
    model = _model()
    for k in range(STEPS):
        window = perm[cuts[k]:cuts[k + 1]].tolist()
        tf.Trainer(model=model, args=_args(str(out / f"step{k}"), len(window), max_steps=1,
                                           train_sampling_strategy="sequential"),
                   train_dataset=Docs(window), data_collator=padded).train()
    return [p.detach().flatten() for p in model.parameters()]


@pytest.fixture(scope="module")
def union(tmp_path_factory) -> list[torch.Tensor]:
    return union_steps(str(tmp_path_factory.mktemp("plain")))


@pytest.mark.parametrize("case", ["budget-padded", "budget-accumulated-packed"])
def test_a_token_budget_in_the_trainer_steps_as_one_process_on_each_steps_documents(trained, tmp_path, case):
    """Steps of 17, 15 and 16 documents: the plain Trainer run one step at a time on each step's documents, in one
    batch, is the reference (budget_steps)."""
    want = budget_steps(tmp_path)
    for rank in trained:
        assert rank[case]["kind"] == "trainer" and sum(rank[case]["sizes"]) == 16  # the last step's documents
        assert max_diff(rank[case]["params"], want) < 1e-5, case
    assert max_diff(trained[0][case]["params"], [p.detach().flatten() for p in _model().parameters()]) > 1e-3


@pytest.mark.parametrize("case", ["padded", "packed", "accumulated-padded", "accumulated-packed", "default-padded",
                                  "default-packed", "capped-accumulated-padded", "capped-padded"])
def test_the_trainer_split_by_tokens_steps_as_one_process_on_the_unpacked_union(trained, union, case):
    moved = max_diff([p.detach().flatten().tolist() for p in _model().parameters()], union)
    assert moved > 1e-3
    for rank in trained:
        assert rank[case]["kind"] == "trainer" and rank[case]["collator"] == case.split("-")[-1]
        assert max_diff(rank[case]["params"], union) < 1e-5, f"{case}: not the union's steps (they moved {moved:.3g})"


def test_max_tokens_keeps_a_ranks_rows_within_its_cap_in_the_trainer(trained):
    """Rows of 2-32 tokens, one a forward: rank 1's max_tokens (CAP) holds no longer row, rank 0 takes them."""
    longest = [rank["capped-accumulated-padded"]["longest"] for rank in trained]
    assert longest[1] <= CAP < longest[0], longest
    held = [rank["capped-padded"]["held"] for rank in trained]  # one forward a step: its rows x the longest
    assert held[1] <= STEP_CAP < held[0], held


@pytest.mark.parametrize("case", REPLAYED)
def test_a_replay_by_tokens_through_the_trainer_gives_every_forward_the_runs_rows_and_decides_nothing(trained, case):
    """bal.replay(the run's decisions, through JSON) in a HeteroTrainer: on each rank every forward gets the rows it
    got in the run, the parameters end as the run's to the bit, and the replay makes no decision. The control: the
    same record with the ranks' costs swapped gives other rows."""
    for rank in trained:
        run, replay = rank[case], rank[f"replay-{case}"]
        assert len(run["decisions"]) == STEPS and all(len(d["per_unit_s"]) == 2 for d in run["decisions"])
        assert replay["forwards"] == run["forwards"] and len(run["forwards"]) >= STEPS
        assert replay["params"] == run["params"] and replay["decisions"] == []
    assert any(rank[f"swapped-{case}"]["forwards"] != rank[case]["forwards"] for rank in trained)


@pytest.mark.parametrize("case", RESUMED)
def test_a_run_by_tokens_resumed_from_a_trainer_checkpoint_takes_the_runs_rows_and_ends_as_the_run(trained, case):
    """train(resume_from_checkpoint=...) from the checkpoint after step 2 (the costs fitted by then are in it): on
    each rank every forward of the last step gets the rows it got in the uninterrupted run, and the parameters end as
    the run's. The split there follows the costs fitted in steps 0-1 (rank 1 is 20 ms a step slower)."""
    for rank in trained:
        run, resumed = rank[case], rank[f"resumed-{case}"]
        last = [f for f in run["forwards"] if f[0] == SAVED]
        assert last and resumed["forwards"] == last
        assert max_diff(resumed["params"], [torch.tensor(p) for p in run["params"]]) < 1e-6


def test_packed_without_the_document_mask_misses_the_union(trained, union):
    assert max_diff(trained[0]["packed-without-document-mask"]["params"], union) > 1e-4


def test_a_collator_that_is_not_the_balances_is_one_line(tmp_path):
    bal = hetero.Balance(global_batch=B, collator="padded")
    bal.set_world(0, 1)
    trainer = HeteroTrainer(model=_model(), args=_args(str(tmp_path), B), train_dataset=Docs(),
                            data_collator=tf.DataCollatorWithFlattening(), balance=bal)
    with pytest.raises(ValueError, match="set collator='packed'"):
        trainer.get_train_dataloader()


def test_packed_rows_without_position_ids_are_refused_on_every_rank(trained):
    assert trained[0]["no-position-ids"] == trained[1]["no-position-ids"]
    assert trained[0]["no-position-ids"].startswith("hetero: collator='packed' needs each packed row's position_ids")


def test_the_default_splits_by_counts_where_the_lengths_do_not_vary_or_a_replay_fixes_them(tmp_path):
    from hetero.integrations.hf.trainer import token_lengths

    class Blocks(Docs):  # every sample 12 tokens: nothing to balance by length
        def __init__(self):
            self.items = [{"input_ids": [1] * 12, "labels": [1] * 12} for _ in range(N)]
    for ds, replayed in ((Blocks(), False), (Docs(), True)):
        bal = hetero.Balance(global_batch=B)
        bal.set_world(0, 1)
        if replayed:
            bal.replay({0: [[B]] * (N // B)})
        trainer = HeteroTrainer(model=_model(), args=_args(str(tmp_path), B), train_dataset=ds, data_collator=padded,
                                balance=bal)
        assert token_lengths(trainer, ds) == {}
    bal = hetero.Balance(global_batch=B)
    bal.set_world(0, 1)
    trainer = HeteroTrainer(model=_model(), args=_args(str(tmp_path), B), train_dataset=Docs(), data_collator=padded,
                            balance=bal)
    assert token_lengths(trainer, Docs())["collator"] == "padded"


def test_by_tokens_chooses_counts_or_tokens_and_refuses_what_it_cannot_in_one_line(tmp_path):
    """HeteroTrainer(by_tokens=...): False splits by counts though the lengths vary (the Trainer's samplers by length
    then refused naming it); True splits by tokens though they do not, and refuses in one line where the Balance
    cannot (a replay) or the items have nothing to measure; by_tokens=False beside a Balance's collator, and a value
    that is no bool, are refused when the Trainer is built."""
    from hetero.integrations.hf.trainer import token_lengths

    class Blocks(Docs):  # every sample 12 tokens
        def __init__(self):
            self.items = [{"input_ids": [1] * 12, "labels": [1] * 12} for _ in range(N)]

    def trainer(ds, by_tokens, replayed=False, collator=None, **args):
        bal = hetero.Balance(global_batch=B, collator=collator)
        bal.set_world(0, 1)
        if replayed:
            bal.replay({0: [[B]] * (N // B)})
        return HeteroTrainer(model=_model(), args=_args(str(tmp_path), B, **args), train_dataset=ds,
                             data_collator=padded, balance=bal, by_tokens=by_tokens)
    assert token_lengths(trainer(Docs(), False), Docs()) == {}
    assert token_lengths(trainer(Docs(), None), Docs())["collator"] == "padded"  # the default, the control
    assert token_lengths(trainer(Blocks(), True), Blocks())["collator"] == "padded"
    assert token_lengths(trainer(Blocks(), None), Blocks()) == {}
    with pytest.raises(ValueError, match=r"^hetero: replay\(\) records sizes.*: HeteroTrainer\(by_tokens=True\) "
                                         r"cannot split by tokens$"):
        token_lengths(trainer(Docs(), True, replayed=True), Docs())
    with pytest.raises(ValueError, match=r"^hetero: train_sampling_strategy='group_by_length' asks for batches by "
                                         r"length, and hetero splits this run by counts \(HeteroTrainer\(by_tokens="
                                         r"False\)\): leave it 'random'$"):
        trainer(Docs(), False, train_sampling_strategy="group_by_length").get_train_dataloader()
    with pytest.raises(ValueError, match=r"by_tokens=False\) splits by counts, and the Balance was built with "
                                         r"collator='padded'"):
        trainer(Docs(), False, collator="padded")
    with pytest.raises(ValueError, match=r"by_tokens='yes'\) takes None"):
        trainer(Docs(), "yes")


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance"])
def test_the_trainers_samplers_by_length_are_taken_where_hetero_splits_by_tokens_and_refused_where_by_counts(
        tmp_path, strategy):
    """transformers' group_by_length and batch_rebalance ask for batches by length: where the lengths vary, hetero's
    split by tokens does their job (the loader splits by tokens, with the collator's layout); where they do not, one
    line says to leave the strategy 'random' (hetero would split by counts, and group nothing)."""
    class Blocks(Docs):  # every sample 12 tokens
        def __init__(self):
            self.items = [{"input_ids": [1] * 12, "labels": [1] * 12} for _ in range(N)]
    for ds, by_tokens in ((Docs(), True), (Blocks(), False)):
        bal = hetero.Balance(global_batch=B)
        bal.set_world(0, 1)
        trainer = HeteroTrainer(model=_model(), args=_args(str(tmp_path), B, train_sampling_strategy=strategy),
                                train_dataset=ds, data_collator=padded, balance=bal)
        if by_tokens:
            trainer.get_train_dataloader()
            assert bal.settings.collator == "padded"
        else:
            with pytest.raises(ValueError) as e:
                trainer.get_train_dataloader()
            assert str(e.value) == (f"hetero: train_sampling_strategy={strategy!r} asks for batches by length, and "
                                    f"hetero splits this run by counts (the samples' lengths do not vary): leave it "
                                    f"'random'")
