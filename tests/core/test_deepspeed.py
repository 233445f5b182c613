"""The DeepSpeed door's parts that need no engine (hetero/core/deepspeed.py), and the doors that refuse DeepSpeed.

The launches: the DeepSpeed door (hetero.core.deepspeed): `bal.attach(engine)` on the engine deepspeed.initialize
returns, ZeRO 0-3 on 2 CPU ranks (gloo, DS_ACCELERATOR=cpu), against one DeepSpeed process on the union of every
step's samples (the same config, world 1), after one and after three steps. One torchrun launch runs every exactness
case, the clock cases and the refusals at attach (tests/scripts/deepspeed_exact.py); one single-process launch runs
their references; a refusal inside a step ends its launch, so each has its own: one for each place a refusal is raised
(engine.step(), the step's end, inside the backward). Every refusal of the door, in one process: a stand-in engine
driven through the loop's calls (the table below)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch

from hetero.core.deepspeed import _rows, _tensors, is_engine

from helpers import ROOT, bounded, clean_env


def test_a_padded_micro_batch_is_the_first_row_of_every_tensor_that_has_the_micro_batchs_rows():
    """ZeRO-3's padding reruns the last micro-batch cut to one sample: tensors whose first dimension is m (4 here)
    are cut in dicts, lists, tuples and named tuples alike; others (a mask of another size, a scalar, a string) pass."""
    Pair = namedtuple("Pair", "a b")
    batch = {"input_ids": torch.arange(8).view(4, 2), "mask": torch.ones(3, 4), "scale": torch.tensor(2.0),
             "nested": [torch.zeros(4, 1), Pair(torch.ones(4), "name")]}
    cut = _rows(batch, 4)
    assert cut["input_ids"].tolist() == [[0, 1]] and cut["mask"].shape == (3, 4) and cut["scale"].item() == 2.0
    assert cut["nested"][0].shape == (1, 1) and isinstance(cut["nested"][1], Pair)
    assert cut["nested"][1].a.shape == (1,) and cut["nested"][1].b == "name"


def test_the_padding_backpropagates_from_the_first_floating_output_with_a_gradient_path():
    x = torch.ones(2, requires_grad=True)
    out = {"loss": (x * 2).sum(), "ids": torch.arange(3), "logits": [x * 3], "frozen": torch.ones(2)}
    found = _tensors(out)
    assert len(found) == 2 and found[0] is out["loss"] and found[1] is out["logits"][0]


def test_a_module_is_no_deepspeed_engine_and_needs_no_deepspeed_to_say_so():
    assert not is_engine(torch.nn.Linear(2, 2))


class FakeEngine:
    """What refusal() reads of a DeepSpeed engine, set to a supported ZeRO-2 engine of 2 ranks."""
    coalesce_grad_reduction = training_dataloader = None
    dp_world_size = 2
    optimizer = SimpleNamespace(_coalesce_grad_reduction=False)

    def step(self):
        pass

    def is_deepcompile_enabled(self):
        return False

    def gradient_accumulation_steps(self):
        return 1

    def managed_gradient_accumulation(self):
        return True

    def zero_optimization_stage(self):
        return 2


@pytest.mark.parametrize("change, line", [
    ({}, None),
    ({"dp_world_size": 1}, "DeepSpeed's data-parallel group has 1 of the 2 ranks (model or sequence parallelism)"),
    ({"gradient_accumulation_steps": lambda self: 4}, "DeepSpeed's gradient_accumulation_steps is 4: hetero decides"),
    ({"managed_gradient_accumulation": lambda self: False}, "managed_gradient_accumulation is false"),
    ({"training_dataloader": object()}, "deepspeed.initialize was given training_data"),
    ({"optimizer": None}, "the DeepSpeed engine has no optimizer"),
    ({"optimizer": SimpleNamespace()}, "DeepSpeed's optimizer wrapper SimpleNamespace cannot keep a step's backwards"),
])
def test_each_engine_setting_hetero_cannot_weight_is_one_line(change, line):
    """The refusals at attach that a launch does not reach (tests/core/test_deepspeed.py reaches
    gas, training_data, DeepCompile, ZeRO-0's bf16 wrapper and a second Balance), on a stand-in engine."""
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    from hetero.core.deepspeed import refusal

    engine = type("Engine", (FakeEngine,), change)()
    got = refusal(engine, 2)
    assert got is None if line is None else got.startswith(line), got


def test_the_hf_trainers_engine_may_accumulate_in_its_config_and_no_other():
    """gradient_accumulation_steps G in the config is refused in an own loop (DeepSpeed would divide the loss by it
    and count the boundary), and taken from the HF Trainer (hosted), which turns both off."""
    pytest.importorskip("deepspeed", reason="the [deepspeed] extra is not installed")
    from hetero.core.deepspeed import hosted, refusal

    own, trainers = (type("Engine", (FakeEngine,), {"gradient_accumulation_steps": lambda self: 4})()
                     for _ in range(2))
    hosted(trainers)
    assert refusal(own, 2).startswith("DeepSpeed's gradient_accumulation_steps is 4") and refusal(trainers, 2) is None


# -- the door in one process (issue 47): every refusal of DeepSpeedDoor, on a stand-in engine ------------------------
class StandIn(torch.nn.Module):
    """What DeepSpeedDoor drives of a DeepSpeed engine: its module, forward, backward and step, the local context
    of a step's micro-batches (ZeRO 1-3 coalesce, ZeRO 0 no_sync) and ZeRO 0's reduction; it counts what ran."""
    gradient_average = True

    def __init__(self, stage: int):
        super().__init__()
        torch.manual_seed(0)
        self.module, self.stage = torch.nn.Linear(4, 1), stage
        self.losses, self.steps, self.entered, self.reduced = [], 0, 0, 0

    def forward(self, x):
        return self.module(x)

    def zero_optimization_stage(self) -> int:
        return self.stage

    def backward(self, loss, *args, **kwargs):
        self.losses.append(float(loss.detach()))
        loss.backward()
        return loss

    def step(self, lr_kwargs=None) -> None:
        self.steps += 1

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        self.entered += 1
        yield

    no_sync = coalesce_grad_reduction

    def allreduce_gradients(self) -> None:
        self.reduced += 1


def _door(monkeypatch, stage: int = 2, micro_batch: int | None = None, rank: int = 0, sizes=(4, 4)):
    """Rank `rank` of 2: a Balance whose engine drives the real DeepSpeedDoor on a stand-in (what attach installs,
    its refusals of the engine's settings aside: tested above); every step of the epoch split as `sizes` (replayed:
    no decision, no collective)."""
    import hetero
    from hetero.core.deepspeed import DeepSpeedDoor

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    bal = hetero.Balance(global_batch=8, scheme="edp", **({"micro_batch": micro_batch} if micro_batch else {}))
    batches = bal.batch_sampler(32)
    bal.replay({0: np.array([list(sizes)] * 4)})
    ds, e = StandIn(stage), bal.engine
    door = DeepSpeedDoor(e, ds)
    e.link.ds, e.link.device, e.link.coll, e.link.model = door, torch.device("cpu"), torch.device("cpu"), ds
    ds.module.register_forward_pre_hook(e.count_forward)
    bal.set_epoch(0)
    return bal, ds, iter(batches)


def _loop(bal, ds, batches, mistake: str = "") -> None:
    """One step of the loop docs/deepspeed.md gives (each micro-batch in `with bal.step()`: the forward,
    engine.backward(loss), engine.step()), with `mistake` made where it is one: engine.step() before the backward
    or a backward after it in the step's last micro-batch (before it, engine.step() is a no-op), a plain
    loss.backward() in the first."""
    last = bal.micro_batches - 1
    for j in range(last + 1):
        idx = next(batches)
        with bal.step():
            if mistake == "early" and j == last:
                ds.step()
            loss = ds(torch.ones(len(idx), 4)).sum()
            loss.backward() if mistake == "torch" and j == 0 else ds.backward(loss)
            if mistake != "missing":
                ds.step()
            if mistake == "twice":
                ds.step()
            if mistake == "after" and j == last:
                ds.backward(loss * 0)
    if mistake == "outside":
        ds.step()
    if mistake == "backward_outside":
        ds.backward(ds(torch.ones(1, 4)).sum())


DOOR_MISTAKES = [  # (mistake, the line's start)
    ("twice", "hetero: engine.step() ran twice in step 0 of epoch 0 on rank {r}: call it once"),
    ("outside", "hetero: engine.step() ran outside `with bal.step()`: call it inside"),
    ("missing", "hetero: step 0 of epoch 0 ended on rank {r} without engine.step()"),
    ("early", "hetero: engine.step() ran before engine.backward(loss) in step 0 of epoch 0 on rank {r}"),
    ("torch", "hetero: a backward ran outside engine.backward(loss) in step 0 of epoch 0 on rank {r}"),
    ("after", "hetero: a backward ran after engine.step() in step 0 of epoch 0 on rank {r}"),
    ("backward_outside", "hetero: engine.backward(loss) ran outside `with bal.step()`"),
]
SETUPS = [(0, None), (2, None), (2, 2), (3, 2)]  # (ZeRO stage, micro_batch): no_sync, coalescing, ZeRO-3's padding


def _raised(monkeypatch, mistake: str, stage: int, micro_batch: int | None, rank: int) -> str:
    from hetero.core.agree import HeteroError

    bal, ds, batches = _door(monkeypatch, stage, micro_batch, rank)
    with pytest.raises(HeteroError) as e:
        _loop(bal, ds, batches, mistake)
    return str(e.value)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("stage,micro_batch", SETUPS)
@pytest.mark.parametrize("mistake,words", DOOR_MISTAKES, ids=[m for m, _ in DOOR_MISTAKES])
def test_every_door_refusal_is_one_line_on_a_stand_in_engine(monkeypatch, mistake, words, stage, micro_batch, rank):
    """Each way a loop can drive a DeepSpeed engine wrongly is refused in hetero's one line, naming the step and
    the rank, in one process (the launches below check that every rank then stops, with no hang)."""
    line = _raised(monkeypatch, mistake, stage, micro_batch, rank)
    assert line.startswith(words.format(r=rank)) and "\n" not in line, line


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("stage,micro_batch", SETUPS)
def test_a_right_loop_weighs_each_loss_and_steps_the_engine_once_a_step(monkeypatch, stage, micro_batch, rank):
    """The table's negative control: the loop run right, on steps split [2, 6], runs the epoch's 4 steps, with
    DeepSpeed's own step once a step after the step's one local context (ZeRO 0: its own reduction once a step).
    Each backward gets the loss times its rows' weight (2 or 6 of 8, or a micro-batch's 2) times the world
    DeepSpeed's mean divides by; under ZeRO-3 with micro-batches the rank with fewer runs zero-weight ones up to the
    step's most."""
    bal, ds, batches = _door(monkeypatch, stage, micro_batch, rank, sizes=(2, 6))
    for _ in range(4):
        _loop(bal, ds, batches)
    mine = (2, 6)[rank]
    rows = micro_batch or mine
    with torch.no_grad():
        one = float(torch.nn.functional.linear(torch.ones(rows, 4), ds.module.weight, ds.module.bias).sum())
    step = [one * rows / 8 * 2] * (mine // rows) + [0.0] * ((6 - mine) // rows if stage == 3 else 0)
    assert ds.losses == pytest.approx(step * 4)
    assert ds.steps == 4 and ds.entered == 4 and ds.reduced == (4 if stage == 0 else 0)


def test_every_door_refusal_is_in_the_table(monkeypatch):
    """Every literal line DeepSpeedDoor refuses with is raised by a case of the table (its placeholders filled):
    a refusal added without a case fails here; one removed fails its case."""
    import ast
    import re

    import hetero.core.deepspeed as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    door = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepSpeedDoor")
    sites = ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values)
             if isinstance(arg, ast.JoinedStr) else arg.value
             for node in ast.walk(door) if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "refuse"
             for arg in node.args[:1]]
    assert len(sites) >= 7, sites
    lines = [_raised(monkeypatch, m, 2, 2, 0) for m, _ in DOOR_MISTAKES]
    missing = [s for s in sites if not any(re.fullmatch(re.escape(s).replace(r"\{\}", ".*"), ln, re.S)
                                           for ln in lines)]
    assert not missing, f"no case raises: {missing}"


# the cases that launch processes
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="the [deepspeed] extra is not installed")
SCRIPT = str(ROOT / "tests" / "scripts" / "deepspeed_exact.py")
EXAMPLES = ROOT / "examples"
# the examples' slow rank: 3x slower and 0.05 s a step more, a signal no busy host hides (a verdict on the host's
# speed otherwise: a loaded .ci/run kept even splits where the 3x alone was the signal)
HETERO = "1:slowdown=3,1:delay=0.05"

EXACT = [f"{stage}:{mode}:sgd" for stage in range(4) for mode in ("micro", "batch")] + [
    "0:batch:adamw", "1:micro:adamw", "2:micro:adamw", "3:micro:adamw",
    "0:micro:sgd:sum", "2:micro:adamw:sum",  # gradient_allreduce_op "sum" (ZeRO 0-2): DeepSpeed divides by nothing
    "1:micro:sgd:pair", "3:micro:adamw:pair"]  # a model returning its loss and logits, as a Hugging Face one
BROKEN = ["1:micro:sgd:double", "2:batch:sgd:remove", "3:micro:sgd:double"]  # each must miss the reference
EQUAL = ["2:micro:sgd:equal"]  # even counts: the check that the unequal split ran must see it
CLOCK = ["0:clock:sgd", "1:clock:sgd", "2:clock:sgd", "3:clock:sgd"]
AT_ATTACH = ["1:batch:sgd:gas", "2:micro:sgd:data", "0:batch:sgd:bf16", "2:batch:sgd:deepcompile", "3:batch:sgd:again"]
BF16 = ["1:batch:sgd:bf16", "2:micro:sgd:bf16", "3:micro:sgd:bf16"]  # bf16 parameters, fp32 master weights
RESUMED = ["0:resume:sgd", "2:resume:adamw", "3:resume:sgd"]
# split by tokens (issue 49; tests/tokenlm.py's documents of 1-512 tokens): padded with a token-mean loss, packed in
# micro-batches of 2 rows with a sample mean (ZeRO-3: the ranks' counts of micro-batches differ, so the padding must
# count each rank's micro-batches, not its rows over m), a token budget's steps of 28, 21 and 23 documents in
# micro-batches of 2 (ZeRO 1 and 3); case: the loss mean of the loop (its reference)
TOKENS = {"0:tokens:sgd": "tokens", "3:tokmicro:sgd": "samples", "1:budget:sgd": "samples", "3:budget:sgd": "samples"}
TOKENS_BROKEN = {"0:tokens:sgd:samples": "tokens"}  # sample weights where the loop's loss is a token mean
DECIDED = ["0:decide:sgd", "0:decide:sgd:replay", "0:decide:sgd:swapped"]  # a run by tokens, its replay, the control


def _torchrun(nproc: int, *args: str, script: str = SCRIPT):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--log-dir={os.devnull}", script, *map(str, args)]
    env = {**clean_env(threads="1"), "DS_ACCELERATOR": "cpu"}
    return bounded(cmd, env, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's ranks and reference records: {case: (rank 0, rank 1, reference or None)}."""
    out = tmp_path_factory.mktemp("deepspeed") / "rec"
    cases = EXACT + BROKEN + EQUAL + CLOCK + AT_ATTACH + RESUMED + BF16 + [*TOKENS, *TOKENS_BROKEN] + DECIDED
    p = _torchrun(2, out, *cases)
    assert p.returncode == 0, p.stderr[-6000:]
    trained = EXACT + BROKEN + EQUAL + CLOCK + RESUMED + BF16
    p = _torchrun(1, out, "--ref", *trained)
    assert p.returncode == 0, p.stderr[-6000:]

    def read(case, who):
        return json.loads(out.with_name(f"rec.{case.replace(':', '-')}.{who}.json").read_text())
    return {c: (read(c, "rank0"), read(c, "rank1"), read(c, "ref") if c in trained else None) for c in cases}


def _by_tokens(runs, case: str, mean: str) -> tuple[float, list, list]:
    """A split-by-tokens case: its largest miss against plain SGD in one process on each step's unpacked union
    (tests/tokenlm.py), after each step; each step's rows over both ranks; each rank's micro-batch counts."""
    import tokenlm

    r0, r1, _ = runs[case]
    assert r0["params"] == r1["params"], "the replicas drifted apart"
    steps = [sorted(a + b) for a, b in zip(r0["rows"], r1["rows"])]
    _, tokens, labels = tokenlm.corpus(72)
    want = tokenlm.reference(steps, tokens, labels, mean, 0.5)
    miss = max(float(np.abs(np.array(got) - np.array(w)).max()) for got, w in zip(r0["params"], want))
    return miss, steps, [r0["micro_batches"], r1["micro_batches"]]


def _off(rank: dict, ref: dict) -> float:
    return max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in zip(rank["params"], ref["params"]))


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT)
def test_every_zero_stage_is_one_deepspeed_process_on_the_union_after_one_and_three_steps(runs, case):
    """Unequal work (sizes [3, 13], or micro-batches of 4 with counts [1, 3]): both ranks' parameters equal the
    single-process DeepSpeed run on each step's union, after step 1 and step 3, and are the same on both ranks."""
    r0, r1, ref = runs[case]
    assert r0["params"] == r1["params"], "the replicas drifted apart"
    assert _off(r0, ref) < 1e-6
    union = [sorted(a + b) for a, b in zip(r0["steps"], r1["steps"])]
    assert all(len(u) == len(set(u)) == 16 for u in union)                      # every step: 16 samples, once each
    assert _unequal(case, r0)                                                   # the unequal split really ran
    assert r0["ds_global_steps"] == 3 and r0["ds_global_samples"] == 48         # train_batch_size 16: true counts


def _unequal(case: str, rank0: dict) -> bool:
    """Rank 0 drew the replayed unequal share every step: 4 samples (k = 1 of 4) or 3."""
    return [len(s) for s in rank0["steps"]] == [4 if case.split(":")[1] == "micro" else 3] * 3


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", TOKENS)
def test_a_split_by_tokens_is_one_process_on_the_unpacked_union_on_zero_0_1_and_3(runs, case):
    """A DeepSpeed engine fed by a Balance with a collator (and a token budget): after each of the epoch's three
    steps, the parameters equal plain SGD in one process on the step's unpacked union (fp32: DeepSpeed reduces no
    float64), every step is 24 documents (or the budget's 28, 21 and 23), every document once. ZeRO-3 with
    micro-batches: some step gives the ranks different counts of them, and ZeRO-3 must pad by the count (by rows
    over m it hangs: the ranks' gathers fall out of step)."""
    miss, steps, micro = _by_tokens(runs, case, TOKENS[case])
    assert miss < 1e-6
    assert [len(s) for s in steps] == ([28, 21, 23] if ":budget:" in case else [24] * 3)
    assert sorted(i for s in steps for i in s) == list(range(72))
    if case.startswith("3:"):
        assert micro[0] != micro[1]  # the padding ran (ranks with unequal counts in a step)


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", TOKENS_BROKEN)
def test_by_tokens_sample_weights_for_a_token_mean_miss_the_union(runs, case):
    miss, _, _ = _by_tokens(runs, case, TOKENS_BROKEN[case])
    assert miss > 1e-4


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
def test_negative_control_even_counts_fail_the_unequal_split_check(runs):
    """Counts [2, 2] in place of [1, 3]: exact too (the union is the same), but the check that rank 0 ran its one
    micro-batch sees the even split, so the exactness cases above cannot pass on an even split by accident."""
    r0, _, ref = runs[EQUAL[0]]
    assert _off(r0, ref) < 1e-6 and not _unequal(EQUAL[0], r0)


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", BF16)
def test_bf16_on_zero_1_to_3_is_the_single_process_run_to_one_bf16_rounding(runs, case):
    """bf16 (DeepSpeed's fp32 master weights, bf16 module parameters): the replicas stay identical and within one
    bf16 step of the single-process run at these magnitudes (2e-3 near 0.4; the negative controls miss by 4e-2)."""
    r0, r1, ref = runs[case]
    assert r0["params"] == r1["params"] and _off(r0, ref) < 4e-3


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMED)
def test_a_run_resumed_from_a_deepspeed_checkpoint_goes_on_exactly_where_it_stopped(runs, case):
    """Two steps, engine.save_checkpoint with hetero's state in client_state, a new engine and Balance that load it
    and run the third step: the parameters equal the uninterrupted single-process run (AdamW's moments included),
    and the epoch's three steps drew 48 different samples (the resumed sampler starts at step 2)."""
    r0, r1, ref = runs[case]
    assert r0["params"] == r1["params"] and _off(r0, ref) < 1e-6
    drawn = [i for r in (r0, r1) for step in r["steps"] for i in step]
    assert len(drawn) == len(set(drawn)) == 48
    assert r0["ds_global_steps"] == 3


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", BROKEN)
def test_negative_controls_miss_the_reference(runs, case):
    """A doubled weight on one rank, or the mean of the ranks' means (no b_i/B): the same harness sees the error."""
    r0, r1, ref = runs[case]
    assert _off(r0, ref) > 1e-3


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case", CLOCK)
def test_the_clock_counts_a_slow_ranks_delay_as_its_compute_and_as_the_others_wait(runs, case):
    """Rank 1 sleeps 1 s a step where its gradients are ready: its compute holds the second, rank 0's wait in the
    one reduction holds it, and rank 0's compute does not (ZeRO-3's gathers do not hide it either)."""
    r0, r1, _ = runs[case]
    for fast, slow in zip(r0["clock"], r1["clock"]):
        assert slow["delay_s"] >= 1.0 and slow["compute_s"] >= 1.0
        assert fast["delay_s"] == 0 and fast["wait_s"] > 0.5 and fast["compute_s"] < 0.5


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case, line", [
    ("1:batch:sgd:gas", "DeepSpeed's gradient_accumulation_steps is 2: hetero decides each rank's micro-batches"),
    ("2:micro:sgd:data", "deepspeed.initialize was given training_data: hetero's sampler feeds the engine"),
    ("0:batch:sgd:bf16", "ZeRO stage 0 with DeepSpeed's FP16_UnfusedOptimizer (fp16/bf16) is not supported"),
    ("2:batch:sgd:deepcompile", "DeepCompile reduces gradients in its compiled graph: turn compile.deepcompile off"),
    ("3:batch:sgd:again", "this DeepSpeed engine has a Balance attached already: one Balance per engine")])
def test_configs_hetero_cannot_weight_are_refused_at_attach_on_every_rank(runs, case, line):
    r0, r1, _ = runs[case]
    assert r0["refused"] == r1["refused"] and r0["refused"].startswith(line)


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("case, line", [  # where a refusal is raised (in engine.step, at the step's end, inside the
    # backward), ZeRO-3 among them; every refusal's line and place: the table in one process above
    ("3:batch:sgd:missing", "hetero: step 0 of epoch 0 ended on rank "),
    ("3:micro:sgd:early", "hetero: engine.step() ran before engine.backward(loss) in step 0 of epoch 0 on rank 0"),
    ("2:batch:sgd:torch", "hetero: a backward ran outside engine.backward(loss) in step 0 of epoch 0 on rank ")])
def test_a_loop_that_steps_the_engine_wrongly_stops_every_rank_with_one_line(tmp_path, case, line):
    """engine.step() never (under ZeRO-3), or before the backward (under ZeRO-3 rank 1's gathers then fail: it says
    rank 0's line), or a backward that bypasses engine.backward (its loss unweighted): every rank stops with hetero's
    line, none with DeepSpeed's assertion or a hang.

    Before the backward, rank 0 refuses alone while rank 1 waits in ZeRO-3's parameter gather, a gloo collective in
    C++ that ends only when rank 0's process exits (after its 3.5 s for the line to be read, agree.post). torchrun's
    agent then stops rank 1 within its monitor interval (0.1 s): on a loaded host (one core kept busy, 2026-12-07)
    before rank 1 could say the line. There, rank 0's line and rank 1's stop by torchrun's SIGTERM are what holds
    (docs/deepspeed.md); any line rank 1 says is still rank 0's."""
    p = _torchrun(2, tmp_path / "rec", case)
    assert p.returncode != 0
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: ")]
    alone = case.endswith(":early")
    assert (len(said) in (1, 2) if alone else len(said) == 2) and all(ln.startswith(line) for ln in said), \
        p.stderr[-4000:]
    if len(said) == 1:  # rank 1 stopped by torchrun before it said the line: by its SIGTERM, nothing else
        assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -15 ", p.stderr), p.stderr[-4000:]
    assert "]: Traceback" not in p.stderr and "AssertionError" not in p.stderr  # no rank's traceback


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """examples/deepspeed_lm_baseline.py, the diff's other side: a plain DeepSpeed loop, two epochs."""
    rec = tmp_path_factory.mktemp("baseline") / "rec"
    p = _torchrun(2, "--record", rec, script=str(EXAMPLES / "deepspeed_lm_baseline.py"))
    assert p.returncode == 0, p.stderr[-6000:]
    return [json.loads(rec.with_name(f"rec.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
def test_the_baseline_example_covers_every_row_once_an_epoch_and_learns(baseline):
    for epoch in ("0", "1"):
        assert sorted(baseline[0]["seen"][epoch] + baseline[1]["seen"][epoch]) == list(range(320))
    assert baseline[0]["losses"] == baseline[1]["losses"] and baseline[0]["losses"][1] < baseline[0]["losses"][0]


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("args", [["--zero", "3", "--micro-batch", "4"], ["--zero", "0"]], ids=["zero3-micro", "zero0"])
def test_the_example_covers_every_row_once_gives_the_slow_rank_less_and_learns_like_the_baseline(tmp_path, baseline,
                                                                                                 args):
    """examples/deepspeed_lm.py as the docs run it (a tiny GPT-2, rank 1 emulated slower): every row once per
    epoch over both ranks, the decisions give rank 1 well under half (ZeRO-3's padded micro-batches included: the
    ranks' gathers stay aligned, no hang), and the epochs' mean loss within 10% of the plain DeepSpeed script's."""
    rec = tmp_path / "rec"
    p = _torchrun(2, "--record", rec, "--hetero", HETERO, *args, script=str(EXAMPLES / "deepspeed_lm.py"))
    assert p.returncode == 0, p.stderr[-6000:]
    ranks = [json.loads(rec.with_name(f"rec.rank{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1"):
        assert sorted(ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]) == list(range(320)), epoch
    last = ranks[0]["decisions"][-1]["sizes"]
    assert last == ranks[1]["decisions"][-1]["sizes"] and last[1] < 0.4 * sum(last)
    losses, base = ranks[0]["losses"], baseline[0]["losses"]
    assert losses[1] < losses[0] and abs(losses[1] - base[1]) < 0.1 * base[1]


def _lines(path) -> dict[int, list[int]]:
    """A rank's per-batch log: {global step: the step's sample indices}."""
    steps: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], []).extend(row["idx"])
    return steps


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
def test_a_run_killed_after_a_mid_epoch_checkpoint_resumes_with_its_shares_and_covers_every_row_once(tmp_path):
    """examples/deepspeed_lm.py on ZeRO-3 with micro-batches of 4, a DeepSpeed checkpoint every 4 steps (hetero's
    state in its client_state), SIGKILLed (torchrun and both ranks) once both ranks have logged a step past the first
    checkpoint (step 4 of the 10 in epoch 0), then run again with --resume: the resumed run repeats the steps the
    killed one ran past the checkpoint with the same samples on the same ranks (the shares carried from its first
    step, the slow rank's under an even half), and each epoch's rows, counted from the killed run before the
    checkpoint and the resumed run after it, are every row exactly once."""
    ckpt, env = tmp_path / "ckpt", {**clean_env(threads="1"), "DS_ACCELERATOR": "cpu", "PYTHONFAULTHANDLER": "1"}
    common = ["--zero", "3", "--micro-batch", "4", "--rebalance-every", "2", "--hetero", "1:slowdown=3,1:delay=0.3",
              "--checkpoint-dir", str(ckpt), "--save-every", "4"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--log-dir={os.devnull}", str(EXAMPLES / "deepspeed_lm.py"), *common]
    with open(tmp_path / "killed.err", "w") as err:
        p = subprocess.Popen([*cmd, "--record", str(tmp_path / "killed")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=err, start_new_session=True)
        logs, deadline = [tmp_path / f"killed.rank{r}.steps.jsonl" for r in range(2)], time.monotonic() + 400
        try:  # until both ranks have logged a batch of step 5: step 4 is whole in both logs
            while not ((ckpt / "latest").exists() and all(f.exists() and max(_lines(f), default=0) >= 5 for f in logs)):
                assert p.poll() is None, (tmp_path / "killed.err").read_text()[-4000:]
                assert time.monotonic() < deadline, "no checkpoint and step past it in time"
                time.sleep(0.05)
        finally:  # the job killed whole, as a scheduler or the OOM killer does: torchrun starts each rank in a
            tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]  # session of its own
            for proc in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            p.wait(timeout=60)
            _, alive = psutil.wait_procs(tree[1:], timeout=60)  # SIGKILL lands in its time: gone, not at once
            assert not alive, alive
    saved = int((ckpt / "latest").read_text().strip().removeprefix("global_step"))
    q = bounded([*cmd, "--resume", "--record", str(tmp_path / "resumed")], env, timeout=600)
    assert q.returncode == 0, q.stderr[-6000:]
    killed = [_lines(tmp_path / f"killed.rank{r}.steps.jsonl") for r in range(2)]
    resumed = [_lines(tmp_path / f"resumed.rank{r}.steps.jsonl") for r in range(2)]
    assert saved in (4, 8, 12, 16) and min(resumed[0]) == saved and max(resumed[0]) == 19  # on from the checkpoint
    # (the first one, step 4, unless a loaded host let the killed run go on before the kill)
    repeated = [g for g in killed[0] if g >= saved]
    assert repeated and all(killed[r][saved] == resumed[r][saved] for r in range(2))  # its first step, whole
    for r in range(2):  # the kill lands mid-step: what the killed run did of a step is how the resumed one began it
        assert all(resumed[r][g][:len(killed[r].get(g, []))] == killed[r].get(g, []) for g in repeated)
    assert len(resumed[1][saved]) < len(resumed[0][saved])                        # the slow rank's share, carried
    for epoch in range(2):
        rows = [i for r in range(2) for part in (killed[r], resumed[r]) for g, idx in part.items()
                if g // 10 == epoch and (part is resumed[r]) == (g >= saved) for i in idx]
        assert sorted(rows) == list(range(320)), epoch


@pytest.mark.launch
@needs_deepspeed
@pytest.mark.slow
def test_a_replay_by_tokens_on_a_deepspeed_engine_gives_each_step_the_runs_rows_and_decides_nothing(runs):
    """bal.replay(the decisions of a run by tokens, through JSON) on a new DeepSpeed engine in the same launch: on
    each rank every step gets the run's rows, the parameters after each step are the run's to the bit, and the
    replay makes no decision. The control: the record with the ranks' costs swapped (rank 1 was the slower) gives
    other rows."""
    run, replay, swapped = (runs[case][:2] for case in DECIDED)
    for r in range(2):
        assert len(run[r]["decisions"]) >= 2 and len(run[r]["rows"]) == 3
        assert replay[r]["rows"] == run[r]["rows"] and replay[r]["params"] == run[r]["params"]
        assert replay[r]["decisions"] == []
    assert any(swapped[r]["rows"] != run[r]["rows"] for r in range(2))
