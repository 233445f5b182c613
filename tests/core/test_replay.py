"""bal.replay (issue #48 item 4 and its traceback bullet): a record that does not cover what the loop runs is one
`hetero:` line, at replay(), at bind (the world known) or when the epoch length is known, never a KeyError from
the plan, an IndexError from the sampler, or a sampler cut for ranks that do not exist."""
from __future__ import annotations

import numpy as np
import pytest

import hetero


def _lone(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg.startswith("hetero: ") and "\n" not in msg, msg
    return msg


def test_a_replay_of_two_ranks_in_a_world_of_one_is_refused_at_bind(monkeypatch):
    """Item 4: rank 0 got 4 of each step's 8 samples, the other 4 went to a rank that does not exist, and half of
    each epoch was never trained, with exit 0."""
    _lone(monkeypatch)
    bal = hetero.Balance(global_batch=8)
    bal.replay({0: [[4, 4], [4, 4]]})
    loader = bal.batch_sampler(16)
    with pytest.raises(ValueError) as e:
        bal.set_epoch(0)  # the world (of one) is bound here
    assert "records 2 rank(s), but the world has 1" in _one_line(e.value)
    with pytest.raises(ValueError, match="records 2 rank"):
        list(loader)  # nothing is handed out either


def test_a_replay_of_another_width_is_refused_when_the_world_is_already_known(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=8)  # bound to rank 0 of 2 at construction
    with pytest.raises(ValueError) as e:
        bal.replay({0: [[8]] * 2})
    assert "records 1 rank(s), but the world has 2" in _one_line(e.value)


def test_a_replay_given_before_a_launcher_binds_the_world_is_checked_then(monkeypatch):
    """Lightning's own launcher: the callback binds the world (set_world) after the script's replay()."""
    _lone(monkeypatch)
    bal = hetero.Balance(global_batch=8)
    bal.replay({0: [[4, 4]] * 2})
    with pytest.raises(ValueError, match="records 2 rank.*world has 3"):
        bal.set_world(0, 3)


def test_a_replay_of_the_world_s_width_trains_every_sample(monkeypatch):
    _lone(monkeypatch)
    bal = hetero.Balance(global_batch=8)
    bal.replay({0: [[8], [8]], 1: np.array([[8], [8]])})
    loader = bal.batch_sampler(16)
    for epoch in (0, 1):
        bal.set_epoch(epoch)
        seen = []
        for idx in loader:
            with bal.step(len(idx)):
                seen += idx
        assert sorted(seen) == list(range(16))


@pytest.mark.parametrize("record, match", [
    ([[4, 4]], "takes a dict of epochs"),                                     # not a dict
    ({}, "is empty"),                                                         # an empty dict
    ({-1: [[4, 4]]}, "has the key -1: epochs are whole numbers"),             # a negative key
    ({"0": [[4, 4]]}, "has the key '0'"),
    ({0: [[4, 4]], 2: [[4, 4]]}, "skips epoch 1"),                            # a skipped epoch
    ({0: [[4, 4]], 1: [[8]]}, "records 1 and 2 ranks in different epochs"),
    ({0: [[4, 4], [8]]}, "do not all list the same number of ranks"),
    ({0: []}, "at least one step"), ({0: [4, 4]}, r"shape \(2,\)"),
    ({0: [[4.0, 4.0]]}, "whole numbers"), ({0: [[True, False]]}, "whole numbers"),
    ({0: [[5, 4]]}, r"sizes \[5, 4\] sum to 9, not the global batch 8"),
    ({0: [[9, -1]]}, "gives rank 1 -1 samples"), ({0: [[8, 0]]}, "0 only with sit_out"),
])
def test_a_malformed_replay_is_one_line_at_replay(monkeypatch, record, match):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=8)
    with pytest.raises(ValueError, match=match) as e:
        bal.replay(record)
    _one_line(e.value)


def test_a_replay_with_too_few_steps_is_refused_when_the_epoch_length_is_known(monkeypatch):
    for given_first in (True, False):  # the record before the epoch length, or after it
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        bal = hetero.Balance(global_batch=8)
        with pytest.raises(ValueError) as e:
            if given_first:
                bal.replay({0: [[4, 4]] * 2})
                bal.batch_sampler(24)
            else:
                bal.batch_sampler(24)
                bal.replay({0: [[4, 4]] * 2})
        assert "records 2 step(s) of epoch 0, but an epoch has 3" in _one_line(e.value)


def test_a_replay_with_too_few_steps_is_refused_before_a_late_bound_world_runs(monkeypatch):
    _lone(monkeypatch)
    bal = hetero.Balance(global_batch=8)
    bal.replay({0: [[4, 4]] * 2})
    bal.batch_sampler(24)  # the world is not bound yet (Lightning's launcher binds it in setup)
    with pytest.raises(ValueError, match="records 2 step"):
        bal.set_world(1, 2)


def test_an_epoch_past_the_record_stops_in_one_line_before_it_trains(monkeypatch):
    """A missing epoch: the loop runs one more epoch than was recorded (KeyError from plan.py before)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=8)
    bal.replay({0: [[4, 4]] * 2, 1: [[2, 6]] * 2})
    loader = bal.batch_sampler(16)
    for epoch in (0, 1):
        bal.set_epoch(epoch)
        for idx in loader:
            with bal.step(len(idx)):
                pass
    bal.set_epoch(2)
    with pytest.raises(hetero.HeteroError) as e:
        next(iter(loader))
    assert "epoch 2 is not in bal.replay's record (it records epochs 0, 1)" in _one_line(e.value)


def test_a_loop_without_epochs_past_the_record_stops_in_one_line(monkeypatch):
    """Too few steps for a loop without epochs (IndexError from plan.py before)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=8)
    bal.replay({0: np.array([[6, 2]] * 3)})
    for _ in range(3):
        bal.begin_step()
        bal.end_step()
    with pytest.raises(hetero.HeteroError) as e:
        bal.begin_step()
    assert "step 3 of epoch 0 is past bal.replay's record of 3 step(s)" in _one_line(e.value)


# -- the trainer's --replay: the same rules, before any process starts --------------------------------------------
def _record(path, epochs: dict[int, list[list[int]]]):
    path.mkdir()
    rows = ["epoch,step,rank,batch_size"] + [f"{e},{s},{r},{b}" for e, steps in epochs.items()
                                             for s, sizes in enumerate(steps) for r, b in enumerate(sizes)]
    (path / "steps.csv").write_text("\n".join(rows) + "\n")
    return path


def test_the_trainer_refuses_a_replayed_batch_0_without_sit_out(tmp_path, monkeypatch, capsys):
    """A recorded sit-out (affine --sit-out) replayed without --sit-out: under dp the zero rank's borrowed samples
    count 0 while DDP still divides by the world, so the update would be wrong."""
    from helpers import SMALL, assert_one_line, check

    rec = _record(tmp_path / "rec", {1: [[128, 0]] * 4})
    rc, err = check([*SMALL, "--epochs", "1", "--scheme", "dp", "--replay", str(rec)], monkeypatch, capsys, world=2)
    assert_one_line(rc, err, "it gives a rank batch 0, which only --sit-out allows")


def test_the_trainer_replays_the_epochs_it_runs_of_a_longer_record(tmp_path, monkeypatch, capsys):
    """A record whose last epoch was cut short (a crashed run) replays its complete first epoch: the Balance is
    given the epochs the run trains, not the partial one it would refuse."""
    from helpers import SMALL, check, read_run

    rec = _record(tmp_path / "rec", {1: [[128]] * 4, 2: [[128]]})
    run = tmp_path / "run"
    rc, err = check([*SMALL, "--epochs", "1", "--replay", str(rec), "--run-dir", str(run), "--device", "cpu"],
                    monkeypatch, capsys, check_only=False)
    assert rc == 0, err
    assert read_run(run)["steps"]["batch_size"].tolist() == [128] * 4
