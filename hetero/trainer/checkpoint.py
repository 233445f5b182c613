"""The trainer's checkpoint file: plain data (what `torch.load(weights_only=True)` loads, so it cannot run code),
sealed with a SHA-256 digest over its content, so that an edited or damaged file is refused before anything runs.

torch.save writes a zip whose entries torch.load does not check: 64 bytes overwritten inside a tensor still load,
and an edited number (a step moved by one) loads as well. The digest covers every key, value, tensor dtype, shape
and byte, walked in the file's own order (torch.load keeps dict order), and is stored beside the content under
`sha256`, so the file stays a plain dict a user can torch.load.

Format 2 (this one) holds the Balance's own `state_dict()` under `balance`. A checkpoint written before it (format
1: no digest; the balancer, global_step and identities at the top level) loads with one warning line and is
converted; its next save is format 2. A format-2 key set without a digest is refused: only an edit makes one.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError

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
