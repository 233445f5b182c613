"""Accumulation in a plain Accelerate loop with hetero's per-rank counts, k = [1, 3] micro-batches of 2 on 2 gloo ranks
(Balance(micro_batch=2, global_batch=8)): the pattern that takes the place of accelerator.accumulate(model) (each
micro-batch in `with bal.step():`, the optimizer stepped where bal.sync_now) makes one optimizer step equal to one
single-process step on the union, on a DDP model and on an FSDP2 model (FullyShardedDataParallelPlugin(fsdp_version=2),
prepared by accelerate and attached by hetero.integrations.accelerate.prepare); the weight doubled or removed
(scheme "dp": each rank's mean over its own micro-batches, the ranks alike) is caught, and an Accelerator that
accumulates a fixed count on every rank (gradient_accumulation_steps=2) is refused in one line.

accelerate 1.15 keeps no FSDP plugin on CPU ranks (test_hf_fsdp.py): the FSDP2 case runs with the plugin kept after
AcceleratorState's __init__, as there."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from test_hf import MeanLoss, Points  # noqa: E402
from test_hf_fsdp import _fsdp_on_cpu  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hetero  # noqa: E402
from hetero.integrations.accelerate import prepare  # noqa: E402

from helpers import max_diff, spawned  # noqa: E402

pytestmark = pytest.mark.slow  # two processes importing accelerate and transformers
B, M, SIZES, LR, SEED = 8, 2, [2, 6], 0.5, 3  # k = [1, 3]
CASES = {"ddp": ("edp", 1, False), "ddp_doubled": ("edp", 2, False), "ddp_removed": ("dp", 1, False),
         "fsdp": ("edp", 1, True), "fsdp_doubled": ("edp", 2, True)}  # name: (scheme, weight factor, FSDP2)


def _step(accelerator: Accelerator, scheme: str, factor: float) -> dict:
    """One optimizer step of the documented loop; the model's parameters after it (whole, also under FSDP2)."""
    bal = hetero.Balance(global_batch=B, micro_batch=M, scheme=scheme, seed=SEED)
    bal.replay({0: [SIZES]})
    model = MeanLoss()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = prepare(accelerator, bal, model, opt)
    loader = DataLoader(Points(), batch_sampler=bal.batch_sampler(B))
    bal.set_epoch(0)
    micro, steps = [], 0
    for batch in loader:                        # this rank's k_i micro-batches of M
        with bal.step():                        # in place of accelerator.accumulate(model)
            if factor != 1:
                bal.set_weight(bal.engine.running().weight * factor)
            accelerator.backward(model(**batch)["loss"])
            micro.append(len(batch["x"]))
            if bal.sync_now:
                opt.step()
                opt.zero_grad()
                steps += 1
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"model": type(model).__name__, "micro": micro, "steps": steps,
            "params": [p.detach().flatten().tolist() for p in full]}


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    try:
        prepare(Accelerator(cpu=True, gradient_accumulation_steps=2), hetero.Balance(global_batch=B, micro_batch=M),
                MeanLoss())
    except ValueError as e:
        result["fixed"] = str(e)
    for name, (scheme, factor, fsdp) in CASES.items():
        if fsdp:
            _fsdp_on_cpu()
            accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        else:
            accelerator = Accelerator(cpu=True)
        result[name] = _step(accelerator, scheme, factor)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _union() -> list[torch.Tensor]:
    """One SGD step of one process on the 8 rows at once (the step's window is the whole data set)."""
    model, data = MeanLoss(), Points()
    model(data.x, data.y)["loss"].backward()
    with torch.no_grad():
        return [(p - LR * p.grad).flatten() for p in model.parameters()]


def test_accumulating_per_rank_counts_in_an_accelerate_loop_is_the_union_step(tmp_path):
    spawned(_worker, tmp_path)
    want = _union()
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["fixed"].startswith("hetero: Accelerator(gradient_accumulation_steps=2) accumulates the same count")
        for name in ("ddp", "fsdp"):
            run = got[name]
            assert run["micro"] == [M] * (SIZES[rank] // M) and run["steps"] == 1
            assert max_diff(run["params"], want) < 1e-6, f"{name}: not the union's step"
        assert got["ddp"]["model"] == "DistributedDataParallel" and got["fsdp"]["model"].startswith("FSDP")
        for wrong in ("ddp_doubled", "ddp_removed", "fsdp_doubled"):
            assert max_diff(got[wrong]["params"], want) > 1e-3, f"{wrong}: not caught"
