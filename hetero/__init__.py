"""hetero: heterogeneity-aware synchronous data-parallel training (Sync-SGD, DP-SGD, EDP-SGD and beyond).

Four layers (tests/project/test_layers.py holds the import rules; the module map is docs/api.md#modules):
- hetero.core: the library (Balance, its sampler, comm hook, balancers and partition maths); torch and numpy only.
- hetero.integrations: the core inside other engines' loops (Lightning, Hugging Face, Accelerate, Ray); the
  core only.
- hetero.trainer: the built-in CIFAR-10 trainer (`python -m hetero.trainer`), one user of the core; the core only.
- hetero.lab: grids, reports, the simulator and the benchmarks, on top of the other three.
"""
from .core import __version__  # noqa: F401 - re-exported (__all__)

_CORE = {"Balance": "balance", "BalancedBatchSampler": "sampler", "Decision": "records", "HeteroError": "agree",
         "Position": "records", "StepRecord": "records"}
__all__ = sorted([*_CORE, "BalanceCallback", "HeteroTrainer", "__version__"])


def __getattr__(name: str):
    # the public names import torch when first asked for: `import hetero.core.partition` stays numpy-only
    if name in _CORE:
        from importlib import import_module
        return getattr(import_module(f".core.{_CORE[name]}", __name__), name)
    if name == "BalanceCallback":  # needs the [lightning] extra
        from .integrations.lightning import BalanceCallback
        return BalanceCallback
    if name == "HeteroTrainer":  # needs the [hf] extra
        from .integrations.hf import HeteroTrainer
        return HeteroTrainer
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
