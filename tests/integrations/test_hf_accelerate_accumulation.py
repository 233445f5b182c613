"""Accumulation in a plain Accelerate loop with hetero's per-rank counts, k = [1, 3] micro-batches of 2 on 2 gloo ranks
(Balance(micro_batch=2, global_batch=8)): the pattern that takes the place of accelerator.accumulate(model) (each
micro-batch in `with bal.step():`, the optimizer stepped where bal.sync_now) makes one optimizer step equal to one
single-process step on the union, on a DDP model and on an FSDP2 model (FullyShardedDataParallelPlugin(fsdp_version=2),
prepared by accelerate and attached by hetero.integrations.accelerate.prepare); the weight doubled or removed
(scheme "dp": each rank's mean over its own micro-batches, the ranks alike) is caught, and an Accelerator that
accumulates a fixed count on every rank (gradient_accumulation_steps=2) is refused in one line.

By tokens (issue 49), in the same launch: documents of 1-512 tokens split among the ranks by their lengths
(Balance(collator=..., loss_mean="tokens")), padded and packed, whole steps and micro-batches of 2 rows, each loss
through accelerator.backward: three steps equal plain SGD in one process on the unpacked union of each step's
documents, every document of the epoch seen once. Replayed from its decisions (through JSON), a run by tokens gives
every step the run's rows on every rank and ends with the run's parameters, deciding nothing.

accelerate 1.15 keeps no FSDP plugin on CPU ranks (test_hf_fsdp.py): the FSDP2 case runs with the plugin kept after
AcceleratorState's __init__, as there."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from test_hf import MeanLoss, Points  # noqa: E402
from test_hf_fsdp import _fsdp_on_cpu  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hetero  # noqa: E402
from hetero.core.sampler import EpochPlan  # noqa: E402
from hetero.integrations.accelerate import prepare  # noqa: E402

import tokenlm  # noqa: E402
from helpers import max_diff, spawned  # noqa: E402

pytestmark = [pytest.mark.launch, pytest.mark.slow]  # two processes importing accelerate and transformers
B, M, SIZES, LR, SEED = 8, 2, [2, 6], 0.5, 3  # k = [1, 3]
CASES = {"ddp": ("edp", 1, False), "ddp_doubled": ("edp", 2, False), "ddp_removed": ("dp", 1, False),
         "fsdp": ("edp", 1, True), "fsdp_doubled": ("edp", 2, True)}  # name: (scheme, weight factor, FSDP2)


def _step(accelerator: Accelerator, scheme: str, factor: float) -> dict:
    """One optimizer step of the documented loop; the model's parameters after it (whole, also under FSDP2)."""
    bal = hetero.Balance(global_batch=B, micro_batch=M, scheme=scheme, seed=SEED)
    bal.replay({0: [SIZES]})
    model = MeanLoss()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = prepare(accelerator, bal, model, opt)
    loader = DataLoader(Points(), batch_sampler=bal.batch_sampler(B))
    bal.set_epoch(0)
    micro, steps = [], 0
    for batch in loader:                        # this rank's k_i micro-batches of M
        with bal.step():                        # in place of accelerator.accumulate(model)
            if factor != 1:
                bal.set_weight(bal.engine.running().weight * factor)
            accelerator.backward(model(**batch)["loss"])
            micro.append(len(batch["x"]))
            if bal.sync_now:
                opt.step()
                opt.zero_grad()
                steps += 1
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"model": type(model).__name__, "micro": micro, "steps": steps,
            "params": [p.detach().flatten().tolist() for p in full]}


TN, TB, TLR = 72, 24, 0.5  # by tokens: 3 steps of 24 documents
TOKENS = {"tokens-padded": ("padded", 0), "tokens-packed": ("packed", 0), "tokens-padded-micro2": ("padded", 2),
          "budget-packed-samples": ("packed", 0)}  # a token budget: 3 steps of 28, 21 and 23 documents, sample-mean
BUDGET = 6400


def _by_tokens(accelerator: Accelerator, collator: str, m: int, budget: int | None = None,
               record: list[dict] | None = None) -> dict:
    """An epoch of the own-loop recipe of docs/tokens.md through accelerate: each step's rows and the parameters
    after it, and the decisions made; with a record, bal.replay(record) of a run by tokens (through JSON)."""
    lengths, tokens, labels = tokenlm.corpus(TN)
    counted = [int((y != tokenlm.IGNORE).sum()) for y in labels]
    mean = "samples" if budget else "tokens"
    bal = hetero.Balance(global_batch=None if budget else TB, token_budget=budget, collator=collator, loss_mean=mean,
                         rebalance_every=1, micro_batch=m)
    if record is not None:
        bal.replay(json.loads(json.dumps(record)))
    model = tokenlm.PrefixLM()
    opt = torch.optim.SGD(model.parameters(), lr=TLR)
    model, opt = prepare(accelerator, bal, model, opt)
    sampler = bal.batch_sampler(TN, lengths=lengths, loss_tokens=None if budget else counted)
    bal.set_epoch(0)
    rows, params = [[] for _ in range(len(sampler) if not m else TN // TB)], []
    for idx in sampler:
        step = bal.position.step
        rows[step] += idx
        mine = sampler.rows_at(0, step)  # a micro-batch's loss: its sum over this rank's count for the step
        scale = sum(counted[i] for i in idx) / sum(counted[i] for i in mine) if m else 1.0
        with bal.step(len(idx)):
            accelerator.backward(scale * tokenlm.loss(model, tokenlm.collate(idx, tokens, labels, collator),
                                                      mean, len(idx)))
            if bal.sync_now:
                opt.step()
                opt.zero_grad()
                params.append(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
    return {"rows": rows, "params": params, "decisions": [dataclasses.asdict(d) for d in bal.decisions]}


REPLAYED = ("tokens-padded", "tokens-packed")  # replayed from their decisions


def _slowed(decisions: list[dict]) -> list[dict]:
    """The record with rank 1's fitted cost per token tripled (the replay's negative control: the ranks here are
    alike, so swapping their costs could leave the split as it was)."""
    return [{**d, "per_unit_s": [d["per_unit_s"][0], 3 * d["per_unit_s"][1]]} for d in decisions]


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    try:
        prepare(Accelerator(cpu=True, gradient_accumulation_steps=2), hetero.Balance(global_batch=B, micro_batch=M),
                MeanLoss())
    except ValueError as e:
        result["fixed"] = str(e)
    for name, (collator, m) in TOKENS.items():  # before the FSDP2 cases: AcceleratorState keeps their plugin
        result[name] = _by_tokens(Accelerator(cpu=True), collator, m, BUDGET if name.startswith("budget") else None)
    for name in REPLAYED:
        collator, m = TOKENS[name]
        run = result[name]["decisions"]
        result[f"replay-{name}"] = _by_tokens(Accelerator(cpu=True), collator, m, record=run)
        result[f"slowed-{name}"] = _by_tokens(Accelerator(cpu=True), collator, m, record=_slowed(run))
    for name, (scheme, factor, fsdp) in CASES.items():
        if fsdp:
            _fsdp_on_cpu()
            accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        else:
            accelerator = Accelerator(cpu=True)
        result[name] = _step(accelerator, scheme, factor)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _union() -> list[torch.Tensor]:
    """One SGD step of one process on the 8 rows at once (the step's window is the whole data set)."""
    model, data = MeanLoss(), Points()
    model(data.x, data.y)["loss"].backward()
    with torch.no_grad():
        return [(p - LR * p.grad).flatten() for p in model.parameters()]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawned(_worker, tmp_path_factory.mktemp("accelerate"))


def test_accumulating_per_rank_counts_in_an_accelerate_loop_is_the_union_step(ranks):
    want = _union()
    for rank, got in enumerate(ranks):
        assert got["fixed"].startswith("hetero: Accelerator(gradient_accumulation_steps=2) accumulates the same count")
        for name in ("ddp", "fsdp"):
            run = got[name]
            assert run["micro"] == [M] * (SIZES[rank] // M) and run["steps"] == 1
            assert max_diff(run["params"], want) < 1e-6, f"{name}: not the union's step"
        assert got["ddp"]["model"] == "DistributedDataParallel" and got["fsdp"]["model"].startswith("FSDP")
        for wrong in ("ddp_doubled", "ddp_removed", "fsdp_doubled"):
            assert max_diff(got[wrong]["params"], want) > 1e-3, f"{wrong}: not caught"


@pytest.mark.parametrize("name", TOKENS)
def test_an_accelerate_loop_split_by_tokens_is_the_union_step(ranks, name):
    perm = EpochPlan(TN, TB, 0, 0).perm.tolist()
    counts = [len(a) + len(b) for a, b in zip(*(r[name]["rows"] for r in ranks))]
    ends = np.cumsum([0, *counts]) if name.startswith("budget") else np.arange(0, TN + 1, TB)
    if name.startswith("budget"):  # 3 runs of the permutation of varying counts, each about a third of the tokens
        assert len(counts) == 3 and len(set(counts)) > 1 and ends[-1] == TN, counts
    steps = []
    for s, parts in enumerate(zip(*(r[name]["rows"] for r in ranks))):
        assert sorted(parts[0] + parts[1]) == sorted(perm[ends[s]:ends[s + 1]]), f"step {s} is not its window"
        assert parts[0] and parts[1]
        steps.append(sorted(parts[0] + parts[1]))
    assert sorted(i for s in steps for i in s) == list(range(TN))  # every document of the epoch once
    _, tokens, labels = tokenlm.corpus(TN)
    want = tokenlm.reference(steps, tokens, labels, "samples" if name.startswith("budget") else "tokens", TLR)
    for r in ranks:
        assert len(r[name]["params"]) == 3
        for got, ref in zip(r[name]["params"], want):
            assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-9
    assert any(sorted(r0) != sorted(perm[ends[s]:ends[s] + len(r0)]) for s, r0 in enumerate(ranks[0][name]["rows"]))


@pytest.mark.parametrize("name", REPLAYED)
def test_a_replay_by_tokens_in_an_accelerate_loop_gives_each_step_the_runs_rows_and_decides_nothing(ranks, name):
    """bal.replay(the run's decisions, through JSON) in the same Accelerate loop: on each rank every step gets the rows
    it got in the run, the parameters end as the run's to the bit, and the replay makes no decision. The control: the
    same record with rank 1's cost per token tripled gives other rows."""
    for rank in ranks:
        run, replay = rank[name], rank[f"replay-{name}"]
        assert len(run["decisions"]) >= 2 and all(len(d["per_unit_s"]) == 2 for d in run["decisions"])
        assert replay["rows"] == run["rows"] and replay["params"] == run["params"] and replay["decisions"] == []
    assert any(rank[f"slowed-{name}"]["rows"] != rank[name]["rows"] for rank in ranks)
