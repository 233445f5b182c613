"""What the step engine shares with the parts installed on the model: the comm hook (hook.py), FSDP2's comms
(fsdp.py), a DeepSpeed engine's door (deepspeed.py), the loss weighting (lossweight.py) and the optimizer guard
(guard.py).

One small object, set once at attach (Engine.connect) and then read and flagged by those parts during a step, as
accelerate's data loader and optimizer read its `GradientState`: the parts never reach into the engine's own state,
and the engine never calls back up into them.
"""
from __future__ import annotations

import torch

from .agree import peer_error


class Link:
    """The attached model and the flags of the steps in flight (module docstring)."""

    def __init__(self):
        self.model: torch.nn.Module | None = None  # the attached DDP model or FSDP2 root (None: not attached)
        self.fsdp = None                        # an FSDP2 model's schedule (fsdp.FSDPSchedule)
        self.ds = None                          # a DeepSpeed engine's door (deepspeed.DeepSpeedDoor)
        self.loss = None                        # weighting="loss": the DDP model's loss door (lossweight.py)
        self.device = self.coll = torch.device("cpu")  # the model's device; the collectives' (NCCL: the device)
        self.sync_now = True      # the micro-batch running now (or next) all-reduces
        self.unsynced = False     # a backward ran under no_sync since the last all-reduce (the guard reads it)
        self.since_opt = 0        # steps begun since the model's optimizer last stepped (the guard resets it)
        self.peer_failed: str | None = None  # a peer's posted line, seen when this rank's collective failed
        self.watch = False        # the comm hook's collectives are watched for a peer's line (agree.polled: gloo)
        self.first: torch.nn.Parameter | None = None  # the model's first parameter (begin reads its grad)

    def collective_failed(self) -> bool:
        """This rank's gradient collective failed: True when a peer posted why (raised at the optimizer step or
        end); False when it did not (the collective's own error stands)."""
        self.peer_failed = self.peer_failed or peer_error()
        return self.peer_failed is not None
