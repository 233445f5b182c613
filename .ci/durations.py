"""CI's evidence (issue 47): every test's duration, read from the JUnit XML pytest wrote.

    python .ci/durations.py runs/ci/junit.xml

writes runs/ci/durations.csv (test, seconds, outcome; slowest first) beside it, prints the 30 slowest and the
total per file, and exits 1 when a test not named in SLOW below took over LIMIT_S. A test that slow has to be named
here with its reason, or be made cheaper (one launch per door, many checks inside it), or move to `make bench`.
The limit is a budget, not a verdict on the code: the named tests take well under it on a 2-core VM, so the limit
leaves about three times their time for a busy machine.
"""
from __future__ import annotations

import csv
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

LIMIT_S = 60.0

# file::test (parameters dropped): why it may take over a minute. Keep this list short.
SLOW = {
}


def _name(case: ET.Element) -> str:
    """tests/x/test_y.py::test_z[param] from a JUnit testcase's classname and name."""
    parts = case.get("classname", "").split(".")
    k = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    path = "/".join(parts[:k + 1]) + ".py"
    return "::".join([path, *parts[k + 1:], case.get("name", "")])


def _outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return tag
    return "passed"


def main(xml: str) -> int:
    cases = [(_name(c), float(c.get("time", 0)), _outcome(c)) for c in ET.parse(xml).getroot().iter("testcase")]
    cases.sort(key=lambda c: -c[1])
    out = Path(xml).with_name("durations.csv")
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test", "seconds", "outcome"])
        w.writerows([(n, f"{t:.2f}", o) for n, t, o in cases])
    per_file: dict[str, float] = defaultdict(float)
    for n, t, _ in cases:
        per_file[n.split("::")[0]] += t
    total = sum(per_file.values())
    print(f"\nci: {len(cases)} tests, {total:.0f} s in tests ({out})\nthe 30 slowest:")
    for n, t, o in cases[:30]:
        print(f"  {t:7.1f} s  {n}{'' if o == 'passed' else f'  ({o})'}")
    print("per file (the 15 costliest):")
    for path, t in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {t:7.1f} s  {path}")
    over = [(n, t) for n, t, _ in cases if t > LIMIT_S and re.sub(r"\[.*\]$", "", n) not in SLOW]
    for n, t in over:
        print(f"ci: {n} took {t:.0f} s, over the {LIMIT_S:.0f} s a test may take unless .ci/durations.py names it "
              f"with a reason", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
