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


COLLATORS = ("padded", "packed")  # how a rank's rows are laid out (tokens.Cost)
LOSS_MEANS = ("samples", "tokens")


def check_tokens(s, spell: Spell = argument) -> None:
    """Balancing by tokens (Settings.collator): the collator, the attention term and the loss's mean, and what
    does not combine with them yet, each in one line."""
    if s.collator not in (None, *COLLATORS):
        raise ValueError(f"{spell('collator')} must be None (split by counts) or one of {', '.join(COLLATORS)} "
                         f"(got {s.collator!r})")
    if s.attention is not None and (isinstance(s.attention, bool) or not isinstance(s.attention, numbers.Real) or
                                    not 0 <= s.attention < float("inf")):
        raise ValueError(f"{spell('attention')} must be None (fitted) or a finite number >= 0 (got {s.attention!r})")
    if s.loss_mean not in LOSS_MEANS:
        raise ValueError(f"{spell('loss_mean')} must be one of {', '.join(LOSS_MEANS)} (got {s.loss_mean!r})")
    if s.max_tokens is not None:
        for t in s.max_tokens if isinstance(s.max_tokens, (list, tuple)) else [s.max_tokens]:
            if t is not None and t != "probe":  # "probe": bal.probe finds it on a GPU
                whole("max_tokens", t, 1)
        if s.collator is None:
            raise ValueError(f"{spell('max_tokens')} caps the tokens of one forward of a split by tokens: set "
                             f"{spell('collator')}='padded' or 'packed'")
    if s.token_budget is not None:
        whole(spell("token_budget"), s.token_budget, 1)
        if s.global_batch is not None:
            raise ValueError(f"give {spell('global_batch')} (samples a step) or {spell('token_budget')} (about that "
                             f"many tokens a step), not both")
        if s.collator is None:
            raise ValueError(f"{spell('token_budget')} cuts each step by its samples' tokens: set "
                             f"{spell('collator')}='padded' or 'packed' and give batch_sampler(len(ds), lengths=...)")
    if s.collator is None:
        if s.attention is not None or s.loss_mean != "samples":
            which = spell("attention") if s.attention is not None else f"{spell('loss_mean')}='tokens'"
            raise ValueError(f"{which} needs the samples' lengths: set {spell('collator')}='padded' or 'packed' "
                             f"and give batch_sampler(len(ds), lengths=...)")
        return
    if s.scheme not in ("edp", "affine"):
        raise ValueError(f"{spell('collator')} splits each step by its tokens' fitted cost, weighted by each rank's "
                         f"share: {spell('scheme')} must be edp or affine (got {s.scheme!r})")
    if s.sit_out:
        raise ValueError(f"{spell('sit_out')} does not combine with {spell('collator')}: a split by tokens gives "
                         f"every rank rows")
    if s.max_batch:
        raise ValueError(f"{spell('max_batch')} caps a rank's rows, and a split by tokens caps its tokens: set "
                         f"{spell('max_tokens')} (a number per rank, or 'probe') in its place")
