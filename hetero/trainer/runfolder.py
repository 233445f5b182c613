"""The run folder: every file the trainer keeps in it, and how each is found, claimed, written and read back.

Files (the table with their columns: docs/trainer.md#the-run-folder): config.json, summary.json, checkpoint.pt,
the tables epochs.csv, ranks.csv, steps.csv and membership.csv, and the lock `.lock`. Rules that hold for each:
- Nothing but a regular file is opened. Anything else at one of these names (a FIFO, socket, device, folder, or a
  symbolic link, which the trainer never makes) is refused by name before any process group, on every rank, by
  lstat alone (check_files): a FIFO would block its opener for ever.
- One job at a time owns a folder: its rank 0 holds an exclusive `flock` on `.lock` for the job's life (the kernel
  drops it when the process dies, even by SIGKILL), and only the holder writes into the folder. It claims the
  folder after every read-only check passed, so a refused job changes no file in it.
- Tables are tidy (one observation per row, one schema per file; pandas.read_csv feeds seaborn) and appended every
  epoch; JSON files and the checkpoint are replaced atomically (a temporary file, fsync, rename) through safeio, so
  a crash leaves the previous complete version and a planted link is never written through.
- The checkpoint holds plain data sealed with a digest (checkpoint.py): it loads with `weights_only=True` (a crafted
  file cannot run code), and an edited or damaged one is refused in one line.
"""
from __future__ import annotations

import csv
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import socket
import stat
import sys
import time
import zipfile
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core import safeio
from ..core.agree import remap_identities
from .checkpoint import RUN_UID, damage, opened, sealed
from .config import Config, ConfigError, default_run_dir, shown

CONFIG, SUMMARY, CHECKPOINT, LOCK = "config.json", "summary.json", "checkpoint.pt", ".lock"
TABLES = ("epochs", "ranks", "steps")
APPENDED = tuple(f"{t}.csv" for t in (*TABLES, "membership"))
FILES = (CONFIG, SUMMARY, CHECKPOINT, LOCK, *APPENDED)  # every name the trainer opens in a run folder
BOARD = "tensorboard"  # the folder --tensorboard writes its event files into (board.py), and deletes them from


# -- where the folder is, and whether this job continues it ---------------------------------------------------------
def run_id_folder(run_id: str) -> str:
    """A folder name for torchrun's run id, one per id: the id itself when it is a plain name, else its plain
    characters and a digest of the whole id (two ids that share a prefix never share a folder)."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", run_id):
        return run_id
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:40].lstrip("._-")
    return f"{plain}-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"


def resolve(cfg: Config) -> tuple[Config, bool]:
    """The run folder and whether to resume: explicit (--resume), or the folder of this torchrun job's run id again
    (a restart, a node joining; the caller checks its settings: resume.rejoined_config)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    run_dir = cfg.resume or cfg.run_dir
    if not run_dir:
        if run_id and run_id != "none":  # stable over torchrun restarts and the same on every node
            run_dir = str(Path("runs") / f"{cfg.model}-{cfg.scheme}-{run_id_folder(run_id)}")
        else:
            run_dir = str(default_run_dir(cfg, datetime.now().strftime("%Y%m%d-%H%M%S")))
    has_checkpoint = os.path.lexists(Path(run_dir) / CHECKPOINT)
    # torchrun restarts its workers when one fails (RESTART_COUNT grows) and when a node joins (it does not; a
    # joining node's workers start at 0): both continue their own run, known by torchrun's run id
    same_job = bool(run_id) and run_id != "none" and run_id_of(Path(run_dir)) == run_id
    resume = bool(cfg.resume) or (has_checkpoint and (restarted or same_job))
    # a restart before the first checkpoint starts the run again in its own folder
    overwrite = cfg.overwrite or (restarted and not has_checkpoint)
    return dataclasses.replace(cfg, run_dir=run_dir, overwrite=overwrite and not resume), resume


def check_files(path: Path, resume: bool, tensorboard: bool = False) -> None:
    """Every rank, before any process group, opening nothing: each of FILES present in `path` is a regular file
    (lstat, so a link is refused too), with --tensorboard its event folder a real folder, and a resumed folder holds
    its checkpoint; else a ConfigError."""
    for name in FILES:
        _regular_or_absent(path, name)
    if tensorboard:
        try:
            own_folder(path / BOARD, make=False)
        except safeio.UnsafeFile as e:
            raise ConfigError(f"run folder {path}: {e.strerror}") from None
    if resume and not (path / CHECKPOINT).exists():
        raise ConfigError(f"cannot resume: {path} holds no checkpoint ({CHECKPOINT})")


def _regular_or_absent(path: Path, name: str) -> None:
    try:
        st = os.lstat(path / name)
    except FileNotFoundError:
        return
    except OSError as e:  # ENOTDIR: the run folder is a file; EACCES
        raise ConfigError(f"run folder {path} cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"run folder {path}: its {name} is a symbolic link: hetero does not write through links "
                          f"it did not create (remove it)")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"run folder {path}: its {name} is {safeio.file_kind(st.st_mode)}, not a regular file: "
                          f"refusing to open it (remove it)")


def own_folder(folder: Path, make: bool = True) -> None:
    """A folder the run writes into and deletes from: made here if missing (make), and a real folder, not a link
    (whose target another run or user owns) nor anything else; else safeio.UnsafeFile naming it."""
    if make:
        try:
            os.mkdir(folder)  # never through a link: mkdir fails on any existing name, a link included
        except FileExistsError:
            pass
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise safeio.UnsafeFile(errno.ELOOP, f"its {folder.name} folder is a symbolic link: hetero does not write "
                                f"or delete through links it did not create (remove it)")
    if not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else safeio.file_kind(st.st_mode)
        raise safeio.UnsafeFile(errno.ENOTDIR, f"its {folder.name} is {kind}, not a folder (remove it)")


def file_id(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime in ns, size) of a file, None if absent: what tells a replaced checkpoint from the one read."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


# -- reading back what a run recorded ---------------------------------------------------------------------------------
def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a run: {"config": {...}, "world_size": n, ...}; ConfigError in one line if it is missing,
    unreadable, or not a record of a run."""
    where, path = f"cannot resume {folder}", folder / CONFIG
    try:
        _regular_or_absent(folder, CONFIG)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if not path.is_file():
        raise ConfigError(f"{where}: it holds no {CONFIG}")
    try:
        meta = json.loads(safeio.read_bytes(path, f"its {CONFIG}"))
    except safeio.UnsafeFile as e:
        raise ConfigError(f"{where}: {e.strerror}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: its {CONFIG} is unreadable or truncated ({e})") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("config"), dict)):
        raise ConfigError(f"{where}: its {CONFIG} has no config record")
    return meta


def run_id_of(folder: Path) -> str | None:
    """The torchrun run id that started the folder's run (recorded in its config.json), None if unknown."""
    try:
        meta = json.loads(safeio.read_bytes(folder / CONFIG))
        return (meta.get("torchrun") or {}).get("TORCHELASTIC_RUN_ID")
    except (OSError, ValueError, AttributeError):
        return None


def epochs_done(folder: Path) -> int:
    """Epochs completed per summary.json (written after each checkpoint, so never ahead of it); 0 if unknown."""
    try:
        done = json.loads(safeio.read_bytes(folder / SUMMARY)).get("epochs_completed", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return done if isinstance(done, int) else 0


# -- who ran it, and a run's sizes read back for a replay ----------------------------------------------------------
def membership_rows(ids: list[str], old_ids: list[str] | None, old_world: int, epoch: int, step: int) -> list[dict]:
    """membership.csv: one row per worker at each start of the run (the first, a --resume, a torchrun restart):
    when, after which epoch and step (the checkpoint's), the old and new world size, and each worker's identity
    (ids: this world's, in rank order) with its rank in the new world and in the old (-1: not in it; a worker that
    left has rank -1). old_world 0: a first start."""
    now, world, old = datetime.now().isoformat(timespec="seconds"), len(ids), old_ids or []
    src = remap_identities(old, old_world, ids, world) if old_world else [None] * world
    base = {"time": now, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "epoch": epoch,
            "step": step, "old_world": old_world, "world": world}
    rows = [{**base, "rank": r, "old_rank": -1 if src[r] is None else src[r], "identity": ids[r]}
            for r in range(world)]
    kept = {i for i in src if i is not None}
    return rows + [{**base, "rank": -1, "old_rank": i, "identity": name} for i, name in enumerate(old)
                   if i not in kept]



REPLAY_COLUMNS = ("epoch", "step", "rank", "batch_size")


def load_replay(run: Path, cfg: Config, world: int) -> dict[int, np.ndarray]:
    """Recorded batch sizes {epoch: [steps, world]} of an earlier run, to train with the same partition; a file
    that is not a complete record (empty, a column missing, text or negative sizes, duplicate or missing rows) is
    one ConfigError."""
    import pandas as pd

    path, where = run / "steps.csv", f"cannot replay {run}"
    if not path.exists():
        raise ConfigError(f"{where}: it has no steps.csv")
    try:
        df = pd.read_csv(io.BytesIO(safeio.read_bytes(path, "its steps file")))
    except safeio.UnsafeFile as e:
        raise ConfigError(f"{where}: {e.strerror}") from None
    except (OSError, ValueError, pd.errors.ParserError) as e:  # EmptyDataError, UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{where}: its steps.csv is unreadable ({type(e).__name__}: "
                          f"{shown(str(e).splitlines()[0] if str(e) else '', 80)})") from None
    if missing := [c for c in REPLAY_COLUMNS if c not in df.columns]:
        raise ConfigError(f"{where}: its steps.csv has no column {', '.join(missing)} (is it a hetero steps.csv?)")
    if df.empty:
        raise ConfigError(f"{where}: its steps.csv has no rows")
    for c in REPLAY_COLUMNS:
        if not pd.api.types.is_integer_dtype(df[c]) or (df[c] < 0).any():
            bad = df[c][pd.to_numeric(df[c], errors="coerce").isna() | (pd.to_numeric(df[c], errors="coerce") < 0)]
            raise ConfigError(f"{where}: its steps.csv column {c} holds {shown(bad.tolist()[0]) if len(bad) else 'a '}"
                              f"{'' if len(bad) else 'fraction'}, not a whole number >= 0")
    if (dup := df.duplicated(["epoch", "step", "rank"], keep=False)).any():
        e, st, r = df.loc[dup, ["epoch", "step", "rank"]].iloc[0]
        raise ConfigError(f"{where}: its steps.csv lists epoch {e} step {st} rank {r} twice")
    if sorted(df["rank"].unique()) != list(range(world)):
        raise ConfigError(f"{where}: it ran {df['rank'].nunique()} ranks, this run has {world}")
    out = {}
    for epoch, g in df.groupby("epoch"):
        table = g.pivot(index="step", columns="rank", values="batch_size")
        if list(table.index) != list(range(len(table))) or table.isna().any().any():
            raise ConfigError(f"{where}: its steps.csv has gaps in epoch {epoch} (every step 0.. needs all {world} "
                              f"ranks)")
        sizes = table.to_numpy(np.int64)
        if not np.all(sizes.sum(1) == cfg.global_batch):
            raise ConfigError(f"{where}: its global batch is not {cfg.global_batch}")
        out[int(epoch)] = sizes
    return out



# -- one job owns the folder ------------------------------------------------------------------------------------------
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
    _regular_or_absent(path, LOCK)  # looked at without opening it
    fd = safeio.open_nofollow(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)  # NONBLOCK: swapped since
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
        st = json.loads(safeio.read_bytes(path / SUMMARY)).get("status", "started")
    except FileNotFoundError:
        st = "started" if (path / CONFIG).exists() else "new"
    except (OSError, ValueError):
        st = "started"
    return "interrupted" if st == "running" else st


def claim_run_dir(path: Path, resume: bool, overwrite: bool, read: tuple | None = None,
                  tensorboard: bool = False) -> RunLock:
    """Lock the folder for this job, then refuse one that cannot be written, that already holds a run unless
    resuming or overwriting, or whose checkpoint is no longer the one this job read (`read`: its file_id). The
    caller ran every read-only check first (check_files, the checkpoint), so a refused job changed nothing; the
    holder then removes temporary files a killed job left behind."""
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
        if (path / CONFIG).exists() and not (resume or overwrite):
            raise ConfigError(f"run folder {path} already holds a run: pass --resume to continue it or "
                              f"--overwrite to replace it, or choose another --run-dir")
        check_files(path, resume, tensorboard)  # again, now that no other job can be writing here
        if resume and file_id(path / CHECKPOINT) != read:
            raise ConfigError(f"cannot resume: {path / CHECKPOINT} was replaced while this job started (by another "
                              f"job?): start the resume again")
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
        self.run_uid: str | None = None  # the run's own id (checkpoint.RUN_UID), from the config start() writes

    def start(self, config: dict[str, Any], resume_epoch: int | None, overwrite: bool) -> None:
        """Create the folder; on resume keep rows up to the checkpoint's epoch and drop any later ones."""
        self.path.mkdir(parents=True, exist_ok=True)
        if overwrite and resume_epoch is None:
            for name in (n for n in FILES if n != LOCK):
                (self.path / name).unlink(missing_ok=True)
        if resume_epoch is not None:
            for t in TABLES:
                self._truncate(self.path / f"{t}.csv", resume_epoch)
        else:  # claim the folder atomically: two launches aimed at one folder cannot both write it
            try:
                (self.path / CONFIG).open("x").close()
            except FileExistsError:
                raise ConfigError(f"run folder {self.path} already holds a run") from None
        self.write_json(CONFIG, config)
        self.run_uid = config.get(RUN_UID)

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
        """state: tensors, lists, dicts, strings and numbers only (what weights_only=True loads); saved sealed."""
        state = sealed({**state, RUN_UID: self.run_uid} if self.run_uid else state)  # bound to this run
        _atomic_write(self.path / CHECKPOINT, lambda fh: torch.save(state, fh))

    def load_checkpoint(self, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """The checkpoint file as saved (digest included), loaded with weights_only=True (no code runs);
        ConfigError in one line."""
        path = self.path / CHECKPOINT
        try:
            safeio.regular_file(path, "cannot resume: the checkpoint")  # a FIFO would block torch.load for ever
        except safeio.UnsafeFile as e:
            raise ConfigError(e.strerror) from None
        if zipfile.is_zipfile(path) and (what := damage(path)) is not None:
            raise ConfigError(f"cannot resume: {path} fails its integrity check (its bytes are damaged: {what}); "
                              f"nothing was changed: restore it, or start the run again")
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:  # weights_only refuses anything but plain data: say what, not how
            what = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
            raise ConfigError(f"cannot resume: {path} holds more than tensors and plain data, so it was not loaded "
                              f"(it could run code){': ' + what[:160] if what else ''}") from None
        except (OSError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, KeyError) as e:
            raise ConfigError(f"cannot resume: {path} is corrupt or truncated ({type(e).__name__})") from None

    def load_trainer_checkpoint(self) -> tuple[dict[str, Any], tuple | None]:
        """The checkpoint verified (its digest) in the current layout, for Trainer.load_state_dict, and the file's
        file_id; ConfigError in one line. An older one without a digest loads with a warning line (checkpoint.py)."""
        read = file_id(self.path / CHECKPOINT)
        state, warning = opened(self.load_checkpoint(), self.path / CHECKPOINT)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        return state, read
