"""The built-in trainer: CIFAR-10 models and data on the device, run folders, resume; one user of hetero.core.

`python -m hetero.trainer --help` (under torchrun for several ranks). Imports nothing from hetero.lab.
- run: the command's life cycle; loop: the Trainer (one epoch top to bottom in train_epoch);
- config, cli: the settings and their flags; data, models: CIFAR-10 and the networks;
- dist: the process group and devices; runfolder (its files, lock and reading back), checkpoint (the sealed
  checkpoint file), fit (does a checkpoint fit this run), resume (the recorded config), provenance: the run
  folder and what it records.
"""
