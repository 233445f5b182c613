"""This process's CFS quota, read from its cgroups: (quota_s, period_s) of CPU, the tightest over its cgroup and
every cgroup above it (a container's or a Kubernetes pod's CPU limit is one of those). Read-only; (inf, inf) where
there is none or it cannot be read, or $HETERO_CPU_QUOTA=off: the balancer then decides from measured times alone.

cgroup v2: the `0::/path` line of /proc/self/cgroup, `cpu.max` ("max 100000" or "33000 100000", microseconds) in
each folder from it up to the root. cgroup v1: the line whose controllers include `cpu`, `cpu.cfs_quota_us` (-1:
none) and `cpu.cfs_period_us` under the cpu controller's mount. A path that is not under the mount (a container
sees its own cgroup as the root) reads the mount's root.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "HETERO_CPU_QUOTA"  # "off": read no quota (the balancer decides from the measured times alone)
NONE = (float("inf"), float("inf"))
V1_MOUNTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")
V2_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _us(quota: str, period: str) -> tuple[float, float] | None:
    """Two counts of microseconds as seconds; None unless both are whole and positive ("max", -1: no quota)."""
    if quota.isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0:
        return int(quota) / 1e6, int(period) / 1e6
    return None


def _v2(folder: Path) -> tuple[float, float] | None:
    quota, _, period = _text(folder / "cpu.max").partition(" ")
    return _us(quota, period.strip())


def _v1(folder: Path) -> tuple[float, float] | None:
    return _us(_text(folder / "cpu.cfs_quota_us"), _text(folder / "cpu.cfs_period_us"))


def _tightest(mount: Path, path: str, read) -> tuple[float, float]:
    folder = mount / path.lstrip("/")
    if not folder.is_dir():
        folder = mount
    best = NONE
    while True:
        q = read(folder)
        if q is not None and (best == NONE or q[0] / q[1] < best[0] / best[1]):
            best = q
        if folder == mount or mount not in folder.parents:
            return best
        folder = folder.parent


def own_quota(proc: str = "/proc/self/cgroup", v1_mounts=V1_MOUNTS, v2_mounts=V2_MOUNTS) -> tuple[float, float]:
    """(quota_s, period_s): the tightest CFS quota over this process's cgroups; NONE where there is none, or
    where $HETERO_CPU_QUOTA is "off"."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return NONE
    lines = _text(Path(proc)).splitlines()
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "cpu" in controllers.split(","):
            for m in map(Path, v1_mounts):
                if (m / "cpu.cfs_quota_us").is_file():
                    return _tightest(m, path, _v1)
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            for m in map(Path, v2_mounts):
                if (m / "cgroup.controllers").is_file():
                    return _tightest(m, path, _v2)
    return NONE
