"""Recorded sizes (`bal.replay`), checked where each fact becomes known, so that a replay that does not cover what
the loop runs is one line before a step trains on it, never a KeyError from the plan or a sampler cut for ranks
that do not exist.

- `recorded`, at bal.replay(): the record's own shape: {epoch: [steps, width]}, epochs consecutive, whole sizes
  that sum to the global batch at every step, one width throughout;
- `fit`, at bind (the world is known) and once the epoch length is known: the width is the world's, every
  recorded epoch has the epoch's steps;
- `sizes`, when a step's sizes are fixed: an epoch past the record, or a step past it in a loop without epochs.
"""
from __future__ import annotations

import numbers

import numpy as np

from .agree import HeteroError
from .settings import Settings

Replay = dict[int, np.ndarray]


def _line(why: str) -> ValueError:
    return ValueError(f"hetero: bal.replay({{epoch: [steps, ranks]}}) {why}")


def _epoch(key) -> int:
    if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
        raise _line(f"has the key {key!r}: epochs are whole numbers >= 0")
    return int(key)


def _table(epoch: int, value, settings: Settings) -> np.ndarray:
    """One epoch's [steps, width] whole sizes, each step's summing to the global batch."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError):  # ragged rows: numpy refuses an inhomogeneous shape
        raise _line(f"epoch {epoch}: its steps do not all list the same number of ranks") from None
    if a.ndim != 2 or not a.size:
        raise _line(f"epoch {epoch}: expected a [steps, ranks] table of batch sizes with at least one step "
                    f"(got shape {a.shape})")
    if a.dtype.kind not in "iu":  # floats, bools, strings, objects: a size is a whole number of samples
        raise _line(f"epoch {epoch}: batch sizes must be whole numbers (got {a.dtype} values)")
    low = 0 if settings.sit_out else 1  # a rank sits a step out (size 0) only under sit_out
    if (bad := np.argwhere(a < low)).size:
        s, r = bad[0]
        raise _line(f"epoch {epoch} step {s} gives rank {r} {a[s, r]} samples: each needs >= {low}"
                    + ("" if low == 0 else " (0 only with sit_out)"))
    if (off := np.flatnonzero(a.sum(1) != settings.global_batch)).size:
        s = off[0]
        raise _line(f"epoch {epoch} step {s}: sizes {a[s].tolist()} sum to {a[s].sum()}, not the global batch "
                    f"{settings.global_batch}")
    if (m := settings.micro_batch) and (bad := np.argwhere(a % m)).size:
        s, r = bad[0]
        raise _line(f"epoch {epoch} step {s} gives rank {r} {a[s, r]} samples, not whole micro-batches of {m}")
    return a.astype(np.int64)


def recorded(sizes, settings: Settings) -> Replay:
    """bal.replay's argument checked on its own (no world needed): a checked copy, epoch -> int64 [steps, width]."""
    if settings.by_tokens:
        raise ValueError("hetero: replay() records sizes, and a Balance with a collator splits each step by its "
                         "samples' lengths: replay without collator")
    if not isinstance(sizes, dict):
        raise _line(f"takes a dict of epochs (got {type(sizes).__name__})")
    if not sizes:
        raise _line("is empty: it must record every epoch the loop runs")
    out = {e: _table(e, v, settings) for e, v in sorted((_epoch(k), v) for k, v in sizes.items())}
    epochs = list(out)
    if (gap := next((e for e, f in zip(epochs, epochs[1:]) if f != e + 1), None)) is not None:  # a skipped epoch
        raise _line(f"skips epoch {gap + 1} (it records epochs {_span(epochs)}): record every epoch the loop runs")
    widths = {v.shape[1] for v in out.values()}
    if len(widths) > 1:
        raise _line(f"records {' and '.join(map(str, sorted(widths)))} ranks in different epochs: one world's record")
    return out


def fit(replay: Replay | None, world: int, steps_per_epoch: int) -> None:
    """At bind and once the epoch length is known (0: not yet, or a loop without epochs): the record is this
    world's, and each recorded epoch has exactly the epoch's steps."""
    if replay is None:
        return
    width = next(iter(replay.values())).shape[1]
    if width != world:
        raise _line(f"records {width} rank(s), but the world has {world}: replay a record of this world's ranks "
                    f"(each step's samples go to every recorded rank)")
    if steps_per_epoch:
        for e, v in replay.items():
            if len(v) != steps_per_epoch:
                raise _line(f"records {len(v)} step(s) of epoch {e}, but an epoch has {steps_per_epoch} "
                            f"(n_samples // global_batch): record the same data set and global batch")


def sizes(replay: Replay, epoch: int, step: int) -> np.ndarray:
    """Every rank's recorded sizes at (epoch, step); a position past the record stops in one line (the same on
    every rank: every rank runs the same epochs and steps)."""
    if epoch not in replay:
        raise HeteroError(f"hetero: epoch {epoch} is not in bal.replay's record (it records epochs "
                          f"{_span(list(replay))}): record every epoch the loop runs")
    if step >= len(replay[epoch]):
        raise HeteroError(f"hetero: step {step} of epoch {epoch} is past bal.replay's record of "
                          f"{len(replay[epoch])} step(s): record every step the loop runs")
    return replay[epoch][step].copy()


def _span(epochs: list[int]) -> str:
    """Sorted epochs for a message: "1-150" when consecutive, else the first few."""
    if len(epochs) > 2 and epochs[-1] - epochs[0] == len(epochs) - 1:
        return f"{epochs[0]}-{epochs[-1]}"
    return ", ".join(map(str, epochs[:6])) + (", ..." if len(epochs) > 6 else "")
