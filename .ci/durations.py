"""CI's evidence (issue 47): every test's duration, read from the JUnit XML pytest wrote.

    python .ci/durations.py runs/ci/junit.xml [--costs tests/costs.csv]

writes runs/ci/durations.csv (test, seconds, outcome, cpu_s, child_cpu_s; slowest first) beside it, prints the 30
slowest, the total per file, the suite's CPU and the 15 tests that cost the most of it, and names every test not
listed in SLOW below that took over LIMIT_S (120 s): a test that slow is to be made cheaper (one launch per door,
many checks inside it), moved to `make bench`, or named here with its reason.
--costs also writes each file's total seconds, costliest first, to the given table: tests/conftest.py starts the
costliest files first from it (refresh it after a full run when files are added or their cost moves).
It reports and never fails: a wall time is the machine's, not the code's, and a CI verdict resting on it failed a
submission whose every test passed (test_real_data took 224 s on a slower CI machine, 2026-12-04). It exits 0
unless the XML cannot be read.
CPU: tests/conftest.py keeps each test's as two JUnit properties, cpu_s (the pytest process's own) and child_cpu_s
(the processes it started, its fork server's ranks included); a test without them (another XML) reads as blank.
"""
from __future__ import annotations

import csv
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

LIMIT_S = 120.0  # twice the 60 s issue 47 asks for; reported, never a verdict

_RAY = "a local Ray cluster started and torn down, workers killed and restarted (Ray's own start is ~20 s)"
_BENCH = "the smoke run of make bench's parts (or scripts/gpu_check.py), each part once at its smallest"
_SHARED = "a module's shared fixture (one launch, many checks) is timed with its first test"
_RESTART = "a run killed, stopped or restarted and resumed: two or more launches of torchrun"
# file::test (parameters dropped): why it may take over LIMIT_S / 2.6. Shorten it, never lengthen it.
SLOW = {
    "tests/integrations/test_ray.py::test_a_run_resized_through_restarts_keeps_the_global_batch_and_coverage":
        _RAY,
    "tests/integrations/test_ray.py::test_a_killed_worker_restarts_the_group_from_the_checkpoint_by_identity":
        _RAY,
    "tests/integrations/test_ray.py::test_example_covers_every_sample_moves_shares_and_equals_one_process_sgd":
        _RAY,
    "tests/integrations/test_ray.py::test_a_ray_train_epoch_split_by_tokens_equals_one_process_on_the_unpacked_union":
        _RAY,
    "tests/lab/test_bench.py::test_bench_quickest": _BENCH,
    "tests/lab/test_bench.py::test_gpu_check_smoke": _BENCH,
    "tests/lab/test_bench.py::test_bench_outside_quick_rows_teardown_and_figures":
        _BENCH + " (with real CPU quotas and a busy neighbour)",
    "tests/project/test_quickstart.py::test_the_quickstart_runs_as_written":
        "the quickstart page's script and its hetero diff, each under torchrun, as a reader runs them",
    "tests/core/test_memory.py::test_probe_on_cpu_ranks_means_no_limit_and_limits_still_hold":
        "the trainer's probe under torchrun, then runs held to --max-batch",
    "tests/trainer/test_ownership.py::test_grid_timeout_ends_every_process_even_a_stopped_rank":
        "a grid run past its timeout with one rank stopped (SIGSTOP): the timeout itself is the wait",
    "tests/trainer/test_elastic.py::test_step_checkpoint_resumes_mid_epoch_bit_for_bit": _RESTART,
    "tests/trainer/test_elastic.py::test_resume_onto_another_world_size_carries_the_balance": _RESTART,
    "tests/trainer/test_elastic.py::test_losing_a_torchrun_node_mid_epoch_goes_on_with_the_other":
        _RESTART + " (two torchrun nodes)",
    "tests/trainer/test_reliability.py::test_replay_then_resume_reproduces_the_original_bit_for_bit":
        _RESTART,
    "tests/trainer/test_reliability.py::test_killed_worker_fails_fast_and_resume_completes": _RESTART,
    "tests/integrations/test_hf_loss_rule.py::test_one_row_micro_batches_of_one_shape_are_joined_and_told":
        _SHARED + " (90 HF Trainer runs in two ranks)",
    "tests/lab/test_notebooks.py::test_notebook_outputs_have_no_object_reprs":
        _SHARED + " (the notebooks through papermill)",
    "tests/trainer/test_train_e2e.py::test_output_to_a_file_is_one_line_per_epoch": _SHARED + " (e2e runs)",
    "tests/trainer/test_real_data.py::test_edp_and_sync_on_real_cifar10":
        "two 4-epoch trainer runs on 10,000 real CIFAR-10 images, rank 1 twice slower: learning is under test "
        "(top-1 above 0.35 and EDP within 0.05 of Sync on the 10,000 test images)",
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


def _cpu(case: ET.Element) -> tuple[float | None, float | None]:
    """(own, children) CPU seconds from the test's properties; None where not kept."""
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    try:
        return tuple(float(props[k]) if k in props else None for k in ("cpu_s", "child_cpu_s"))
    except ValueError:
        return None, None


def main(xml: str, costs: str | None = None) -> int:
    cases = [(_name(c), float(c.get("time", 0)), _outcome(c), *_cpu(c))
             for c in ET.parse(xml).getroot().iter("testcase")]
    cases.sort(key=lambda c: -c[1])
    out = Path(xml).with_name("durations.csv")
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test", "seconds", "outcome", "cpu_s", "child_cpu_s"])
        w.writerows([(n, f"{t:.2f}", o, *("" if v is None else f"{v:.2f}" for v in cpu)) for n, t, o, *cpu in cases])
    per_file: dict[str, float] = defaultdict(float)
    for n, t, *_ in cases:
        per_file[n.split("::")[0]] += t
    total = sum(per_file.values())
    if costs:
        with Path(costs).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["file", "seconds"])
            w.writerows([(path, f"{t:.1f}") for path, t in sorted(per_file.items(), key=lambda kv: -kv[1])])
    print(f"\nci: {len(cases)} tests, {total:.0f} s in tests ({out})\nthe 30 slowest:")
    for n, t, o, *_ in cases[:30]:
        print(f"  {t:7.1f} s  {n}{'' if o == 'passed' else f'  ({o})'}")
    print("per file (the 15 costliest):")
    for path, t in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {t:7.1f} s  {path}")
    kept = [(n, own, kids) for n, _, _, own, kids in cases if own is not None and kids is not None]
    if kept:
        own, kids = sum(k[1] for k in kept), sum(k[2] for k in kept)
        print(f"CPU: {own + kids:.0f} s, {kids:.0f} s of it in the processes the tests started ({len(kept)} tests); "
              f"the 15 costliest:")
        for n, o, k in sorted(kept, key=lambda c: -(c[1] + c[2]))[:15]:
            print(f"  {o + k:7.1f} s  {n}")
    over = [(n, t) for n, t, *_ in cases if t > LIMIT_S and re.sub(r"\[.*\]$", "", n) not in SLOW]
    for n, t in over:
        print(f"ci: note: {n} took {t:.0f} s, over the {LIMIT_S:.0f} s budget; make it cheaper, or name it in "
              f".ci/durations.py with a reason")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 4) or (len(sys.argv) == 4 and sys.argv[2] != "--costs"):
        sys.exit("usage: python .ci/durations.py JUNIT_XML [--costs TABLE]")
    sys.exit(main(sys.argv[1], sys.argv[3] if len(sys.argv) == 4 else None))
