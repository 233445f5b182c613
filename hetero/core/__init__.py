"""The library: per-rank batch sizes by measured speed, the exact global-batch gradient, and the maths behind them.

Imports nothing from hetero.trainer or hetero.lab (tests/unit/test_layers.py checks it); needs torch and numpy only.
- partition, balancer: pure maths (numpy): shares, sizes and the rebalancing rules.
- balance: the Balance, the public front; sampler, hook and fsdp are how it meets a loader, DDP and FSDP2.
- agree, clock, settle: distributed plumbing (what the ranks agree on, the step clock, a clean exit).
- emulator, memory, records, seeding, safeio: emulated slow ranks, the largest-batch probe, step records, seeds
  and safe file writes.
"""
