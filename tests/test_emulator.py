"""The HETERO grammar and the emulator's delays."""
import numpy as np
import pytest

from hetero.emulator import Emulator, parse_hetero


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
