"""The run folder: config.json, epochs.csv, ranks.csv, steps.csv, summary.json and checkpoint.pt.

Tidy files (one observation per row, one schema per file) so pandas.read_csv feeds seaborn directly. Rows are
flushed every epoch; the checkpoint and summary are replaced atomically (write a temporary file, fsync, rename)
so a crash at any instant leaves the previous complete version.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError

TABLES = ("epochs", "ranks", "steps")
CHECKPOINT = "checkpoint.pt"


def check_run_dir(path: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a folder that cannot be written, or that already holds a run unless resuming or overwriting; creates
    nothing."""
    holds_run = (path / "config.json").exists()
    if resume and not (path / CHECKPOINT).exists():
        raise ConfigError(f"cannot resume: {path} holds no checkpoint ({CHECKPOINT})")
    if holds_run and not (resume or overwrite):
        raise ConfigError(f"run folder {path} already holds a run: pass --resume to continue it or "
                          f"--overwrite to replace it, or choose another --run-dir")
    # Nothing is created here (a --check or a failed data load leaves no folder behind): the folder itself if it
    # exists, else its nearest existing parent, must take a file. RunFolder.start creates the folder later.
    existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor or "."))
    try:  # really try: permission bits say little to root, and read-only file systems say nothing
        probe = existing / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run folder {path} is not writable ({e.strerror or e})") from None


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class RunFolder:
    """Written by global rank 0 only."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def start(self, config: dict[str, Any], resume_epoch: int | None, overwrite: bool) -> None:
        """Create the folder; on resume keep rows up to the checkpoint's epoch and drop any later ones."""
        self.path.mkdir(parents=True, exist_ok=True)
        if overwrite and resume_epoch is None:
            for name in [f"{t}.csv" for t in TABLES] + ["summary.json", CHECKPOINT, "config.json"]:
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
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh))
        if not rows:
            return
        col = rows[0].index("epoch")
        kept = [rows[0]] + [r for r in rows[1:] if int(r[col]) <= last_epoch]

        def write(fh):
            fh.write("".join(",".join(r) + "\n" for r in kept).encode())
        _atomic_write(path, write)

    def append(self, table: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        path = self.path / f"{table}.csv"
        new = not path.exists() or path.stat().st_size == 0
        with open(path, "a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
            if new:
                w.writeheader()
            w.writerows(rows)
            fh.flush()
            os.fsync(fh.fileno())

    def write_json(self, name: str, obj: dict[str, Any]) -> None:
        _atomic_write(self.path / name, lambda fh: fh.write((json.dumps(obj, indent=2, default=str) + "\n").encode()))

    def read_json(self, name: str) -> dict[str, Any]:
        return json.loads((self.path / name).read_text())

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        _atomic_write(self.path / CHECKPOINT, lambda fh: torch.save(state, fh))

    def load_checkpoint(self, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        return torch.load(self.path / CHECKPOINT, map_location=map_location, weights_only=False)
