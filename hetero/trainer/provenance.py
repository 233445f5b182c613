"""What a run's results depend on besides its config: the host, the checkout's git commit and dirtiness, versions."""
from __future__ import annotations

import importlib
import platform
import socket
import subprocess
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # where git is asked (an installed copy: no git, "unknown")


def git(*args: str) -> str:
    """`git ARGS` in this checkout, its output stripped; "" when git is missing or fails."""
    try:
        return subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def versions(modules: tuple[str, ...] = ("hetero", "torch", "torchvision", "numpy")) -> dict[str, str]:
    """Python's and the given modules' versions; a module missing here is left out."""
    out = {"python": platform.python_version()}
    for name in modules:
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            continue
    return out


def provenance() -> dict:
    """What a run's results depend on besides its config: host, git commit and dirtiness, library versions."""
    return {"host": socket.gethostname(), "git_commit": git("rev-parse", "HEAD") or "unknown",
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "versions": versions()}
