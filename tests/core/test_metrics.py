"""The read-out (hetero.core.metrics): its numbers against the cost model worked out by hand, read from the
decisions alone (none passed over between two calls), no claimed speedup without evidence, and no collective on
any call (a real Balance in a one-process gloo group).

The launches: the hetero/ scalars where users look: the built-in trainer's --tensorboard event files read back
against its own steps.csv, ranks.csv and epochs.csv; the Hugging Face example with report_to tensorboard and the
Lightning example with a CSVLogger, each on 2 CPU ranks (gloo) with rank 1 emulated slower."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

from hetero.core.balancer import Balancer
from hetero.core.metrics import PER_RANK_MAX, metrics
from hetero.core.records import Decision, StepRecord

from helpers import ROOT, TINY, clean_env, read_run, run_train


def _affine_window(a, c, sizes) -> tuple[np.ndarray, np.ndarray]:
    """Steps at the given [steps, world] sizes timed exactly t = a + c b."""
    b = np.asarray(sizes, float)
    return b, np.asarray(a) + np.asarray(c) * b


def test_predicted_is_the_affine_fit_at_the_chosen_and_at_the_even_sizes():
    a, c = np.array([0.010, 0.050]), np.array([1e-3, 1e-3])  # rank 1: 40 ms more per step, same per sample
    bal = Balancer("affine", 2, 64)
    b, t = _affine_window(a, c, [bal.sizes_for_step(s) for s in range(16)])  # the probe's two sizes
    bal.observe(b, t)
    bal.decide()
    chosen, even = bal.predicted()
    assert bal.sizes.tolist() == [52, 12]  # 0.01 + 52e-3 = 0.062 = 0.05 + 12e-3
    assert chosen == pytest.approx(max(a + c * bal.sizes))
    assert even == pytest.approx(0.050 + 32e-3)
    assert even / chosen == pytest.approx(0.082 / 0.062)


def test_predicted_is_the_proportional_model_for_dp_and_edp():
    bal = Balancer("proportional", 2, 64)
    bal.observe([[32, 32]] * 4, [[0.1, 0.3]] * 4)  # rank 1 three times slower per sample
    bal.decide()
    chosen, even = bal.predicted()
    assert bal.sizes.tolist() == [48, 16]
    assert chosen == pytest.approx(max(0.1 / 32 * 48, 0.3 / 32 * 16))
    assert even == pytest.approx(0.3)
    assert Balancer("proportional", 2, 64).predicted() is None  # before a decision: no model
    assert Balancer("static", 2, 64).predicted() is None


class _Stub:
    """The public names the read-out reads, over a real Balancer: two ranks, this one rank 1."""

    def __init__(self, rule: str = "proportional", world: int = 2):
        self.rank = 1
        self.settings = SimpleNamespace(global_batch=64)
        self.balancer = Balancer(rule, world, 64)
        self.decisions: list[Decision] = []
        self.records: list[StepRecord] = []
        self.last_sizes = self.balancer.sizes.tolist()

    def epoch_records(self):
        return self.records

    def decide(self, compute_s):
        """A window at the current sizes, then a decision recorded as the plan records it. compute_s: per-rank step
        times (4 steps each), or [steps, world] of them."""
        sizes = self.balancer.sizes.copy()
        steps = np.asarray(compute_s, float)
        steps = np.repeat(steps[None], 4, axis=0) if steps.ndim == 1 else steps
        self.balancer.observe([sizes] * len(steps), steps)
        changed = self.balancer.decide()
        chosen, even = self.balancer.predicted() or (None, None)
        self.decisions.append(Decision(0, 3, 4, self.balancer.sizes.tolist(), self.balancer.shares.tolist(),
                                       steps.mean(0).tolist(), chosen, even, self.balancer.window_noise_s, changed))
        self.last_sizes = self.balancer.sizes.tolist()
        self.records.append(StepRecord(0, 3, sizes, float(steps[-1, self.rank]), 0.25, 0.0))


def test_the_read_out_of_two_decisions():
    bal = _Stub()
    first = metrics(bal)
    assert first["hetero/batch_size"] == 32 and first["hetero/share"] == 0.5 and first["hetero/decisions"] == 0
    assert "hetero/predicted_speedup" not in first and "hetero/compute_s" not in first
    bal.decide([0.1, 0.3])
    m = metrics(bal)
    assert m["hetero/batch_size"] == 16 and m["hetero/share"] == 0.25  # this rank (1), the slow one
    assert [m["hetero/rank0/batch_size"], m["hetero/rank1/batch_size"]] == [48, 16]
    assert m["hetero/compute_s"] == 0.3 and m["hetero/wait_s"] == 0.25
    assert [m["hetero/rank0/compute_s"], m["hetero/rank1/compute_s"]] == [0.1, 0.3]
    assert [m["hetero/rank0/idle_s"], m["hetero/rank1/idle_s"]] == pytest.approx([0.2, 0.0])
    assert m["hetero/slowest_rank"] == 1
    assert m["hetero/predicted_step_s"] == pytest.approx(0.15)  # 0.1/32*48 = 0.3/32*16
    assert m["hetero/predicted_speedup"] == pytest.approx(2.0)
    assert m["hetero/decisions"] == 1 and m["hetero/size_changes"] == 1
    assert "hetero/misallocation" not in m  # nothing predicted the first window
    bal.decide([0.15, 0.18])  # at 48/16: rank 1 came out 20% slower than the model said
    m = metrics(bal)
    assert m["hetero/misallocation"] == pytest.approx(0.18 / 0.15)
    assert m["hetero/decisions"] == 2
    assert m["hetero/size_changes"] == (2 if bal.decisions[1].sizes != [48, 16] else 1)


def test_a_decision_passed_over_between_two_calls_still_gives_misallocation():
    bal = _Stub()
    metrics(bal)
    bal.decide([0.1, 0.3])
    bal.decide([0.15, 0.18])  # two decisions between calls: each carries its own prediction
    m = metrics(bal)
    assert m["hetero/misallocation"] == pytest.approx(0.18 / 0.15)
    assert m["hetero/decisions"] == 2 and m["hetero/size_changes"] == sum(d.changed for d in bal.decisions) >= 1
    late = _Stub()  # first read only after two decisions: the first one's change of the sizes still counts
    late.decide([0.1, 0.3])
    late.decide([0.15, 0.18])
    assert metrics(late)["hetero/size_changes"] == m["hetero/size_changes"]
    assert metrics(late)["hetero/misallocation"] == m["hetero/misallocation"]


def test_large_worlds_are_summarised():
    big = _Stub(world=PER_RANK_MAX + 1)
    m = metrics(big)
    assert not any(k.startswith("hetero/rank") for k in m)
    assert m["hetero/min_share"] == min(big.last_sizes) / 64 and m["hetero/max_share"] == max(big.last_sizes) / 64
    assert any(k.startswith("hetero/rank") for k in metrics(big, per_rank=True))


@pytest.mark.parametrize("steps", [
    [[0.0015, 0.0015], [0.0015, 0.0015], [0.0015, 0.0015], [0.0015, 0.0260]],  # equal ranks, one stall on rank 1
    [[0.0015, 0.0015], [0.0016, 0.0079]],  # two steps: the balancer's own noise test cannot act, and moves
    [[0.0015, 0.0060]],                     # one step: no noise measured at all
], ids=["a stall", "two steps", "one step"])
def test_predicted_speedup_is_1_until_a_decision_has_evidence(steps):
    """Two equal ranks under the default edp: a short window's noise moves the proportional rule's sizes, and its
    model then claims a speedup over an even split (issue 48, item 10: it read 4.0 and 1.83). The read-out says 1
    until the window shows the gain beyond its noise; the model's own step times stay as they are."""
    bal = _Stub()
    bal.decide(steps)
    d, m = bal.decisions[-1], metrics(bal)
    assert d.sizes != [32, 32] and d.predicted_even_step_s / d.predicted_step_s > 1.5  # the model's claim
    assert m["hetero/predicted_speedup"] == 1.0
    assert m["hetero/predicted_step_s"] == d.predicted_step_s
    assert m["hetero/predicted_even_step_s"] == d.predicted_even_step_s


def test_predicted_speedup_is_the_models_where_the_window_shows_it():
    bal = _Stub()
    bal.decide([[0.100, 0.300], [0.101, 0.306]])  # rank 1 three times slower, in two steps that agree
    m = metrics(bal)
    assert bal.decisions[-1].noise_s is not None
    model = m["hetero/predicted_even_step_s"] / m["hetero/predicted_step_s"]
    assert m["hetero/predicted_speedup"] == pytest.approx(model) and model > 1.9


def test_a_real_balance_reads_out_without_a_collective(tmp_path, monkeypatch):
    """One gloo rank: decisions every 2 steps; every collective is refused while metrics() runs."""
    import hetero
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        bal = hetero.Balance(global_batch=8, scheme="edp", rebalance_every=2)
        bal.attach(model)
        sampler = bal.batch_sampler(32)
        bal.set_epoch(0)
        calls = []
        for idx in sampler:
            with bal.step(len(idx)):
                model(torch.randn(len(idx), 4)).sum().backward()
            with monkeypatch.context() as mp:
                for name in ("all_gather", "all_reduce", "broadcast", "all_gather_object", "gather", "barrier"):
                    mp.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"metrics() ran {_n}"))
                calls.append(metrics(bal))
        assert [m["hetero/decisions"] for m in calls] == [0, 1, 1, 2]
        last = calls[-1]
        assert last["hetero/batch_size"] == 8 and last["hetero/share"] == 1.0
        assert last["hetero/compute_s"] == bal.epoch_records()[-1].compute_s
        assert last["hetero/predicted_speedup"] == pytest.approx(1.0)  # one rank: the even split is the split
        d = bal.decisions[-1]  # the plan recorded the model's numbers with the decision, as plain data
        assert d.predicted_step_s == last["hetero/predicted_step_s"] > 0 and d.changed is False
        assert json.loads(json.dumps(d.__dict__)) == d.__dict__
        assert all(isinstance(v, float) for m in calls for v in m.values())
    finally:
        dist.destroy_process_group()


def test_the_trainers_board_writes_the_rows_and_an_overwritten_run_starts_afresh(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hetero.trainer.board import Board, progress

    bal = _Stub()
    bal.decide([0.1, 0.3])
    line = {"train_loss": 1.5, "train_top1": 0.4, "test_loss": 1.6, "test_top1": 0.3, "test_top5": 0.9, "lr": 0.1,
            "epoch_time_s": 2.0, "balance_eff": 0.8}
    steps = [{"epoch": 1, "step": s, "rank": r, "batch_size": 32, "compute_s": 0.1 * (r + 1) + s, "wait_s": 0.01}
             for s in range(4) for r in range(2)]
    ranks = [{"epoch": 1, "rank": r, "share": 0.5} for r in range(2)]
    for loss in (1.5, 2.5):  # the same run folder twice: the second run starting afresh (--overwrite)
        board = Board(tmp_path, steps_per_epoch=4)
        board.epoch(1, {**line, "train_loss": loss}, ranks, steps, bal)
        board.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(4, 2.5)]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("hetero/rank1/compute_s")] == [
        (s, round(0.2 + s, 6)) for s in range(4)]
    assert acc.Scalars("hetero/predicted_speedup")[0].value == pytest.approx(2.0)
    assert progress(bal) == "shares 0.75/0.25 | predicted 2.00x"


def test_size_changes_are_counted_as_decisions_come_and_afresh_for_another_list():
    """The read-out counts only the decisions added since its last call on a list (O(1) per step however long the
    run, issue 51): its count equals the full sum after every addition, and another list (or a shorter one) is
    counted from its start."""
    from hetero.core.metrics import _size_changes
    from hetero.core.records import Decision

    def d(changed):
        return Decision(0, 0, 1, [4, 4], [0.5, 0.5], [0.1, 0.1], changed=changed)

    rng = np.random.default_rng(0)
    decisions = []
    for _ in range(300):
        decisions.append(d(bool(rng.random() < 0.3)))
        assert _size_changes(decisions) == sum(x.changed for x in decisions)
    other = [d(True), d(True)]
    assert _size_changes(other) == 2 and _size_changes(decisions) == sum(x.changed for x in decisions)
    del decisions[5:]  # shorter than what was counted: afresh
    assert _size_changes(decisions) == sum(x.changed for x in decisions)
    decisions[-1] = d(not decisions[-1].changed)  # the last counted is another object: afresh
    assert _size_changes(decisions) == sum(x.changed for x in decisions)


# the cases that launch processes
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard is not installed")


def scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar tag in the event files under `folder`: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert files, f"no event files under {folder}"
    out: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


@pytest.mark.launch
@needs_tensorboard
@pytest.mark.slow
def test_trainer_event_files_hold_the_tables_numbers(tmp_path):
    run = tmp_path / "run"
    # 3x slower and 0.1 s a step more: a signal no busy host hides (rank 1's smaller batch below rests on it)
    run_train([*TINY, "--scheme", "edp", "--hetero", "1:slowdown=3,1:delay=0.1", "--rebalance-every", "4",
               "--threads", "1", "--tensorboard", "--run-dir", str(run)], nproc=2)
    r, tb = read_run(run), scalars(run / "tensorboard")
    steps_per_epoch = int(r["steps"]["step"].max()) + 1
    for key in ("batch_size", "compute_s", "wait_s"):
        for rank, rows in r["steps"].groupby("rank"):
            want = {int((e - 1) * steps_per_epoch + s): v for e, s, v in zip(rows["epoch"], rows["step"], rows[key])}
            got = tb[f"hetero/rank{rank}/{key}"]
            assert sorted(got) == sorted(want)
            assert np.allclose([got[k] for k in sorted(want)], [want[k] for k in sorted(want)], rtol=1e-6)
    for rank, rows in r["ranks"].groupby("rank"):
        got = tb[f"hetero/rank{rank}/share"]
        assert np.allclose([got[e * steps_per_epoch] for e in rows["epoch"]], rows["share"], rtol=1e-6)
    ends = [e * steps_per_epoch for e in r["epochs"]["epoch"]]
    assert np.allclose([tb["test/top1"][x] for x in ends], r["epochs"]["test_top1"], rtol=1e-6)
    assert np.allclose([tb["train/loss"][x] for x in ends], r["epochs"]["train_loss"], rtol=1e-6)
    # the slow rank 1 got less work by the end; the cost model's predicted speedup is written at every epoch's end,
    # 1 unless the gain it sees beats its noise (a verdict on the host: a busy core's noise held it at 1 in a .ci/run
    # on 2026-12-05; the rule is tested on recorded steps in tests/core/test_metrics.py)
    speedup = [tb["hetero/predicted_speedup"][x] for x in ends]
    last = r["steps"][r["steps"]["epoch"] == r["epochs"]["epoch"].max()]
    assert last[last["rank"] == 1]["batch_size"].iloc[-1] < last[last["rank"] == 0]["batch_size"].iloc[-1]
    assert len(speedup) == len(ends) and all(np.isfinite(speedup)) and min(speedup) >= 1, speedup
    assert "hetero/misallocation" in tb and all(v > 0 for v in tb["hetero/misallocation"].values())
    assert tb["hetero/decisions"][ends[-1]] == len(r["epochs"]) * (steps_per_epoch // 4 + (steps_per_epoch % 4 > 0))


def _launch(script: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--log-dir=/dev/null",
           str(ROOT / "examples" / script), *args]
    env = {**clean_env(threads="1"), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-20000:]}"
    return p


@pytest.mark.launch
@needs_tensorboard
@pytest.mark.slow
def test_hf_trainer_reports_the_hetero_scalars_to_tensorboard(tmp_path):
    out = tmp_path / "hf"
    _launch("hf_trainer.py", ["--text", str(ROOT / "docs" / "trainer.md"), "--subset", "192", "--global-batch", "16",
                              "--epochs", "1", "--log-every", "2", "--rebalance-every", "3", "--hetero",
                              "1:slowdown=3,1:delay=0.05", "--out", str(out), "--report-to", "tensorboard"])
    tb = scalars(out)
    logged = sorted(tb["train/loss"])  # the Trainer's own scalar: the hetero/ ones come at the same logging steps
    assert logged == [2, 4, 6, 8, 10, 12]
    for tag in ("hetero/rank0/share", "hetero/rank1/share", "hetero/batch_size", "hetero/decisions"):
        assert sorted(tb[f"train/{tag}"]) == logged, tag
    shares = tb["train/hetero/rank0/share"], tb["train/hetero/rank1/share"]
    assert all(abs(shares[0][s] + shares[1][s] - 1) < 1e-6 for s in logged)
    assert shares[1][logged[-1]] < 0.5  # the 3x slower rank was given less
    assert tb["train/hetero/predicted_speedup"][logged[-1]] > 1


@pytest.mark.launch
@needs_tensorboard
@pytest.mark.slow
def test_lightning_logs_the_hetero_scalars_through_its_logger(tmp_path):
    data = tmp_path / "images"
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in range(2):
        (data / f"c{c}").mkdir(parents=True)
        for i in range(64):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(data / f"c{c}" / f"{i}.png")
    logs = tmp_path / "logs"
    _launch("lightning_example.py", ["--data", str(data), "--epochs", "2", "--global-batch", "32", "--size", "16",
                                     "--workers", "0", "--cpu", "--rebalance-every", "2",
                                     "--hetero", "1:slowdown=3,1:delay=0.05",
                                     "--log-dir", str(logs)])
    csvs = sorted(logs.rglob("metrics.csv"))
    assert len(csvs) == 1, csvs  # rank 0 only
    m = pd.read_csv(csvs[0])
    rows = m.dropna(subset=["hetero/rank0/share"])
    # batch norm needs 2 samples a rank: the example's min_batch=2, however far a busy host moves the shares
    assert len(rows) >= 4 and np.allclose(rows["hetero/rank0/share"] + rows["hetero/rank1/share"], 1)
    assert rows["hetero/rank1/share"].iloc[-1] < 0.5
    assert rows["hetero/decisions"].max() == 4  # 4 steps per epoch, a decision every 2 steps, 2 epochs
    assert (rows.dropna(subset=["hetero/predicted_speedup"])["hetero/predicted_speedup"] > 1).any()
