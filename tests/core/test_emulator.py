"""The HETERO grammar and the emulator's delays."""
import numpy as np
import pytest

from hetero.core.emulator import Emulator, parse_hetero


def test_grammar():
    spec = parse_hetero("1:delay=0.1, 2:gamma=2/0.05@3-5, 0:exp=0.02@s10-, 3:slowdown=3@cycle=40/10")
    assert sorted(spec) == [0, 1, 2, 3]
    assert spec[1][0].params == (0.1,) and spec[1][0].window is None
    assert spec[2][0].window == ("epoch", 3, 5)
    assert spec[0][0].window == ("step", 10, None)
    assert spec[3][0].window == ("cycle", 40, 10)
    assert parse_hetero("") == {}


@pytest.mark.parametrize("bad", ["1:delay", "x:delay=1", "1:delay=-1", "1:delay=nan", "1:delay=inf",
                                 "1:warp=2", "1:gamma=2", "1:slowdown=0.5", "1:delay=1@5-2", "1:delay=1@0-2",
                                 "1:delay=1@cycle=4/5", "1:delay=1@later"])
def test_bad_specs(bad):
    with pytest.raises(ValueError):
        parse_hetero(bad)


def test_delays_windows_and_reproducibility():
    e = Emulator("1:delay=0.1@2-3,1:slowdown=3", rank=1, seed=0)
    e.start_epoch(1)
    assert e.delay_s(1, 0, compute_s=0.5) == pytest.approx(1.0)          # (3-1) x 0.5, delay not active
    assert e.delay_s(2, 0, compute_s=0.5) == pytest.approx(1.1)
    assert Emulator("1:delay=0.1", rank=0, seed=0).effects == []           # roles follow the global rank
    g1, g2 = Emulator("0:gamma=2/0.05", 0, 7), Emulator("0:gamma=2/0.05", 0, 7)
    g1.start_epoch(4), g2.start_epoch(4)
    d = [g1.delay_s(4, s, 0) for s in range(2000)]
    assert d[:5] == [g2.delay_s(4, s, 0) for s in range(5)]
    assert np.mean(d) == pytest.approx(0.1, rel=0.1)
    cyc = Emulator("0:delay=1@cycle=4/1", 0, 0)
    assert [cyc.delay_s(1, s, 0) for s in range(8)] == [1, 0, 0, 0, 1, 0, 0, 0]


def _old_delay_s(effects, rng, epoch, step, compute_s):
    """The emulator's per-step formula before the effects were vectorised: the trainer must draw the same."""
    total = 0.0
    for e in effects:
        if not e.active(epoch, step):
            continue
        if e.kind == "delay":
            total += e.params[0]
        elif e.kind == "exp":
            total += rng.exponential(e.params[0]) if e.params[0] > 0 else 0.0
        elif e.kind == "gamma":
            total += rng.gamma(e.params[0], e.params[1])
        else:
            total += (e.params[0] - 1.0) * compute_s
    return total


def test_delays_are_bit_identical_to_the_per_step_formula():
    spec = ("0:exp=0.02@s5-40, 0:gamma=0.5/0.04@cycle=7/3, 0:slowdown=2.5@2-, 0:delay=0.003, 0:exp=0@s3-, "
            "0:gamma=2/0.01@1-1")
    new = Emulator(spec, 0, seed=11)
    effects, compute = new.effects, np.random.default_rng(1).uniform(0.01, 0.1, 300)
    for epoch in (1, 2, 3):
        new.start_epoch(epoch)
        old_rng = np.random.default_rng()
        old_rng.bit_generator.state = new.rng.bit_generator.state  # the same seeded generator
        for step in range(100 * (epoch - 1), 100 * epoch):
            c = float(compute[step])
            assert new.delay_s(epoch, step, c) == _old_delay_s(effects, old_rng, epoch, step, c)
        assert new.rng.bit_generator.state == old_rng.bit_generator.state  # the same number of draws


def test_vectorised_windows_match_the_grammar():
    from hetero.core.emulator import active
    effects = [e for es in parse_hetero("0:delay=1@2-3, 0:delay=1@s4-6, 0:delay=1@cycle=5/2, 0:delay=1@s8-").values()
               for e in es]
    on = active(effects, 2, np.arange(12))
    assert on[0].all() and not active(effects, 4, np.arange(3))[0].any()
    assert np.flatnonzero(on[1]).tolist() == [4, 5, 6]
    assert np.flatnonzero(on[2]).tolist() == [0, 1, 5, 6, 10, 11]
    assert np.flatnonzero(on[3]).tolist() == [8, 9, 10, 11]


def test_mean_effects_is_what_the_draws_average_to():
    from hetero.core.emulator import mean_effects, sample_effects
    effects = parse_hetero("0:exp=0.02, 0:gamma=2/0.05, 0:slowdown=3, 0:delay=0.01")[0]
    factor, mean = mean_effects(effects)
    assert factor.tolist() == [0, 0, 2, 0] and mean == pytest.approx([0.02, 0.1, 0, 0.01])
    compute = np.full(20000, 0.5)
    drawn = sample_effects(effects, np.ones((4, len(compute)), bool), compute, np.random.default_rng(0))
    assert drawn.mean(1) == pytest.approx(factor * 0.5 + mean, rel=0.03)
    off = sample_effects(effects, np.zeros((4, 3), bool), compute[:3], np.random.default_rng(0))
    assert not off.any()
