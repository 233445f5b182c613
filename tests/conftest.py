"""The costliest test files first (tests/costs.csv: each file's seconds in a full run, refreshed with
`python .ci/durations.py runs/ci/junit.xml --costs tests/costs.csv`). The Makefile runs pytest-xdist with
`--dist loadfile --no-loadscope-reorder`: a worker takes the next file in this order, so the long files start early
and the short ones fill in at the end (longest first). xdist's own order (files with the most tests first) started
one-test files such as test_real_data.py last, while the other worker sat idle for a minute or more. A file keeps
its tests' order; a file not in the table comes after those in it, in collection order. Ordering only: no test's
outcome depends on it.

Each test's CPU is kept beside its time (issue 47): `cpu_s`, this pytest process's own, and `child_cpu_s`, that of
the processes the test started (a launcher counts its ranks; the fork server of helpers.spawned, which reaps the
ranks it forks, counts theirs). On 2 cores the suite is bound by CPU,
mostly interpreters starting, and a test's wall time says little of what it costs: a rank that sleeps is cheap.
.ci/durations.py reads both from the JUnit XML. A process nobody waits for (Ray's daemons) is not counted."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("costs.csv")
_STARTED = pytest.StashKey[tuple]()
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def file_costs(path: Path | None = None) -> dict[str, float]:
    """{test file relative to the repository: seconds} (COSTS by default); empty when missing or unreadable."""
    try:
        with (path or COSTS).open(newline="") as f:
            return {row["file"]: float(row["seconds"]) for row in csv.DictReader(f)}
    except (OSError, KeyError, ValueError):
        return {}


def pytest_collection_modifyitems(session, config, items):
    cost = file_costs()
    if not cost:
        return
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda item: (-cost.get(item.nodeid.split("::")[0], 0.0), first[item.nodeid.split("::")[0]]))


def _live_children() -> dict[int, float]:
    """{pid: CPU seconds, its own and its reaped children's} of this process's live children, from /proc (empty
    without it). A child that outlives a test (the fork server) is counted by what it spent during the test."""
    me, out = os.getpid(), {}
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid ... utime stime cutime cstime (fields 14-17)
        if int(fields[1]) == me:
            out[int(pid)] = sum(map(int, fields[11:15])) / _TICK
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_STARTED] = (os.times(), _live_children())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The test's CPU from its setup to its teardown, kept as JUnit properties (the teardown's report carries them).
    Children: those reaped (os.times, less what a child alive at the start had spent before it) and those alive."""
    yield
    if (started := item.stash.get(_STARTED, None)) is not None:
        (t0, live0), t1, live1 = started, os.times(), _live_children()
        own = t1.user - t0.user + t1.system - t0.system
        reaped = t1.children_user - t0.children_user + t1.children_system - t0.children_system
        children = reaped - sum(v for pid, v in live0.items() if pid not in live1) \
            + sum(v - live0.get(pid, 0.0) for pid, v in live1.items())
        item.user_properties += [("cpu_s", f"{own:.2f}"), ("child_cpu_s", f"{max(children, 0.0):.2f}")]
