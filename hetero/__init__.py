"""hetero: heterogeneity-aware synchronous data-parallel training (Sync-SGD, DP-SGD, EDP-SGD and beyond)."""

__version__ = "0.1.0"

_API = {"Balance", "BalancedBatchSampler", "Decision", "HeteroError", "StepRecord", "balance_hook"}
__all__ = sorted([*_API, "BalanceCallback", "__version__"])


def __getattr__(name: str):
    # the public API (api.py) imports torch; `import hetero.partition` stays numpy-only until it is asked for
    if name in _API:
        from . import api
        return getattr(api, name)
    if name == "BalanceCallback":
        from .lightning import BalanceCallback
        return BalanceCallback
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
