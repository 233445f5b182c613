"""CI's evidence (.ci/durations.py): every test's time read back from pytest's JUnit XML, the slowest printed, and a
test over the budget named unless it is listed with a reason; never a failure (a wall time is the machine's)."""
from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import ROOT


def _load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def durations():
    return _load("ci_durations", ROOT / ".ci" / "durations.py")


def _xml(path, cases: list[tuple[str, str, float, str]]):
    rows = "".join(f'<testcase classname="{c}" name="{n}" time="{t}">{body}</testcase>' for c, n, t, body in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return path


def test_a_slow_test_not_named_is_reported_not_failed_and_every_time_is_kept(durations, tmp_path, capsys):
    xml = _xml(tmp_path / "junit.xml", [
        ("tests.unit.test_a", "test_quick", 0.5, ""),
        ("tests.integration.test_b", "test_slow[x-1]", 175.0, ""),
        ("tests.integration.test_b.TestC", "test_failed", 3.0, "<failure message='no'/>"),
    ])
    assert durations.main(str(xml)) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.count("took") == 1
    assert "ci: note: tests/integration/test_b.py::test_slow[x-1] took 175 s" in out
    assert "3 tests, 178 s in tests" in out
    rows = list(csv.DictReader((tmp_path / "durations.csv").open()))
    assert [r["test"] for r in rows] == ["tests/integration/test_b.py::test_slow[x-1]",
                                         "tests/integration/test_b.py::TestC::test_failed",
                                         "tests/unit/test_a.py::test_quick"]
    assert [r["outcome"] for r in rows] == ["passed", "failure", "passed"]


def test_a_named_slow_test_is_not_reported_with_its_parameters(durations, tmp_path, monkeypatch, capsys):
    xml = _xml(tmp_path / "junit.xml", [("tests.integration.test_b", "test_slow[x-1]", 175.0, "")])
    monkeypatch.setitem(durations.SLOW, "tests/integration/test_b.py::test_slow", "one launch of many checks")
    assert durations.main(str(xml)) == 0
    assert "took" not in capsys.readouterr().out


def test_the_per_file_table_is_written_costliest_first_and_read_back_by_the_test_order(durations, tmp_path, capsys):
    xml = _xml(tmp_path / "junit.xml", [("tests.unit.test_a", "test_x", 2.0, ""),
                                        ("tests.unit.test_a", "test_y", 1.5, ""),
                                        ("tests.integration.test_b", "test_z", 9.0, "")])
    assert durations.main(str(xml), str(tmp_path / "costs.csv")) == 0
    order = _load("tests_conftest", ROOT / "tests" / "conftest.py")
    assert list(order.file_costs(tmp_path / "costs.csv").items()) == [("tests/integration/test_b.py", 9.0),
                                                                     ("tests/unit/test_a.py", 3.5)]
    assert order.file_costs(tmp_path / "missing.csv") == {}


BURN_TESTS = """
import subprocess, sys
from helpers import spawned

BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5:\\n    pass\\n"


def test_in_a_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)


def test_in_pytest():
    exec(BURN)


def _burn(rank, out):
    exec(BURN)
    open(f"{out}/rank{rank}.json", "w").write("{}")


def test_in_a_spawned_rank(tmp_path):
    spawned(_burn, tmp_path, nprocs=1)
"""


def test_each_tests_cpu_is_kept_its_own_apart_from_its_processes_and_reported(durations, tmp_path, capsys):
    """tests/conftest.py keeps a test's CPU as JUnit properties: what pytest's process spent (cpu_s) apart from what
    the processes the test started spent (child_cpu_s); .ci/durations.py writes both and sums them. Each test burns
    0.5 s of CPU where the other does not (a CPU time, not a wall time: no verdict on the host's speed; the margins
    are ten times os.times' tick of 10 ms). The third burns in a rank forked by helpers.spawned's fork server,
    which reaps it: counted as the test's too."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_burn.py").write_text(BURN_TESTS)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "--junitxml", "junit.xml", "test_burn.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    assert p.returncode == 0, p.stdout + p.stderr
    assert durations.main(str(tmp_path / "junit.xml")) == 0
    rows = {r["test"].split("::")[-1]: r for r in csv.DictReader((tmp_path / "durations.csv").open())}
    child, own = rows["test_in_a_child"], rows["test_in_pytest"]
    assert float(child["child_cpu_s"]) >= 0.4 and float(child["cpu_s"]) < 0.2
    assert float(own["cpu_s"]) >= 0.4 and float(own["child_cpu_s"]) < 0.1
    assert float(rows["test_in_a_spawned_rank"]["child_cpu_s"]) >= 0.4
    assert "in the processes the tests started (3 tests)" in capsys.readouterr().out


def test_the_costliest_files_run_first_each_keeping_its_tests_order(monkeypatch, tmp_path):
    """tests/conftest.py: with --no-loadscope-reorder, xdist hands out the files in this order (longest first); a file
    not in the table goes last, in collection order. Control: an empty table leaves the order as collected."""
    order = _load("tests_conftest", ROOT / "tests" / "conftest.py")

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    ids = ["tests/unit/test_a.py::t1", "tests/unit/test_new.py::t1", "tests/unit/test_a.py::t2",
           "tests/integration/test_b.py::t2", "tests/integration/test_b.py::t1", "tests/unit/test_c.py::t1"]
    table = tmp_path / "costs.csv"
    table.write_text("file,seconds\ntests/unit/test_a.py,3.5\ntests/integration/test_b.py,9.0\ntests/unit/test_c.py,0.2\n")
    monkeypatch.setattr(order, "COSTS", table)
    items = [Item(i) for i in ids]
    order.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ["tests/integration/test_b.py::t2", "tests/integration/test_b.py::t1",
                                         "tests/unit/test_a.py::t1", "tests/unit/test_a.py::t2",
                                         "tests/unit/test_c.py::t1", "tests/unit/test_new.py::t1"]
    monkeypatch.setattr(order, "COSTS", tmp_path / "none.csv")
    items = [Item(i) for i in ids]
    order.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ids


def test_the_committed_cost_table_names_test_files_that_exist():
    """A file renamed or removed leaves a dead row (harmless to the order, but the table is to be refreshed)."""
    rows = list(csv.DictReader((ROOT / "tests" / "costs.csv").open()))
    assert rows and all((ROOT / r["file"]).is_file() and float(r["seconds"]) >= 0 for r in rows)
    assert [float(r["seconds"]) for r in rows] == sorted((float(r["seconds"]) for r in rows), reverse=True)


def test_every_named_test_exists(durations):
    """A name left behind by a renamed or removed test would excuse nothing: each is a test in its file."""
    for name in durations.SLOW:
        path, test = name.split("::", 1)
        assert (ROOT / path).is_file(), name
        assert f"def {test.split('::')[-1]}(" in (ROOT / path).read_text(), name


THREADS = """
import importlib, os, sys, threading, time
for m in sys.argv[1:]:
    if m == "thread":  # the counter's control
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    else:
        importlib.import_module(m)
print(len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_fork_server_of_spawned_ranks_imports_nothing_that_starts_a_thread():
    """helpers.spawned forks every rank from a server that has imported PRELOAD: a thread there (holding a lock at the
    fork) could leave a rank hung. One thread after importing them, as the server starts (one BLAS thread); one started
    beside them is counted (the control)."""
    import subprocess
    import sys

    import helpers

    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "tests")}
    mods = helpers.PRELOAD + [m for m in helpers.PRELOAD_IF_INSTALLED if importlib.util.find_spec(m)]

    def threads(*modules: str) -> int:
        p = subprocess.run([sys.executable, "-c", THREADS, *modules], env=env, capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        return int(p.stdout.split()[-1])

    assert threads(*mods) == 1
    assert threads(*mods, "thread") == 2
