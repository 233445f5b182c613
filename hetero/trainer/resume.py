"""Resuming a run: the recorded Config with the flags that may change, every problem one ConfigError before any
process group exists; and the learning-rate rule when --epochs changes. The files are read by runfolder."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import fields
from pathlib import Path

import torch

from .config import Config, ConfigError
from .runfolder import epochs_done, read_config

# Flags that may differ from the recorded run on --resume: how long, where and how fast it runs, not what it
# computes. A grown --epochs re-lays the cosine schedule (relay_cosine, from Trainer.load_state_dict).
# The per-rank ones (device, threads, affinity, max_batch) may be given anew for another world size; a recorded list
# of one value per rank does not carry over to another world (whose ranks are other workers), it is refused.
RESUMABLE = ("epochs", "timeout_s", "device", "backend", "threads", "affinity", "eval_batch", "data_dir",
             "max_batch", "checkpoint_every", "tensorboard")
PER_RANK = ("device", "threads", "affinity", "max_batch")
FOLDER = ("resume", "run_dir", "overwrite")  # where the run is, not what it computes


def resumed_config(cfg: Config, given: set[str], world_size: int, rejoined: str = "") -> Config:
    """The Config recorded in the --resume folder, with the resumable flags given on this command line; every
    problem (unreadable or foreign config.json, a per-rank list or emulated rank that does not fit another world
    size, a changed flag) is a ConfigError. rejoined: how a torchrun job found the folder instead of --resume (its
    world may then change as torchrun's elastic rules allow: Config.check_world)."""
    folder = Path(cfg.resume)
    where = f"cannot resume {folder}" + (f" ({rejoined})" if rejoined else "")
    meta = read_config(folder)
    saved = meta["config"]
    defaults = {f.name: f.default for f in fields(Config)}
    if unknown := sorted(set(saved) - set(defaults)):
        raise ConfigError(f"{where}: its config.json has unknown field(s) {', '.join(map(repr, unknown))} "
                          f"(written by another version of hetero?)")
    ran = meta.get("world_size")
    if not (type(ran) is int and ran >= 1):
        raise ConfigError(f"{where}: its config.json has no world size")
    if cfg.run_dir and Path(cfg.run_dir) != folder:
        raise ConfigError(f"--run-dir {cfg.run_dir} differs from --resume {folder}: a resumed run stays in its folder")
    recorded = {**defaults, **saved}  # a field added since the run was recorded holds its default
    changed = [n for n in defaults if n in given and n not in RESUMABLE + FOLDER and getattr(cfg, n) != recorded[n]]
    if changed:
        raise ConfigError(f"{where} with another " + ", ".join(f"--{n.replace('_', '-')} (recorded "
                          f"{recorded[n]!r})" for n in changed) + ": a resumed run keeps its configuration; only "
                          + ", ".join(f"--{n.replace('_', '-')}" for n in RESUMABLE) + " may change"
                          + (" (another --rdzv-id or --run-dir starts a new run)" if rejoined else ""))
    if ran != world_size and not rejoined:  # another world: what was set per rank is said anew, or one value
        for n in PER_RANK:
            listed = str(recorded[n]).split(",") if recorded[n] else []
            if n not in given and len(listed) > 1:
                raise ConfigError(f"{where} on {world_size} rank(s): its --{n.replace('_', '-')} {recorded[n]!r} "
                                  f"was given per rank for {ran}; give --{n.replace('_', '-')} anew (one value, or "
                                  f"{world_size})")
        from ..core.emulator import parse_hetero

        if far := sorted(r for r in parse_hetero(str(recorded["hetero"])) if r >= world_size):
            raise ConfigError(f"{where} on {world_size} rank(s): its --hetero {recorded['hetero']!r} emulates rank "
                              f"{far[0]}, outside this world (the emulation is kept on resume)")
    try:
        new = Config(**{**recorded, **{n: getattr(cfg, n) for n in RESUMABLE if n in given},
                        "resume": str(folder), "run_dir": str(folder), "overwrite": False})
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    done = epochs_done(folder)
    if new.epochs < done:
        raise ConfigError(f"{where} with --epochs {new.epochs}: it has completed {done} epochs already")
    return new


def rejoined_config(cfg: Config, world_size: int, run_id: str) -> Config:
    """The run a torchrun job continues by its run id (a restart, or a new job given the same --rdzv-id): every
    setting of this command line (given or default) is held to the record exactly as --resume holds a given one."""
    every = {f.name for f in fields(Config)} - set(FOLDER)
    how = f"the folder of torchrun's run id {run_id!r}" if run_id and run_id != "none" else "a torchrun restart"
    return resumed_config(dataclasses.replace(cfg, resume=cfg.run_dir), every, world_size, how)


def relay_cosine(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.CosineAnnealingLR, done: int,
                 epochs: int) -> None:
    """The rule for a changed --epochs E on resume after `done` epochs: from here on the learning rate is what a
    cosine over E epochs gives, lr * (1 + cos(pi * k / E)) / 2 for epoch k + 1 (a step up when E grows)."""
    sched.T_max = epochs
    for group, base in zip(opt.param_groups, sched.base_lrs):
        group["lr"] = sched.eta_min + (base - sched.eta_min) * (1 + math.cos(math.pi * done / epochs)) / 2
    # step() continues recursively from the current lr, which now sits on the new curve
    sched._last_lr = [g["lr"] for g in opt.param_groups]  # what get_last_lr() reports
