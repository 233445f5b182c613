"""hetero/core/tokens.py (issue 49): a step's samples split among the ranks by their predicted cost. Pure maths in one
process: every sample once, the caps, the refusals, and the quality of the split against the exhaustive optimum on
small steps, against the fluid lower bound on large ones, and against today's split by counts.

The launches: balancing by tokens in an own DDP or FSDP2 loop (issue 49), 2 and 3 gloo ranks: each step's window of
the shared permutation is split by the samples' lengths, and the update equals plain SGD in one process on the
unpacked union of the step's samples, padded and packed, for a token-mean and a sample-mean loss, after 1 and after 3
steps. One launch per world runs every case in turn; three negative controls (sample weights where tokens count,
equal weights, packing without the document mask) each miss the reference."""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import hetero
from hetero.core import partition
from hetero.core.memory import fitting_tokens
from hetero.core.sampler import EpochPlan
from hetero.core.tokens import Cost, CostModel, budget_cuts, budget_steps, check_lengths, micro_batches, split, times

import tokenlm
from helpers import spawned

COSTS = [Cost("padded"), Cost("padded", attention=1e-3), Cost("packed"), Cost("packed", attention=1e-3)]


def _case(rng, n: int, world: int):
    lengths = rng.integers(1, 513, n)
    fixed = rng.uniform(0, 0.01, world)
    per_unit = rng.uniform(1e-5, 3e-5, world) * rng.choice([1, 3], world)  # some ranks about 3x slower
    return lengths, fixed, per_unit


def _long_tailed(rng, n: int) -> np.ndarray:
    return np.minimum(np.round(rng.lognormal(np.log(64), 1.0, n)).astype(np.int64) + 1, 1024)


def _exhaustive(lengths, fixed, per_unit, cost: Cost) -> float:
    """The least slowest-rank time over every assignment of the samples with at least one on each rank."""
    world, L = len(fixed), np.asarray(lengths, dtype=float)
    assign = np.array(list(itertools.product(range(world), repeat=len(L))))  # [assignments, samples]
    worst = np.zeros(len(assign))
    for r in range(world):
        mine = assign == r
        rows = mine.sum(1)
        if cost.collator == "padded":
            top = (mine * L).max(1)
            work = rows * top * (1 + cost.attention * top)
        else:
            work = mine @ (L + cost.attention * L * L)
        worst = np.maximum(worst, np.where(rows > 0, fixed[r] + per_unit[r] * work, np.inf))
    return float(worst.min())


def _fluid(lengths, fixed, per_unit, cost: Cost) -> float:
    """A lower bound for packed rows: the time T at which the ranks' budgets (T - a_i) / c_i hold every unit."""
    total, lo, hi = cost.work(lengths), 0.0, float(np.max(fixed + per_unit * cost.work(lengths)))
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if np.maximum((mid - fixed) / per_unit, 0).sum() >= total else (mid, hi)
    return hi


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: f"{c.collator}-{c.attention:g}")
def test_every_sample_lands_on_exactly_one_rank_with_at_least_min_rows_each(cost):
    rng = np.random.default_rng(0)
    for _ in range(60):
        world = int(rng.integers(1, 9))
        n = int(rng.integers(world, 200))
        lengths, fixed, per_unit = _case(rng, n, world)
        min_rows = int(rng.integers(0, n // world + 1))
        parts = split(lengths, fixed, per_unit, cost, min_rows=min_rows)
        assert len(parts) == world
        assert sorted(np.concatenate(parts).tolist()) == list(range(n))
        assert min(len(p) for p in parts) >= min_rows
        assert all(np.all(np.diff(p) > 0) for p in parts)  # positions ascending
        assert all(p.dtype == np.int64 for p in parts)


def test_padded_rows_reach_the_exhaustive_optimum_on_small_steps():
    """Every assignment of up to 8 samples to 2 or 3 ranks (at least one each): the split's slowest predicted step
    is the least possible one. (A property of the search's runs of similar lengths, checked on 120 random steps.)"""
    rng = np.random.default_rng(1)
    for cost in COSTS[:2]:
        for world in (2, 3):
            for _ in range(30):
                lengths, fixed, per_unit = _case(rng, int(rng.integers(world, 9)), world)
                got = times(lengths, split(lengths, fixed, per_unit, cost), fixed, per_unit, cost).max()
                assert got == pytest.approx(_exhaustive(lengths, fixed, per_unit, cost), rel=1e-9), lengths


def test_packed_rows_come_close_to_the_optimum_small_and_to_the_fluid_bound_large():
    """Packed rows are a partition problem: on up to 8 samples the split is within 15% of the exhaustive optimum
    (the measured worst of these cases, 1.14), and on long-tailed steps of 128 and 512 samples within 0.1% of the
    fluid lower bound (measured 1.0005 at worst over 2-8 ranks)."""
    rng = np.random.default_rng(2)
    cost = Cost("packed")
    worst = []
    for world in (2, 3):
        for _ in range(25):
            lengths, fixed, per_unit = _case(rng, int(rng.integers(world, 9)), world)
            got = times(lengths, split(lengths, fixed, per_unit, cost), fixed, per_unit, cost).max()
            worst.append(got / _exhaustive(lengths, fixed, per_unit, cost))
    assert 1 - 1e-12 <= min(worst) and max(worst) < 1.15, max(worst)
    for n in (128, 512):
        for world in (2, 3, 4, 8):
            _, fixed, per_unit = _case(rng, 1, world)
            lengths = _long_tailed(rng, n)
            got = times(lengths, split(lengths, fixed, per_unit, cost), fixed, per_unit, cost).max()
            assert got <= 1.001 * _fluid(lengths, fixed, per_unit, cost), (n, world)


@pytest.mark.parametrize("collator", ["padded", "packed"])
def test_the_split_by_cost_beats_todays_split_by_counts(collator):
    """Negative control: today's split gives each rank a count in proportion to its speed and the step's samples in
    the order drawn. On long-tailed lengths with rank 1 three times slower, the split by cost never predicts a slower
    step, and on average a faster one (measured on these 40 steps: padded 2.43x, as each rank's rows pad to
    similar lengths; packed 1.13x)."""
    rng = np.random.default_rng(3)
    cost, gains = Cost(collator), []
    for _ in range(40):
        lengths = _long_tailed(rng, 64)
        fixed, per_unit = np.array([0.002, 0.002]), np.array([1e-5, 3e-5])
        counts = partition.affine_batch_sizes(fixed, per_unit * cost.work(lengths) / len(lengths), len(lengths))
        by_count = np.split(np.arange(len(lengths)), np.cumsum(counts)[:-1])
        before = times(lengths, by_count, fixed, per_unit, cost).max()
        after = times(lengths, split(lengths, fixed, per_unit, cost), fixed, per_unit, cost).max()
        assert after <= before * (1 + 1e-12)
        gains.append(before / after)
    print(f"{collator}: {np.mean(gains):.3f} faster on average, {max(gains):.3f} at best")
    assert np.mean(gains) > {"padded": 1.2, "packed": 1.1}[collator], np.mean(gains)


def test_equal_ranks_and_equal_lengths_split_evenly():
    for cost in COSTS:
        parts = split(np.full(12, 100), [0.001] * 3, [1e-5] * 3, cost)
        assert [len(p) for p in parts] == [4, 4, 4]


def test_the_split_is_the_same_on_every_call():
    rng = np.random.default_rng(4)
    lengths, fixed, per_unit = _case(rng, 300, 4)
    for cost in COSTS:
        a, b = split(lengths, fixed, per_unit, cost), split(lengths.copy(), fixed.copy(), per_unit.copy(), cost)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: f"{c.collator}-{c.attention:g}")
def test_a_sample_goes_only_to_a_rank_whose_cap_holds_it(cost):
    rng = np.random.default_rng(5)
    for _ in range(30):
        lengths, fixed, per_unit = _case(rng, 64, 3)
        caps = np.array([600, 300, 200])
        parts = split(lengths, fixed, per_unit, cost, caps=caps)
        assert sorted(np.concatenate(parts).tolist()) == list(range(64))
        for r, p in enumerate(parts):
            assert np.all(lengths[p] <= caps[r])


def test_a_sample_longer_than_every_cap_is_refused_by_its_position_and_length():
    with pytest.raises(ValueError, match=r"^hetero: sample 2 is 900 tokens long, more than any rank can hold "
                                         r"\(the largest cap is 512 tokens\)"):
        split([10, 20, 900, 30], [0, 0], [1e-5, 1e-5], caps=[512, 256])
    with pytest.raises(ValueError, match="no split of this step's 3 samples fits the ranks' caps with 1 row"):
        split([400, 300, 300], [0, 0], [1e-5, 1e-5], caps=[512, 100])  # rank 1 can hold none of them


@pytest.mark.parametrize("bad, line", [
    ([3, 0, 4], r"the length of sample 1 is 0: lengths are whole token counts >= 1 \(1 such\)"),
    ([3, -2, -1], r"the length of sample 1 is -2: .* \(2 such\)"),
    ([3.0, 2.5], r"the length of sample 1 is 2.5"),
    ([3.0, float("nan")], r"the length of sample 1 is nan"),
    ([True, False], r"whole token counts \(got values of type bool\)"),
    (["a", "b"], r"whole token counts \(got values of type <U1\)"),
    ("12", r"got a string"),
    ([[1, 2], [3, 4]], r"one number per sample \(got an array of shape \(2, 2\)\)"),
    ([[1, 2], [3]], r"a flat sequence of whole token counts"),
    ([], r"lengths is empty"),
])
def test_bad_lengths_are_one_line(bad, line):
    with pytest.raises(ValueError, match="^hetero: " + ".*" + line):
        check_lengths(bad)


def test_lengths_must_match_the_data_set():
    with pytest.raises(ValueError, match=r"^hetero: 3 lengths for a data set of 4 samples: give one per sample$"):
        check_lengths([1, 2, 3], samples=4)
    assert check_lengths(np.array([1.0, 2.0]), samples=2).tolist() == [1, 2]


def test_bad_costs_and_coefficients_are_one_line():
    with pytest.raises(ValueError, match="^hetero: collator must be one of padded, packed"):
        Cost("flat")
    with pytest.raises(ValueError, match="^hetero: attention must be a finite number >= 0"):
        Cost("padded", attention=-1)
    with pytest.raises(ValueError, match="^hetero: the ranks' fixed costs must be finite"):
        split([1, 2], [0, 0], [1e-5, 0])
    with pytest.raises(ValueError, match=r"^hetero: fixed_s, per_unit_s and caps take one number per rank, or one "
                                         r"for every rank \(got 2, 3 numbers\)$"):
        split([1, 2, 3], [0, 0], [1, 1, 1])
    with pytest.raises(ValueError, match="^hetero: a step of 3 samples cannot give 2 ranks 2 each"):
        split([1, 2, 3], [0, 0], [1, 1], min_rows=2)


@pytest.mark.parametrize("collator", ["padded", "packed"])
def test_micro_batches_fit_the_cap_and_cover_each_row_once(collator):
    rng = np.random.default_rng(6)
    cost = Cost(collator)
    for _ in range(30):
        lengths = _long_tailed(rng, int(rng.integers(1, 100)))
        cap = int(rng.integers(lengths.max(), 4096))
        batches = micro_batches(lengths, cap, cost)
        assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
        for b in batches:
            tokens = len(b) * lengths[b].max() if collator == "padded" else lengths[b].sum()
            assert tokens <= cap
    with pytest.raises(ValueError, match="^hetero: sample 1 is 700 tokens long, more than this rank's cap of 512$"):
        micro_batches([10, 700], 512, cost)


def test_budget_cuts_are_consecutive_runs_near_an_even_share_of_the_tokens_covering_every_sample():
    # 24 tokens, budget 10: ceil(24 / 10) = 3 steps of about 8; midpoints 2.5 6.5 9.5 13 18 21.5 22.5 23.5 -> runs
    # floor(3 x midpoint / 24) = 0 0 1 1 2 2 2 2: steps of 8, 7 and 9 tokens
    assert budget_steps([5, 3, 3, 4, 6, 1, 1, 1], 10) == 3
    assert budget_cuts([5, 3, 3, 4, 6, 1, 1, 1], 10).tolist() == [0, 2, 4, 8]
    rng = np.random.default_rng(7)
    for _ in range(30):
        lengths, budget = _long_tailed(rng, 500), int(rng.integers(1024, 8192))
        off = budget_cuts(lengths, budget)
        steps, total = len(off) - 1, int(lengths.sum())
        assert steps == budget_steps(lengths, budget) == -(-total // budget)
        assert off[0] == 0 and off[-1] == len(lengths) and np.all(np.diff(off) >= 1)  # every sample, once, in order
        sums = np.array([lengths[a:b].sum() for a, b in zip(off[:-1], off[1:])])
        assert np.all(np.abs(sums - total / steps) <= lengths.max())  # within one sample of an even share
        assert budget_steps(rng.permutation(lengths), budget) == steps  # the same count in any order
    assert budget_cuts([7], 7).tolist() == [0, 1]


def test_a_sample_over_the_token_budget_or_a_budget_over_the_data_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^hetero: sample 1 is 40 tokens long, more than the step's token budget "
                                         r"of 32: raise token_budget to at least 40$"):
        budget_cuts([8, 40, 8], 32)
    with pytest.raises(ValueError, match="^hetero: the token budget must be a whole number of tokens >= 1"):
        budget_steps([8], 0)
    with pytest.raises(ValueError, match="^hetero: token_budget 64 exceeds the 24 tokens of the 3 samples$"):
        budget_steps([8, 8, 8], 64)


def test_the_cost_model_recovers_each_ranks_fixed_and_per_token_cost_and_starts_equal():
    model = CostModel(3, prior_per_unit_s=2e-6)
    assert model.coefficients()[0].tolist() == [0, 0, 0] and model.coefficients()[1].tolist() == [2e-6] * 3
    rng = np.random.default_rng(8)
    work = rng.uniform(1e3, 2e4, (10, 3))
    work[:, 2] = 0  # rank 2 sat every step out: it keeps the prior
    true_a, true_c = np.array([0.004, 0.001, 0.0]), np.array([1e-6, 3e-6, 1e-6])
    model.observe(work, np.where(work > 0, true_a + true_c * work, 0.0))
    a, c = model.coefficients()
    assert np.allclose(a[:2], true_a[:2], rtol=1e-6) and np.allclose(c[:2], true_c[:2], rtol=1e-6)
    assert (a[2], c[2]) == (0.0, 2e-6)
    with pytest.raises(ValueError, match="^hetero: the prior cost per token must be finite and > 0"):
        CostModel(2, prior_per_unit_s=0)


@pytest.fixture(scope="module")
def simulated():
    from hetero.lab import tokensim
    return tokensim.table(global_batch=64, steps=150)


def test_in_simulation_tokens_come_within_10_percent_of_the_ideal_and_ahead_of_every_other_split(simulated):
    """hetero.lab.tokensim (true costs known, the model fitted online from noisy times every 10 steps): the split by
    fitted cost is within 10% of the ideal split in every row (the issue's target), ahead of every other policy where
    rank 1 is 3x slower, and no slower than transformers' BatchRebalanceSampler on equal ranks."""
    by = {(r["collator"], r["ranks"], r["policy"]): r for r in simulated}
    for collator in ("padded", "packed"):
        for ranks in ("equal", "rank 1 3x slower"):
            mine = by[collator, ranks, "tokens"]["over_ideal"]
            assert 1 - 1e-9 <= mine <= 1.10, (collator, ranks, mine)
            others = {p: by[collator, ranks, p]["over_ideal"] for p in ("equal", "batch_rebalance", "samples")}
            if ranks == "equal":
                assert mine <= others["batch_rebalance"] * 1.01, (collator, mine, others)
            else:
                assert all(mine < v for v in others.values()), (collator, mine, others)
                assert by[collator, ranks, "tokens"]["token_shares"][1] < 0.4  # the slow rank: well below a half


# -- behind Balance: the split of each step by its lengths, its weights, its refusals, its state ------------------
def _bound(rank: int, world: int, collator: str, mean: str, lengths, counted, B: int = 12):
    import hetero

    bal = hetero.Balance(global_batch=B, collator=collator, loss_mean=mean)
    bal.set_world(rank, world)
    bal.sampler = bal.batch_sampler(len(lengths), lengths=lengths, loss_tokens=counted if mean == "tokens" else None)
    return bal


def _fitted(bal, per_unit: list[float]) -> None:
    """bal resumed from its own state with these per-token costs (the live model and the regime in force)."""
    state = bal.state_dict()
    for costs in [state["costs"], *(regime for _, regime in state["regimes"])]:
        costs["per_unit_s"] = [1e-6 * v for v in per_unit]
    bal.load_state_dict(state)


@pytest.mark.parametrize("true", [0.0, 1e-3, 1e-2])
def test_the_cost_model_fits_the_attention_weight_with_the_costs(true):
    """Noiseless step times of fixed + per-unit x (tokens + w x squared lengths), per rank: the fit finds w among its
    candidates and every rank's coefficients (the same w for all; a rank's speed scales both terms)."""
    rng = np.random.default_rng(1)
    a, c = np.array([0.002, 0.004]), np.array([1e-5, 3e-5])
    cost = Cost("padded")
    parts = np.array([[cost.parts(rng.integers(1, 1024, rng.integers(1, 16))) for _ in range(2)]
                      for _ in range(40)])  # [steps, world, 2]
    model = CostModel(2)
    model.observe(parts, a + c * (parts[..., 0] + true * parts[..., 1]))
    assert model.attention == pytest.approx(true)
    fixed, per = model.coefficients()
    assert np.allclose(fixed, a, rtol=1e-6, atol=1e-9) and np.allclose(per, c, rtol=1e-6)
    said = CostModel(2, attention=0.0)  # a weight given is kept
    said.observe(parts, a + c * (parts[..., 0] + true * parts[..., 1]))
    assert said.attention == 0.0


@pytest.mark.parametrize("collator", ["padded", "packed"])
@pytest.mark.parametrize("mean", ["tokens", "samples"])
def test_three_partitions_of_one_step_weigh_to_the_gradient_of_its_union(collator, mean):
    """Ranks of a world of 3 in one process, given three different fitted costs through a saved state: each cuts
    the same step's window another way, and the weighted sum of the ranks' gradients is one process's on the
    unpacked union (the launch: tests/core/test_tokens.py)."""
    import torch

    import tokenlm

    lengths, tokens, labels = tokenlm.corpus(48, seed=4)
    counted = np.array([int((y != tokenlm.IGNORE).sum()) for y in labels])
    cuts = []
    for per_unit in ([1.0, 1.0, 1.0], [1.0, 3.0, 1.0], [4.0, 1.0, 2.0]):
        model, grads = tokenlm.PrefixLM(), None
        parts = []
        for rank in range(3):
            bal = _bound(rank, 3, collator, mean, lengths, counted)
            _fitted(bal, per_unit)
            bal.begin_step()
            rows = bal.sampler.rows_at(0, 0)
            parts.append(sorted(rows))
            model.zero_grad()
            tokenlm.loss(model, tokenlm.collate(rows, tokens, labels, collator), mean, len(rows)).backward()
            w = bal.engine.running().weight
            g = [w * p.grad.clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        union = sorted(i for p in parts for i in p)
        assert len(union) == len(set(union)) == 12  # every sample of the step on exactly one rank
        want = tokenlm.reference([union], tokens, labels, mean, 0.5)[0]
        got = torch.cat([(p - 0.5 * g).detach().flatten() for p, g in zip(model.parameters(), grads)])
        assert np.max(np.abs(got.numpy() - np.asarray(want))) < 1e-12
        cuts.append(parts)
    assert len({str(c) for c in cuts}) == 3  # three different partitions of the same step


def test_a_slower_rank_gets_fewer_tokens_and_the_split_is_the_same_on_every_rank():
    lengths = np.random.default_rng(2).integers(1, 513, 60)
    cuts = []
    for rank in range(2):
        bal = _bound(rank, 2, "packed", "samples", lengths, None)
        _fitted(bal, [1.0, 3.0])
        cuts.append([[r.tolist() for r in bal.engine.plan.schedule.rows_at(0, s)] for s in range(5)])
        assert bal.sampler.rows_at(0, 0) == cuts[-1][0][rank]
    assert cuts[0] == cuts[1]
    tokens = np.array([[lengths[r].sum() for r in step] for step in cuts[0]])
    assert np.all(tokens[:, 0] > 2.5 * tokens[:, 1])  # rank 1, 3x slower per token, gets about a quarter


def test_by_tokens_an_epoch_hands_out_every_sample_once_and_learns_the_cost():
    import hetero

    lengths = np.random.default_rng(3).integers(1, 513, 100)
    bal = hetero.Balance(global_batch=10, collator="packed", rebalance_every=2)
    bal.set_world(0, 1)
    seen = []
    sampler = bal.batch_sampler(100, lengths=lengths)
    for epoch in range(2):
        bal.set_epoch(epoch)
        seen = []
        for idx in sampler:
            with bal.step(len(idx)):
                seen += idx
        assert sorted(seen) == list(range(100))
    assert len(bal.decisions) == 10 and bal.decisions[-1].sizes == [10]
    state = bal.state_dict()
    again = hetero.Balance(global_batch=10, collator="packed", rebalance_every=2)
    again.set_world(0, 1)
    again.batch_sampler(100, lengths=lengths)
    again.load_state_dict(state)
    assert again.state_dict()["costs"] == state["costs"]


def test_a_token_budget_cuts_every_epoch_into_the_same_steps_of_varying_counts_each_sample_once_and_resumes():
    """Two ranks of one world (each its own Balance, no process group): every epoch has ceil(T / budget) steps, the
    loader's length; each step's rows over the ranks are a run of the permutation, and the epoch's runs hold every
    sample once (none dropped, though 100 is no multiple of any step's count); the counts differ between steps."""
    import hetero

    lengths = np.random.default_rng(3).integers(1, 513, 100)
    budget, steps = 5000, -(-int(lengths.sum()) // 5000)
    ranks = []
    for rank in range(2):
        bal = hetero.Balance(token_budget=budget, collator="packed", rebalance_every=2)
        bal.set_world(rank, 2)
        ranks.append((bal, bal.batch_sampler(100, lengths=lengths)))
    assert steps == 6 and all(len(sampler) == steps for _, sampler in ranks)
    for epoch in range(2):
        rows = [[], []]
        for rank, (bal, sampler) in enumerate(ranks):
            bal.set_epoch(epoch)
            rows[rank] = [sampler.rows_at(epoch, step) for step in range(steps)]
        perm, counts = EpochPlan(100, 1, 0, epoch).perm.tolist(), [len(a) + len(b) for a, b in zip(*rows)]
        ends = np.cumsum([0, *counts])
        assert [sorted(a + b) for a, b in zip(*rows)] == [sorted(perm[x:y]) for x, y in zip(ends[:-1], ends[1:])]
        assert ends[-1] == 100 and len(set(counts)) > 1, counts
    state = ranks[0][0].state_dict()
    again = hetero.Balance(token_budget=budget, collator="packed")
    again.set_world(0, 2)
    again.batch_sampler(100, lengths=lengths)
    again.load_state_dict(state)
    other = hetero.Balance(global_batch=16, collator="packed")
    other.set_world(0, 2)
    with pytest.raises(ValueError, match="^a state of token_budget 5000, but this Balance's is None: resume with "
                                         "token_budget=5000$"):
        other.load_state_dict(state)


@pytest.mark.parametrize("micro_batch", [0, 2])
def test_a_token_budget_keeps_a_capped_ranks_forwards_within_its_max_tokens(micro_batch):
    """Steps of a token budget under max_tokens [None, 300], padded: every forward of rank 1 (its whole step, or each
    micro-batch of 2 rows) within 300 tokens, every sample of the epoch in one step."""
    import hetero

    lengths = np.random.default_rng(3).integers(1, 200, 100)
    rows, forwards = [], []
    for rank in range(2):
        bal = hetero.Balance(token_budget=3000, collator="padded", max_tokens=[None, 300], micro_batch=micro_batch)
        bal.set_world(rank, 2)
        sampler = bal.batch_sampler(100, lengths=lengths)
        bal.set_epoch(0)
        forwards.append(list(sampler))
        rows += [sampler.rows_at(0, step) for step in range(bal.position.steps_per_epoch)]
    assert sorted(i for r in rows for i in r) == list(range(100))
    assert max(Cost("padded").work(lengths[b]) for b in forwards[1]) <= 300
    assert max(Cost("padded").work(lengths[b]) for b in forwards[0]) > 300  # the cap bound: rank 0 took more


def test_a_bad_token_budget_is_one_line_before_any_step():
    import hetero

    lengths = np.array([300, 20, 30, 25, 40, 35])  # 450 tokens
    for kwargs, n, line in [
        ({"token_budget": 100}, 6, "^token_budget cuts each step by its samples' tokens: set collator='padded' or "
                                   "'packed'"),
        ({"token_budget": 100, "global_batch": 8, "collator": "padded"}, 6, r"^give global_batch \(samples a step\) "
                                                                            "or token_budget"),
        ({"token_budget": 0, "collator": "padded"}, 6, "^token_budget must be a whole number >= 1"),
        ({"collator": "padded"}, 6, r"^global_batch must be a whole number >= 1 \(got None\)"),
        ({"token_budget": 1000, "collator": "padded"}, 6, "^hetero: token_budget 1000 exceeds the 450 tokens of the 6 "
                                                          "samples$"),
        ({"token_budget": 200, "collator": "padded"}, 6, "^hetero: sample 0 is 300 tokens long, more than the "
                                                         "step's token budget of 200: raise token_budget to at least "
                                                         "300$"),
    ]:
        with pytest.raises(ValueError, match=line) as e:
            bal = hetero.Balance(**kwargs)
            bal.set_world(0, 2)
            bal.batch_sampler(n, lengths=lengths)
        assert "\n" not in str(e.value)
    # 105 tokens in 2 steps of about 52: each holds at most 5 samples, fewer than 2 ranks x min_batch 3, refused
    # before the epoch's first step, naming the step
    bal = hetero.Balance(token_budget=100, collator="padded", min_batch=3)
    bal.set_world(0, 2)
    sampler = bal.batch_sampler(6, lengths=np.array([100, 1, 1, 1, 1, 1]))
    bal.set_epoch(0)
    with pytest.raises(hetero.HeteroError, match=r"^hetero: step 0 of epoch 0 holds \d sample\(s\) \(\d+ tokens\) "
                                                 r"under token_budget 100, fewer than 2 ranks x min_batch 3: raise "
                                                 r"token_budget$"):
        next(iter(sampler))


@pytest.mark.parametrize("kwargs, line", [
    ({"collator": "flat"}, "collator must be None"),
    ({"attention": 0.1}, "attention needs the samples' lengths"),
    ({"loss_mean": "tokens"}, "loss_mean='tokens' needs the samples' lengths"),
    ({"loss_mean": "words", "collator": "padded"}, "loss_mean must be one of samples, tokens"),
    ({"collator": "padded", "attention": -1.0}, "attention must be None \\(fitted\\) or a finite number >= 0"),
    ({"collator": "padded", "scheme": "dp"}, "scheme must be edp or affine"),
    ({"collator": "padded", "sit_out": True, "scheme": "affine"},
     "sit_out does not combine with collator: a split by tokens gives every rank rows"),
    ({"collator": "padded", "max_batch": 8},
     "max_batch caps a rank's rows, and a split by tokens caps its tokens: set max_tokens"),
    ({"max_tokens": 512}, "max_tokens caps the tokens of one forward of a split by tokens: set collator='padded' "
                          "or 'packed'"),
    ({"collator": "padded", "micro_batch": 1, "max_tokens": 0}, "max_tokens must be a whole number >= 1"),
    ({"collator": "padded", "micro_batch": 1, "max_tokens": [512, 1.5]}, "max_tokens must be a whole number >= 1"),
])
def test_a_bad_token_setting_is_one_line(kwargs, line):
    import hetero

    with pytest.raises(ValueError, match=line) as e:
        hetero.Balance(global_batch=8, **kwargs)
    assert "\n" not in str(e.value)


def test_a_bad_lengths_argument_is_one_line():
    import hetero

    L = np.arange(1, 21)
    by_tokens = hetero.Balance(global_batch=4, collator="padded", loss_mean="tokens")
    by_counts = hetero.Balance(global_batch=4)
    cases = [
        (lambda: by_tokens.batch_sampler(20), "give batch_sampler\\(len\\(ds\\), lengths=...\\)"),
        (lambda: by_counts.batch_sampler(20, lengths=L), "build the Balance with collator="),
        (lambda: by_counts.batch_sampler(20, loss_tokens=L), "loss_mean='tokens'"),
        (lambda: by_tokens.batch_sampler(20, lengths=L[:19]), "19 lengths for a data set of 20 samples"),
        (lambda: by_tokens.batch_sampler(20, lengths=L, loss_tokens=L + 1), "loss_tokens\\[0\\] is 2, outside 0..1"),
        (lambda: by_tokens.batch_sampler(20, lengths=L, loss_tokens=L * 0.5), "one whole number per sample"),
        (lambda: by_tokens.replay({0: np.full((5, 1), 4)}), "takes the run's list of decisions \\(bal.decisions\\), "
                                                            "not \\{epoch: sizes\\}"),
    ]
    for call, line in cases:
        with pytest.raises(ValueError, match=line) as e:
            call()
        assert "\n" not in str(e.value)
    by_tokens.set_world(0, 1)
    sampler = by_tokens.batch_sampler(20, lengths=L)
    with pytest.raises(ValueError, match="read sampler.rows_at"):
        sampler.plan(0)
    by_counts.set_world(0, 1)
    with pytest.raises(ValueError, match="rows_at is the split by tokens"):
        by_counts.batch_sampler(20).rows_at(0, 0)


def test_a_state_split_by_counts_is_not_resumed_by_tokens():
    import hetero

    counts = hetero.Balance(global_batch=4)
    counts.set_world(0, 1)
    tokens = hetero.Balance(global_batch=4, collator="padded")
    tokens.set_world(0, 1)
    with pytest.raises(ValueError, match="resume with the collator it was saved with"):
        tokens.load_state_dict(counts.state_dict())


def _costs(effective: int, per_unit: list[float], attention: float = 0.0) -> dict:
    """A decision by tokens as JSON keeps it: where it took effect and the fitted costs it recorded."""
    return {"epoch": 0, "step": effective - 1, "effective": effective, "sizes": [6, 6], "shares": [0.5, 0.5],
            "compute_s": [0.1, 0.1], "fixed_s": [0.0] * len(per_unit), "per_unit_s": [1e-6 * v for v in per_unit],
            "attention": attention}


def test_a_replay_by_tokens_splits_each_step_by_the_costs_in_force_there_on_every_rank():
    """bal.replay(decisions) with a collator: before the first decision's effective position the prior's split,
    from each one's position on the split its recorded costs make (the same as a Balance holding those costs), on
    every rank alike; no decision is made."""
    lengths = np.random.default_rng(7).integers(1, 513, 60)  # 5 steps of 12
    record = [_costs(2, [1.0, 3.0]), _costs(4, [3.0, 1.0])]

    def rows(bal) -> list[list[list[int]]]:
        return [[r.tolist() for r in bal.engine.plan.schedule.rows_at(0, s)] for s in range(5)]

    want = []
    for per_unit in (None, [1.0, 3.0], [3.0, 1.0]):
        bal = _bound(0, 2, "packed", "samples", lengths, None)
        if per_unit is not None:
            _fitted(bal, per_unit)
        want.append(rows(bal))
    assert want[0] != want[1] != want[2] != want[0]  # the three regimes split differently: the control
    for rank in range(2):
        bal = hetero.Balance(global_batch=12, collator="packed", rebalance_every=1)
        bal.set_world(rank, 2)
        bal.replay(record)
        bal.sampler = bal.batch_sampler(60, lengths=lengths)
        assert rows(bal) == [*want[0][:2], *want[1][2:4], want[2][4]]
        bal.set_epoch(0)
        for idx in bal.sampler:
            with bal.step(len(idx)):
                pass
        assert bal.decisions == []


@pytest.mark.parametrize("record, line", [
    ({0: [[6, 6]]}, r"takes the run's list of decisions \(bal.decisions\), not \{epoch: sizes\}"),
    (5, "takes a list of decisions \\(got int\\)"),
    ([], "is empty"),
    ([{**_costs(1, [1.0, 1.0]), "fixed_s": None}], "has decision 0 without fitted costs .*which replays its sizes"),
    ([_costs(2, [1.0, 1.0]), _costs(2, [1.0, 2.0])], "has decision 1 taking effect at 2: .*after the one before"),
    ([_costs(1, [1.0, -1.0])], "has decision 0 with costs .*per_unit_s > 0 per rank"),
    ([_costs(1, [1.0, 1.0], attention=float("nan"))], "has decision 0 with costs .*an attention >= 0"),
    ([_costs(1, [1.0, 1.0]), _costs(2, [1.0, 1.0, 1.0])], "records 2 and 3 ranks in different decisions"),
    ([_costs(1, [1.0, 1.0, 1.0])], "records the costs of 3 rank\\(s\\), but the world has 2"),
])
def test_a_bad_replay_by_tokens_is_one_line(record, line):
    bal = hetero.Balance(global_batch=12, collator="padded")
    bal.set_world(0, 2)
    with pytest.raises(ValueError, match=r"^hetero: bal.replay\(decisions\) of a run by tokens " + line) as e:
        bal.replay(record)
    assert "\n" not in str(e.value)


def test_a_replay_of_a_run_by_counts_still_takes_its_sizes():
    bal = hetero.Balance(global_batch=12)
    bal.set_world(0, 2)
    with pytest.raises(ValueError, match=r"takes a dict of epochs \(got list\)"):
        bal.replay([{**_costs(1, [1.0, 1.0]), "fixed_s": None, "per_unit_s": None}])  # a run by counts' decisions
    # a run by tokens' decisions (HeteroTrainer's default where the lengths vary) to a Balance without a collator
    with pytest.raises(ValueError, match=r"^hetero: bal.replay\(decisions\) of a run by tokens needs the Balance "
                                         r"built with the run's collator \('padded' or 'packed'"):
        bal.replay(json.loads(json.dumps([_costs(1, [1.0, 1.0])])))


def test_a_collator_said_at_the_sampler_splits_by_tokens_and_is_refused_where_it_cannot():
    import hetero
    from hetero.core.agree import HeteroError

    L = np.random.default_rng(5).integers(1, 513, 40)
    bal = hetero.Balance(global_batch=8, rebalance_every=2)
    bal.set_world(0, 2)
    sampler = bal.batch_sampler(40, lengths=L, collator="packed")
    assert bal.settings.collator == "packed" and len(sampler.rows_at(0, 0)) >= 1
    state = bal.state_dict()
    assert "costs" in state
    with pytest.raises(ValueError, match="the Balance splits with collator='packed', and batch_sampler says "
                                         "collator='padded': say one"):
        bal.batch_sampler(40, lengths=L, collator="padded")
    cases = [({"scheme": "dp"}, None, "scheme must be edp or affine"),
             ({}, "replay", r"replay\(\) records sizes"),
             ({}, "step", "after attach, a step or a resume")]
    for kw, before, line in cases:
        other = hetero.Balance(global_batch=8, **kw)
        other.set_world(0, 1)
        if before == "replay":
            other.replay({0: np.full((5, 1), 8)})
        if before == "step":
            other.batch_sampler(40)
            other.set_epoch(0)
            other.begin_step()
            other.end_step()
        with pytest.raises((ValueError, HeteroError), match=line) as e:
            other.batch_sampler(40, lengths=L, collator="padded")
        assert "\n" not in str(e.value)


# -- max_tokens: each rank's cap on a micro-batch's tokens ----------------------------------------------------------
def _capped(rank: int, world: int, lengths, max_tokens, m: int = 2, B: int = 12, min_batch: int = 1,
            collator: str = "padded"):
    import hetero

    bal = hetero.Balance(global_batch=B, collator=collator, micro_batch=m, max_tokens=max_tokens, min_batch=min_batch)
    bal.set_world(rank, world)
    bal.sampler = bal.batch_sampler(len(lengths), lengths=lengths)
    return bal


@pytest.mark.parametrize("collator", ["padded", "packed"])
def test_max_tokens_cuts_each_ranks_micro_batches_within_its_cap_and_long_samples_go_to_the_rank_that_holds_them(
        collator):
    """Rank 1 holds 200 tokens a micro-batch, rank 0 1024; micro-batches of at most 3 rows: every micro-batch of
    either rank within its cap (padded: rows x the longest; packed: the sum) and 3 rows, the rank's rows each once,
    more micro-batches than by count where the cap binds, every sample of the epoch once; what the sampler hands out
    is that cut, and bal.micro_batches counts it. Without the caps rank 1 gets longer rows (the control)."""
    lengths = np.random.default_rng(5).integers(1, 513, 96)
    lengths[::3] = np.random.default_rng(6).integers(1, 60, 32)  # a third short, so every step can feed rank 1
    cost = Cost(collator)
    for caps in ([1024, 200], None):
        seen, longest, cut_more = [], [], False
        for rank in range(2):
            bal = _capped(rank, 2, lengths, caps, m=3, collator=collator)
            bal.set_epoch(0)
            sched = bal.engine.plan.schedule
            assert bal.micro_batches == len(sched.micro_at(0, 0)[rank])
            handed = list(bal.sampler)
            micro = [b.tolist() for s in range(8) for b in sched.micro_at(0, s)[rank]]
            assert handed == micro
            for s in range(8):
                batches, rows = sched.micro_at(0, s)[rank], sched.rows_at(0, s)[rank]
                assert sorted(i for b in batches for i in b) == sorted(rows)
                cut_more |= len(batches) > -(-len(rows) // 3)
            assert all(len(b) <= 3 for b in micro)
            if caps is not None:
                assert all(cost.work(lengths[b]) <= caps[rank] for b in micro), rank
            seen += [i for b in micro for i in b]
            longest.append(max(lengths[b].max() for b in micro))
        assert sorted(seen) == list(range(96))
        assert (longest[1] <= 200) == (caps is not None), longest
        assert cut_more == (caps is not None)


def test_a_sample_longer_than_every_ranks_cap_is_refused_at_the_sampler_naming_it():
    lengths = np.full(24, 50)
    lengths[17] = 300
    with pytest.raises(ValueError) as e:
        _capped(0, 2, lengths, [256, 128])
    assert str(e.value) == ("hetero: sample 17 is 300 tokens long, more than any rank's max_tokens (the largest is "
                            "256): raise max_tokens (1 sample(s) too long)")
    _capped(0, 2, lengths, [300, 128])  # 300 on rank 0, a micro-batch of its own: taken


def _refusals(lengths, caps, m: int = 2) -> set[str]:
    """The line each of 2 ranks stops with at its sampler's first step (one set: the same line on every rank)."""
    from hetero.core.agree import HeteroError

    lines = set()
    for rank in range(2):
        bal = _capped(rank, 2, lengths, caps, m=m)
        bal.set_epoch(0)
        with pytest.raises(HeteroError) as e:
            next(iter(bal.sampler))
        lines.add(str(e.value))
    return lines


def test_an_epoch_with_a_step_that_cannot_feed_a_capped_rank_is_refused_before_its_first_step():
    """Rank 1 holds micro-batches of at most 80 tokens; a step whose 12 samples are all longer is found when the
    epoch's first step is cut, on every rank alike, naming the step (the same windows everywhere)."""
    from hetero.core.sampler import EpochPlan

    lengths = np.full(48, 30)
    window = EpochPlan(48, 12, 0, 0).perm[24:36].numpy()  # step 2 of epoch 0
    lengths[window] = 100
    assert _refusals(lengths, [1024, 80]) == {
        "hetero: step 2 of epoch 0 cannot give rank 1 1 row(s) of at most 80 tokens (its max_tokens) beside the ranks "
        "holding less: its 12 samples are 100-100 tokens long; raise rank 1's max_tokens or the global batch"}
    lengths[window[0]] = 30  # one short sample in the step: fed
    bal = _capped(0, 2, lengths, [1024, 80])
    bal.set_epoch(0)
    assert next(iter(bal.sampler))


def test_max_tokens_per_rank_entries_must_match_the_world():
    lengths = np.full(24, 5)
    with pytest.raises(ValueError, match="^hetero: max_tokens has 3 entries for 2 ranks$"):
        _capped(0, 2, lengths, [64, 64, 64])
    _capped(0, 2, lengths, [64, None])  # None: no cap on that rank


def test_the_split_cost_table_times_each_layout_size_and_world():
    """python -m hetero.lab.tokensim --split-cost (docs/balancers.md#tokens): one row per layout, size and world,
    each a positive time (a smoke test: the figure is the host's, never a verdict)."""
    from hetero.lab.tokensim import split_cost

    rows = split_cost(sizes=(8, 16), worlds=(2,), repeats=1)
    assert [(r["collator"], r["samples"], r["ranks"]) for r in rows] == [
        ("padded", 8, 2), ("padded", 16, 2), ("packed", 8, 2), ("packed", 16, 2)]
    assert all(0 < r["fastest_ms"] <= r["median_ms"] for r in rows)


def _held(L: np.ndarray, collator: str) -> float:
    """A rank's rows' tokens as its collator lays them out in one forward (padded: rows x the longest)."""
    return Cost(collator).parts(L)[0]


@pytest.mark.parametrize("collator", ["padded", "packed"])
def test_a_split_keeps_each_ranks_whole_rows_within_its_total_of_tokens(collator):
    """split(totals=...): without micro-batches a rank's step is one forward, so its rows together (padded: rows x the
    longest; packed: their sum) stay within its total, every sample once and min_rows each, or no split is found
    (ValueError). Without the totals the same steps overflow them (the control: the cap binds)."""
    rng = np.random.default_rng(11)
    split_found = over_without = 0
    for _ in range(300):
        n = int(rng.integers(2, 5))
        L = rng.integers(1, 300, int(rng.integers(n, 40)))
        a, c = rng.random(n) * 1e-3, rng.uniform(0.5, 3, n) * 1e-6
        totals = rng.integers(300, 4000, n).astype(float)
        if rng.random() < 0.3:
            totals[int(rng.integers(n))] = np.inf  # a rank without a cap
        try:
            parts = split(L, a, c, Cost(collator), min_rows=1, totals=totals)
        except ValueError as e:
            assert "no split" in str(e) or "more than any rank can hold" in str(e), e
            continue
        split_found += 1
        assert sorted(np.concatenate(parts).tolist()) == list(range(L.size))
        assert all(len(p) >= 1 for p in parts)
        assert all(_held(L[p], collator) <= t for p, t in zip(parts, totals)), (L, totals, parts)
        free = split(L, a, c, Cost(collator), min_rows=1)
        over_without += any(_held(L[p], collator) > t for p, t in zip(free, totals))
    assert split_found > 150 and over_without > 20, (split_found, over_without)


@pytest.mark.parametrize("collator", ["padded", "packed"])
def test_max_tokens_without_micro_batches_keeps_each_ranks_step_within_its_cap(collator):
    """A Balance with max_tokens and no micro_batch (a rank's step is one forward): over an epoch every rank's rows of
    every step within its cap as its collator lays them out, every sample once, what the sampler hands out; without
    the caps rank 1 gets more (the control)."""
    lengths = np.random.default_rng(7).integers(1, 200, 96)
    for caps in ([4096, 700], None):
        seen, most = [], []
        for rank in range(2):
            bal = _capped(rank, 2, lengths, caps, m=0, collator=collator)
            bal.set_epoch(0)
            sched = bal.engine.plan.schedule
            handed = list(bal.sampler)
            assert handed == [sched.rows_at(0, s)[rank].tolist() for s in range(8)]
            if caps is not None:
                assert all(_held(lengths[b], collator) <= caps[rank] for b in handed), rank
            seen += [i for b in handed for i in b]
            most.append(max(_held(lengths[b], collator) for b in handed))
        assert sorted(seen) == list(range(96))
        assert (most[1] <= 700) == (caps is not None), most


def test_an_epoch_with_a_step_that_cannot_split_within_the_caps_is_refused_before_its_first_step():
    """Without micro-batches: a step whose samples cannot be shared within the ranks' max_tokens is found when the
    epoch's first step is cut, on every rank alike, naming the step and what to set."""
    from hetero.core.agree import HeteroError
    from hetero.core.sampler import EpochPlan

    lengths = np.full(48, 20)
    window = EpochPlan(48, 12, 0, 0).perm[24:36].numpy()  # step 2 of epoch 0
    lengths[window] = 90  # 12 x 90 tokens padded: more than 600 + 400
    assert _refusals(lengths, [600, 400], m=0) == {
        "hetero: step 2 of epoch 0 cannot split its 12 samples (90-90 tokens long, 1080 in all) within the ranks' "
        "max_tokens [600, 400] with 1 row(s) each, padded: raise max_tokens, or give micro_batch (a rank's rows in "
        "several forwards)"}
    bal = _capped(0, 2, lengths, [700, 400], m=0)  # 7 + 4 rows of 90: 11 of 12, still short
    bal.set_epoch(0)
    with pytest.raises(HeteroError):
        next(iter(bal.sampler))
    bal = _capped(0, 2, lengths, [720, 400], m=0)  # 8 + 4: fits
    bal.set_epoch(0)
    assert next(iter(bal.sampler))


def test_a_step_whose_fitted_split_finds_no_room_takes_the_priors_split_checked_before_the_epoch():
    """Packed, no micro-batches, caps of 258 and 734 tokens: under these fitted costs the search finds no split of
    this step within the caps (split raises), while the prior's (checked before the epoch) fits; the step takes that
    one, within both caps, every sample once."""
    lengths = np.array([37, 127, 113, 130, 63, 184, 146, 165])
    fitted = np.array([1.832661859442005, 1.1915786093078993])
    with pytest.raises(ValueError, match="no split"):
        split(lengths, np.zeros(2), fitted, Cost("packed"), totals=[258.0, 734.0])
    bal = _capped(0, 2, lengths, [258, 734], m=0, B=8, collator="packed")
    bal.set_epoch(0)
    sched = bal.engine.plan.schedule
    costs = CostModel(2, attention=0.0)
    costs.per_unit_s = fitted
    rows = sched._split(costs, 0, 0)
    assert sorted(np.concatenate(rows).tolist()) == list(range(8))
    assert [int(lengths[r].sum()) <= cap for r, cap in zip(rows, (258, 734))] == [True, True]


# the cases that launch processes
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
# a token budget in place of B: ceil(18,979 / 6,400) = 3 steps an epoch of about 6,326 tokens, 28, 21 and 23 samples
BUDGET = {"budget-padded-tokens": 6400, "budget-packed-samples": 6400, "budget-micro2-padded-samples": 6400,
          "fsdp2-budget-packed-tokens": 6400, "budget-weights-of-a-fixed-batch": 6400}
MICRO["budget-micro2-padded-samples"] = 2
MICRO["replay-micro2-padded-tokens"] = 2

CASES = {  # name: (collator, the Balance's loss_mean, the loss the loop computes, the model keeps documents apart,
    #               a weight the loop sets: False, "equal" 1 / world, "fixed" its count over an epoch's mean count)
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
    # a token budget: steps of varying counts, each weighed over its own (every sample of the epoch in one step)
    "budget-padded-tokens": ("padded", "tokens", "tokens", True, False),
    "budget-packed-samples": ("packed", "samples", "samples", True, False),
    "budget-micro2-padded-samples": ("padded", "samples", "samples", True, False),
    "fsdp2-budget-packed-tokens": ("packed", "tokens", "tokens", True, False),
    # bal.replay of the run above (its decisions as plain dicts, as JSON keeps them): the same split, no decision
    "replay-packed-tokens": ("packed", "tokens", "tokens", True, False),
    "replay-micro2-padded-tokens": ("padded", "tokens", "tokens", True, False),
    # negative controls: each must miss the reference of its loss
    "sample-weights-for-a-token-mean": ("padded", "samples", "tokens", True, False),
    "equal-weights": ("padded", "tokens", "tokens", True, "equal"),
    "budget-weights-of-a-fixed-batch": ("padded", "samples", "samples", True, "fixed"),  # b_i over N / steps
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
    for name, (collator, mean, loss_mean, documents, weight) in CASES.items():
        net = tokenlm.PrefixLM(documents=documents)
        ddp = fully_shard(net) if name.startswith("fsdp2") else DDP(net)
        m = MICRO.get(name, 0)
        caps = [None] * (world - 1) + [CAPS[name]] if name in CAPS else None
        bal = hetero.Balance(global_batch=None if name in BUDGET else B, token_budget=BUDGET.get(name),
                             collator=collator, loss_mean=mean, rebalance_every=1, micro_batch=m,
                             max_tokens="probe" if name.startswith("probed") else caps)
        if name.startswith("probed"):  # the probe's search runs on the CPU as on a GPU, before DDP
            hetero.core.probe.probe_max_tokens = fitting_tokens
            probed = bal.probe(OutOfMemoryAbove(OOM if rank == world - 1 else 10**9), device=torch.device("cpu"),
                               max_length=512)
            assert probed == [1024.0] * (world - 1) + [0.9 * OOM], probed  # every rank's, gathered
        if name.startswith("replay-"):
            bal.replay(json.loads(json.dumps(result[name.removeprefix("replay-")]["decisions"])))
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
            # with micro-batches, this micro-batch's mean as its sum over this rank's count for the step
            scale = tokenlm.micro_scale(idx, sampler.rows_at(0, step), counted, loss_mean) if m else 1.0
            batch = tokenlm.collate(idx, tokens, labels, collator)
            with bal.step(len(idx)):
                if weight:  # (no micro-batches in these cases)
                    bal.set_weight(1 / world if weight == "equal" else len(idx) * len(sampler) / N)
                (scale * tokenlm.loss(ddp, batch, loss_mean, len(idx))).backward()
                if bal.sync_now:
                    opt.step()
                    opt.zero_grad()
            if bal.position.step > step:  # the step ended
                full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in ddp.parameters()]  # collective
                params.append(torch.cat([p.detach().flatten() for p in full]).tolist())
        result[name] = {"rows": rows, "params": params, "batches": batches,
                        "decisions": [dataclasses.asdict(d) for d in bal.decisions]}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def launched(request, tmp_path_factory):
    world = request.param
    return world, spawned(_worker, tmp_path_factory.mktemp(f"tokens{world}"), world, (world,))


def _windows(ranks: list[dict], name: str) -> list[list[int]]:
    """Each step's window of the permutation: B samples; under a token budget the epoch's consecutive runs, as many
    as ceil(its tokens / the budget), each within one sample's length of an even share of the tokens, every sample in
    one."""
    perm = EpochPlan(N, B, 0, 0).perm.tolist()
    if name not in BUDGET:
        return [perm[s * B:(s + 1) * B] for s in range(N // B)]
    lengths, counts = tokenlm.corpus(N)[0], [sum(len(part) for part in parts) for parts in zip(*(r[name]["rows"]
                                                                                              for r in ranks))]
    steps, total = -(-int(lengths.sum()) // BUDGET[name]), int(lengths.sum())
    assert len(counts) == steps and sum(counts) == N and len(set(counts)) > 1, counts  # counts vary, all covered
    ends = np.cumsum([0, *counts])
    windows = [perm[a:b] for a, b in zip(ends[:-1], ends[1:])]
    assert all(abs(lengths[w].sum() - total / steps) <= lengths.max() for w in windows)
    return windows


def _steps(ranks: list[dict], name: str) -> list[list[int]]:
    """Each step's samples over every rank (sorted), checked to be exactly the step's window of the permutation."""
    per_rank = [r[name]["rows"] for r in ranks]
    steps = []
    for s, (parts, window) in enumerate(zip(zip(*per_rank), _windows(ranks, name))):
        union = sorted(i for part in parts for i in part)
        assert union == sorted(window), f"{name}: step {s} is not its window"
        assert all(parts), f"{name}: step {s} left a rank without rows"
        steps.append(union)
    return steps


def _miss(got: list[float], want: list[float]) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))))


@pytest.mark.launch
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[1] == c[2] and c[3] and not c[4]])
def test_a_split_by_tokens_equals_one_process_on_the_unpacked_union(launched, name):
    world, ranks = launched
    steps, windows = _steps(ranks, name), _windows(ranks, name)
    assert sorted(i for s in steps for i in s) == sorted(i for w in windows for i in w)
    assert len({i for s in steps for i in s}) == sum(map(len, windows))  # coverage: every sample of the epoch once
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
    # not the split by counts: rank 0's rows are not the window's head
    assert any(sorted(r0) != sorted(w[:len(r0)]) for w, r0 in zip(windows, ranks[0][name]["rows"]))


@pytest.mark.launch
@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("replay-")])
def test_a_replay_by_tokens_splits_every_step_as_the_run_did_and_decides_nothing(launched, name):
    """bal.replay(the run's decisions, through JSON): every rank takes the rows it took in the run at every step,
    the parameters after every step are the run's to the bit, and the replay makes no decision."""
    world, ranks = launched
    run = name.removeprefix("replay-")
    for r in ranks:
        assert r[run]["decisions"] and all(d["per_unit_s"] is not None and len(d["per_unit_s"]) == world
                                           for d in r[run]["decisions"])
        assert r[name]["rows"] == r[run]["rows"] and r[name]["batches"] == r[run]["batches"]
        assert r[name]["params"] == r[run]["params"]
        assert r[name]["decisions"] == []


@pytest.mark.launch
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not (c[1] == c[2] and c[3] and not c[4])])
def test_a_negative_control_misses_the_reference(launched, name):
    world, ranks = launched
    steps = _steps(ranks, name)
    _, tokens, labels = tokenlm.corpus(N)
    want = tokenlm.reference(steps, tokens, labels, CASES[name][2], LR)
    assert _miss(ranks[0][name]["params"][2], want[2]) > 1e-4
