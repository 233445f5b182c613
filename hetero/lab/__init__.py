"""The lab: experiment grids, reports and figures, the simulator and the benchmarks, on top of the core and the trainer.

Commands: `python -m hetero.lab.grid`, `python -m hetero.lab.bench`, `python -m hetero.lab.simbench`,
`python -m hetero.lab.analysis`; the Makefile's targets run them.
"""
