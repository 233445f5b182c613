"""The trainer's checkpoint file: plain data (what `torch.load(weights_only=True)` loads, so it cannot run code),
sealed with a SHA-256 digest over its content, so that an edited or damaged file is refused before anything runs.

torch.save writes a zip whose entries torch.load does not check: 64 bytes overwritten inside a tensor still load,
and an edited number (a step moved by one) loads as well. Two checks: `damage` reads the zip's own CRC-32s and
headers before torch.load (damaged bytes anywhere, in the headers and padding the content never shows too), and
a digest over the content catches an edit that torch.save wrote afresh. The digest covers every key, value,
tensor dtype, shape and byte, walked in the file's own order (torch.load keeps dict order), and is stored beside
the content under `sha256`, so the file stays a plain dict a user can torch.load.

Format 3 (this one) holds the Balance's own `state_dict()` under `balance`, and with it the one position: the
epoch, the steps ended in it and the steps per epoch are the Balance's (a complete epoch is step = steps_per_epoch);
the trainer keeps no epoch or step of its own. A step checkpoint's `partial` holds only what the Balance does not:
the epoch's metric totals, its segments of step times, every rank's augmentation RNG and batch-norm buffers, and
its training seconds. Older files still resume, converted on load with one warning line for format 1: format 2
kept the trainer's own copy of the position (`epoch`, and the partial epoch's `epoch`, `step` and `identities`),
which must agree with the Balance's and is then dropped; its next save is format 3. Format 1 had no digest and kept
the Balance's state at the top level. A current key set without a digest is refused: only an edit makes one.
fit.check_checkpoint then tries the content against this run (model, config, the epoch's length) on CPU stand-ins.
"""
from __future__ import annotations

import hashlib
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, shown

FORMAT = 3
KEYS = ("model", "optimizer", "scheduler", "balance", "train_time_s", "history", "rng")
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
    for an edited or damaged one (digest), an unsealed current one, one whose older layout holds two positions that
    disagree, or one that is not a trainer checkpoint."""
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
        if body.get("format") not in (2, FORMAT):
            raise ConfigError(f"{where} has format {body.get('format')!r}; this hetero reads {FORMAT} and 2 (written "
                              f"by another version of hetero?)")
        state, warning = (body if body["format"] == FORMAT else _from_format_2(body, where)), ""
    elif "balance" in state or "format" in state:
        raise ConfigError(f"{where} has no integrity digest (sha256), though its layout is hetero's current one: "
                          f"edited? Restore it, or start the run again")
    elif all(k in state for k in OLD_KEYS):
        state, warning = _from_format_2(_from_format_1(state), where), (
            f"hetero: warning: {path} was written by an older hetero (no integrity digest): loaded unverified; its "
            f"next save carries one")
    else:
        missing = [k for k in KEYS if k not in state]
        raise ConfigError(f"{where} is not a hetero checkpoint (no {', '.join(missing)})")
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ConfigError(f"{where} is not a hetero checkpoint (no {', '.join(missing)})")
    if not (isinstance(state["model"], dict) and all(isinstance(v, torch.Tensor) for v in state["model"].values())
            and isinstance(state["balance"], dict)):
        raise ConfigError(f"{where} is not a hetero checkpoint (bad model weights or balance state)")
    return state, warning


def _from_format_1(old: dict[str, Any]) -> dict[str, Any]:
    """Format 1 built the Balance's state by hand from these keys; format 2 stores Balance.state_dict() itself."""
    s = {k: v for k, v in old.items() if k not in ("balancer", "global_step", "identities")}
    part = old.get("partial") if isinstance(old.get("partial"), dict) else None
    s["balance"] = {"balancer": old["balancer"], "global_step": old["global_step"],
                    "identities": old.get("identities"), "epoch": part.get("epoch") if part else old["epoch"],
                    "step": part.get("step") if part else 0}
    return s


def _from_format_2(old: dict[str, Any], where: str) -> dict[str, Any]:
    """Format 2 kept the trainer's own position beside the Balance's: `epoch` (the epochs completed) and, in a step
    checkpoint, the partial epoch's `epoch` and `step` (and the saving world's identities, which the Balance's state
    holds too). The two must agree; then the Balance's alone is kept. An epoch's end in a Balance state of version 2
    (step 0, which also meant "not begun") becomes step 0 of the next epoch: nothing of it ran, the same position."""
    done, part, b = old.get("epoch"), old.get("partial"), old.get("balance")
    if not (type(done) is int and done >= 0 and (part is None or isinstance(part, dict)) and isinstance(b, dict)):
        raise ConfigError(f"{where} is not a hetero checkpoint (bad epoch, partial epoch or balance state)")
    at = (b.get("epoch"), b.get("step", 0))
    if part is not None:
        mine, same = (part.get("epoch"), part.get("step")), at == (part.get("epoch"), part.get("step"))
    else:
        mine, same = (done, 0), at in ((done, 0), (done, b.get("steps_per_epoch")))
    if not same:
        said = f"epoch {shown(mine[0])} step {shown(mine[1])}" if part is not None else f"the end of epoch {done}"
        raise ConfigError(f"{where} does not fit this run: its balance state is at epoch {shown(at[0])} step "
                          f"{shown(at[1])}, the checkpoint at {said}")
    if part is None and at == (done, 0):
        b = {**b, "epoch": done + 1}
    s = {k: v for k, v in old.items() if k != "epoch"}
    s["balance"] = b
    if part is not None:
        s["partial"] = {k: v for k, v in part.items() if k not in ("epoch", "step", "identities")}
    return s


# What the trainer reads of the Balance's own state (Balance.state_dict's layout), in this one place.
def balance_position(balance: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(epoch, step, steps_per_epoch) of a Balance state: `step` steps of `epoch` ended (= steps_per_epoch: the
    epoch is complete; 0: none of it ran)."""
    return balance.get("epoch"), balance.get("step", 0), balance.get("steps_per_epoch")


def balance_world(balance: dict[str, Any]) -> tuple[list[str] | None, int]:
    """(identities, world size) of the world that saved a Balance state."""
    ids = balance.get("identities")
    return ids, len(ids) if ids else len(balance["balancer"]["shares"])


# A run's own id, minted at its first start, kept in config.json and sealed into each of its checkpoints: the digest
# says a file is intact, the id that it is this folder's run's (another run's checkpoint copied in has another);
# fit.check_owner compares them.
RUN_UID = "run_uid"
