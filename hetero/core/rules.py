"""The rules a Balance's settings obey, each written once. The trainer's config checks its flags with the same
functions before any process starts, naming them as flags (`spell`); the Balance names them as arguments."""
from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

Spell = Callable[[str], str]


def argument(name: str) -> str:
    """How the library names a setting: as its keyword argument."""
    return name


def whole(name: str, value, low: int) -> int:
    """An int >= low (not a bool, a float or a string): one clear line otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low} (got {value!r})")
    return int(value)


def fraction(name: str, value, high: float) -> float:
    """A number in [0, high)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < high:
        raise ValueError(f"{name} must be a number in [0, {high:g}) (got {value!r})")
    return float(value)


def check_sit_out(sit_out: bool, scheme: str, micro_batch: int, spell: Spell = argument) -> None:
    """A rank may sit out (batch 0) under the affine scheme only, and never in micro-batches (k_i >= 1)."""
    if sit_out and scheme != "affine":
        raise ValueError(f"{spell('sit_out')} applies to the affine scheme only (got {spell('scheme')} {scheme!r})")
    if sit_out and micro_batch:
        raise ValueError(f"{spell('sit_out')} does not combine with {spell('micro_batch')} (every rank runs at least "
                         f"one micro-batch)")


def micro_batch_too_big(micro_batch: int, limits: Sequence[float]) -> int | None:
    """The first rank whose largest batch (limits; inf or 0: none) is below the micro-batch, else None: with
    micro-batches a rank's limit bounds m, what it computes at once, not k_i * m."""
    if micro_batch:
        for r, v in enumerate(limits):
            if 0 < v < micro_batch:
                return r
    return None
