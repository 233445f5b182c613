"""Reading a process's CFS quota from its cgroups (hetero.core.cpuquota) on folders laid out like the kernel's
(v1 and v2, a tighter quota above, a container's own view); the real kernel's is in test_straggler.py."""
from __future__ import annotations

import math

import pytest

from hetero.core.cpuquota import NONE, own_quota


def _v1(root, path: str, quota: int, period: int = 100000):
    folder = root / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (folder / "cpu.cfs_period_us").write_text(f"{period}\n")


def _v2(root, path: str, cpu_max: str | None):
    folder = root / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cgroup.controllers").write_text("cpu memory\n")
    if cpu_max is not None:
        (folder / "cpu.max").write_text(cpu_max + "\n")


def _read(tmp_path, proc_line: str, **kw):
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    return own_quota(str(proc), v1_mounts=[str(tmp_path / "v1")], v2_mounts=[str(tmp_path / "v2")], **kw)


def test_v1_the_tightest_quota_over_the_cgroup_and_those_above_it(tmp_path):
    _v1(tmp_path / "v1", "/", -1)
    _v1(tmp_path / "v1", "/pod", 50000)               # half a core for the pod
    _v1(tmp_path / "v1", "/pod/rank", 33000)          # a third for the rank: the tightest
    _v1(tmp_path / "v1", "/pod/rank/inner", -1)       # no quota of its own
    assert _read(tmp_path, "4:cpu,cpuacct:/pod/rank/inner") == pytest.approx((0.033, 0.1))
    _v1(tmp_path / "v1", "/pod/rank", 400000, 200000)  # two cores at 200 ms periods: the pod's half is tighter
    assert _read(tmp_path, "4:cpu,cpuacct:/pod/rank/inner") == pytest.approx((0.05, 0.1))


def test_v2_cpu_max_and_max_for_none(tmp_path):
    _v2(tmp_path / "v2", "/", None)
    _v2(tmp_path / "v2", "/job", "max 100000")
    assert _read(tmp_path, "0::/job") == NONE
    _v2(tmp_path / "v2", "/job", "25000 50000")
    assert _read(tmp_path, "0::/job") == pytest.approx((0.025, 0.05))
    for bad in ("lots 100000", "25000 0", "25000", ""):  # unreadable: no quota, never an error in every Balance
        _v2(tmp_path / "v2", "/job", bad)
        assert _read(tmp_path, "0::/job") == NONE


def test_a_container_that_sees_its_own_cgroup_as_the_root_reads_the_mount(tmp_path):
    _v2(tmp_path / "v2", "/", "200000 100000")  # the container's limit of 2 cores, at the root of its view
    assert _read(tmp_path, "0::/kubepods/burstable/pod-1/abc") == pytest.approx((0.2, 0.1))


def test_no_cgroup_no_quota_unreadable_files_and_off(tmp_path, monkeypatch):
    assert _read(tmp_path, "0::/") == NONE                      # neither hierarchy mounted
    _v1(tmp_path / "v1", "/", -1)
    assert _read(tmp_path, "4:cpu,cpuacct:/") == NONE          # no quota anywhere
    (tmp_path / "v1" / "cpu.cfs_quota_us").write_text("garbage")
    assert _read(tmp_path, "4:cpu,cpuacct:/") == NONE
    _v1(tmp_path / "v1", "/", 33000)
    monkeypatch.setenv("HETERO_CPU_QUOTA", "off")
    assert _read(tmp_path, "4:cpu,cpuacct:/") == NONE
    assert all(math.isinf(v) for v in NONE)
