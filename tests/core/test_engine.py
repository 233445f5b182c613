"""The step engine in one process (issue 47): every refusal of hetero/core/engine.py and the optimizer guard, at every
door that can make the mistake, for rank r of a world of w, with no process group and no launch.

The rig stands in for what attach installs on a DDP model, and drives the same engine calls DDP would:
- the model has DDP's `no_sync()`; its forward pre-hook is `engine.count_forward`, as attach registers it;
- a gradient hook on its parameter calls `engine.gradients_ready()` at a backward outside no_sync, where DDP's comm
  hook (hook.py) calls it at the step's last bucket; with weighting="loss" the real loss door (lossweight.py) is
  installed instead, and the loop's backward is `bal.backward(loss)` (DDP's own all-reduce: nothing to stand in for);
- the optimizer guard is the real one (guard.py), on a real SGD;
- the gathers at a decision and at an epoch's end (agree.gather_rows) are faked: every rank's row is this one's.
Doors: `with bal.step()` (the loader's batches), begin_step/end_step by hand, the Hugging Face Trainer's loop
(engine.micro(ends_step=False), then end_step after the optimizer step), Lightning's per-rank recipe under DDP
(micro-batches counted at their backward, engine.count_forward, and the step checked at the batch's end) and FSDP2
(its schedule stands in for no_sync). A case is (door, mistake) -> the line's words; `test_every_refusal_is_in_the
_table` reads the engine's and the guard's sources, so a new refusal without a case here fails, and a refusal
removed fails its case.
"""
from __future__ import annotations

import ast
import re
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

import hetero
import hetero.core.agree
import hetero.core.attach
import hetero.core.engine
import hetero.core.fsdp
import hetero.core.plan
from hetero.core.agree import HeteroError
from hetero.core.guard import OptimizerGuard
from hetero.core.lossweight import LossWeighting

N, B, M = 32, 8, 2  # samples, global batch, micro-batch: 4 steps an epoch


class Net(torch.nn.Module):
    """What the engine uses of a DDP model: parameters, forward, no_sync()."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.synced = self.require_backward_grad_sync = True  # DDP's flag, which its no_sync clears

    def forward(self, x):
        return self.lin(x)

    @contextmanager
    def no_sync(self):
        self.synced = self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.synced = self.require_backward_grad_sync = True


class FakeFSDP:
    """FSDP2's schedule as the engine drives it (fsdp.py's FSDPSchedule.begin): records the micro-batches."""

    def __init__(self):
        self.calls = []

    def begin(self, first: bool, sync: bool) -> None:
        self.calls.append((first, sync))


class FakeDoor:
    """A DeepSpeed engine's door as the engine drives it (deepspeed.py's DeepSpeedDoor): begin and finished."""

    def begin(self, first: bool) -> None:
        pass

    def finished(self) -> None:
        pass


class Rig:
    """Rank `rank` of `world`: a Balance, its engine attached to a Net as attach would, an SGD with the guard."""

    def __init__(self, monkeypatch, rank: int = 0, world: int = 2, attach: bool = True, fsdp: bool = False,
                 ds: bool = False, sampler: bool = True, ran: list[float] | None = None, **kw):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        loss_tokens = kw.pop("loss_tokens", None)  # by tokens: every sample 8 tokens long, these counted
        kw = {"global_batch": B, "scheme": "dp", **kw}
        self.bal = hetero.Balance(**kw)
        tokens = {"lengths": [8] * N, "loss_tokens": loss_tokens} if "collator" in kw else {}
        self.sampler = self.bal.batch_sampler(N, **tokens) if sampler else None
        self.engine = e = self.bal.engine
        self.model = Net()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.world, self._it = world, None

        def gather(row, device):  # every rank measured what this one did; the steps ran: `ran` if given
            if ran is not None and row.numel() == 1:
                return torch.tensor(ran, dtype=row.dtype)[:, None]
            return row[None].repeat(world, 1)
        monkeypatch.setattr(hetero.core.plan, "gather_rows", gather)
        monkeypatch.setattr(hetero.core.agree, "gather_rows", gather)
        if attach:
            link = e.link
            link.model, link.device, link.coll = self.model, torch.device("cpu"), torch.device("cpu")
            link.fsdp = FakeFSDP() if fsdp else None
            link.ds = FakeDoor() if ds else None
            self.model.register_forward_pre_hook(e.count_forward)
            if kw.get("weighting") == "loss":  # the real door: no comm hook to stand in for
                link.loss = LossWeighting(e, self.model)
            else:
                self.model.lin.weight.register_post_accumulate_grad_hook(self._ready)
            self.guard = OptimizerGuard(e, self.model)

    def _ready(self, param) -> None:  # DDP's comm hook at the last bucket; FSDP2 reduce-scatters every backward
        fsdp = self.engine.link.fsdp
        if (fsdp.calls[-1][1] if fsdp is not None else self.model.synced):  # FSDP2: the synced micro-batch's
            s = self.engine.gradients_ready()
            s.bucket_sent(last=True)  # the bucket's all-reduce, sent and back (a world of stand-ins)
            s.bucket_back()

    def backward(self, n: int = M) -> None:
        """The loop's backward: `bal.backward(loss)` (with weighting="loss" it weighs the loss), or loss.backward()."""
        self.bal.backward(self.model(torch.ones(n, 4)).sum())

    def next_batch(self) -> list[int]:
        """The loader's next batch (epoch 0's, its iterator kept across the doors' steps)."""
        if self._it is None:
            self.bal.set_epoch(0)
            self._it = iter(self.sampler)
        return next(self._it)

    def opt_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


# -- the doors, each running one step of this rank's k micro-batches; `k` overrides the count ---------------------
def door_step(r: Rig, k: int | None = None, size: int | None = None) -> None:
    """`with bal.step():` over the loader's batches (the engine keeps all but the step's last under no_sync)."""
    for _ in range(r.bal.micro_batches if k is None else k):
        batch = r.next_batch()
        with r.bal.step(batch_size=size):
            r.backward(len(batch))
        if r.bal.sync_now:
            r.opt_step()


def door_begin_end(r: Rig, k: int | None = None, sync_at: int | None = None) -> None:
    """begin_step, k micro-batches, all but the last under the model's no_sync, the optimizer step, end_step."""
    r.bal.set_epoch(0)
    sizes = r.bal.begin_step()
    m = r.bal.settings.micro_batch or int(sizes[r.bal.rank])
    k = r.bal.micro_batches if k is None else k
    last = k - 1 if sync_at is None else sync_at
    for j in range(k):
        with nullcontext() if j == last else r.model.no_sync():
            r.backward(m)
    r.opt_step()
    r.bal.end_step()


def door_hf(r: Rig, k: int | None = None) -> None:
    """The HF Trainer's loop (hetero/integrations/hf/trainer.py): engine.micro(rows, ends_step=False) per
    micro-batch, then the optimizer step, then the callback's end_step."""
    for _ in range(r.bal.micro_batches if k is None else k):
        r.next_batch()
        with r.engine.micro(M, ends_step=False):
            r.backward()
    r.opt_step()
    r.bal.end_step()


def door_lightning(r: Rig, k: int | None = None) -> None:
    """Lightning's per-rank recipe under DDP: training_step runs inside one DDP forward, so the callback counts each
    micro-batch at its backward (engine.count_forward), and checks the step at the batch's end (engine.running)."""
    for _ in range(r.bal.micro_batches if k is None else k):
        r.next_batch()
        with r.bal.step():
            with torch.no_grad():
                r.model(torch.ones(1, 4))   # a forward without grad is not counted
            r.engine.count_forward(r.model, ())
            (r.model.lin.weight.sum() * M).backward()  # the micro-batch's loss, outside the counted forward
        if r.bal.sync_now:
            r.opt_step()
    if (s := r.engine.running(required=False)) is not None:
        raise HeteroError(f"lightning's batch end: {s.expected - s.left} of {s.expected}")


def door_fsdp(r: Rig, k: int | None = None) -> None:
    """FSDP2: `with bal.step():` over the loader's batches; its schedule, not no_sync, keeps a micro-batch local."""
    door_step(r, k)


DOORS = {"step": door_step, "begin_end": door_begin_end, "hf": door_hf, "lightning": door_lightning}
LOSS = {"micro_batch": M, "weighting": "loss"}  # the weight on the loss (lossweight.py): through both loop doors


def _raises(fn, words: str) -> str:
    with pytest.raises((HeteroError, ValueError)) as e:
        fn()
    line = str(e.value)
    assert words in line and "\n" not in line, line
    return line


# -- the table: (case, door) -> the setting, the mistake, the line's words -------------------------------------------
def m_more(r: Rig, door) -> None:
    """One micro-batch beyond this rank's count."""
    door(r, k=r.bal.micro_batches + 1)


def m_fewer(r: Rig, door) -> None:
    """One micro-batch short of this rank's count, then the optimizer step and the step's end."""
    door(r, k=r.bal.micro_batches - 1)


CASES = [
    # a rank running more micro-batches than its count: where each door sees it first
    ("begin_end", {"micro_batch": M}, m_more, "forwards in step 0 of epoch 0, where its count is"),
    ("hf", {"micro_batch": M}, m_more, "ran a micro-batch beyond its"),
    # fewer: the optimizer steps on gradients that were never all-reduced (the guard), or the step's end refuses
    ("begin_end", {"micro_batch": M}, m_fewer, "all-reduced its gradients after"),
    ("hf", {"micro_batch": M}, m_fewer, "stepped its optimizer after"),
    ("lightning", {"micro_batch": M}, m_fewer, "lightning's batch end"),
    ("begin_end", LOSS, m_more, "forwards in step 0 of epoch 0, where its count is"),
    ("begin_end", LOSS, m_fewer, "all-reduced its gradients after"),  # refused before the backward's all-reduce
]


def _sync_early(r: Rig, door) -> None:  # begin/end: the first of two micro-batches all-reduces
    door_begin_end(r, sync_at=0)


def _never_synced(r: Rig, door) -> None:  # the step's only backward under no_sync, ended without an optimizer step
    r.bal.set_epoch(0)
    r.bal.begin_step()
    for _ in range(r.bal.micro_batches):
        with r.model.no_sync():
            r.backward()
    r.bal.end_step()


def _two_steps_one_opt(r: Rig, door) -> None:  # two steps of the schedule's micro-batches before one optimizer step
    r.bal.set_epoch(0)
    for _ in range(2):
        r.bal.begin_step()
        for j in range(r.bal.micro_batches):
            with nullcontext() if j == r.bal.micro_batches - 1 else r.model.no_sync():
                r.backward()
        r.bal.end_step()
    r.opt_step()


def _twice(r: Rig, door) -> None:
    r.bal.set_epoch(0)
    r.bal.begin_step()
    r.bal.begin_step()


def _wrong_index(r: Rig, door) -> None:
    r.bal.set_epoch(0)
    r.bal.begin_step(step=2)


def _past_epoch(r: Rig, door) -> None:
    for _ in range(N // B + 1):
        door_begin_end(r)


def _plain_loader(r: Rig, door) -> None:  # batches not from the sampler: `with bal.step()` begins from the loader
    r.bal.set_epoch(0)
    with r.bal.step():
        r.backward()


def _wrong_size(r: Rig, door) -> None:
    door_step(r, size=M + 1)


def _no_epochs(r: Rig, door) -> None:  # no batch_sampler, a balancing rule, no rebalance_every
    r.bal.begin_step()


def _set_epoch_without_length(r: Rig, door) -> None:
    r.bal.set_epoch(1)


def _not_attached(r: Rig, door) -> None:
    (door or door_step)(r)


def _by_hand(r: Rig, door) -> None:
    r.bal.set_epoch(0)
    r.bal.begin_step()


def _backward_between_steps(r: Rig, door) -> None:  # the attached model's backward outside any step
    r.bal.set_epoch(0)
    r.backward()


def _weight_between_steps(r: Rig, door) -> None:
    r.bal.set_weight(0.5)


def _peer_failed_at_end(r: Rig, door) -> None:
    r.bal.set_epoch(0)
    r.bal.begin_step()
    r.backward()
    r.engine.link.peer_failed = "hetero: rank 1 stopped: its own line"
    r.bal.end_step()


def _peer_failed_at_opt(r: Rig, door) -> None:
    r.bal.set_epoch(0)
    r.bal.begin_step()
    r.backward()
    r.engine.link.peer_failed = "hetero: rank 1 stopped: its own line"
    r.opt_step()


def _peer_failed_in_backward(r: Rig, door) -> None:  # the backward's collective fails: the peer's line is raised
    r.next_batch()
    with r.bal.step():
        r.engine.link.peer_failed = "hetero: rank 1 stopped: its own line"
        raise RuntimeError("gloo: connection closed by peer")


def _state_of_halves(r: Rig, door) -> None:  # a saved state whose sizes are no whole micro-batches of this m
    state = r.bal.state_dict()
    state["balancer"]["sizes"] = [3, 5]
    state.pop("regimes")  # else the regimes in force carry the sizes (they are checked alike)
    r.bal.load_state_dict(state)


def _left_early(r: Rig, door) -> None:  # rank 1 ran 2 steps of the epoch, this rank 4
    for _ in range(N // B):
        door_begin_end(r)
    r.bal.set_epoch(1)


def _bypassed(r: Rig, door) -> None:  # weighting="loss" and a plain loss.backward(): refused at the optimizer step
    for _ in range(r.bal.micro_batches):
        r.next_batch()
        with r.bal.step():
            r.model(torch.ones(M, 4)).sum().backward()
    r.opt_step()


def _bypassed_no_optimizer(r: Rig, door) -> None:  # ... and at the step's end, without an optimizer step
    r.bal.set_epoch(0)
    r.bal.begin_step()
    r.model(torch.ones(M, 4)).sum().backward()
    r.bal.end_step()


def _loss_peer_failed(r: Rig, door) -> None:  # DDP's own all-reduce fails inside bal.backward: the peer's line
    r.model.lin.bias.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("gloo: connection closed by peer")))
    r.next_batch()
    with r.bal.step():
        r.engine.link.peer_failed = "hetero: rank 1 stopped: its own line"
        r.backward()


def _loss_in_bfloat16(r: Rig, door) -> None:  # a loss in a low precision would round the weight put on it
    r.next_batch()
    with r.bal.step():
        r.bal.backward(r.model(torch.ones(M, 4)).sum().bfloat16())


def _loss_on_fsdp(r: Rig, door) -> None:  # weighting="loss" on an FSDP2 root (its schedule stands in)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hetero.core.fsdp, "attach", lambda e, model: FakeFSDP())
        hetero.core.attach.attach(r.engine, r.model, False)


def _loss_nothing_trainable(r: Rig, door) -> None:
    LossWeighting(r.engine, Net().requires_grad_(False))


def _emulate_far(r: Rig, door) -> None:
    r.bal.emulate("5:delay=0.01")


SINGLE = [  # (id, rig settings, mistake, the line's words)
    ("sync_early", {"micro_batch": M}, _sync_early, "all-reduced its gradients after 1 of its 2 micro-batches"),
    ("never_synced", {}, _never_synced, "gradient accumulation (no_sync) needs micro_batch"),
    ("never_synced_micro_batches", {"micro_batch": M}, _never_synced, "micro-batches per step, the last one synced"),
    ("two_steps_one_optimizer_step", {"micro_batch": M}, _two_steps_one_opt, "ran 2 steps of the schedule"),
    ("begin_twice", {}, _twice, "which has not ended"),
    ("begin_at_another_step", {}, _wrong_index, "the loop is at step 2 of epoch 0, but the Balance at step 0"),
    ("past_the_epoch", {}, _past_epoch, "epoch 0 has run all its 4 steps"),
    ("plain_loader", {}, _plain_loader, "was not handed out by hetero's sampler"),
    ("batch_of_another_size", {}, _wrong_size, "got 3 samples, the schedule says 4"),
    ("no_epochs_no_rebalance_every", {"sampler": False}, _no_epochs, "set rebalance_every > 0"),
    ("set_epoch_without_a_length", {"sampler": False}, _set_epoch_without_length, "without an epoch length"),
    ("micro_batch_before_attach", {"attach": False, "micro_batch": M}, _not_attached, "attach the model first"),
    ("fsdp_micro_batches_by_hand", {"fsdp": True, "micro_batch": M}, _by_hand, "FSDP2 with micro_batch runs"),
    ("deepspeed_by_hand", {"ds": True}, _by_hand, "a DeepSpeed engine runs each micro-batch in `with bal.step():`"),
    ("backward_between_steps", {}, _backward_between_steps, "a backward ran outside `with bal.step()`"),
    ("set_weight_between_steps", {}, _weight_between_steps, "a backward ran outside `with bal.step()`"),
    ("peer_failed_at_end", {}, _peer_failed_at_end, "rank 1 stopped: its own line"),
    ("peer_failed_at_optimizer_step", {}, _peer_failed_at_opt, "rank 1 stopped: its own line"),
    ("peer_failed_in_backward", {}, _peer_failed_in_backward, "rank 1 stopped: its own line"),
    ("state_not_whole_micro_batches", {"micro_batch": M}, _state_of_halves,
     "a state of batch sizes [3, 5], not whole micro-batches of 2: resume with the micro_batch it was saved with"),
    ("rank_left_the_epoch_early", {"ran": [4.0, 2.0], "together": True}, _left_early,
     "rank 1 left epoch 0 after 2 steps, rank 0 ran 4"),
    ("emulated_rank_outside_the_world", {"attach": False}, _emulate_far, "hetero names rank 5, but the world has 2"),
    ("loss_bypassed_at_the_optimizer_step", LOSS, _bypassed, "a backward ran outside bal.backward(loss) in step 0"),
    ("loss_bypassed_at_the_step_end", {"weighting": "loss"}, _bypassed_no_optimizer,
     "a backward ran outside bal.backward(loss) in step 0 of epoch 0 on rank 0"),
    ("loss_peer_failed_in_backward", LOSS, _loss_peer_failed, "rank 1 stopped: its own line"),
    ("loss_in_bfloat16", LOSS, _loss_in_bfloat16, "this loss is torch.bfloat16 (the weight rounded)"),
    ("loss_sync_early", LOSS, _sync_early, "all-reduced its gradients after 1 of its 2 micro-batches"),
    ("loss_nothing_trainable", {"weighting": "loss", "attach": False}, _loss_nothing_trainable,
     "no parameter that requires grad"),
    ("loss_on_fsdp", {"weighting": "loss", "attach": False}, _loss_on_fsdp, "weighting='loss' is for a DDP model"),
    ("no_token_counted", {"scheme": "edp", "collator": "padded", "loss_mean": "tokens", "loss_tokens": [0] * N},
     _by_hand, "step 0 of epoch 0 has no token its loss counts"),
]


def _rig(monkeypatch, kw: dict, rank: int = 0) -> Rig:
    kw = dict(kw)
    replay = kw.pop("replay", None)
    if kw.pop("together", False):  # a world of peers (what a process group says): the epoch's step counts compared
        monkeypatch.setattr(hetero.core.engine, "_together", lambda: True)
        monkeypatch.setattr(hetero.core.engine, "same_steps", lambda *a: None)  # the store's check: no store here
        monkeypatch.setattr(hetero.core.engine.Engine, "_agree", lambda self, where: None)
    r = Rig(monkeypatch, rank=rank, **kw)
    if replay is not None:
        r.bal.replay({e: np.array(v) for e, v in replay.items()})
    return r


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("door,kw,mistake,words", CASES, ids=[f"{c[0]}-{c[2].__name__}" for c in CASES])
def test_every_door_refuses_a_wrong_count_in_one_line(monkeypatch, door, kw, mistake, words, rank):
    r = _rig(monkeypatch, kw, rank)
    _raises(lambda: mistake(r, DOORS[door]), words)


@pytest.mark.parametrize("name,kw,mistake,words", SINGLE, ids=[c[0] for c in SINGLE])
def test_every_mistake_is_refused_in_one_line(monkeypatch, name, kw, mistake, words):
    r = _rig(monkeypatch, kw)
    _raises(lambda: mistake(r, None), words)


def test_not_attached_in_a_world_of_peers_is_refused_at_every_door(monkeypatch):
    """Without attach the gradients are DDP's plain mean: refused at the first step, through every door."""
    for door in (door_step, door_begin_end):
        r = _rig(monkeypatch, {"attach": False, "together": True})
        _raises(lambda: door(r), "call bal.attach(ddp) before the first step")


# -- negative controls: the same doors run right are refused nowhere, and run the schedule's counts ----------------
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("door", [*DOORS, "fsdp", "step_loss", "begin_end_loss"])
def test_every_door_run_right_runs_the_epoch(monkeypatch, door, rank):
    by_loss = door.endswith("_loss")  # weighting="loss": bal.backward weighs the loss, DDP's own all-reduce
    r = _rig(monkeypatch, {"micro_batch": M, "fsdp": door == "fsdp", "weighting": "loss" if by_loss else "hook"}, rank)
    door = door.removesuffix("_loss")
    run = door_fsdp if door == "fsdp" else DOORS[door]
    counts = []
    for _ in range(N // B):
        counts.append(r.bal.micro_batches)
        run(r)
    assert r.bal.position.step == N // B and r.bal.position.global_step == N // B
    assert r.engine.running(required=False) is None
    assert counts == [int(r.bal.sizes_at(0, s)[rank]) // M for s in range(N // B)]
    if door == "fsdp":  # the schedule's micro-batches: the first of each step, the last synced
        fsdp = r.engine.link.fsdp.calls
        k = counts[0]
        assert fsdp[:k] == [(j == 0, j == k - 1) for j in range(k)]


def test_a_step_weights_its_gradient_by_its_share(monkeypatch):
    """b_i/B without micro-batches, m/B with them, 1/world for an unweighted scheme (the hook multiplies by it)."""
    for scheme in ("edp", "dp"):  # weighting="loss": the loss's gradient times w_i x world (DDP's mean undoes world)
        r = _rig(monkeypatch, {"weighting": "loss", "scheme": scheme}, rank=1)
        r.bal.set_epoch(0)
        r.bal.begin_step()
        w = r.engine.running().weight
        r.backward(3)
        assert torch.allclose(r.model.lin.bias.grad, torch.tensor([3.0 * w * 2]))  # d(sum)/d(bias) = 3 rows
    r = _rig(monkeypatch, {}, rank=1)
    r.bal.set_epoch(0)
    sizes = r.bal.begin_step()
    assert r.engine.running().weight == sizes[1] / B
    r = _rig(monkeypatch, {"micro_batch": M})
    r.bal.set_epoch(0)
    r.bal.begin_step()
    assert r.engine.running().weight == M / B



class _Scaled(torch.autograd.Function):
    """A custom Function whose backward writes into its grad_output (against autograd's contract, but it runs)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.mul_(10.0)


def test_the_loss_doors_seed_is_made_once_per_weight_and_never_carries_a_write(monkeypatch):
    """weighting="loss" seeds the backward with w_i x world, made once per weight (issue 51), not per step. A
    backward that wrote into the seed, or a loss that is a leaf, must not carry into the next step: every step's
    gradient is its own weight's (a seed reused after the write would give 10x, then 100x)."""
    r = _rig(monkeypatch, {"weighting": "loss", "scheme": "edp"}, rank=1)
    r.bal.set_epoch(0)
    door = r.engine.link.loss
    seeds = []
    for step in range(4):
        r.bal.begin_step()
        w = r.engine.running().weight
        x = r.model(torch.ones(3, 4)).sum()
        r.bal.backward(_Scaled.apply(x) if step in (1, 2) else x)
        seeds.append(door._seed[1])
        assert torch.allclose(r.model.lin.bias.grad, torch.tensor([3.0 * w * 2 * (10 if step in (1, 2) else 1)]))
        r.opt_step()
        r.bal.end_step()
    assert seeds[0] is seeds[1]  # the same weight: the same seed, until a backward wrote into it
    assert seeds[2] is not seeds[1] and seeds[3] is not seeds[2]  # written into at steps 1 and 2: made afresh
    leaf = torch.tensor(2.0, requires_grad=True)  # a loss that is a leaf: its .grad could be the seed itself
    assert door._seed_of(leaf, 0.5) is not door._seed_of(leaf, 0.5)

# -- the table covers every refusal ----------------------------------------------------------------------------------
CORE = Path(hetero.__file__).parent / "core"
RAISERS = {"HeteroError", "_stop", "refuse", "ValueError"}


def _refusals(path: Path) -> list[str]:
    """Each refusal's fixed words (an f-string's placeholders as '{}'), for every literal line raised in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in RAISERS and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append(arg.value)
            elif isinstance(arg, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values))
    return out


def _lines() -> list[str]:
    """Every line the table's cases raise (rank 0's; the not-attached case at both loop doors)."""
    lines = []
    for kw, mistake, door in [(c[1], c[2], DOORS[c[0]]) for c in CASES] + [(c[1], c[2], None) for c in SINGLE] + \
            [({"attach": False, "together": True}, _not_attached, d) for d in (door_step, door_begin_end)]:
        with pytest.MonkeyPatch.context() as mp:
            r = _rig(mp, kw)
            try:
                mistake(r, door)
            except (HeteroError, ValueError) as e:
                lines.append(str(e))
    return lines


# refusals no public call reaches, kept as the last check before a wrong step: the words, and where it is refused first
BACKSTOPS = {
    "not whole micro-batches of": "sizes come from the balancer (whole micro-batches), bal.replay and load_state_dict, "
                                  "which refuse them (replay.py, plan.py: the state_not_whole_micro_batches case)",
}


def test_every_refusal_is_in_the_table():
    """Every literal line engine.py, guard.py and lossweight.py raise is raised by a case of the table (its
    placeholders filled); fails on a refusal added without a case. The peer's line, raised as the peer wrote it, is
    the peer_failed cases'. A refusal removed fails its own case above."""
    sites = _refusals(CORE / "engine.py") + _refusals(CORE / "guard.py") + _refusals(CORE / "lossweight.py")
    assert len(sites) >= 16, sites
    lines = _lines()
    missing = [site for site in sites if not any(b in site for b in BACKSTOPS)
               if not any(re.fullmatch(re.escape(site).replace(r"\{\}", ".*"), line, re.S) for line in lines)]
    assert not missing, f"no case raises: {missing}"


def test_a_collected_engine_retires_its_guard_without_breaking_an_optimizer_step(monkeypatch):
    """An engine the garbage collector frees during an optimizer step (inside torch's loop over the global step
    pre-hooks) leaves its hook in place, a no-op, until the next attach removes it: removing it there would break
    the loop ("OrderedDict mutated during iteration")."""
    import gc

    from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

    import hetero.core.guard as guard

    def collect(opt, args, kwargs):  # a hook that runs a collection inside the loop over the hooks
        gc.collect()
    handle = register_optimizer_step_pre_hook(collect)  # before the doomed engine's: the loop goes on after it
    try:
        doomed = _rig(monkeypatch, {"weighting": "loss"})  # (the hook rig's gradient hook on a tensor is never freed)
        hooks = len(_global_optimizer_pre_hooks)  # its own included; earlier retired ones removed by its attach
        assert not getattr(guard, "_retired", [])  # (before the fix there was no list: the step below raised)
        del doomed
        torch.optim.SGD(Net().parameters(), lr=0.1).step()    # the doomed engine is freed inside the loop
        assert guard._retired and len(_global_optimizer_pre_hooks) == hooks  # retired, not removed there
    finally:
        handle.remove()
    retired = len(guard._retired)  # (with other engines freed by the same collection)
    _rig(monkeypatch, {})                                       # the next attach removes the retired hooks
    assert not guard._retired and len(_global_optimizer_pre_hooks) == hooks - 1 - retired + 1
