"""Recorded sizes (`bal.replay`), checked where each fact becomes known, so that a replay that does not cover what
the loop runs is one line before a step trains on it, never a KeyError from the plan or a sampler cut for ranks
that do not exist.

- `recorded`, at bal.replay(): the record's own shape: {epoch: [steps, width]}, epochs consecutive, whole sizes
  that sum to the global batch at every step, one width throughout;
- `fit`, at bind (the world is known) and once the epoch length is known: the width is the world's, every
  recorded epoch has the epoch's steps;
- `sizes`, when a step's sizes are fixed: an epoch past the record, or a step past it in a loop without epochs.

By tokens (a Balance with a collator) a step's split is not its sizes but which samples each rank takes, a pure
function of the step's window, the samples' lengths and the fitted costs in force (tokens.split). So a run by tokens
is replayed from its decisions (`bal.decisions`, or their dicts, as JSON keeps them): from each one's `effective`
position on, the costs it recorded (`fixed_s`, `per_unit_s`, `attention`) are the regime; before the first, the
prior, as in the run. `costs` checks that record at bal.replay(); `fit` its width at bind. Every step is then split
exactly as the run split it, and no decision is made.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .agree import HeteroError
from .settings import Settings
from .tokens import CostModel

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


@dataclass(frozen=True)
class CostReplay:
    """A run by tokens replayed: from position regimes[i][0] on, the split follows the cost model regimes[i][1]."""
    regimes: list[tuple[int, CostModel]]
    width: int


def _costs_line(why: str) -> ValueError:
    return ValueError(f"hetero: bal.replay(decisions) of a run by tokens {why}")


def _fitted(d) -> bool:
    """A decision of a run by tokens (a records.Decision, or a dict of its fields, with the costs it fitted)."""
    get = d.get if isinstance(d, dict) else lambda k: getattr(d, k, None)
    return get("per_unit_s") is not None


def costs(record) -> CostReplay:
    """bal.replay's argument for a Balance with a collator: the run's decisions (records.Decision or dicts of their
    fields), each with its effective position and the fitted costs it recorded; checked on its own."""
    if isinstance(record, dict):
        raise _costs_line("takes the run's list of decisions (bal.decisions), not {epoch: sizes}: a collator splits "
                          "each step by its samples' lengths, so sizes do not say which samples each rank took")
    try:
        items = list(record)
    except TypeError:
        raise _costs_line(f"takes a list of decisions (got {type(record).__name__})") from None
    regimes, last = [], -1
    for i, d in enumerate(items):
        get = d.get if isinstance(d, dict) else (lambda k, d=d: getattr(d, k, None))
        effective, fixed, per, attention = (get(k) for k in ("effective", "fixed_s", "per_unit_s", "attention"))
        if fixed is None or per is None or attention is None:
            raise _costs_line(f"has decision {i} without fitted costs (fixed_s, per_unit_s, attention): a decision "
                              f"of a run that split by counts, which replays its sizes ({{epoch: [steps, ranks]}})")
        if isinstance(effective, bool) or not isinstance(effective, numbers.Integral) or effective <= last:
            raise _costs_line(f"has decision {i} taking effect at {effective!r}: each one's effective position is a "
                              f"whole number after the one before it (the run's decisions, in order)")
        try:
            fixed, per, attention = np.asarray(fixed, float), np.asarray(per, float), float(attention)
        except (TypeError, ValueError):
            raise _costs_line(f"has decision {i} whose costs are not numbers") from None
        if fixed.ndim != 1 or fixed.shape != per.shape or not fixed.size or not (
                np.isfinite(fixed).all() and (fixed >= 0).all() and np.isfinite(per).all() and (per > 0).all()
                and np.isfinite(attention) and attention >= 0):
            raise _costs_line(f"has decision {i} with costs fixed_s={fixed.tolist()}, per_unit_s={per.tolist()}, "
                              f"attention={attention}: one finite fixed_s >= 0 and per_unit_s > 0 per rank, an "
                              f"attention >= 0")
        model = CostModel(len(per), attention=attention)
        model.fixed_s, model.per_unit_s = fixed, per
        regimes.append((int(effective), model))
        last = int(effective)
    if not regimes:
        raise _costs_line("is empty: a run that made no decision split every step by the prior; replay nothing")
    if len(widths := {m.world for _, m in regimes}) > 1:
        raise _costs_line(f"records {' and '.join(map(str, sorted(widths)))} ranks in different decisions: one "
                          f"world's record")
    return CostReplay(regimes, regimes[0][1].world)


def recorded(sizes, settings: Settings) -> Replay | CostReplay:
    """bal.replay's argument checked on its own (no world needed): a checked copy, epoch -> int64 [steps, width];
    by tokens, the decisions' regimes (costs)."""
    if settings.by_tokens:
        return costs(sizes)
    if isinstance(sizes, (list, tuple)) and sizes and all(_fitted(d) for d in sizes):
        raise _costs_line("needs the Balance built with the run's collator ('padded' or 'packed'; HeteroTrainer "
                          "chose it from its data_collator, and bal.settings.collator said it): without one it "
                          "splits by counts and replays sizes")
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


def fit(replay: Replay | CostReplay | None, world: int, steps_per_epoch: int) -> None:
    """At bind and once the epoch length is known (0: not yet, or a loop without epochs): the record is this
    world's, and each recorded epoch has exactly the epoch's steps."""
    if replay is None:
        return
    if isinstance(replay, CostReplay):
        if replay.width != world:
            raise _costs_line(f"records the costs of {replay.width} rank(s), but the world has {world}: replay a "
                              f"record of this world's ranks")
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
