"""hetero: heterogeneity-aware synchronous data-parallel training (Sync-SGD, DP-SGD, EDP-SGD and beyond)."""

__version__ = "0.1.0"
