"""The GPU path, tested on the CPU (issue 16): emulated delays that really delay (with a fake GPU whose queued work
finishes after the host moves on), the backend chosen from every rank's physical GPU, the probe's reading of
cuDNN/cuBLAS allocation failures, and batches that reach the model in its memory format without extra copies."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hetero.core import memory
from hetero.core.clock import StepClock
from hetero.core.emulator import Emulator
from hetero.core.engine import spend_delay
from hetero.core.memory import fitting_batch, is_alloc_failure
from hetero.core.seeding import EMULATOR, epoch_seed
from hetero.trainer.data import DeviceLoader
from hetero.trainer.dist import Place, choose_backend, exchange_places, gpu_identity, shared_gpu_groups

from helpers import TINY, read_run, run_train

CPU = torch.device("cpu")
SEED, EPOCH, RANK = 7, 2, 1


# -- emulated delays ---------------------------------------------------------------------------------------------
class FakeGpu:
    """A stand-in for one CUDA stream: work queued on it finishes `seconds` later than the host queued it, events
    complete when the stream reaches them, and synchronising on an event blocks the host until then."""

    def __init__(self):
        self.busy_until = 0.0
        self.syncs = 0

    def queue(self, seconds: float) -> None:  # the host launches kernels and moves on
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu):
        self.gpu, self.t = gpu, None

    def record(self) -> None:
        self.t = max(time.perf_counter(), self.gpu.busy_until)  # the stream reaches it after the queued work

    def synchronize(self) -> None:
        self.gpu.syncs += 1
        if (left := self.t - time.perf_counter()) > 0:
            time.sleep(left)

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.t - self.t) * 1e3  # ms, as torch.cuda.Event


def run_steps(spec: str, steps: int, clock_for, work) -> tuple[np.ndarray, np.ndarray, list[StepClock]]:
    """Steps as the trainer times them (start, own work, the last bucket's hook with the emulated delay, ready,
    returned, end), through the Balance's own delay (api.spend_delay): (compute_s, delay_s, clocks)."""
    emulator = Emulator(spec, RANK, SEED)
    emulator.start_epoch(EPOCH)
    delay, compute, clocks = np.zeros(steps), np.zeros(steps), []
    for step in range(steps):
        clock = clock_for()
        clock.mark("start")
        work()
        delay[step] = spend_delay(emulator, EPOCH, step, clock)
        for name in ("ready", "returned", "end"):
            clock.mark(name)
        compute[step], _ = clock.read()
        clocks.append(clock)
    return compute, delay, clocks


def expected_draws(kind: str, params: tuple[float, ...], steps: int) -> np.ndarray:
    """The emulator's seeded draws, reproduced independently (per seed, rank and epoch)."""
    rng = np.random.default_rng(epoch_seed(SEED, EPOCH, EMULATOR + RANK))
    draw = {"delay": lambda: params[0], "exp": lambda: rng.exponential(params[0]),
            "gamma": lambda: rng.gamma(params[0], params[1])}[kind]
    return np.array([draw() for _ in range(steps)])


@pytest.mark.parametrize("spec,kind,params", [("1:delay=0.02", "delay", (0.02,)), ("1:exp=0.02", "exp", (0.02,)),
                                              ("1:gamma=2/0.01", "gamma", (2, 0.01))])
def test_random_and_fixed_delays_are_counted_as_compute_on_the_cpu(spec, kind, params):
    compute, delay, clocks = run_steps(spec, 6, lambda: StepClock(CPU), lambda: None)
    assert np.allclose(delay, expected_draws(kind, params, 6), rtol=0, atol=1e-12)
    assert np.all(compute >= delay) and delay.sum() > 0
    assert [c.device_waits for c in clocks] == [int(d > 0) for d in delay]


def test_slowdown_on_the_cpu_waits_its_own_compute_times_factor_minus_one():
    compute, delay, clocks = run_steps("1:slowdown=3", 4, lambda: StepClock(CPU), lambda: time.sleep(0.01))
    own = delay / 2
    assert np.all(own >= 0.01)                 # the hook measured at least the step's own work
    assert np.all(compute >= own + delay)      # and the delay came on top of it
    assert all(c.device_waits == 1 for c in clocks)


@pytest.mark.parametrize("spec,kind,params", [("1:delay=0.02", "delay", (0.02,)), ("1:exp=0.02", "exp", (0.02,)),
                                              ("1:gamma=2/0.01", "gamma", (2, 0.01)), ("1:slowdown=2", "slowdown", ())])
def test_delay_is_not_swallowed_by_gpu_work_still_queued(monkeypatch, spec, kind, params):
    """The issue's bug: with 30 ms of kernels still queued when the hook runs, a bare sleep overlaps them and the
    rank's compute_s grows by less than the delay. The hook must wait for the stream (once per delayed step, by an
    event: never a device-wide synchronise) and then sleep."""
    def no_device_sync(*a, **k):
        raise AssertionError("torch.cuda.synchronize waits for NCCL's streams too")
    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    gpu, queued = FakeGpu(), 0.03
    compute, delay, clocks = run_steps(spec, 4, lambda: StepClock(CPU, event=gpu.event), lambda: gpu.queue(queued))
    if kind == "slowdown":
        assert np.all(delay >= queued)  # own compute came from the events: the queued work, not host time
    else:
        assert np.allclose(delay, expected_draws(kind, params, 4), rtol=0, atol=1e-12)
    assert np.all(compute >= queued + delay), (compute, delay)
    assert [c.device_waits for c in clocks] == [1] * 4 and gpu.syncs >= 4


def test_device_wait_only_on_delayed_steps():
    gpu = FakeGpu()
    compute, delay, clocks = run_steps("1:delay=0.01@s1-2", 4, lambda: StepClock(CPU, event=gpu.event),
                                       lambda: gpu.queue(0.005))
    assert delay.tolist() == [0, 0.01, 0.01, 0] and [c.device_waits for c in clocks] == [0, 1, 1, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the fake stream above stands in on the CPU)")
def test_delay_on_a_real_gpu_comes_after_the_queued_kernels():
    dev, waited = torch.device("cuda"), []
    a = torch.randn(4096, 4096, device=dev)

    class Clock(StepClock):
        def wait_device(self):
            waited.append(super().wait_device())
            return waited[-1]

    compute, delay, clocks = run_steps("1:delay=0.02", 3, lambda: Clock(dev), lambda: [a @ a for _ in range(20)])
    assert len(waited) == 3 and all(ev.query() for ev in waited)
    for c, d, clock, ev in zip(compute, delay, clocks, waited):
        queued_s = clock.marks["start"].elapsed_time(ev) / 1e3  # the kernels the host waited for
        assert queued_s > 0 and c >= queued_s + d - 1e-4  # the delay came after them (timer resolution aside)


# -- ranks, GPUs and the backend ---------------------------------------------------------------------------------
def test_gpu_identity_prefers_uuid_then_pci_address_then_name():
    props = SimpleNamespace(name="H200", uuid="8f1c-aa", pci_domain_id=0, pci_bus_id=0x1b, pci_device_id=0)
    assert gpu_identity(props, 0) == "uuid 8f1c-aa"
    assert gpu_identity(SimpleNamespace(**{**props.__dict__, "uuid": ""}), 0) == "pci 0000:1b:00"
    assert gpu_identity(SimpleNamespace(name="H200"), 3) == "H200 #3"


def place(host: str, device: str, gpu: str = "", gpus: int = 1) -> Place:
    return Place(host, device, gpu, gpus if device != "cpu" else 0)


def test_backend_from_every_ranks_place():
    own = [place("a", "cuda:0", "uuid A", 2), place("a", "cuda:1", "uuid B", 2)]
    assert choose_backend(own, "auto") == ("nccl", "") and choose_backend(own, "nccl") == ("nccl", "")
    # SLURM --gpus-per-task: both ranks see their GPU as cuda:0, but the GPUs differ: NCCL is fine
    per_task = [place("a", "cuda:0", "uuid A"), place("a", "cuda:0", "uuid B")]
    assert choose_backend(per_task, "auto") == ("nccl", "") and shared_gpu_groups(per_task) == []
    # NPROC=2 DEVICE=cuda on a one-GPU machine: local ranks wrap onto the one GPU
    wrapped = [place("a", "cuda:0", "uuid A"), place("a", "cuda:0", "uuid A")]
    backend, note = choose_backend(wrapped, "auto")
    assert backend == "gloo" and note == ("hetero: ranks 0, 1 share one GPU (cuda:0 on a, 1 GPU(s) there): using "
                                          "gloo (NCCL refuses two ranks on one GPU)")
    with pytest.raises(ValueError, match=r"^--backend nccl: ranks 0, 1 share one GPU .*use --backend gloo"):
        choose_backend(wrapped, "nccl")
    assert choose_backend(wrapped, "gloo") == ("gloo", "")
    # multi-host --device auto: one host resolved it to its GPU, the other to the CPU; every rank sees both
    mixed = [place("a", "cuda:0", "uuid A"), place("b", "cpu")]
    assert choose_backend(mixed, "auto") == ("gloo", "")
    with pytest.raises(ValueError, match="rank 1 is on the CPU"):
        choose_backend(mixed, "nccl")
    # the same GPU name on two hosts is two GPUs
    assert choose_backend([place("a", "cuda:0", "H200 #0"), place("b", "cuda:0", "H200 #0")], "auto")[0] == "nccl"


def test_places_are_exchanged_through_the_store():
    store, got = dist.HashStore(), {}
    mine = [place("a", "cuda:0", "uuid A"), place("b", "cpu")]
    threads = [threading.Thread(target=lambda r: got.__setitem__(r, exchange_places(store, r, 2, mine[r])), args=(r,))
               for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {0: mine, 1: mine}


# -- the memory probe --------------------------------------------------------------------------------------------
MESSAGES = ["CUDA out of memory. Tried to allocate 2.00 GiB",
            "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
            "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
            "GET was unable to find an engine to execute this computation",
            "Unable to find a valid cuDNN algorithm to run convolution"]


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, message):
        ctx.message = message
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError(ctx.message)


class FailsAbove(nn.Module):
    """Raises `message` (a plain RuntimeError, as cuDNN and cuBLAS do) for batches above `limit`, in forward or
    backward."""

    def __init__(self, limit: int, message: str, where: str):
        super().__init__()
        self.limit, self.message, self.where = limit, message, where
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(4, 10))

    def forward(self, x):
        out = self.body(x)
        if len(x) > self.limit:
            if self.where == "forward":
                raise RuntimeError(self.message)
            out = _FailBackward.apply(out, self.message)
        return out


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("message", MESSAGES)
def test_probe_reads_cudnn_and_cublas_allocation_failures_as_does_not_fit(monkeypatch, message, where):
    recovered = []
    real = memory.recover
    monkeypatch.setattr(memory, "recover", lambda d: (recovered.append(d), real(d)))
    got = fitting_batch(FailsAbove(40, message, where), (3, 8, 8), 10, CPU, lo=1, hi=64)
    assert got == 36  # 40 fits, 41 does not: 0.9 x 40
    assert recovered and all(d == CPU for d in recovered)  # after every failure: cache freed, device checked


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_probe_lets_other_errors_through(where):
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_NOT_SUPPORTED"):
        fitting_batch(FailsAbove(4, "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED", where), (3, 8, 8), 10, CPU, lo=1,
                      hi=64)
    with pytest.raises(RuntimeError, match="not even 8 sample.*unable to find an engine"):
        fitting_batch(FailsAbove(4, MESSAGES[3], where), (3, 8, 8), 10, CPU, lo=8, hi=64)


def test_alloc_failure_classification_and_the_probes_time_limit():
    assert all(is_alloc_failure(RuntimeError(m)) for m in MESSAGES)
    assert is_alloc_failure(torch.cuda.OutOfMemoryError("x"))
    assert not any(is_alloc_failure(e) for e in (RuntimeError("CUDNN_STATUS_INTERNAL_ERROR"), ValueError("out of "
                                                 "memory"), RuntimeError("expected scalar type Float")))
    with pytest.raises(TimeoutError, match="ran past its 0 s limit"):
        fitting_batch(FailsAbove(40, MESSAGES[0], "forward"), (3, 8, 8), 10, CPU, lo=1, hi=64, limit_s=0)


# -- channels-last -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("augment", [True, False])
def test_batches_come_in_the_models_memory_format_without_a_copy(augment):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(40)
    batches = {}
    for fmt in (torch.contiguous_format, torch.channels_last):
        loader = DeviceLoader(x, y, (0.5,) * 3, (0.25,) * 3, CPU, augment, memory_format=fmt)
        loader.seed(3)
        b, _ = loader.batch(torch.arange(5, 25))
        assert b.is_contiguous(memory_format=fmt)
        assert b.contiguous(memory_format=fmt).data_ptr() == b.data_ptr()  # the trainer's line copies nothing
        batches[fmt] = b
    assert torch.equal(batches[torch.contiguous_format], batches[torch.channels_last])  # same crops and flips
    assert not batches[torch.contiguous_format].is_contiguous(memory_format=torch.channels_last)


# the cases that launch processes
@pytest.mark.launch
@pytest.mark.slow
def test_delayed_rank_records_its_delay_as_compute_in_a_real_run(tmp_path):
    run = tmp_path / "run"
    run_train([*TINY, "--epochs", "1", "--scheme", "sync", "--threads", "1", "--hetero", "1:exp=0.03",
               "--run-dir", str(run)], nproc=2)
    steps = read_run(run)["steps"]
    slow = steps[steps["rank"] == 1].sort_values("step")
    rng = np.random.default_rng(epoch_seed(0, 1, EMULATOR + 1))  # the default --seed is 0
    assert np.allclose(slow.delay_s, [rng.exponential(0.03) for _ in range(len(slow))])
    assert (slow.compute_s >= slow.delay_s).all() and (steps[steps["rank"] == 0].delay_s == 0).all()
