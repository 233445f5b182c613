"""The trainer's checkpoint file: plain data (what `torch.load(weights_only=True)` loads, so it cannot run code),
sealed with a SHA-256 digest over its content, so that an edited or damaged file is refused before anything runs.

torch.save writes a zip whose entries torch.load does not check: 64 bytes overwritten inside a tensor still load,
and an edited number (a step moved by one) loads as well. Two checks: `damage` reads the zip's own CRC-32s and
headers before torch.load (damaged bytes anywhere, in the headers and padding the content never shows too), and
a digest over the content catches an edit that torch.save wrote afresh. The digest covers every key, value,
tensor dtype, shape and byte, walked in the file's own order (torch.load keeps dict order), and is stored beside
the content under `sha256`, so the file stays a plain dict a user can torch.load.

Format 2 (this one) holds the Balance's own `state_dict()` under `balance`. A checkpoint written before it (format
1: no digest; the balancer, global_step and identities at the top level) loads with one warning line and is
converted; its next save is format 2. A format-2 key set without a digest is refused: only an edit makes one.
check_checkpoint then tries the content against this run (model, config, the epoch's length) on CPU stand-ins.
"""
from __future__ import annotations

import csv
import hashlib
import io
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core import safeio
from .config import Config, ConfigError, shown
from .models import build_model

FORMAT = 2
KEYS = ("model", "optimizer", "scheduler", "balance", "epoch", "train_time_s", "history", "rng")
OLD_KEYS = ("model", "optimizer", "scheduler", "balancer", "epoch", "train_time_s", "global_step", "history", "rng")


def digest(state: Any) -> str:
    """SHA-256 (hex) over plain data: dicts in their order, lists and tuples, str, bytes, bool, int, float, None and
    tensors (dtype, shape, bytes). TypeError for anything else (a checkpoint holds plain data only)."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.hexdigest()


def _feed(h, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(x.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().data)
    elif isinstance(x, dict):
        h.update(b"D%d:" % len(x))
        for k, v in x.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(x, (list, tuple)):  # one tag: a tuple may come back as a list from another writer
        h.update(b"L%d:" % len(x))
        for v in x:
            _feed(h, v)
    elif isinstance(x, (str, bytes)):
        b = x.encode() if isinstance(x, str) else x
        h.update(b"%s%d:" % (b"S" if isinstance(x, str) else b"B", len(b)))
        h.update(b)
    elif x is None or type(x) in (bool, int):
        h.update(f"{type(x).__name__}{x!r};".encode())
    elif isinstance(x, float):
        h.update(f"f{float(x).hex()};".encode())
    else:
        raise TypeError(f"a {type(x).__name__} in a checkpoint (plain data only)")


def sealed(state: dict[str, Any]) -> dict[str, Any]:
    """The state with its format and digest, ready for torch.save."""
    body = {**state, "format": FORMAT}
    return {**body, "sha256": digest(body)}


def damage(path: Path) -> str | None:
    """What is wrong with the bytes of the zip torch.save wrote, or None: every entry's CRC-32 (which torch writes
    and torch.load does not check), every local header's name against the central directory (zipfile), and the
    alignment padding torch puts in each local header's extra field ("FB", its length, then "Z"s). Together no run
    of 64 damaged bytes goes unseen, even where the content digest could not see it (a header, the padding)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            if bad is not None:
                return f"entry {bad} fails its CRC-32"
            with open(path, "rb") as f:
                for info in z.infolist():
                    f.seek(info.header_offset + 26)
                    n, m = struct.unpack("<HH", f.read(4))
                    f.seek(n, 1)
                    extra = f.read(m)
                    if extra and (extra[:2] != b"FB" or struct.unpack("<H", extra[2:4])[0] != m - 4
                                  or extra[4:].strip(b"Z")):
                        return f"the header of entry {info.filename} is damaged"
    except (zipfile.BadZipFile, struct.error, OSError, EOFError, ValueError, zlib.error) as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def opened(state: Any, path: Path) -> tuple[dict[str, Any], str]:
    """A loaded checkpoint checked and in the current layout, with a warning ("" if none); ConfigError in one line
    for an edited or damaged one (digest), an unsealed format-2 one, or one that is not a trainer checkpoint."""
    where = f"cannot resume: {path}"
    if not isinstance(state, dict):
        raise ConfigError(f"{where} is not a hetero checkpoint (it holds a {type(state).__name__})")
    if "sha256" in state:
        body = {k: v for k, v in state.items() if k != "sha256"}
        try:
            ok = digest(body) == state["sha256"]
        except TypeError:
            ok = False
        if not ok:
            raise ConfigError(f"{where} fails its integrity check (its content does not match its SHA-256 digest: "
                              f"edited or damaged); nothing was changed: restore it, or start the run again")
        if body.get("format") != FORMAT:
            raise ConfigError(f"{where} has format {body.get('format')!r}; this hetero reads {FORMAT} (written by "
                              f"another version of hetero?)")
        state, warning = body, ""
    elif "balance" in state or "format" in state:
        raise ConfigError(f"{where} has no integrity digest (sha256), though its layout is hetero's current one: "
                          f"edited? Restore it, or start the run again")
    elif all(k in state for k in OLD_KEYS):
        state, warning = _from_format_1(state), (f"hetero: warning: {path} was written by an older hetero (no "
                                                 f"integrity digest): loaded unverified; its next save carries one")
    else:
        missing = [k for k in KEYS if k not in state]
        raise ConfigError(f"{where} is not a hetero checkpoint (no {', '.join(missing)})")
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ConfigError(f"{where} is not a hetero checkpoint (no {', '.join(missing)})")
    lowest = 0 if state.get("partial") is not None else 1  # a step checkpoint (--checkpoint-every) in epoch 1
    if not (type(state["epoch"]) is int and state["epoch"] >= lowest and isinstance(state["model"], dict)
            and all(isinstance(v, torch.Tensor) for v in state["model"].values())
            and isinstance(state["balance"], dict)):
        raise ConfigError(f"{where} is not a hetero checkpoint (bad epoch, model weights or balance state)")
    return state, warning


def _from_format_1(old: dict[str, Any]) -> dict[str, Any]:
    """Format 1 built the Balance's state by hand from these keys; format 2 stores Balance.state_dict() itself."""
    s = {k: v for k, v in old.items() if k not in ("balancer", "global_step", "identities")}
    part = old.get("partial") if isinstance(old.get("partial"), dict) else None
    s["balance"] = {"balancer": old["balancer"], "global_step": old["global_step"],
                    "identities": old.get("identities"), "epoch": part.get("epoch") if part else old["epoch"],
                    "step": part.get("step") if part else 0}
    return s


# What the trainer reads of the Balance's own state (Balance.state_dict's layout), in this one place.
def balance_position(balance: dict[str, Any]) -> tuple[Any, Any]:
    """(epoch, step) of a Balance state: `step` steps of `epoch` ran (0: the epoch is complete)."""
    return balance.get("epoch"), balance.get("step", 0)


def balance_world(balance: dict[str, Any]) -> tuple[list[str] | None, int]:
    """(identities, world size) of the world that saved a Balance state."""
    ids = balance.get("identities")
    return ids, len(ids) if ids else len(balance["balancer"]["shares"])


# -- whose is it? -------------------------------------------------------------------------------------------------
# A run's own id, minted at its first start, kept in config.json and sealed into each of its checkpoints: the digest
# says a file is intact, the id that it is this folder's run's (another run's checkpoint copied in has another).
RUN_UID = "run_uid"


def check_owner(state: dict, folder: Path) -> str:
    """"" when the checkpoint is the folder's own run's (their run uids agree); a warning line for one written before
    checkpoints carried a run uid, whose history then must be the folder's epochs.csv; else ConfigError."""
    from .runfolder import read_config  # runfolder imports this module

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
    for h in state["history"]:
        r = rows.get(h["epoch"])
        if r is None or any(not _same(float(r[k]), float(v)) for k, v in h.items()
                            if k in r and type(v) in (int, float)):
            raise ConfigError(f"cannot resume: {path} does not belong to this folder's run: its epoch {h['epoch']} "
                              f"is not the one in epochs.csv (another run's checkpoint?); to start afresh, "
                              f"--overwrite")
    return (f"hetero: warning: {path} was written by an older hetero (no run uid): bound to this run by its "
            f"{len(state['history'])} epoch(s) of history matching epochs.csv")


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # a NaN written to epochs.csv reads back as a NaN


# -- does it fit this run? ----------------------------------------------------------------------------------------
def check_checkpoint(cfg: Config, world_size: int, n_classes: int, steps_per_epoch: int, state: dict,
                     path: Path) -> None:
    """Trainer.load_state_dict tried on CPU stand-ins (model, optimiser, schedule, Balance) before any process group:
    a checkpoint of plain data but the wrong content (tensor shapes, model={}, history="abc", a bad RNG or balancer
    state, epoch=True or 10**18, a step checkpoint's position outside its epoch of steps_per_epoch steps) is one
    ConfigError here, not a traceback on every rank after the group starts."""
    where = f"cannot resume: {path} does not fit this run"
    epoch, part = state.get("epoch"), state.get("partial")
    lowest = 0 if part is not None else 1  # a step checkpoint may come before any epoch's end
    if not (type(epoch) is int and lowest <= epoch <= cfg.epochs - (1 - lowest)):
        raise ConfigError(f"{where}: its epoch {shown(epoch)} is not a whole number in {lowest}.."
                          f"{cfg.epochs - (1 - lowest)} (--epochs)")
    if part is not None:
        if not isinstance(part, dict):
            raise ConfigError(f"{where}: its partial epoch {shown(part)} is not a step checkpoint's record")
        _check_position(part, epoch, steps_per_epoch, where)
    b_epoch, b_step = balance_position(state["balance"])
    if (b_epoch, b_step) != ((part["epoch"], part["step"]) if part is not None else (epoch, 0)):
        raise ConfigError(f"{where}: its balance state is at epoch {shown(b_epoch)} step {shown(b_step)}, the "
                          f"checkpoint at " + (f"epoch {part['epoch']} step {part['step']}" if part is not None else
                                               f"the end of epoch {epoch}"))
    step = state["balance"].get("global_step")
    if not (type(step) is int and 0 <= step <= 2**62):
        raise ConfigError(f"{where}: its global_step {shown(step)} is not a whole number >= 0")
    t = state.get("train_time_s")
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and np.isfinite(t) and t >= 0):
        raise ConfigError(f"{where}: its train_time_s {shown(t)} is not a number of seconds")
    if not (isinstance(state["history"], list) and len(state["history"]) == epoch):
        raise ConfigError(f"{where}: its history is not a list of its {epoch} epochs (got {shown(state['history'])})")
    from .loop import Trainer  # loop imports this module

    torch_rng, numpy_rng = torch.get_rng_state(), np.random.get_state()  # the stand-ins' init draws from them
    try:
        stand_in = _StandIn(cfg, world_size, n_classes)
        Trainer.load_state_dict(stand_in, state)  # the very reads the run will do
        for p, st in stand_in.opt.state.items():  # SGD checks these only at its first step
            buf = st.get("momentum_buffer")
            if buf is not None and (not isinstance(buf, torch.Tensor) or buf.shape != p.shape):
                raise ValueError(f"a momentum buffer of shape {tuple(getattr(buf, 'shape', ()))} for a parameter of "
                                 f"shape {tuple(p.shape)}")
        b = stand_in.balance.engine.plan._balancer
        if b.shares.shape != (world_size,) or b.sizes.shape != (world_size,) or not np.all(np.isfinite(b.shares)) \
                or int(b.sizes.sum()) != cfg.global_batch or np.any(b.sizes < 0):
            raise ValueError(f"balancer shares {shown(b.shares.tolist())} and sizes {shown(b.sizes.tolist())} are not "
                             f"{world_size} ranks' splits of the global batch {cfg.global_batch}")
        if [r.epoch for r in stand_in.history] != list(range(1, epoch + 1)):
            raise ValueError("its history does not list epochs 1.." + str(epoch))
    except Exception as e:  # noqa: BLE001 - load_state_dict raises RuntimeError, KeyError, TypeError, ValueError...
        line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise ConfigError(f"{where} (model {cfg.model}, {world_size} rank(s)): {type(e).__name__}"
                          f"{': ' + shown(line, 160)[1:-1] if line else ''}") from None
    finally:
        torch.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)


def _check_position(part: dict, epoch: int, steps_per_epoch: int, where: str) -> None:
    """A step checkpoint's position: `step` steps of epoch `epoch` + 1 ran, 0 < step < steps_per_epoch, and its
    segments record exactly steps 0..step-1 (a moved step would skip or repeat samples)."""
    at, step = part.get("epoch"), part.get("step")
    if not (type(step) is int and 0 < step < steps_per_epoch and at == epoch + 1):
        raise ConfigError(f"{where}: its step checkpoint is at epoch {shown(at)} step {shown(step)} after {epoch} "
                          f"completed epoch(s); an epoch of this run has {steps_per_epoch} steps (the data's samples "
                          f"// --global-batch), so it must be epoch {epoch + 1}, step 1..{steps_per_epoch - 1}")
    segments = part.get("segments")
    try:
        firsts = [(int(g["first_step"]), len(g["sizes"])) for g in segments]
    except (TypeError, KeyError, ValueError):
        firsts = None
    if firsts is None or [f for f, _ in firsts] != list(np.cumsum([0] + [n for _, n in firsts])[:-1]) \
            or sum(n for _, n in firsts) != step:
        raise ConfigError(f"{where}: its step checkpoint at step {step} does not record steps 0..{step - 1} of its "
                          f"epoch (segments {shown(firsts)})")


class _StandIn:
    """What Trainer.load_state_dict touches, built on the CPU without a process group (check_checkpoint)."""

    def __init__(self, cfg: Config, world_size: int, n_classes: int):
        from .loop import make_balance

        self.cfg = cfg
        self.model = build_model(cfg.model, n_classes)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                   nesterov=cfg.momentum > 0, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.epochs)
        self.balance = make_balance(cfg, 0, world_size)
