"""--tensorboard: TensorBoard event files in RUN_DIR/tensorboard, written by global rank 0 from the rows it writes
to the run's tables, so a chart and its CSV hold the same numbers.

    make experiment ... TENSORBOARD=1 && tensorboard --logdir runs/     # one run per folder, side by side

The x axis is the global step: a step's scalars at (epoch - 1) x steps_per_epoch + step (steps.csv's rows: each
rank's batch size, compute and wait), an epoch's at epoch x steps_per_epoch, the steps run by its end (epochs.csv's
loss, accuracy and learning rate, ranks.csv's shares, and the read-out's predicted speedup and misallocation,
hetero.core.metrics). Needs the [tensorboard] extra.
"""
from __future__ import annotations

from pathlib import Path

from ..core import safeio
from ..core.metrics import metrics, predicted_speedup
from .runfolder import BOARD, DiskError, own_folder

FOLDER = BOARD
# the read-out's keys an epoch adds: the per-step ones come from steps.csv's rows, the shares from ranks.csv's
READ_OUT = ("predicted_step_s", "predicted_even_step_s", "predicted_speedup", "misallocation", "decisions",
            "size_changes", "slowest_rank")
EPOCH_KEYS = {"train_loss": "train/loss", "train_top1": "train/top1", "test_loss": "test/loss",
              "test_top1": "test/top1", "test_top5": "test/top5", "lr": "train/lr", "epoch_time_s": "train/epoch_s",
              "balance_eff": "hetero/balance_eff"}


class Board:
    """One SummaryWriter for the run folder; fed by Trainer._record with the rows of an epoch."""

    def __init__(self, run_dir: Path, steps_per_epoch: int):
        self.folder, self.steps_per_epoch = Path(run_dir) / FOLDER, steps_per_epoch
        self._writer = None  # opened at the first epoch's rows: the run folder is claimed and started by then

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # the [tensorboard] extra, checked by Config
            self._own()
            self._writer = SummaryWriter(log_dir=str(self.folder))
        return self._writer

    def _own(self) -> None:
        """The event folder made and checked again right before its first write or delete (run.prepare checked it
        before the run): a link planted since is refused, never written through."""
        try:
            own_folder(self.folder)
        except safeio.UnsafeFile as e:
            raise DiskError(f"cannot write run folder {self.folder.parent}: {e.strerror}") from None

    def epoch(self, epoch: int, line: dict, ranks: list[dict], steps: list[dict], bal) -> None:
        """One epoch's rows (epochs.csv's line, ranks.csv's and steps.csv's rows) and the read-out, flushed."""
        if epoch == 1 and self._writer is None:
            # a run starting afresh (--overwrite): an earlier run's event files go, as its tables did (a resumed
            # run's first job wrote none with rows before its first epoch ended); from the run's own folder only
            self._own()
            for old in self.folder.glob("events.out.tfevents.*"):
                if old.is_file() and not old.is_symlink():
                    old.unlink()
        w, first = self.writer, (epoch - 1) * self.steps_per_epoch
        for r in steps:
            x = first + r["step"]
            for key in ("batch_size", "compute_s", "wait_s"):
                w.add_scalar(f"hetero/rank{r['rank']}/{key}", r[key], x)
        end = epoch * self.steps_per_epoch
        for key, tag in EPOCH_KEYS.items():
            w.add_scalar(tag, line[key], end)
        for r in ranks:
            w.add_scalar(f"hetero/rank{r['rank']}/share", r["share"], end)
        read = metrics(bal)
        for key in READ_OUT:
            if f"hetero/{key}" in read:
                w.add_scalar(f"hetero/{key}", read[f"hetero/{key}"], end)
        for key, value in read.items():
            if key.endswith("/idle_s"):
                w.add_scalar(key, value, end)
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def progress(bal) -> str:
    """The progress bar's postfix: every rank's share and the latest decision's predicted speedup (read from the
    decision, without the step clocks, so no host sync on CUDA)."""
    shares = "/".join(f"{b / bal.settings.global_batch:.2f}" for b in bal.last_sizes)
    speedup = predicted_speedup(bal.decisions[-1]) if bal.decisions else None
    return f"shares {shares}" + (f" | predicted {speedup:.2f}x" if speedup is not None else "")
