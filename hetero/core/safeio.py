"""Files hetero reads and writes, opened the one safe way: never through a symbolic link it did not create, never
a FIFO or device (opening one can block for ever), and a full disk said as "disk full".

Every writer of the run folder, the grid folder, the report and the image cache goes through `atomic_write`
(a fresh temporary name made with O_EXCL, then a rename: a link planted at the target is replaced, its target
untouched) or `open_nofollow` (O_NOFOLLOW: a link at the file itself is refused). Readers of files a user points
hetero at (checkpoints, config.json, steps.csv) call `regular_file` first, which looks without opening.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

# The limits of a path's text before the system says "File name too long" (pathconf where it answers).
NAME_MAX, PATH_MAX = 255, 4096


class UnsafeFile(OSError):
    """A file hetero refuses to open (a link where it writes, a FIFO or device where it reads): one line."""


def file_kind(mode: int) -> str:
    """What a file's mode says it is, for an error line ("a FIFO", "a character device", ...)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def regular_file(path: Path, what: str = "file") -> os.stat_result:
    """stat(path), following links, and refuse what is not a regular file, without opening it (a FIFO would block
    the opener until a writer comes). FileNotFoundError passes through."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(errno.EINVAL, f"{what} {path} is {file_kind(st.st_mode)}, not a regular file: refusing to "
                                       f"open it")
    return st


def read_bytes(path: Path, what: str = "file") -> bytes:
    """The bytes of a regular file (regular_file first; O_NONBLOCK in case it was swapped for a FIFO since)."""
    regular_file(path, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFile(errno.EINVAL, f"{what} {path} is not a regular file: refusing to read it")
        return fh.read()


def path_problem(text: str) -> str:
    """Why `text` cannot be a path on this system ("" if it can): a NUL byte, a name or the whole too long."""
    if "\0" in text:
        return "holds a NUL byte"
    if len(os.fsencode(text)) > PATH_MAX:
        return f"is longer than the system allows ({len(os.fsencode(text))} bytes; at most {PATH_MAX})"
    long = [p for p in Path(text).parts if len(os.fsencode(p)) > NAME_MAX]
    if long:
        return f"has a name longer than the system allows ({len(os.fsencode(long[0]))} bytes; at most {NAME_MAX})"
    return ""


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open with O_NOFOLLOW | O_CLOEXEC: a symbolic link at `path` is refused (UnsafeFile), never followed."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):  # EMLINK: the BSDs' word for it
            raise UnsafeFile(errno.ELOOP, f"{path} is a symbolic link: hetero does not write through links it did "
                                          f"not create (remove it)") from None
        raise


def append_open(path: Path) -> IO[str]:
    """A text file opened for appending, created if missing, never through a link, never a FIFO (O_NONBLOCK: an
    open without a reader fails at once instead of blocking) or anything else but a regular file."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        mode = os.fstat(fd).st_mode
        os.close(fd)
        raise UnsafeFile(errno.EINVAL, f"{path} is {file_kind(mode)}, not a regular file: refusing to write it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", newline="")


def temp_name(path: Path) -> Path:
    """A fresh hidden name beside `path` matching `.*.tmp` (what a run folder's holder sweeps at start)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `path` whole or not at all: write(fh) into a fresh temporary file (O_EXCL: never an existing file or
    link), fsync, rename over `path`. A link planted at `path` is replaced, its target untouched. An OSError
    (ENOSPC included) propagates after the temporary file is removed; see disk_full for torch's wrapped ones."""
    path = Path(path)
    tmp = temp_name(path)
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as raw:
            fh = _Recording(raw)
            try:
                write(fh)
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - torch.save turns a failed write into RuntimeError
                if fh.error is not None:
                    raise fh.error from None
                if _says_disk_full(e):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None
                raise
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # never leave a half-written file filling the disk
        raise


def _says_disk_full(e: BaseException) -> bool:
    """torch.save's C++ writer reports a short write as `[enforce fail at inline_container.cc] unexpected pos`."""
    text = str(e)
    return "No space left" in text or ("inline_container" in text and "unexpected pos" in text)


class _Recording:
    """A binary file that remembers the OSError of a failed write, which torch.save would otherwise wrap."""

    def __init__(self, fh: IO[bytes]):
        self._fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self._fh, name)


def write_text(path: Path, text: str) -> None:
    """atomic_write of UTF-8 text."""
    atomic_write(path, lambda fh: fh.write(text.encode()))


def is_disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)
