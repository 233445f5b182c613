"""Partition maths: batch sizes sum exactly, bounds hold, the paper's rule has equal step times as fixed point."""
import numpy as np
import pytest

from hetero.core.balancer import Balancer
from hetero.core.partition import batch_sizes, check_feasible, proportional_shares, sustained_s


def test_batch_sizes_random_properties():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 17))
        lo = int(rng.integers(0, 4))
        B = int(rng.integers(max(n * lo, 1), 600))
        hi = None if rng.random() < 0.5 else int(rng.integers(max(lo, -(-B // n)), B + 2))
        shares = rng.dirichlet(np.ones(n)) * (rng.random(n) > 0.2)
        if shares.sum() == 0:
            shares[0] = 1.0
        b = batch_sizes(shares, B, lo, hi)
        assert b.dtype.kind == "i" and b.sum() == B
        assert b.min() >= lo and (hi is None or b.max() <= hi)
        if hi is None and lo <= 1:  # unconstrained: within one sample of the exact proportional split
            assert np.all(np.abs(b - np.maximum(shares / shares.sum() * B, lo)) < 1 + n * lo)


def _bisected(w, total, lo, hi):
    """The real split by plain bisection on the multiplier to rounding error (what _water_fill solved before its
    kinks were used): the reference the fast solver must match."""
    lam_lo, lam_hi = 0.0, float(np.max(hi[w > 0] / w[w > 0]))
    for _ in range(400):
        mid = 0.5 * (lam_lo + lam_hi)
        if not lam_lo < mid < lam_hi:
            break
        lam_lo, lam_hi = (mid, lam_hi) if np.clip(mid * w, lo, hi).sum() < total else (lam_lo, mid)
    return np.clip(lam_hi * w, lo, hi)


def test_water_fill_solves_on_its_kinks_what_bisection_finds():
    from hetero.core.partition import _water_fill

    rng = np.random.default_rng(1)
    for _ in range(3000):
        n = int(rng.integers(1, 12))
        w = rng.random(n) * (rng.random(n) > 0.2)
        w[0] = w[0] or 0.5  # at least one weighted rank
        lo = rng.integers(0, 3, n).astype(float)
        hi = np.where(rng.random(n) < 0.5, rng.integers(3, 200, n), 1e9).astype(float)
        total = float(rng.uniform(lo.sum(), min(hi[w > 0].sum() + lo[w == 0].sum(), 2000)))
        x = _water_fill(w, total, lo, hi)
        assert abs(x.sum() - total) < 1e-6 * max(total, 1) and np.all(x >= lo - 1e-9) and np.all(x <= hi + 1e-9)
        assert np.allclose(x, _bisected(w, total, lo, hi), rtol=1e-6, atol=1e-6), (w, total, lo, hi)


def test_water_fill_sums_every_kink_at_once_to_the_bits_of_its_bisection(monkeypatch):
    """A few ranks' kinks are summed in one numpy call (issue 51: a decision's cost): the same split, bit for bit, as
    the bisection over them that larger worlds keep."""
    from hetero.core import partition

    rng = np.random.default_rng(2)
    cases = []
    for _ in range(2000):
        n = int(rng.integers(1, 40))
        w = rng.random(n) * (rng.random(n) > 0.2)
        w[0] = w[0] or 0.5
        lo = rng.integers(0, 3, n).astype(float)
        hi = np.where(rng.random(n) < 0.5, rng.integers(3, 200, n), 1e9).astype(float)
        total = float(rng.choice([rng.uniform(lo.sum(), min(hi[w > 0].sum() + lo[w == 0].sum(), 2000)),
                                  int(lo.sum()) + 1]))  # a whole total, where a kink's sum can equal it exactly
        cases.append((w, total, lo, np.minimum(hi, total)))
    at_once = [partition._water_fill(*c) for c in cases]
    monkeypatch.setattr(partition, "SMALL_FILL", 0)
    for c, x in zip(cases, at_once):
        assert partition._water_fill(*c).tobytes() == x.tobytes(), c


def test_batch_sizes_exact_cases():
    assert batch_sizes([0.5, 0.5], 256).tolist() == [128, 128]
    assert batch_sizes([1, 1, 1], 250).sum() == 250          # 250 and 100 broke the first implementation
    assert batch_sizes([1, 1, 1], 100).tolist() in ([34, 33, 33], [33, 34, 33], [33, 33, 34])
    assert batch_sizes([1.0, 0.0], 256, min_batch=1).tolist() == [255, 1]  # never a zero share (deadlock)
    assert batch_sizes([0.9, 0.1], 100, min_batch=20).tolist() == [80, 20]
    assert batch_sizes([0.9, 0.1], 100, max_batch=60).tolist() == [60, 40]


def test_infeasible_bounds_fail_clearly():
    with pytest.raises(ValueError, match="smaller than 4 ranks"):
        check_feasible(4, 3, 1)
    with pytest.raises(ValueError, match="exceeds"):
        batch_sizes([1, 1], 100, 1, 40)


def test_proportional_rule_fixed_point_is_equal_step_time():
    # Step time proportional to batch: t_i = b_i * c_i. Iterating the paper's rule converges to equal t_i.
    c = np.array([1.0, 3.0, 1.5, 0.5])
    shares = np.full(4, 0.25)
    for _ in range(20):
        b = shares * 1024
        shares = proportional_shares(b, b * c)
    assert shares.sum() == pytest.approx(1.0)
    t = shares * 1024 * c
    assert np.ptp(t) / t.mean() < 1e-9
    assert shares == pytest.approx((1 / c) / (1 / c).sum())
    # ... and equal step times are a fixed point: the rule leaves them unchanged.
    assert proportional_shares(shares * 1024, t) == pytest.approx(shares)


def test_balancer_static_never_moves_and_proportional_follows_speed():
    static = Balancer("static", 2, 256)
    static.observe([[128, 128]], [[1.0, 3.0]])
    assert not static.decide() and static.sizes.tolist() == [128, 128]
    dp = Balancer("proportional", 2, 256)
    dp.observe([[128, 128]] * 4, [[1.0, 3.0]] * 4)
    assert dp.decide() and dp.sizes.tolist() == [192, 64]
    assert dp.shares.sum() == pytest.approx(1.0)


def test_balancer_state_roundtrip():
    a = Balancer("proportional", 3, 300, smoothing=0.5)
    a.observe([[100, 100, 100]], [[1.0, 2.0, 4.0]])
    a.decide()
    b = Balancer("proportional", 3, 300, smoothing=0.5)
    b.load_state_dict(a.state_dict())
    assert b.sizes.tolist() == a.sizes.tolist() and b.shares == pytest.approx(a.shares)


def test_balancer_resumed_under_lower_limits_keeps_them():
    a = Balancer("proportional", 2, 256)
    a.observe([[128, 128]] * 4, [[3.0, 1.0]] * 4)
    a.decide()
    assert a.sizes.tolist() == [64, 192]
    b = Balancer("proportional", 2, 256, max_batch=[256, 150])  # e.g. a GPU probed again with less memory free
    b.load_state_dict(a.state_dict())
    assert b.sizes.tolist() == [106, 150] and b.shares == pytest.approx(a.shares)


def test_a_quota_sustains_a_ranks_cpu_at_its_rate_and_no_faster():
    """sustained_s: a rank under a quota takes at least its step's CPU x period / quota, less the step's rest; a
    step that took longer keeps its time; a rank without a quota, or a step whose CPU was not measured, as measured."""
    compute = np.array([[0.050, 0.020], [0.050, 0.090], [0.050, 0.020]])
    cpu = np.array([[0.050, 0.018], [0.050, 0.018], [0.050, np.nan]])
    got = sustained_s(compute, cpu, [np.inf, 0.033], [np.inf, 0.1], overhead_s=0.004)
    fluid = 0.018 * 0.1 / 0.033 - 0.004  # 50.5 ms: the quota's third of a core, less the all-reduce
    assert got[:, 0].tolist() == compute[:, 0].tolist()
    assert got[:, 1] == pytest.approx([fluid, 0.090, 0.020])
    assert (sustained_s(compute, None, [np.inf, 0.033], [np.inf, 0.1]) == compute).all()
    assert (sustained_s(compute, cpu, None, None) == compute).all()


def test_the_even_split_a_decision_is_read_against_follows_the_bounds():
    """predicted()'s even split is made once per set of bounds (a decision's read-out), and made again when a probe
    lowers a rank's largest batch: plain DDP under the new bounds, never the old split."""
    b = Balancer("proportional", 2, 100)
    b.observe(np.array([[50, 50]] * 4), np.array([[0.05, 0.15]] * 4))
    b.decide()
    chosen, even = b.predicted()
    assert even == pytest.approx(0.15)  # 50/50 at rank 1's 3 ms a sample
    b.bound([80, 30])  # rank 1 now holds at most 30: the even split within bounds is 70/30
    assert b.predicted()[1] == pytest.approx(max(70 * 0.001, 30 * 0.003))


@pytest.mark.parametrize("rule", ["proportional", "affine"])
def test_a_regimes_snapshot_keeps_its_state_while_the_live_balancer_decides_on(rule):
    """schedule.adopt keeps a snapshot of the live balancer as a regime (a shallow copy: issue 51, a deepcopy cost a
    decision 80 µs): the live one's later observations and decisions leave the regime's sizes and state as they
    were, and the copy is whole (its state is the live one's at the time)."""
    import json

    from hetero.core.tokens import CostModel

    rng = np.random.default_rng(3)
    live = Balancer(rule, 3, 60, deadband=0.0, significance=0.0, windows_kept=3)

    def window(b):
        sizes = np.array([b.sizes_for_step(i) for i in range(8)])
        return sizes, sizes * np.array([1.0, 2.0, 3.0]) * 1e-3 * (1 + 0.1 * rng.random(sizes.shape))

    for _ in range(2):
        live.observe(*window(live))
        live.decide()
    live.observe(*window(live))  # pending observations, shared by a copy that does not copy its lists
    frozen = live.snapshot()
    before = json.dumps(frozen.state_dict())
    assert before == json.dumps(live.state_dict())
    sizes = [frozen.sizes_for_step(i).tolist() for i in range(20)]
    for _ in range(3):
        live.set_quota([0.5, np.inf, np.inf], [1.0, np.inf, np.inf])
        live.decide()
        live.observe(*window(live))
    assert json.dumps(live.state_dict()) != before  # the live one moved on
    assert json.dumps(frozen.state_dict()) == before
    assert [frozen.sizes_for_step(i).tolist() for i in range(20)] == sizes

    costs = CostModel(3)
    costs.observe(rng.integers(1, 100, (6, 3)), rng.random((6, 3)))
    kept = costs.snapshot()
    was = json.dumps(kept.state_dict())
    costs.observe(rng.integers(1, 100, (6, 3)), rng.random((6, 3)))
    assert json.dumps(costs.state_dict()) != was and json.dumps(kept.state_dict()) == was
