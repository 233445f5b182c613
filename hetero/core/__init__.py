"""The library: per-rank batch sizes by measured speed, the exact global-batch gradient, and the maths behind them.

Imports nothing from hetero.trainer or hetero.lab (tests/project/test_layers.py checks it); needs torch and numpy only.
- partition, balancer: pure maths (numpy): shares, sizes and the rebalancing rules.
- balance: the Balance, the public front (the user's verbs); beneath it, called top-down only: engine (one step's
  protocol and every door's checks; the extension surface), plan (sizes per position, the position, the decision
  window, the balancer; its state_dict), settings; sampler, hook, guard and fsdp are how the parts meet a loader,
  DDP, an optimizer and FSDP2; probe finds per-rank largest batches.
- agree, clock, settle: distributed plumbing (what the ranks agree on, the step clock, a clean exit).
- emulator, memory, records, seeding, safeio: emulated slow ranks, the largest-batch probe, step records, seeds
  and safe file writes.
"""

__version__ = "0.1.0"  # here, not in the package root: the core imports nothing from above it
