"""The schedule of sizes: every rank's batch sizes at each position of training, fixed when first handed out.

A position is epoch x steps_per_epoch + step. A position's sizes are fixed when this rank's sampler first asks for
them (a DataLoader's workers may run ahead), from the regime in force there: the balancer as it was after the last
decision taking effect at or before it. A decision made after position p takes effect at p + 1 + lag; with lag
None, at the first position no rank's sampler has handed out yet (the furthest `handed` over the ranks), so no step
is ever cut two ways. A replay fixes the sizes instead: recorded {epoch: [steps, world]}, no decisions (by tokens:
the run's recorded regimes, replay.CostReplay).

By tokens (Settings.collator, issue 49): a regime is the fitted cost model (tokens.CostModel) instead of the
balancer, and a position's rows are `tokens.split` of that step's window of the shared permutation, by the samples'
lengths; its sizes are the counts of those rows. Which samples form a step (the window) never depends on the ranks:
global_batch samples, or with a token_budget the epoch's run of the permutation holding about that many tokens
(tokens.budget_cuts), so the window's count varies from step to step and the sizes sum to it.

The plan (plan.py) owns the schedule and the live balancer it copies regimes from; the sampler, the probe and the
step engine read it. It holds no position of its own: where training is, is the plan's `at`, passed in.
"""
from __future__ import annotations

import copy
import zlib

import numpy as np

from . import replay
from .agree import HeteroError
from .balancer import Balancer
from .partition import check_feasible
from .rules import micro_batch_too_big, whole
from .seeding import permutation
from .settings import Settings
from .tokens import Cost, CostModel, budget_cuts, budget_steps, check_lengths, split

FAR = -(1 << 62)    # the start of the first regime: before any step
ENDLESS = 1 << 62   # steps_per_epoch of a loop without epochs (no batch_sampler): one epoch that never ends


def epoch_length(settings: Settings, n_samples: int) -> int:
    """n_samples checked as an epoch's length: a whole number of at least one global batch."""
    n = whole("n_samples", n_samples, 1)
    if settings.global_batch is not None and settings.global_batch > n:
        raise ValueError(f"global batch {settings.global_batch} exceeds the {n} samples")
    return n


class SizeSchedule:
    """Every rank's sizes per position of one rank's Balance: the regimes, the replay, the epoch's length, the
    per-rank largest batches."""

    def __init__(self, settings: Settings, rank: int, world: int):
        self.settings, self.rank, self.world = settings, rank, world
        per_rank = settings.per_rank_max(world)
        self.probes = [v == "probe" for v in per_rank]  # ranks whose largest batch bal.probe finds
        self.configured = [float("inf") if v in (None, 0, "probe", float("inf")) else int(v) for v in per_rank]
        self.replayed: dict[int, np.ndarray] | replay.CostReplay | None = None
        self.n_samples: int | None = None
        self.steps_per_epoch = 0  # 0: no epochs (a loop without batch_sampler)
        self._balancer: Balancer | None = None
        self._live: Balancer | CostModel | None = None  # what a regime copies: the balancer, or the cost model
        # by tokens: every sample's length and the tokens its loss counts, the permutation's seed, the cost
        self.lengths: np.ndarray | None = None
        self.counted: np.ndarray | None = None
        self.seed = settings.seed
        self.cost = Cost(settings.collator) if settings.by_tokens else None  # its attention: the regime's
        # what the split predicts: in micro-batches a rank's rows cost about the sum of their lengths (exactly, for
        # micro-batches of one row; sorted longest first, micro-batches of m pad little)
        self.split_layout = "packed" if settings.micro_batch else settings.collator
        # max_tokens: the most tokens one micro-batch of each rank holds (inf: no cap); a row alone must fit, and a
        # rank's rows are cut into micro-batches of at most micro_batch rows and max_tokens tokens (micro_at); without
        # micro_batch a rank's whole step is one forward, so its rows together hold at most max_tokens (step_caps)
        tokens = None if settings.max_tokens is None else settings.per_rank_tokens(world)
        self.token_probes = [t == "probe" for t in tokens] if tokens is not None else [False] * world
        self.row_caps = None if tokens is None else np.array([np.inf if t == "probe" else t for t in tokens], float)
        self.step_caps = self._whole(self.row_caps)
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, its permutation)
        self._cuts: np.ndarray | None = None  # with token_budget: the epoch's [steps + 1] window offsets

    # -- the limits -------------------------------------------------------------------------------------------
    def check_limits(self, limits: list[float]) -> list[float]:
        """The per-rank largest batches, checked; with micro-batches they bound m (the counts are unbounded)."""
        m = self.settings.micro_batch
        if (r := micro_batch_too_big(m, limits)) is not None:
            raise ValueError(f"micro_batch {m} exceeds rank {r}'s largest batch {limits[r]:g}: lower micro_batch")
        limits = [float("inf")] * len(limits) if m else limits
        if not self.settings.budgeted:  # a token budget's windows are checked per epoch (_epoch_windows)
            check_feasible(len(limits), self.settings.global_batch, self.settings.min_batch, limits, max(m, 1))
        return limits

    def set_token_caps(self, caps: list[float]) -> None:
        """New per-rank max_tokens (after a probe): a sample longer than every cap is refused as at set_length."""
        self.row_caps = np.array(caps, dtype=float)
        self.step_caps = self._whole(self.row_caps)
        self._check_longest()

    def _whole(self, caps: np.ndarray | None) -> np.ndarray | None:
        """Without micro_batch a rank's whole step is one forward: its rows together within its cap (None: no rank
        capped, or micro-batches)."""
        return caps if caps is not None and not self.settings.micro_batch and np.isfinite(caps).any() else None

    def bound(self, limits: list[float]) -> None:
        """New per-rank largest batches (after a probe): the sizes start afresh within them."""
        self._balancer.bound(self.check_limits(limits))
        self.reset(self._balancer, self._live if self.cost is not None else None)

    @property
    def limits(self) -> list[float | None]:
        """Every rank's largest batch in force (None: unbounded), as the ranks compare them."""
        return [None if v == float("inf") else v for v in (self._balancer.max_batch or [])]

    def reset(self, balancer: Balancer, costs: CostModel | None = None) -> None:
        """Start afresh from the (live) balancer, or by tokens its cost model: at set-up, after a probe, on
        load_state_dict."""
        self._balancer, self._live = balancer, costs if costs is not None else balancer
        self.regimes: list[tuple[int, Balancer | CostModel]] = [(FAR, copy.deepcopy(self._live))]
        self.planned: dict[int, np.ndarray] = {}  # position -> every rank's sizes, fixed when handed out
        self._frozen: dict[int, tuple] = {}  # id(a regime's sizes) -> (them, as one read-only array): _fixed
        self.rows: dict[int, list[np.ndarray]] = {}  # by tokens: position -> every rank's sample indices
        self.micro: dict[int, list[list[np.ndarray]]] = {}  # ... and with micro_batch, each rank's micro-batches
        self.handed = FAR       # the next position this rank's sampler hands out
        self.iterated: int | None = None  # the epoch a sampler last iterated
        self.last = balancer.sizes  # every rank's sizes at the latest step begun

    # -- the sizes --------------------------------------------------------------------------------------------
    def index(self, epoch: int, step: int) -> int:
        """The position of (epoch, step), counted over every epoch."""
        return epoch * (self.steps_per_epoch or ENDLESS) + step

    def sizes_at(self, epoch: int, step: int) -> np.ndarray:
        """Every rank's sizes at (epoch, step), the same on every rank; fixed from now on."""
        pos = epoch * (self.steps_per_epoch or ENDLESS) + step  # self.index, inline: on every step's path
        if (sizes := self.planned.get(pos)) is not None:
            return sizes
        if isinstance(self.replayed, dict):
            self.planned[pos] = replay.sizes(self.replayed, epoch, step)
        else:  # the regime in force at pos; affine's first epoch probes two sizes (Balancer.sizes_for_step)
            regimes = self._regimes()
            start, regime = regimes[-1]  # the latest, mostly
            if start > pos:
                regime = next(b for start, b in reversed(regimes) if start <= pos)
            if self.cost is not None:
                self.rows[pos] = self._split(regime, epoch, step)
                self.planned[pos] = np.array([len(r) for r in self.rows[pos]], np.int64)
                if self.settings.micro_batch:
                    self.micro[pos] = [self._cut(r, rank) for rank, r in enumerate(self.rows[pos])]
            else:
                self.planned[pos] = self._fixed(regime.sizes_for_step(step))
        self.handed = max(self.handed, pos + 1)
        return self.planned[pos]

    def _fixed(self, raw) -> np.ndarray:
        """A regime's sizes as one read-only int64 array, made once per regime (and per probe size), not per step
        (issue 51): its steps share it, and no holder can write into another step's sizes. A regime's sizes are its
        own and rebound, never written into (Balancer.snapshot), so the array made from them stays theirs."""
        held = self._frozen.get(id(raw))
        if held is None or held[0] is not raw:
            if len(self._frozen) > 8:  # the regimes still in use hold a few each
                self._frozen.clear()
            sizes = np.array(raw, np.int64)
            sizes.flags.writeable = False
            self._frozen[id(raw)] = held = (raw, sizes)
        return held[1]

    def _regimes(self) -> list[tuple[int, Balancer | CostModel]]:
        """The regimes in force: the decisions', or a replay by tokens' recorded ones after the prior (no decision
        is made in a replay, so the first regime is still the prior)."""
        if isinstance(self.replayed, replay.CostReplay):
            return [self.regimes[0], *self.replayed.regimes]
        return self.regimes

    def _split(self, costs: CostModel, epoch: int, step: int) -> list[np.ndarray]:
        """Every rank's sample indices at (epoch, step): the step's window of the shared permutation, split by the
        regime's fitted costs (each rank's rows in the permutation's order)."""
        window = self.window(epoch, step)
        fixed, per = costs.coefficients()
        cost = Cost(self.split_layout, costs.attention)
        try:
            parts = self._split_window(window, fixed, per, cost)
        except ValueError:  # step caps: no split under these costs; the prior's, checked before the epoch, fits
            if self.step_caps is None:
                raise
            parts = self._split_window(window, *self._prior(), Cost(self.split_layout))
        if not self.settings.micro_batch:
            return [window[np.sort(p)] for p in parts]
        # micro-batches of m: each rank's rows longest first (ties by position), so a padded micro-batch pads least
        return [window[p][np.lexsort((window[p], -self.lengths[window[p]]))] for p in parts]

    def window(self, epoch: int, step: int) -> np.ndarray:
        """By tokens: the sample indices of (epoch, step) over every rank, in the permutation's order: its
        global_batch samples, or its run of the token budget."""
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, permutation(self.n_samples, self.seed, epoch).numpy())
            self._epoch_windows(epoch)
            self._check_caps(epoch)
        if self._cuts is not None:
            return self._perm[1][self._cuts[step]:self._cuts[step + 1]]
        B = self.settings.global_batch
        return self._perm[1][step * B:(step + 1) * B]

    def _epoch_windows(self, epoch: int) -> None:
        """With token_budget, before an epoch's first split: its steps' offsets into the permutation, each step
        holding at least min_batch rows for every rank (else one line on every rank alike: the cuts are the same
        everywhere)."""
        if not self.settings.budgeted:
            return
        self._cuts = budget_cuts(self.lengths[self._perm[1]], self.settings.token_budget)
        rows, least = np.diff(self._cuts), self.world * self.settings.min_batch
        if (short := np.flatnonzero(rows < least)).size:
            k = int(short[0])
            tokens = int(self.lengths[self._perm[1][self._cuts[k]:self._cuts[k + 1]]].sum())
            raise HeteroError(f"hetero: step {k} of epoch {epoch} holds {int(rows[k])} sample(s) ({tokens} tokens) "
                              f"under token_budget {self.settings.token_budget}, fewer than {self.world} ranks x "
                              f"min_batch {self.settings.min_batch}: raise token_budget")

    def most_rows(self) -> int:
        """The most samples one step can hold: global_batch, or under a token budget as many of the shortest samples
        as fit within one step's most tokens (budget_cuts: the epoch's tokens over its steps, plus the longest
        sample), in any epoch's order."""
        if not self.settings.budgeted:
            return self.settings.global_batch
        L = np.sort(self.lengths)
        most = -(-int(L.sum()) // self.steps_per_epoch) + int(L[-1])
        return int(np.searchsorted(np.cumsum(L), most, side="right"))

    def _split_window(self, window: np.ndarray, fixed, per, cost: Cost) -> list[np.ndarray]:
        if self.step_caps is not None:
            return split(self.lengths[window], fixed, per, cost, min_rows=self.settings.min_batch,
                         totals=self.step_caps)
        return split(self.lengths[window], fixed, per, cost, self.row_caps, min_rows=self.settings.min_batch)

    def _prior(self) -> tuple[np.ndarray, np.ndarray]:
        """The cost model's prior coefficients: no fixed part, the same cost per token on every rank."""
        return np.zeros(self.world), np.ones(self.world)

    def _cut(self, rows: np.ndarray, rank: int) -> list[np.ndarray]:
        """One rank's rows (longest first) in micro-batches of at most micro_batch rows and, with max_tokens, at most
        its tokens (padded: rows x the longest, the first; packed: the sum); each closes where the next row would
        overflow it."""
        m = self.settings.micro_batch
        cap = float("inf") if self.row_caps is None else self.row_caps[rank]
        padded, out, start, held = self.cost.collator == "padded", [], 0, 0.0
        for i, length in enumerate(self.lengths[rows].tolist()):
            n = i - start
            over = (n + 1) * self.lengths[rows[start]] > cap if padded else held + length > cap
            if n and (n == m or over):
                out.append(rows[start:i])
                start, held = i, 0.0
            held += length
        if len(rows):
            out.append(rows[start:])
        return out

    def micro_at(self, epoch: int, step: int) -> list[list[np.ndarray]]:
        """By tokens with micro_batch: every rank's micro-batches at (epoch, step) (sample indices), fixed from now
        on."""
        self.sizes_at(epoch, step)
        return self.micro[self.index(epoch, step)]

    def _check_caps(self, epoch: int) -> None:
        """max_tokens, before an epoch's first split: every step's window can give each rank min_batch rows it
        holds (else one line on every rank alike, naming the step: the windows are the same everywhere). Without
        micro_batch, each step's window splits under the prior's costs within every rank's max_tokens (a split
        under the fitted costs that finds none takes that one)."""
        if self.row_caps is None:
            return
        k = self.settings.min_batch
        if self.step_caps is not None:
            for step in range(self.steps_per_epoch):
                window = self.window(epoch, step)
                try:
                    self._split_window(window, *self._prior(), Cost(self.split_layout))
                except ValueError:
                    L = self.lengths[window]
                    raise HeteroError(
                        f"hetero: step {step} of epoch {epoch} cannot split its {L.size} samples ({int(L.min())}-"
                        f"{int(L.max())} tokens long, {int(L.sum())} in all) within the ranks' max_tokens "
                        f"{[None if np.isinf(c) else int(c) for c in self.step_caps]} with {k} row(s) each, "
                        f"{self.settings.collator}: raise max_tokens, or give micro_batch (a rank's rows in several "
                        f"forwards)") from None
            return
        order = np.argsort(self.row_caps, kind="stable")  # the ranks holding the shortest rows first
        for step in range(self.steps_per_epoch):
            L = np.sort(self.lengths[self.window(epoch, step)])
            # Hall's condition on nested sets: the j ranks with the lowest caps take rows only under the j-th cap
            for j, r in enumerate(order, start=1):
                if np.searchsorted(L, self.row_caps[r], side="right") < j * k:
                    raise HeteroError(
                        f"hetero: step {step} of epoch {epoch} cannot give rank {r} {k} row(s) of at most "
                        f"{self.row_caps[r]:g} tokens (its max_tokens) beside the ranks holding less: its {L.size} "
                        f"samples are {int(L[0])}-{int(L[-1])} tokens long; raise rank {r}'s max_tokens or the "
                        f"global batch")

    def rows_at(self, epoch: int, step: int) -> list[np.ndarray]:
        """By tokens: every rank's sample indices at (epoch, step), fixed from now on (as sizes_at)."""
        if self.cost is None:
            raise ValueError("hetero: rows_at is the split by tokens (a Balance with collator); by counts, cut "
                             "sampler.plan(epoch).indices(step, bal.sizes_at(epoch, step), bal.rank)")
        self.sizes_at(epoch, step)
        return self.rows[self.index(epoch, step)]

    def work_at(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """By tokens: every rank's cost units at (epoch, step) as their two terms [world, 2] (Cost.parts, summed over
        its micro-batches) and the tokens its loss counts."""
        rows = self.rows_at(epoch, step)
        micro = self.micro_at(epoch, step) if self.settings.micro_batch else [[r] for r in rows]
        return (np.array([np.sum([self.cost.parts(self.lengths[b]) for b in batches], axis=0) for batches in micro]),
                np.array([int(self.counted[r].sum()) for r in rows], np.int64))

    def digest(self) -> int | None:
        """By tokens: a checksum of the lengths, the loss's tokens and the seed (the ranks must share them)."""
        if self.lengths is None:
            return None
        return zlib.crc32(self.lengths.tobytes() + self.counted.tobytes() + str(self.seed).encode())

    def handed_out(self, epoch: int, step: int) -> bool:
        """A sampler (or sizes_at) has fixed this step's sizes."""
        return self.index(epoch, step) in self.planned

    def set_length(self, n_samples: int, tokens: tuple | None = None) -> None:
        """The epoch's length: floor(n / B) steps, or with token_budget ceil(its tokens / the budget); by tokens,
        by_tokens' (lengths, loss tokens, seed) too."""
        n = epoch_length(self.settings, n_samples)
        if tokens is not None:
            self.lengths, self.counted, self.seed = tokens
            self._perm = self._cuts = None
            self._check_longest()
        self.n_samples = n
        self.steps_per_epoch = budget_steps(self.lengths, self.settings.token_budget) if self.settings.budgeted \
            else n // self.settings.global_batch
        replay.fit(self.replayed, self.world, self.steps_per_epoch)  # a record of other epochs is refused here

    def _check_longest(self) -> None:
        """A sample longer than every rank's max_tokens is refused, naming it (the lengths known)."""
        if self.row_caps is not None and self.lengths is not None and \
                (long := np.flatnonzero(self.lengths > self.row_caps.max())).size:
            i = int(long[0])
            raise ValueError(f"hetero: sample {i} is {int(self.lengths[i])} tokens long, more than any rank's "
                             f"max_tokens (the largest is {self.row_caps.max():g}): raise max_tokens "
                             f"({long.size} sample(s) too long)")

    def start_iteration(self, epoch: int, first: int) -> int:
        """A sampler starts handing out `epoch` at step `first` (> 0 in an epoch resumed mid-way): refuse a second
        pass and an epoch already run; returns `first`."""
        if first >= self.steps_per_epoch:
            raise HeteroError(f"hetero: epoch {epoch} has run all its {self.steps_per_epoch} steps and the loader "
                              f"is iterated again: call bal.set_epoch(epoch) before each epoch")
        # positions fixed by sizes_at alone (bal.micro_batches read before the first batch) are handed out as
        # fixed; only a second pass of a sampler over the epoch is refused
        if self.index(epoch, first) < self.handed and self.iterated == epoch:
            raise HeteroError(f"hetero: the loader was iterated twice in epoch {epoch} (a `next(iter(loader))` "
                              f"peek, or a second pass): each step's batches are handed out once; learn the "
                              f"sizes from bal.sizes_at(epoch, step) instead of peeking")
        self.iterated = epoch
        return first

    def ended(self, pos: int) -> None:
        """The step at pos ended: the sizes fixed for it are no longer needed. Steps end in order, and positions are
        fixed in order, so that is pos's alone; a position before it fixed since (sizes_at on a past step) goes once
        it is the oldest left (O(1) a step, where a sweep of every position would be O(the steps fixed ahead))."""
        for d in (self.planned, self.rows, self.micro):
            if not d:  # rows and micro hold nothing but by tokens
                continue
            d.pop(pos, None)
            if d and next(iter(d)) < pos:
                for p in [p for p in d if p < pos]:
                    del d[p]

    # -- regimes (a decision's sizes from where it takes effect) ----------------------------------------------
    def adopt(self, pos: int, furthest: int) -> int:
        """The live balancer just decided after the step at pos: its copy is the regime from where the decision
        takes effect, which it returns; furthest: the ranks' furthest `handed`. Every rank computes it from the same
        gathered numbers, so a refusal stops every rank alike."""
        lag = self.settings.lag
        at = pos + 1 + (lag or 0)
        if lag is None:
            at = max(at, furthest)
        elif furthest > at:
            raise HeteroError(f"hetero: a batch sampler ran {furthest - pos - 1} steps ahead of training, beyond "
                              f"lag={lag}: set lag >= num_workers x prefetch_factor (+1 for Lightning), or None")
        self.regimes = [r for i, r in enumerate(self.regimes)  # regimes no position after pos can use go
                        if i + 1 == len(self.regimes) or self.regimes[i + 1][0] > pos]
        self.regimes.append((at, self._live.snapshot()))
        return at

    def regimes_state(self, here: int) -> list:
        """The regimes still in force from position `here` on, as plain data: a decision made before a checkpoint
        that takes effect after it (DataLoader workers ran ahead) keeps the sizes the steps between were cut with."""
        first = max((i for i, (start, _) in enumerate(self.regimes) if start <= here), default=0)
        return [[None if start == FAR else start, b.state_dict()] for start, b in self.regimes[first:]]

    def load_regimes(self, saved: list) -> None:
        """The regimes of regimes_state, over copies of the live balancer."""
        self.regimes = []
        for start, b in saved:
            regime = copy.deepcopy(self._live)
            regime.load_state_dict(b)
            self.regimes.append((FAR if start is None else whole("regime start", start, 0), regime))
        if self.cost is None:
            self.last = self.regimes[0][1].sizes


def by_tokens(settings: Settings, n_samples: int, lengths, counted, seed: int) -> tuple | None:
    """batch_sampler's lengths and loss tokens checked against the settings: (lengths, loss tokens, seed) as int64
    arrays by tokens, else None; one line for lengths without a collator, a collator without lengths, loss tokens
    without a token-mean loss, or counts that are not one whole number per sample."""
    if (lengths is None) == settings.by_tokens:
        raise ValueError(f"hetero: collator={settings.collator!r} splits each step by its samples' lengths: give "
                         f"batch_sampler(len(ds), lengths=...)" if lengths is None else
                         "hetero: lengths balance by tokens: build the Balance with collator='padded' or 'packed' "
                         "(how your collator lays out a rank's rows)")
    if counted is not None and settings.loss_mean != "tokens":
        raise ValueError("hetero: loss_tokens weigh a token-mean loss: build the Balance with loss_mean='tokens'")
    if lengths is None:
        return None
    lengths = check_lengths(lengths, n_samples)
    return lengths, lengths if counted is None else check_counted(counted, lengths), seed


def check_counted(counted, lengths: np.ndarray) -> np.ndarray:
    """The tokens each sample's loss counts: one whole number per sample, from 0 to its length."""
    try:
        c = np.asarray(counted)
    except (ValueError, TypeError):
        raise ValueError("hetero: loss_tokens must be a flat sequence of whole token counts, one per sample") from None
    if c.shape != lengths.shape or c.dtype == bool or not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"hetero: loss_tokens must be one whole number per sample ({lengths.size}; got an array of "
                         f"shape {c.shape} and type {c.dtype})")
    if (bad := np.flatnonzero((c < 0) | (c > lengths))).size:
        i = int(bad[0])
        raise ValueError(f"hetero: loss_tokens[{i}] is {int(c[i])}, outside 0..{int(lengths[i])} (the sample's "
                         f"length)")
    return c.astype(np.int64)
