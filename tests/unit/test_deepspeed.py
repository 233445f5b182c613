"""The DeepSpeed door's parts that need no engine (hetero/core/deepspeed.py), and the doors that refuse DeepSpeed.
The door itself runs in tests/integration/test_deepspeed_launch.py (2 ranks, ZeRO 0-3, against one process)."""
from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from hetero.core.deepspeed import _rows, _tensors, is_engine


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
    """The refusals at attach that a launch does not reach (tests/integration/test_deepspeed_launch.py reaches
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
