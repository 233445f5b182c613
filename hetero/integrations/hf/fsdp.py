"""The HF Trainer on FSDP2: `TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2, ...})`, accelerate's
FSDP2 plugin (`fully_shard` on the wrapped layers, a tail group and the root), with hetero's weighted reduce-scatter
(hetero.core.fsdp) in place of DDP's comm hook. What HeteroTrainer adds for it:

- `Balance.attach` on the Trainer's FSDP2 root (its `model_wrapped`), which installs the weighted reduce-scatter;
- with accumulation (micro_batch m), each of this rank's k_i micro-batches runs through the core's micro-batch door
  (`Engine.micro`), which opens it with the FSDP2 schedule (the step's first unshards every module, only the
  last reduce-scatters) where DDP takes no_sync;
- the loss probe (loss.decide) runs a different number of forwards on each rank, so it runs with every module
  unsharded once and kept so (`gathered`): no all-gather inside it.

Refused, one line each: FSDP1 (`fsdp_version` 1), and `fsdp` on CPU ranks, where accelerate 1.15 keeps no FSDP
plugin (accelerate/state.py, AcceleratorState.__init__: the FSDP branch is reached only for the accelerator
distributed types, MULTI_GPU to MULTI_NEURON; CPU ranks are MULTI_CPU) and the Trainer would train DDP silently.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ...core import fsdp

CPU_REFUSAL = ("hetero: fsdp on CPU ranks: accelerate keeps its FSDP plugin only on accelerator devices "
               "(accelerate/state.py, AcceleratorState: CPU ranks are MULTI_CPU), so the Trainer would train DDP "
               "instead of FSDP2; run FSDP2 on GPUs, or drop fsdp on CPU")


def refusal(trainer) -> str | None:
    """Why hetero cannot run this Trainer's FSDP setting (one line), or None (no FSDP, or FSDP2 on devices)."""
    if not trainer.args.fsdp:
        return None
    if not trainer.is_fsdp_enabled:  # asked for, and dropped by accelerate
        return CPU_REFUSAL
    version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
    if version != 2:
        return (f"hetero: fsdp_version {version} (FSDP1) is not supported: set fsdp_config "
                f"{{\"fsdp_version\": 2}}, whose fully_shard reduce-scatter hetero weights")
    return None


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 module unsharded (the same all-gathers on every rank) and not resharded after forward, for
    forwards without gradient between two steps; then its reshard_after_forward back and FSDP's iteration state
    reset (torch >= 2.14's reset_iter_state). No-op for a model without FSDP2 modules."""
    modules = fsdp.fsdp_modules(model)
    # torch keeps reshard_after_forward per param group (no getter): saved and restored as set_reshard_after_forward
    # writes it (torch/distributed/fsdp/_fully_shard/_fully_shard.py)
    saved = [(m._get_fsdp_state(), m._get_fsdp_state()._auto_reshard_after_forward,
              [g.post_forward_mesh_info for g in m._get_fsdp_state()._fsdp_param_groups]) for m in modules]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for g, info in zip(state._fsdp_param_groups, infos):
                g.post_forward_mesh_info = info
        if modules:  # reshards every group and clears FSDP's post-forward order, which the probe's forwards (a
            # different count per rank) filled: backward's prefetch would follow it and all-gather on one rank only
            if hasattr(model, "reset_iter_state"):
                model.reset_iter_state()
            else:  # torch < 2.14: the same two parts by hand
                for m in modules:
                    m.reshard()
                model._get_fsdp_state()._comm_ctx.post_forward_order.clear()
