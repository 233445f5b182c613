"""The run folder: config.json, epochs.csv, ranks.csv, steps.csv, membership.csv, summary.json and checkpoint.pt.

Tidy files (one observation per row, one schema per file) so pandas.read_csv feeds seaborn directly. Rows are
flushed every epoch; the checkpoint and summary are replaced atomically (write a temporary file, fsync, rename)
so a crash at any instant leaves the previous complete version. Every write goes through safeio: a symbolic link
planted at any of these files is never followed.

One job at a time owns a folder: its rank 0 holds an exclusive `flock` on `.lock` for the job's life (the kernel
drops it when the process dies, even by SIGKILL), and only the holder writes into the folder. Checkpoints hold
only tensors, lists, dicts, strings and numbers, so they load with `weights_only=True`: a crafted file cannot run
code.
"""
from __future__ import annotations

import csv
import fcntl
import json
import os
import pickle
import socket
import stat
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..core import safeio
from .config import ConfigError

TABLES = ("epochs", "ranks", "steps")
CHECKPOINT = "checkpoint.pt"
LOCK = ".lock"
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "balancer", "epoch", "train_time_s", "global_step", "history",
                   "rng")


class RunLock:
    """An exclusive flock on RUN_DIR/.lock, held until release() or the process ends."""

    def __init__(self, path: Path, fd: int, created: tuple[Path, ...] = ()):
        self.path, self.fd, self.created = path, fd, created  # created: the folders this job made, deepest first

    def release(self, discard: bool = False) -> None:
        """Drop the lock; with discard, also remove the folder if this job created it and left nothing else in it
        (a `--check`, or a job refused before its run started, leaves no trace)."""
        if self.fd < 0:
            return
        if discard and self.created and [p.name for p in self.path.iterdir()] == [LOCK]:
            (self.path / LOCK).unlink(missing_ok=True)  # still holding it, so no job is between open and flock
            for folder in self.created:  # the run folder, then the parents made for it, while they are empty
                try:
                    folder.rmdir()
                except OSError:
                    break
        os.close(self.fd)  # closing the only descriptor drops the flock
        self.fd = -1


def _holder(path: Path) -> str:
    try:
        pid, host = (path / LOCK).read_text().split()[:2]
        return f"pid {pid} on host {host}"
    except (OSError, ValueError):
        return "holder unknown"


def acquire_lock(path: Path, tries: int = 10) -> RunLock:
    """Take the folder's lock or raise ConfigError naming its holder. A few quick retries ride out a reader's
    momentary shared probe (is_busy); a live job holds it for good."""
    fd = safeio.open_nofollow(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)  # NONBLOCK: a FIFO there
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"run folder {path}: its {LOCK} is not a regular file (remove it)")
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if i == tries - 1:
                os.close(fd)
                raise ConfigError(f"run folder {path} is in use by another job ({_holder(path)})") from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return RunLock(path, fd)


def is_busy(path: Path) -> bool:
    """Whether a live job holds the folder's lock (a shared, non-blocking probe; never blocks the holder)."""
    try:
        fd = safeio.open_nofollow(Path(path) / LOCK, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's shared lock


def status(path: Path) -> str:
    """`running` while a job holds the folder's lock; else the status in summary.json (completed, failed), with a
    `running` there shown as `interrupted` (its job died without a word, e.g. SIGKILL); `started` (config.json
    only) or `new`. Never writes."""
    path = Path(path)
    if is_busy(path):
        return "running"
    try:
        st = json.loads(safeio.read_bytes(path / "summary.json")).get("status", "started")
    except FileNotFoundError:
        st = "started" if (path / "config.json").exists() else "new"
    except (OSError, ValueError):
        st = "started"
    return "interrupted" if st == "running" else st


def claim_run_dir(path: Path, resume: bool, overwrite: bool) -> RunLock:
    """Lock the folder for this job, then refuse one that cannot be written, or that already holds a run unless
    resuming or overwriting. The lock comes before anything else is written; the holder then removes temporary
    files a killed job left behind."""
    if resume and not (path / CHECKPOINT).exists():
        raise ConfigError(f"cannot resume: {path} holds no checkpoint ({CHECKPOINT})")
    if resume:
        try:
            safeio.regular_file(path / CHECKPOINT, "cannot resume: the checkpoint")
        except OSError as e:
            raise ConfigError(e.strerror) from None
    try:  # really try: permission bits say little to root, and read-only file systems say nothing
        created = tuple(p for p in (path, *path.parents) if not p.exists())
        path.mkdir(parents=True, exist_ok=True)
        lock = acquire_lock(path)
        lock.created = created
    except safeio.UnsafeFile as e:
        raise ConfigError(f"run folder {path}: {e.strerror}") from None
    except OSError as e:
        raise ConfigError(f"run folder {path} is not writable ({e.strerror or e})") from None
    try:
        if (path / "config.json").exists() and not (resume or overwrite):
            raise ConfigError(f"run folder {path} already holds a run: pass --resume to continue it or "
                              f"--overwrite to replace it, or choose another --run-dir")
        # the tables are appended in place (O_NOFOLLOW would refuse a link there only after the first epoch)
        if links := [n for n in (f"{t}.csv" for t in (*TABLES, "membership")) if (path / n).is_symlink()]:
            raise ConfigError(f"run folder {path}: {links[0]} is a symbolic link: hetero does not write through links "
                              f"it did not create (remove it)")
        for tmp in [*path.glob(".*.tmp"), *path.glob(".write-test-*")]:
            tmp.unlink(missing_ok=True)
    except BaseException:
        lock.release(discard=True)
        raise
    return lock


def disk_error(e: OSError, path: Path) -> str:
    """One line for a failed write: disk full (ENOSPC, EDQUOT) said plainly."""
    if isinstance(e, safeio.UnsafeFile):  # its text names the file
        return f"cannot write: {e.strerror}"
    if safeio.is_disk_full(e):
        return f"disk full writing {path} ({e.strerror}): the previous checkpoint is kept; free space and --resume"
    return f"cannot write {path} ({e.strerror or e})"


class DiskError(RuntimeError):
    """A write into the run folder failed (disk full, I/O error); the message is one line."""


def _atomic_write(path: Path, write) -> None:
    try:
        safeio.atomic_write(path, write)
    except OSError as e:
        raise DiskError(disk_error(e, path)) from None


class RunFolder:
    """Written by global rank 0 only, and only while its job holds the folder's lock."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def start(self, config: dict[str, Any], resume_epoch: int | None, overwrite: bool) -> None:
        """Create the folder; on resume keep rows up to the checkpoint's epoch and drop any later ones."""
        self.path.mkdir(parents=True, exist_ok=True)
        if overwrite and resume_epoch is None:
            for name in [f"{t}.csv" for t in TABLES] + ["membership.csv", "summary.json", CHECKPOINT, "config.json"]:
                (self.path / name).unlink(missing_ok=True)
        if resume_epoch is not None:
            for t in TABLES:
                self._truncate(self.path / f"{t}.csv", resume_epoch)
        else:  # claim the folder atomically: two launches aimed at one folder cannot both write it
            try:
                (self.path / "config.json").open("x").close()
            except FileExistsError:
                raise ConfigError(f"run folder {self.path} already holds a run") from None
        self.write_json("config.json", config)

    @staticmethod
    def _truncate(path: Path, last_epoch: int) -> None:
        if not path.exists():
            return
        rows = list(csv.reader(safeio.read_bytes(path).decode(errors="replace").splitlines()))
        if not rows:
            return
        col = rows[0].index("epoch")
        kept = [rows[0]] + [r for r in rows[1:] if len(r) == len(rows[0]) and int(r[col]) <= last_epoch]

        def write(fh):
            fh.write("".join(",".join(r) + "\n" for r in kept).encode())
        _atomic_write(path, write)

    def append(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Append rows; a failed write (disk full) is rolled back so the file never ends in a partial row."""
        if not rows:
            return
        path = self.path / f"{table}.csv"
        size = path.lstat().st_size if path.exists() else 0
        try:
            with safeio.append_open(path) as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
                if size == 0:
                    w.writeheader()
                w.writerows(rows)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as e:
            if not isinstance(e, safeio.UnsafeFile):
                try:
                    fd = safeio.open_nofollow(path, os.O_WRONLY)
                    os.ftruncate(fd, size)
                    os.close(fd)
                except OSError:
                    pass
            raise DiskError(disk_error(e, path)) from None

    def write_json(self, name: str, obj: dict[str, Any]) -> None:
        _atomic_write(self.path / name, lambda fh: fh.write((json.dumps(obj, indent=2, default=str) + "\n").encode()))

    def read_json(self, name: str) -> dict[str, Any]:
        return json.loads(safeio.read_bytes(self.path / name))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """state: tensors, lists, dicts, strings and numbers only (what weights_only=True loads)."""
        _atomic_write(self.path / CHECKPOINT, lambda fh: torch.save(state, fh))

    def load_checkpoint(self, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """The checkpoint, loaded with weights_only=True (no code runs); ConfigError in one line."""
        path = self.path / CHECKPOINT
        try:
            safeio.regular_file(path, "cannot resume: the checkpoint")  # a FIFO would block torch.load for ever
        except safeio.UnsafeFile as e:
            raise ConfigError(e.strerror) from None
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:  # weights_only refuses anything but plain data: say what, not how
            what = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
            raise ConfigError(f"cannot resume: {path} holds more than tensors and plain data, so it was not loaded "
                              f"(it could run code){': ' + what[:160] if what else ''}") from None
        except (OSError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, KeyError) as e:
            raise ConfigError(f"cannot resume: {path} is corrupt or truncated ({type(e).__name__})") from None
        return state

    def load_trainer_checkpoint(self) -> dict[str, Any]:
        """load_checkpoint, then checked to hold what Trainer.load_state_dict reads; ConfigError in one line."""
        state, path = self.load_checkpoint(), self.path / CHECKPOINT
        missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            raise ConfigError(f"cannot resume: {path} is not a hetero checkpoint (no {', '.join(missing)})")
        lowest = 0 if state.get("partial") is not None else 1  # a step checkpoint (--checkpoint-every) in epoch 1
        if not (isinstance(state["epoch"], int) and state["epoch"] >= lowest and isinstance(state["model"], dict)
                and all(isinstance(v, torch.Tensor) for v in state["model"].values())):
            raise ConfigError(f"cannot resume: {path} is not a hetero checkpoint (bad epoch or model weights)")
        return state
