"""A Balance's settings: one frozen record, checked once when it is built (the rules are in rules.py).

Every rank must hold the same settings; the step engine's fingerprint (engine.py) adds what the run has learnt since
(the epoch length, the emulation, a replay, the resolved per-rank limits) and is what the ranks compare (agree.agree).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .partition import SCHEMES
from .rules import check_sit_out, check_tokens, fraction, whole


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What a Balance is built with (Balance's Args); validated in __post_init__."""
    global_batch: int | None = None  # samples per step over every rank (the sizes sum to it); None: token_budget
    scheme: str = "edp"           # sync, dp, edp or affine (partition.SCHEMES)
    rebalance_every: int = 0      # decide every K steps; 0: at each epoch's end only
    smoothing: float = 0.0        # weight of the previous estimate, [0, 1)
    deadband: float = 0.0         # keep the sizes unless the predicted step shrinks by more than this, [0, 1)
    significance: float = 1.0     # ... and by more than this many standard errors
    min_batch: int = 1            # the smallest batch a rank gets (sit_out, not 0, lets affine give 0)
    max_batch: int | str | Sequence | None = None  # int, "probe", None, or one of those per rank
    seed: int = 0                 # the sampler's permutations
    lag: int | None = None        # None: the first step no sampler handed out; int: a decision after s acts at s+1+lag
    sit_out: bool = False         # affine may give a rank batch 0 (it still runs forward and backward)
    micro_batch: int = 0          # m > 0: every micro-batch is m samples, k_i of them per rank and step
    worker_id: str | None = None  # this worker's identity (None: HETERO_WORKER_ID, else host and device)
    collator: str | None = None   # None: split by counts; "padded" or "packed": by tokens (batch_sampler's lengths)
    attention: float | None = None  # with collator: a squared length's weight in a row's cost (None: fitted)
    loss_mean: str = "samples"    # the loss's mean: over samples (weights b_i/B) or over tokens (n_i/N)
    max_tokens: int | Sequence | None = None  # with collator: tokens one forward holds, per rank ("probe")
    weighting: str = "hook"       # DDP: "hook" (a comm hook weighs the gradients) or "loss" (bal.backward(loss))
    token_budget: int | None = None  # with collator, in place of global_batch: about this many tokens a step

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r} (choose from {', '.join(SCHEMES)})")
        if self.token_budget is None or self.global_batch is not None:
            whole("global_batch", self.global_batch, 1)
        whole("rebalance_every", self.rebalance_every, 0)
        whole("micro_batch", self.micro_batch, 0)
        whole("seed", self.seed, 0)
        whole("min_batch", self.min_batch, 1)
        if self.lag is not None:
            whole("lag", self.lag, 0)
        fraction("smoothing", self.smoothing, 1)
        fraction("deadband", self.deadband, 1)
        fraction("significance", self.significance, float("inf"))
        if not isinstance(self.sit_out, bool):
            raise ValueError(f"sit_out must be True or False (got {self.sit_out!r})")
        check_sit_out(self.sit_out, SCHEMES[self.scheme].rule, self.micro_batch)
        check_tokens(self)
        if self.weighting not in ("hook", "loss"):
            raise ValueError(f"weighting must be 'hook' (a comm hook weighs every backward) or 'loss' (bal.backward "
                             f"weighs the loss; a DDP loop that owns its backward) (got {self.weighting!r})")
        if self.worker_id is not None and not (isinstance(self.worker_id, str) and self.worker_id.strip()):
            raise ValueError(f"worker_id must be a non-empty string (got {self.worker_id!r})")

    @property
    def by_tokens(self) -> bool:
        """Each step's samples are split by what they cost (tokens.py), from the lengths given to batch_sampler."""
        return self.collator is not None

    @property
    def budgeted(self) -> bool:
        """Each step is the run of the permutation holding about token_budget tokens (schedule.budget_cuts), not
        global_batch samples."""
        return self.token_budget is not None

    @property
    def rule(self) -> str:
        """The balancer's rule: static, proportional or affine."""
        return SCHEMES[self.scheme].rule

    @property
    def weighted(self) -> bool:
        """Gradients weighted by b_i/B (edp, affine), else DDP's mean 1/world (sync, dp)."""
        return SCHEMES[self.scheme].weighted

    def per_rank_max(self, world: int) -> list:
        """max_batch as one entry per rank (int, "probe" or None), each checked."""
        per_rank = list(self.max_batch) if isinstance(self.max_batch, (list, tuple)) else [self.max_batch] * world
        if len(per_rank) != world:
            raise ValueError(f"max_batch has {len(per_rank)} entries for {world} ranks")
        for v in per_rank:
            if v not in (None, "probe", float("inf")):
                whole("max_batch", v, 0)
        return per_rank

    def per_rank_tokens(self, world: int) -> list[float | str]:
        """max_tokens as one entry per rank (a number, inf: no cap, or "probe": bal.probe finds it), each checked."""
        v = self.max_tokens
        per_rank = list(v) if isinstance(v, (list, tuple)) else [v] * world
        if len(per_rank) != world:
            raise ValueError(f"hetero: max_tokens has {len(per_rank)} entries for {world} ranks")
        return [float("inf") if t is None else t if t == "probe" else whole("max_tokens", t, 1) for t in per_rank]

    def shared(self) -> dict:
        """The settings every rank must share, as plain data (the worker's own identity is not one)."""
        d = asdict(self)
        del d["worker_id"], d["max_batch"]  # compared resolved, in the engine's fingerprint
        return d
