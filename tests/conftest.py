"""The costliest test files first (tests/costs.csv: each file's seconds in a full run, refreshed with
`python .ci/durations.py runs/ci/junit.xml --costs tests/costs.csv`). The Makefile runs pytest-xdist with
`--dist loadfile --no-loadscope-reorder`: a worker takes the next file in this order, so the long files start early
and the short ones fill in at the end (longest first). xdist's own order (files with the most tests first) started
one-test files such as test_real_data.py last, while the other worker sat idle for a minute or more. A file keeps
its tests' order; a file not in the table comes after those in it, in collection order. Ordering only: no test's
outcome depends on it."""
from __future__ import annotations

import csv
from pathlib import Path

COSTS = Path(__file__).with_name("costs.csv")


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
