"""Does a checkpoint fit this run? Asked on rank 0 before any process group, so that a checkpoint of plain data but
the wrong content (tensor shapes, model={}, history="abc", a bad RNG or balancer state, a position outside its
epoch) is one ConfigError here, not a traceback on every rank after the group starts.

It sits above loop.py and checkpoint.py (the file's format) and below run.py, which asks it. The position it checks
is the Balance's own, read from the saved state's `epoch`, `step` and `steps_per_epoch` (what `bal.position` gives
once it is loaded); the trainer keeps none of its own. The rest is loop.restore, the very reads the run will do,
tried on CPU stand-ins (model, optimiser, schedule, Balance), and the loaded Balance read through its public names.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import torch

from ..core import safeio
from .checkpoint import RUN_UID, balance_position
from .config import Config, ConfigError, shown
from .loop import done_at, make_balance, optimiser, restore
from .models import build_model
from .runfolder import read_config


def check_checkpoint(cfg: Config, world_size: int, n_classes: int, steps_per_epoch: int, state: dict,
                     path: Path) -> None:
    """ConfigError in one line unless the checkpoint (current layout: checkpoint.opened) resumes this run: its
    position inside --epochs, a step checkpoint's record of exactly the steps its position says ran, its history of
    the epochs completed, and every part loading into this run's model, optimiser, schedule and Balance."""
    where = f"cannot resume: {path} does not fit this run"
    part = state.get("partial")
    if part is not None and not isinstance(part, dict):
        raise ConfigError(f"{where}: its partial epoch {shown(part)} is not a step checkpoint's record")
    epoch, step, spe = balance_position(state["balance"])
    if not (type(epoch) is int and type(step) is int and 0 <= epoch <= cfg.epochs + 1 and step >= 0):
        raise ConfigError(f"{where}: its balance state is at epoch {shown(epoch)} step {shown(step)}, not a position "
                          f"in epochs 1..{cfg.epochs} (--epochs)")
    if step and spe not in (None, steps_per_epoch):  # None: a format-1 state, which did not say
        raise ConfigError(f"{where}: its balance state is at step {step} of an epoch of {shown(spe)} steps; an epoch "
                          f"of this run has {steps_per_epoch} steps (the data's samples // --global-batch)")
    if part is not None:
        _check_position(part, epoch, step, steps_per_epoch, where)
    elif 0 < step < steps_per_epoch:
        raise ConfigError(f"{where}: its balance state is at epoch {epoch} step {step}, inside the epoch, but it "
                          f"holds no step checkpoint's record of the steps that ran")
    done = epoch if step == steps_per_epoch else epoch - 1  # what done_at reads off the loaded Balance's position
    lowest = 0 if part is not None else 1  # a step checkpoint may come before any epoch's end
    if not lowest <= done <= cfg.epochs - (1 - lowest):
        raise ConfigError(f"{where}: its balance state is at epoch {epoch} step {step}, after {done} completed "
                          f"epoch(s), not a whole number in {lowest}..{cfg.epochs - (1 - lowest)} (--epochs)")
    g = state["balance"].get("global_step")
    if not (type(g) is int and 0 <= g <= 2**62):
        raise ConfigError(f"{where}: its global_step {shown(g)} is not a whole number >= 0")
    t = state.get("train_time_s")
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and np.isfinite(t) and t >= 0):
        raise ConfigError(f"{where}: its train_time_s {shown(t)} is not a number of seconds")
    if not (isinstance(state["history"], list) and len(state["history"]) == done):
        raise ConfigError(f"{where}: its balance state is at epoch {epoch} step {step}, after {done} completed "
                          f"epoch(s), but its history is not a list of {done} epochs (got {shown(state['history'])})")
    _try_loading(cfg, world_size, n_classes, steps_per_epoch, state, where, done)


def _check_position(part: dict, epoch: int, step: int, steps_per_epoch: int, where: str) -> None:
    """A step checkpoint's position: `step` steps of `epoch` ran, 0 < step < steps_per_epoch, and its segments record
    exactly steps 0..step-1 (a moved step would skip or repeat samples)."""
    if not 0 < step < steps_per_epoch:
        raise ConfigError(f"{where}: its step checkpoint is at epoch {epoch} step {step}; an epoch of this run has "
                          f"{steps_per_epoch} steps (the data's samples // --global-batch), so it must be at step "
                          f"1..{steps_per_epoch - 1}")
    try:
        firsts = [(int(g["first_step"]), len(g["sizes"])) for g in part.get("segments")]
    except (TypeError, KeyError, ValueError):
        firsts = None
    if firsts is None or [f for f, _ in firsts] != list(np.cumsum([0] + [n for _, n in firsts])[:-1]) \
            or sum(n for _, n in firsts) != step:
        raise ConfigError(f"{where}: its balance state is at epoch {epoch} step {step}, but its step checkpoint "
                          f"does not record steps 0..{step - 1} of its epoch (segments {shown(firsts)})")


def _try_loading(cfg: Config, world_size: int, n_classes: int, steps_per_epoch: int, state: dict, where: str,
                 done: int) -> None:
    """loop.restore on CPU stand-ins, then what SGD checks only at its first step and what the loaded Balance says:
    a split of the global batch over this world's ranks, at the position the state was saved at."""
    torch_rng, numpy_rng = torch.get_rng_state(), np.random.get_state()  # the stand-ins' init draws from them
    try:
        model = build_model(cfg.model, n_classes)
        opt, sched = optimiser(cfg, model)
        bal = make_balance(cfg, 0, world_size)
        bal.batch_sampler(steps_per_epoch * cfg.global_batch)  # the epoch's length, as the Trainer gives it
        history = restore(state, cfg, model, opt, sched, bal)
        for p, st in opt.state.items():  # SGD checks these only at its first step
            buf = st.get("momentum_buffer")
            if buf is not None and (not isinstance(buf, torch.Tensor) or buf.shape != p.shape):
                raise ValueError(f"a momentum buffer of shape {tuple(getattr(buf, 'shape', ()))} for a parameter of "
                                 f"shape {tuple(p.shape)}")
        if done_at(bal.position)[0] != done:
            raise ValueError(f"the loaded Balance is at {bal.position}, {done} epoch(s) completed were saved")
        b = bal.state_dict()["balancer"]  # the loaded balancer (carried over to this world by worker identity)
        shares, sizes = np.asarray(b["shares"], float), np.asarray(b["sizes"])
        if shares.shape != (world_size,) or sizes.shape != (world_size,) or not np.all(np.isfinite(shares)) \
                or int(sizes.sum()) != cfg.global_batch or np.any(sizes < 0):
            raise ValueError(f"balancer shares {shown(shares.tolist())} and sizes {shown(sizes.tolist())} are not "
                             f"{world_size} ranks' splits of the global batch {cfg.global_batch}")
        if [r.epoch for r in history] != list(range(1, done + 1)):
            raise ValueError("its history does not list epochs 1.." + str(done))
    except Exception as e:  # noqa: BLE001 - load_state_dict raises RuntimeError, KeyError, TypeError, ValueError...
        line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise ConfigError(f"{where} (model {cfg.model}, {world_size} rank(s)): {type(e).__name__}"
                          f"{': ' + shown(line, 160)[1:-1] if line else ''}") from None
    finally:
        torch.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)


# -- whose is it? --------------------------------------------------------------------------------------------------
def check_owner(state: dict, folder: Path) -> str:
    """"" when the checkpoint is the folder's own run's (their run uids agree); a warning line for one written before
    checkpoints carried a run uid, whose history then must be the folder's epochs.csv; else ConfigError."""
    path, its = folder / "checkpoint.pt", state.get(RUN_UID)
    mine = read_config(folder).get(RUN_UID)
    if its is not None:
        if its != mine:
            raise ConfigError(f"cannot resume: {path} was written by another run (run uid {shown(its)}, this "
                              f"folder's run is {shown(mine)}): a checkpoint resumes only the run that wrote it (to "
                              f"move a run, copy its whole folder; to start afresh, --overwrite)")
        return ""
    try:
        rows = {int(r["epoch"]): r for r in csv.DictReader(io.StringIO(
            safeio.read_bytes(folder / "epochs.csv", "its epochs file").decode()))}
    except FileNotFoundError:
        rows = {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot resume: {folder / 'epochs.csv'} is unreadable ({type(e).__name__}), and "
                          f"{path} carries no run uid to bind it to this run") from None
    try:  # checked before check_checkpoint: the history may be anything
        mismatch = next((h["epoch"] for h in state["history"] if (r := rows.get(h["epoch"])) is None or any(
            not _same(float(r[k]), float(v)) for k, v in h.items() if k in r and type(v) in (int, float))), None)
    except (TypeError, KeyError, AttributeError, ValueError):
        raise ConfigError(f"cannot resume: {path} carries no run uid, and its history is not a list of epochs to "
                          f"bind it to this folder's run by; to start afresh, --overwrite") from None
    if mismatch is not None:
        raise ConfigError(f"cannot resume: {path} does not belong to this folder's run: its epoch {mismatch} is not "
                          f"the one in epochs.csv (another run's checkpoint?); to start afresh, --overwrite")
    return (f"hetero: warning: {path} was written by an older hetero (no run uid): bound to this run by its "
            f"{len(state['history'])} epoch(s) of history matching epochs.csv")


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # a NaN written to epochs.csv reads back as a NaN
