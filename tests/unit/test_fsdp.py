"""hetero on FSDP2 (fully_shard, gloo on the CPU): the exact global-batch gradient at 2 and 3 ranks with unequal
sizes, in micro-batch mode with unequal counts, with clipping and mixed precision; refusals in one line on every
rank; the example (examples/fsdp_lm.py) under torchrun: coverage, the slow rank's share, the loss, a resume.
Here the cases in one process; those that launch processes: tests/integration/test_fsdp_launch.py."""
from __future__ import annotations

import pytest
import torch

import hetero


def test_a_plain_module_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^attach takes a DDP model or an FSDP2 root; this Linear is neither "
                                         r"\(wrap it in DistributedDataParallel, or fully_shard it\)$"):
        hetero.Balance(global_batch=8).attach(torch.nn.Linear(2, 2))


def test_fsdp1_is_refused_in_one_line(monkeypatch):
    from torch.distributed.fsdp import FullyShardedDataParallel

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # FSDP1 needs an accelerator to build
    with pytest.raises(ValueError, match=r"^FSDP1 \(FullyShardedDataParallel\) is not supported: shard with FSDP2"):
        hetero.Balance(global_batch=8).attach(fsdp1)
