"""Heterogeneity emulation: per global rank, extra time inside each training step.

Grammar (docs/trainer.md has examples): items separated by ",", each `RANK:EFFECT[@WINDOW]`.
  EFFECT  delay=S          constant S seconds per step (the paper's emulation)
          exp=MEAN         exponentially distributed delay per step, mean MEAN seconds (the paper)
          gamma=K/THETA    gamma distributed delay per step, shape K, scale THETA seconds (mean K*THETA)
          slowdown=F       the rank computes F times slower: it waits (F-1) x its own measured compute
  WINDOW  A-B | A-         epochs A..B (1-based, inclusive; open-ended without B)
          sA-B | sA-       global steps A..B (0-based, counted over the whole run)
          cycle=P/ON       in every P global steps, active during the first ON (an on/off noisy neighbour)
A rank may carry several items; their delays add up. `active`, `mean_effects` and `sample_effects` are the one
implementation of the effects, vectorised over steps: the trainer's Emulator and the simulator both call them.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np

from .seeding import EMULATOR, epoch_seed

_ITEM = re.compile(r"^(\d+):(delay|exp|gamma|slowdown)=([^@]+)(?:@(.+))?$", re.ASCII)
# Bounds that keep every effect inside what a run can live through (numpy's int64 step counters, float seconds):
# a larger number is a typo, refused here rather than overflowing on one rank mid-run. The delays are also bounded
# by the collective timeout (Config: a peer waiting longer than --timeout-s is declared dead).
MAX_SECONDS = 1e7          # any one parameter in seconds (about 4 months)
MAX_SLOWDOWN = 1000.0      # a rank 1000 times slower
MAX_COUNT = 10**12         # epochs, steps, cycle lengths and ranks in windows
MAX_RANK = 10**6


@dataclass(frozen=True)
class Effect:
    """One item of the grammar: params in seconds (a factor for slowdown); window None = always on."""
    kind: str                 # delay, exp, gamma, slowdown
    params: tuple[float, ...]
    window: tuple[str, int, int | None] | None = None  # ("epoch"|"step"|"cycle", a, b)

    def active(self, epoch: int, step: int) -> bool:
        """Whether the effect is on at this global step (0-based) of this epoch (1-based)."""
        return bool(active([self], epoch, np.array([step]))[0, 0])


def _number(text: str) -> float:
    if len(text) > 40:
        raise ValueError(f"{text[:20]!r}... ({len(text)} characters) is not a number of seconds or a factor")
    v = float(text)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{text!r} must be a finite non-negative number")
    if v > MAX_SECONDS:
        raise ValueError(f"{text!r} is too large (at most {MAX_SECONDS:g})")
    return v


def _count(text: str, what: str) -> int:
    """A whole number of a window, bounded before conversion (a 400-digit step would overflow numpy's int64)."""
    if len(text) > 13 or int(text) > MAX_COUNT:
        raise ValueError(f"{what} {text[:20]}{'...' if len(text) > 20 else ''} is too large (at most {MAX_COUNT:.0e})")
    return int(text)


def _window(text: str) -> tuple[str, int, int | None]:
    m = re.fullmatch(r"cycle=(\d+)/(\d+)", text, re.ASCII)
    if m:
        period, on = _count(m[1], "cycle period"), _count(m[2], "cycle ON")
        if not 0 < on <= period:
            raise ValueError(f"window {text!r}: need 0 < ON <= P")
        return ("cycle", period, on)
    m = re.fullmatch(r"(s?)(\d+)-(\d*)", text, re.ASCII)
    if not m:
        raise ValueError(f"window {text[:40]!r} is not A-B, A-, sA-B, sA- or cycle=P/ON")
    a, b = _count(m[2], "window start"), (_count(m[3], "window end") if m[3] else None)
    if b is not None and b < a:
        raise ValueError(f"window {text!r} ends before it starts")
    if not m[1] and a < 1:
        raise ValueError(f"window {text!r}: epochs count from 1")
    return ("step" if m[1] else "epoch", a, b)


def within(spec: str, world: int) -> str:
    """The spec's items for ranks below `world` (an elastic restart onto fewer ranks emulates the ranks it has)."""
    items = filter(None, (s.strip() for s in spec.replace(";", ",").split(",")))
    return ",".join(i for i in items if int(i.split(":", 1)[0]) < world)


def parse_hetero(spec: str) -> dict[int, list[Effect]]:
    """Parse a spec into {global rank: effects}; raises ValueError naming the bad part."""
    out: dict[int, list[Effect]] = {}
    for item in filter(None, (s.strip() for s in spec.replace(";", ",").split(","))):
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"{item[:60]!r} is not RANK:EFFECT=VALUE[@WINDOW] with EFFECT delay, exp, gamma or "
                             f"slowdown")
        if len(m[1]) > 7 or int(m[1]) > MAX_RANK:
            raise ValueError(f"rank {m[1][:20]} is too large (at most {MAX_RANK})")
        rank, kind, value, window = int(m[1]), m[2], m[3], m[4]
        parts = value.split("/")
        if len(parts) != (2 if kind == "gamma" else 1):
            raise ValueError(f"{item!r}: {kind} takes {'K/THETA' if kind == 'gamma' else 'one number'}")
        params = tuple(_number(p) for p in parts)
        if kind == "slowdown" and params[0] < 1:
            raise ValueError(f"{item!r}: a slowdown factor is at least 1")
        if kind == "slowdown" and params[0] > MAX_SLOWDOWN:
            raise ValueError(f"{item!r}: a slowdown factor is at most {MAX_SLOWDOWN:g}")
        if kind == "gamma" and params[0] <= 0:
            raise ValueError(f"{item!r}: the gamma shape must be positive")
        out.setdefault(rank, []).append(Effect(kind, params, _window(window) if window else None))
    return out


# What each effect adds to a step, in one place: (factor on the step's compute, mean delay in seconds).
_MEAN = {"delay": lambda p: (0.0, p[0]), "exp": lambda p: (0.0, p[0]), "gamma": lambda p: (0.0, p[0] * p[1]),
         "slowdown": lambda p: (p[0] - 1.0, 0.0)}


def longest_delay_s(spec: dict[int, list[Effect]]) -> tuple[int, float]:
    """(rank, seconds): the largest mean delay per step any rank's effects add up to (slowdowns aside: they scale
    the rank's own compute), for the bound by the collective timeout."""
    worst = (0, 0.0)
    for rank, effects in spec.items():
        total = sum(_MEAN[e.kind](e.params)[1] for e in effects)
        worst = max(worst, (rank, total), key=lambda w: w[1])
    return worst


def active(effects: list[Effect], epoch: int, steps: np.ndarray) -> np.ndarray:
    """[effects, steps] bool: which effects are on at these global steps (0-based) of this epoch (1-based)."""
    steps = np.asarray(steps)
    out = np.ones((len(effects), len(steps)), bool)
    for k, e in enumerate(effects):
        if e.window is None:
            continue
        kind, a, b = e.window
        if kind == "cycle":
            out[k] = steps % a < b
        else:
            at = np.full(len(steps), epoch) if kind == "epoch" else steps
            out[k] = (at >= a) & (True if b is None else at <= b)
    return out


def mean_effects(effects: list[Effect]) -> tuple[np.ndarray, np.ndarray]:
    """Per effect, (factor, delay_s): on average it adds factor x compute_s + delay_s seconds to a step (read-only)."""
    return _mean_effects(tuple(effects))


@functools.lru_cache(maxsize=256)  # the trainer asks once per step for the same effects
def _mean_effects(effects: tuple[Effect, ...]) -> tuple[np.ndarray, np.ndarray]:
    pairs = [_MEAN[e.kind](e.params) for e in effects]
    out = np.array([f for f, _ in pairs], float), np.array([d for _, d in pairs], float)
    for a in out:
        a.setflags(write=False)
    return out


def sample_effects(effects: list[Effect], on: np.ndarray, compute_s: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
    """[effects, steps] s each effect adds given compute_s [steps]: 0 where off, one draw per active step if random."""
    factor, mean = mean_effects(effects)
    out = (factor[:, None] * np.asarray(compute_s, float) + mean[:, None]) * on
    for k, e in enumerate(effects):
        if e.kind in ("exp", "gamma") and (e.kind == "gamma" or e.params[0] > 0) and (n := int(on[k].sum())):
            out[k, on[k]] = rng.exponential(e.params[0], n) if e.kind == "exp" else rng.gamma(*e.params, n)
    return out


class Emulator:
    """The effects on one global rank; delay_s() is called once per step, when the rank's gradients are ready."""

    def __init__(self, spec: str, rank: int, seed: int):
        self.effects = parse_hetero(spec).get(rank, [])
        self.rank, self.seed = rank, seed
        self.rng = np.random.default_rng(0)

    def start_epoch(self, epoch: int) -> None:
        # Random delays are reproducible per (seed, rank, epoch), so a resumed run draws the same delays.
        self.rng = np.random.default_rng(epoch_seed(self.seed, epoch, EMULATOR + self.rank))

    @property
    def needs_compute_time(self) -> bool:
        return any(e.kind == "slowdown" for e in self.effects)

    def delay_s(self, epoch: int, step: int, compute_s: float) -> float:
        """Seconds to wait at this step, given the step's own compute time so far (for slowdown)."""
        if not self.effects:
            return 0.0
        each = sample_effects(self.effects, active(self.effects, epoch, np.array([step])), np.array([compute_s]),
                              self.rng)
        return float(sum(each[:, 0].tolist(), 0.0))  # in the order of the spec, as the effects add up
