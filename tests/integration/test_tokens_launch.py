"""Balancing by tokens in an own DDP or FSDP2 loop (issue 49), 2 and 3 gloo ranks: each step's window of the shared
permutation is split by the samples' lengths, and the update equals plain SGD in one process on the unpacked union
of the step's samples, padded and packed, for a token-mean and a sample-mean loss, after 1 and after 3 steps. One
launch per world runs every case in turn; three negative controls (sample weights where tokens count, equal weights,
packing without the document mask) each miss the reference. What needs no processes: tests/unit/test_tokens.py."""
from __future__ import annotations

import datetime
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hetero
from hetero.core.memory import fitting_tokens
from hetero.core.sampler import EpochPlan
from hetero.core.tokens import Cost

import tokenlm
from helpers import spawned

N, B, LR = 72, 24, 0.5  # 3 steps an epoch
MICRO = {"micro2-padded-tokens": 2, "micro1-packed-samples": 1, "micro3-padded-samples": 3,
         "capped-micro1-padded-tokens": 1, "capped-micro3-packed-samples": 3,
         "fsdp2-capped-micro2-packed-tokens": 2, "probed-micro2-padded-tokens": 2}  # micro_batch m
# max_tokens of the last rank in the capped cases (the others none): no micro-batch of it holds more (one row of at
# most 200 tokens; up to 3 rows packed within 600, cut where the next row would overflow)
CAPS = {"capped-micro1-padded-tokens": 200, "capped-micro3-packed-samples": 600,
        "fsdp2-capped-micro2-packed-tokens": 500,
        # without micro-batches a rank's step is one forward: its rows together within the cap (padded: rows x the
        # longest; packed: their sum), each below an even share of any step
        "capped-padded-tokens": 600, "capped-packed-samples": 900,
        # max_tokens "probe": every rank probes (a search on the CPU standing in for a GPU's, a model out of memory
        # above OOM tokens on the last rank): the caps gathered, the last rank's 0.9 x OOM
        "probed-micro2-padded-tokens": 540}
OOM = 600

CASES = {  # name: (collator, the Balance's loss_mean, the loss the loop computes, the model keeps documents apart,
    #               the loop sets equal weights)
    "padded-tokens": ("padded", "tokens", "tokens", True, False),
    "padded-samples": ("padded", "samples", "samples", True, False),
    "packed-tokens": ("packed", "tokens", "tokens", True, False),
    "packed-samples": ("packed", "samples", "samples", True, False),
    "fsdp2-padded-tokens": ("padded", "tokens", "tokens", True, False),  # fully_shard'ed: its weighted reduce-scatter
    "fsdp2-packed-samples": ("packed", "samples", "samples", True, False),
    # per-rank accumulation: each micro-batch's loss over this rank's count for the step (docs/tokens.md)
    "micro2-padded-tokens": ("padded", "tokens", "tokens", True, False),
    "micro1-packed-samples": ("packed", "samples", "samples", True, False),
    "micro3-padded-samples": ("padded", "samples", "samples", True, False),
    # per-rank memory: the last rank's micro-batches hold at most its max_tokens (CAPS), the others any
    "capped-micro1-padded-tokens": ("padded", "tokens", "tokens", True, False),
    "capped-micro3-packed-samples": ("packed", "samples", "samples", True, False),
    "fsdp2-capped-micro2-packed-tokens": ("packed", "tokens", "tokens", True, False),  # FSDP2's micro-batch schedule
    "capped-padded-tokens": ("padded", "tokens", "tokens", True, False),
    "capped-packed-samples": ("packed", "samples", "samples", True, False),
    "probed-micro2-padded-tokens": ("padded", "tokens", "tokens", True, False),
    # negative controls: each must miss the reference of its loss
    "sample-weights-for-a-token-mean": ("padded", "samples", "tokens", True, False),
    "equal-weights": ("padded", "tokens", "tokens", True, True),
    "packed-without-document-mask": ("packed", "tokens", "tokens", False, False),
}


class OutOfMemoryAbove(torch.nn.Module):
    """What a GPU's probe trial meets: CUDA's out-of-memory error for a forward of more than `limit` tokens; else a
    language model's loss (Hugging Face's convention)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.emb = limit, torch.nn.Embedding(8, 4)

    def forward(self, input_ids, labels):
        if input_ids.numel() > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({input_ids.numel()} tokens)")
        return {"loss": self.emb(input_ids).square().mean()}


def _worker(rank: int, out: str, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    lengths, tokens, labels = tokenlm.corpus(N)
    counted = np.array([int((y != tokenlm.IGNORE).sum()) for y in labels])
    result = {}
    for name, (collator, mean, loss_mean, documents, equal) in CASES.items():
        net = tokenlm.PrefixLM(documents=documents)
        ddp = fully_shard(net) if name.startswith("fsdp2") else DDP(net)
        m = MICRO.get(name, 0)
        caps = [None] * (world - 1) + [CAPS[name]] if name in CAPS else None
        bal = hetero.Balance(global_batch=B, collator=collator, loss_mean=mean, rebalance_every=1, micro_batch=m,
                             max_tokens="probe" if name.startswith("probed") else caps)
        if name.startswith("probed"):  # the probe's search runs on the CPU as on a GPU, before DDP
            hetero.core.probe.probe_max_tokens = fitting_tokens
            probed = bal.probe(OutOfMemoryAbove(OOM if rank == world - 1 else 10**9), device=torch.device("cpu"),
                               max_length=512)
            assert probed == [1024.0] * (world - 1) + [0.9 * OOM], probed  # every rank's, gathered
        bal.attach(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        sampler = bal.batch_sampler(N, lengths=lengths, loss_tokens=counted if mean == "tokens" else None)
        bal.set_epoch(0)
        rows, params, batches = [], [], []
        for idx in sampler:
            step = bal.position.step
            if len(rows) == step:
                rows.append([])
            rows[step] += idx
            batches.append(idx)
            scale = 1.0
            if m:  # this micro-batch's mean, as its sum over this rank's count for the step
                mine = sampler.rows_at(0, step)
                scale = counted[idx].sum() / counted[mine].sum() if loss_mean == "tokens" else len(idx) / len(mine)
            batch = tokenlm.collate(idx, tokens, labels, collator)
            with bal.step(len(idx)):
                if equal:
                    bal.set_weight(1 / world)
                (scale * tokenlm.loss(ddp, batch, loss_mean, len(idx))).backward()
                if bal.sync_now:
                    opt.step()
                    opt.zero_grad()
            if bal.position.step > step:  # the step ended
                full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in ddp.parameters()]  # collective
                params.append(torch.cat([p.detach().flatten() for p in full]).tolist())
        result[name] = {"rows": rows, "params": params, "batches": batches}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def launched(request, tmp_path_factory):
    world = request.param
    return world, spawned(_worker, tmp_path_factory.mktemp(f"tokens{world}"), world, (world,))


def _steps(ranks: list[dict], name: str) -> list[list[int]]:
    """Each step's samples over every rank (sorted), checked to be exactly the step's window of the permutation."""
    per_rank = [r[name]["rows"] for r in ranks]
    perm = EpochPlan(N, B, 0, 0).perm.tolist()
    steps = []
    for s, parts in enumerate(zip(*per_rank)):
        union = sorted(i for part in parts for i in part)
        assert union == sorted(perm[s * B:(s + 1) * B]), f"{name}: step {s} is not its window"
        assert all(parts), f"{name}: step {s} left a rank without rows"
        steps.append(union)
    return steps


def _miss(got: list[float], want: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[1] == c[2] and c[3] and not c[4]])
def test_a_split_by_tokens_equals_one_process_on_the_unpacked_union(launched, name):
    world, ranks = launched
    steps = _steps(ranks, name)
    assert sorted(i for s in steps for i in s) == sorted(EpochPlan(N, B, 0, 0).perm[:len(steps) * B].tolist())
    assert len({i for s in steps for i in s}) == len(steps) * B  # coverage: every sample of the epoch once
    _, tokens, labels = tokenlm.corpus(N)
    want = tokenlm.reference(steps, tokens, labels, CASES[name][2], LR)
    for r in ranks:  # after 1 and after 3 steps, on every rank
        assert _miss(r[name]["params"][0], want[0]) < 1e-9
        assert _miss(r[name]["params"][2], want[2]) < 1e-9
    if name in CAPS and name not in MICRO:  # the last rank's whole step within its max_tokens, below an even share
        lengths, cost, cap = tokenlm.corpus(N)[0], Cost(CASES[name][0]), CAPS[name]
        assert all(cost.work(lengths[b]) <= cap for b in ranks[-1][name]["batches"])
        assert all(cost.work(lengths[s]) / world > cap for s in steps)
    elif name in CAPS:  # each micro-batch of the last rank within its max_tokens; some step had longer rows
        lengths, cost = tokenlm.corpus(N)[0], Cost(CASES[name][0])
        assert all(cost.work(lengths[b]) <= CAPS[name] and len(b) <= MICRO[name] for b in ranks[-1][name]["batches"])
        m, cap = MICRO[name], CAPS[name]  # the cap bound: a longer row went to another rank (one row a micro-batch);
        # cut by count alone, some micro-batch of the last rank would exceed it (several)
        by_count = [sorted(r, key=lambda i: (-lengths[i], i)) for r in ranks[-1][name]["rows"]]
        assert (max(lengths[i] for s in steps for i in s) > cap if m == 1 else
                any(cost.work(lengths[r[i:i + m]]) > cap for r in by_count for i in range(0, len(r), m)))
    perm = EpochPlan(N, B, 0, 0).perm.tolist()  # not the split by counts: rank 0's rows are not the window's head
    assert any(sorted(r0) != sorted(perm[s * B:s * B + len(r0)]) for s, r0 in enumerate(ranks[0][name]["rows"]))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not (c[1] == c[2] and c[3] and not c[4])])
def test_a_negative_control_misses_the_reference(launched, name):
    world, ranks = launched
    steps = _steps(ranks, name)
    _, tokens, labels = tokenlm.corpus(N)
    want = tokenlm.reference(steps, tokens, labels, CASES[name][2], LR)
    assert _miss(ranks[0][name]["params"][2], want[2]) > 1e-4
