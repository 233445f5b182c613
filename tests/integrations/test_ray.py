"""hetero.integrations.ray's pure parts, in one process (no Ray cluster): an emulation spec and per-worker settings
follow the workers' identities when Ray renumbers the ranks or the group shrinks; the example's bad settings stop
before Ray starts.

The launches: examples/ray_train.py on a local Ray cluster of 2 CPU workers (Ray Train's TorchTrainer, gloo), worker
1 emulated 3x slower: every sample of each epoch consumed once, the shares moved to the fast worker, every recorded
step equal to one-process SGD on the union of the workers' batches; a worker killed mid-epoch (Ray restarts the group
from the last checkpoint, the estimates come back by identity, no sample lost or doubled); the group resized through
restarts, on one running cluster that each start joins (`ray start --head`, the example's --address); an epoch split
by tokens (tests/scripts/ray_tokens.py). Each test shuts its cluster down (the script does, or `ray start --block`
when signalled) and checks that no Ray process is left. Ray's start-up is slow on 2 busy cores (a minute or more per
cluster): the slow tier, and few tests."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from hetero.integrations import ray as hetero_ray  # its pure parts load without Ray

from helpers import ROOT, clean_env, free_port


def test_the_emulation_follows_the_worker_not_the_rank():
    first = ["h/gpu uuid A", "h/gpu uuid B"]
    assert hetero_ray.for_this_world("1:slowdown=3", first, first) == "1:slowdown=3"
    # Ray put worker B on rank 0 this time: the slowness goes with B
    assert hetero_ray.for_this_world("1:slowdown=3,0:delay=0.1@s5-", first, first[::-1]) == \
        "0:slowdown=3,1:delay=0.1@s5-"
    assert hetero_ray.for_this_world("1:slowdown=3", first, ["h/gpu uuid A"]) == ""  # B is gone
    assert hetero_ray.for_this_world("", first, first) == ""


def test_a_spec_naming_a_worker_the_first_start_lacked_or_a_bad_spec_is_one_line():
    with pytest.raises(ValueError, match="hetero names worker 2, but the first start had 2 worker"):
        hetero_ray.for_this_world("2:slowdown=3", ["a", "b"], ["a", "b"])
    with pytest.raises(ValueError):
        hetero_ray.for_this_world("1:fast=3", ["a", "b"], ["a", "b"])


def test_per_worker_settings_by_identity():
    assert hetero_ray.by_worker({"b": 48}, ["b", "a", "c"], None) == [48, None, None]


@pytest.mark.slow  # the example imports Ray (seconds of imports on a busy machine)
def test_the_example_refuses_a_bad_setting_in_one_line_before_ray_starts():
    pytest.importorskip("ray.train", reason="the [ray] extra is not installed")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_train.py"), "--scheme", "fast"], cwd=ROOT,
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "hetero: error: unknown scheme 'fast' (choose from sync, dp, edp, affine)"]


# the cases that launch processes
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the [ray] extra is not installed")

SAMPLES, B = 1024, 64
STEPS = SAMPLES // B  # per epoch
# worker 1 computes 3x slower and also waits 50 ms a step: the 3x alone on tiny steps left the shares even through
# a whole epoch of a CI run beside Ray's own processes (the significance test rightly saw only noise there, 2026-12-05);
# 50 ms a step stands far above that noise, so the tests that check the shares move rest on no host's speed
SLOW = "1:slowdown=3,1:delay=0.05"


def _env() -> dict[str, str]:
    env = clean_env(threads="1")
    # tests/raystub first: keeps a slow optional import out of Ray's own processes (see its docstring); tests/ last:
    # tests/scripts/ray_tokens.py's workers import tokenlm
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "raystub"), str(ROOT), str(ROOT / "tests")])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"  # a local cluster: no token written to the home folder
    return env


def _is_ray(name: str, argv: list[str]) -> bool:
    """A process of Ray's own: raylet or gcs_server, a worker named ray::..., or Ray's code run as a program (its
    binary or script among the first arguments). Matched on whole arguments, so that a process of another test
    whose code string merely names Ray's folder (a multiprocessing fork server's `-c` with its sys.path, from
    another xdist process) is not counted: that was a failure by chance of schedule (2026-12-06)."""
    head = argv[:4]
    return (name in ("raylet", "gcs_server") or bool(argv) and argv[0].startswith("ray::")
            or any("site-packages/ray/" in a and not a.startswith("-") and " " not in a for a in head))


def _ray_processes(since: float) -> list[str]:
    """Ray's processes started after `since` (raylet, gcs_server, its agents, workers named ray::...)."""
    out = []
    for p in psutil.process_iter(["name", "cmdline", "create_time"]):
        try:
            argv = p.info["cmdline"] or []
            if p.info["create_time"] >= since - 1 and p.status() != psutil.STATUS_ZOMBIE and _is_ray(
                    p.info["name"] or "", argv):
                out.append(f"{p.pid} {' '.join(argv)[:100]}")
        except psutil.Error:
            continue
    return out


def _no_ray_left(since: float, grace_s: float = 60.0) -> None:
    deadline = time.monotonic() + grace_s
    while (left := _ray_processes(since)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"Ray processes left after the run: {left}"


def _start(tmp_path: Path, *args: str, script: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "examples" / "ray_train.py"), "--samples", str(SAMPLES), "--global-batch",
           str(B), "--storage", str(tmp_path / "storage"), "--record", str(tmp_path / "rec"), *args] if script is None \
        else [sys.executable, str(script), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


STARTUP = "The current node timed out during startup"  # ray.init: the raylet gave up on its agent (15 s, hard-coded)


def _run(tmp_path: Path, *args: str, watch=None, timeout: float = 1200, script: Path | None = None) -> str:
    """Run the example to the end (rc 0); `watch(p)` is polled while it runs until it returns True. A cluster that
    did not start (Ray's agent slower than the raylet's 15 s limit on a loaded machine, ray-project/ray#65983) is
    started again, up to 3 times: no training has run then; the attempt's orphaned agents are stopped by pid."""
    for attempt in range(3):
        since = time.time()
        p = _start(tmp_path, *args, script=script)
        deadline = time.monotonic() + timeout
        while watch is not None and p.poll() is None and time.monotonic() < deadline and not watch(p):
            time.sleep(0.02)
        out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if p.returncode != 0 and STARTUP in out and attempt < 2:
            print(f"\nray.init timed out during start-up (attempt {attempt + 1}): starting the cluster again")
            for line in _ray_processes(since):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(int(line.split()[0])).kill()
            continue
        assert p.returncode == 0, f"{(script or 'ray_train.py')} exited {p.returncode}\n{out[-8000:]}"
        return out
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _head():
    """A running Ray cluster of 2 CPUs, as `ray start --head` begins one on a machine (--block: it stops its
    processes when signalled), with its own temporary folder and ports (so no other run on this machine finds or
    collides with it); yields its address. A start that timed out (STARTUP) is tried again, up to 3 times."""
    # its SIGTERM would first drain the node for up to 30 s (Ray's RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, for Serve's
    # proxies), and a node that ran Ray Train keeps it busy that long: 30 s idle per test; <= 0 stops it at once
    head_env = {**_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    for attempt in range(3):
        tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # Ray's socket paths must stay short
        port, client, agent = free_port(), free_port(), free_port()
        log = tmp / "head.log"
        with log.open("w") as out:
            head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}",
                                     "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                                     f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
                                     f"--temp-dir={tmp}", "--block"], cwd=ROOT, env=head_env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while head.poll() is None and "Ray runtime started" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            if head.poll() is None and "Ray runtime started" in log.read_text():
                yield f"127.0.0.1:{port}"
                return
            if STARTUP not in log.read_text() or attempt == 2:
                raise AssertionError(f"ray start did not start a cluster:\n{log.read_text()[-4000:]}")
            print(f"\nray start timed out during start-up (attempt {attempt + 1}): starting it again")
        finally:
            head.terminate()  # --block: its node stops the cluster's processes
            try:
                head.wait(timeout=120)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(head.pid, signal.SIGKILL)
                head.wait()
            shutil.rmtree(tmp, ignore_errors=True)


def _steps(tmp_path: Path, start: int) -> list[dict]:
    rows = []
    for f in sorted(tmp_path.glob(f"rec.start{start}.rank*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def _example(name: str = "ray_train.py"):
    spec = importlib.util.spec_from_file_location(name[:-3] + "_example", ROOT / "examples" / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_ray
def test_the_examples_start_a_cluster_of_their_own_or_join_the_one_named(monkeypatch):
    """Without --address (nor RAY_ADDRESS) an example starts a local cluster of its own even where `ray start` began
    one on the machine, which a plain ray.init(num_cpus=...) would join and then refuse; with it, it joins."""
    calls = []

    def init(**kw):
        calls.append(kw)
        raise RuntimeError("stop here")
    own = {"address": "local", "num_cpus": 2, "include_dashboard": False}
    for mod in (_example(), _example("ray_train_baseline.py")):
        monkeypatch.setattr(mod.ray, "init", init)
        for address in ("", "auto", "10.0.0.5:6379"):
            with pytest.raises(RuntimeError, match="stop here"):
                mod.main(_args(address=address))
    assert calls == [own, {"address": "auto"}, {"address": "10.0.0.5:6379"}] * 2


def _args(**kw):
    """The example's settings as its command line's defaults give them, `kw` changed."""
    import argparse

    return argparse.Namespace(**{**dict(workers=2, min_workers=0, max_failures=0, samples=64, epochs=1, seed=0,
                                        checkpoint_every=0, record_params=0, global_batch=8, scheme="edp",
                                        rebalance_every=0, hetero="", address=""), **kw})


@needs_ray
@pytest.mark.parametrize("kw, line", [
    ({"workers": 0}, "--workers 0 must be at least 1"),
    ({"workers": -1}, "--workers -1 must be at least 1"),
    ({"min_workers": 3}, "--min-workers 3 exceeds --workers 2"),
    ({"max_failures": -2}, "--max-failures -2 must be at least -1"),
    ({"global_batch": 65}, "--global-batch 65 exceeds the 64 --samples"),
    ({"record_params": -1}, "--record-params -1 must be at least 0"),
    ({}, "")])
def test_the_example_names_each_bad_count_in_one_line(kw, line):
    """Each count the example checks before Ray starts, in one process (one of them also through the real command
    line: tests/integrations/test_examples.py); its defaults pass."""
    assert _example().bad_count(_args(**kw)) == line


@pytest.mark.launch
@needs_ray
@pytest.mark.slow
def test_example_covers_every_sample_moves_shares_and_equals_one_process_sgd(tmp_path):
    since = time.time()
    _run(tmp_path, "--workers", "2", "--hetero", SLOW, "--rebalance-every", "5", "--epochs", "3",
         "--record-params", "24")
    _no_ray_left(since)
    ranks = [json.loads((tmp_path / f"rec.rank{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1", "2"):
        seen = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: not every sample exactly once"
    d = ranks[0]["decisions"]
    assert d == ranks[1]["decisions"] and len(d) >= 6  # mid-epoch decisions, the same on both workers
    assert d[-1]["shares"][1] < 0.4, d[-1]           # the slow worker's share well below one half (about 1/4)
    assert all(x["sizes"][0] > x["sizes"][1] for x in d[len(d) // 2:])

    # exactness: the parameters after each of the first 24 steps (sizes equal, then unequal after the first
    # decisions) are those of one process running the same optimizer on the union of the two workers' batches
    ex = _example()
    rows = sorted(_steps(tmp_path, 0), key=lambda r: (r["epoch"], r["step"], r["rank"]))
    by_step: dict[tuple, list[dict]] = {}
    for r in rows:
        by_step.setdefault((r["epoch"], r["step"]), []).append(r)
    ds, model = ex.Synthetic(SAMPLES), ex.make_model(0)
    opt = ex.make_optimizer(model, 0.05)
    worst, unequal = 0.0, 0
    for key in sorted(by_step)[:24]:
        pair = by_step[key]
        assert len(pair) == 2 and all("params" in r for r in pair)
        idx = torch.tensor(pair[0]["idx"] + pair[1]["idx"])
        assert len(idx) == B
        unequal += len(pair[0]["idx"]) != len(pair[1]["idx"])
        F.cross_entropy(model(ds.x[idx]), ds.y[idx]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for got, p in zip(pair[0]["params"], model.parameters()):
            worst = max(worst, (torch.tensor(got) - p.detach().flatten()).abs().max().item())
        assert pair[0]["params"] == pair[1]["params"]  # the replicas stay identical
    assert unequal >= 3, "the exactness check must cover steps with unequal batch sizes"
    assert worst < 1e-5, worst


def _positions(rows: list[dict]) -> set[tuple[int, int]]:
    return {(r["epoch"], r["step"]) for r in rows}


@pytest.mark.launch
@needs_ray
@pytest.mark.slow
def test_a_killed_worker_restarts_the_group_from_the_checkpoint_by_identity(tmp_path):
    """FailureConfig(max_failures=1), an elastic group (1, 2): worker 1's process is killed (SIGKILL) mid-epoch 1.
    Ray restarts the group from the last reported checkpoint (on one machine with 2 workers again: the killed
    worker's CPU is free at once); the slow worker gets less from the first step after the restart, because its
    estimate came back by identity; counting the steps repeated since the checkpoint, every sample of every epoch
    is consumed once."""
    since = time.time()
    # a constant delay per step as well, so that a step lasts long enough for the kill to land mid-epoch
    log, kill_after, killed = tmp_path / "rec.start0.rank1.jsonl", STEPS + 7, []  # epoch 1 step 6: past step 5's

    def kill(p) -> bool:
        rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
        if len(rows) >= kill_after:
            killed.append(time.time())
            psutil.Process(rows[-1]["pid"]).kill()
        return bool(killed)

    out = _run(tmp_path, "--workers", "2", "--min-workers", "1", "--max-failures", "1", "--epochs", "3", "--hetero",
               "0:delay=0.02,1:delay=0.06,1:slowdown=3", "--rebalance-every", "5", "--checkpoint-every", "5",
               watch=kill)
    _no_ray_left(since)
    assert killed, "the run ended before worker 1 reached the step to kill it at"
    killed_at = killed[0]

    before, after = _steps(tmp_path, 0), _steps(tmp_path, 1)
    ranks = [json.loads((tmp_path / f"rec.rank{r}.json").read_text()) for r in range(2)]
    assert [r["restarts"] for r in ranks] == [1, 1]
    e, k = ranks[0]["resumed_at"]
    ran = max(_positions(before))
    assert k % 5 == 0 and (e, k) <= (ran[0], ran[1] + 1) and e == 1, (e, k, ran)
    repeated = sorted(x for x in _positions(before) if x >= (e, k))
    assert min(_positions(after)) == (e, k)  # the restart goes on at the checkpoint: no step skipped
    for epoch in range(3):
        seen = [i for r in before if r["epoch"] == epoch and (r["epoch"], r["step"]) < (e, k) for i in r["idx"]]
        seen += [i for r in after if r["epoch"] == epoch for i in r["idx"]]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: a sample lost or doubled"
    # the slow worker, by identity, wherever Ray put it this time
    slow = next(r["worker"] for r in before if r["rank"] == 1)
    first = [r for r in after if (r["epoch"], r["step"]) == (e, k)]
    mine = next(r for r in first if r["worker"] == slow)
    assert sum(mine["sizes"]) == B and mine["sizes"][mine["rank"]] < B // 2, mine["sizes"]
    resumed_s = min(r["t"] for r in after) - killed_at
    print(f"\nkill at epoch {ran[0]} step {ran[1]}, resumed at epoch {e} step {k} ({len(repeated)} steps run again); "
          f"{resumed_s:.1f} s from the kill to the first new step; sizes there {mine['sizes']} (slow worker on "
          f"rank {mine['rank']})")
    assert {len(r["sizes"]) for r in after} == {2}  # on one machine Ray restarts the (1, 2) group at 2 workers
    # why, in Ray's own words: the controller's lines on the group it starts (the killed worker's CPU is free again)
    print("\n".join(sorted({ln.split("[0m")[-1].strip() for ln in out.splitlines() if "worker group of size" in ln})))


@pytest.mark.launch
@needs_ray
@pytest.mark.slow
def test_a_run_resized_through_restarts_keeps_the_global_batch_and_coverage(tmp_path):
    """One run (one storage and name) started three times on one running cluster (the example's --address): 2
    workers for epoch 0, 1 worker for epoch 1, 2 again for epoch 2. Ray Train v2 resumes each from the run's latest
    checkpoint (the restart count says 2 at the end); the global batch and the coverage of every epoch stay those of
    the run. The cluster stopped, no Ray process is left."""
    since = time.time()
    common = ["--hetero", SLOW, "--rebalance-every", "5", "--checkpoint-every", "5"]
    with _head() as address:  # the three starts join one running cluster, as on a real one (--address)
        for workers, epochs in (("2", "1"), ("1", "2"), ("2", "3")):
            _run(tmp_path, "--workers", workers, "--epochs", epochs, "--address", address, *common)
    _no_ray_left(since)
    for start, (epoch, world) in enumerate(((0, 2), (1, 1), (2, 2))):
        rows = _steps(tmp_path, start)
        assert {r["epoch"] for r in rows} == {epoch} and {len(r["sizes"]) for r in rows} == {world}
        assert all(sum(r["sizes"]) == B for r in rows)  # the same global batch on 2, 1 and 2 workers
        assert sorted(i for r in rows for i in r["idx"]) == list(range(SAMPLES)), f"epoch {epoch}"
    # the fast worker (local rank 0) had the larger share at the end of epoch 0 (2 workers) and again by the end of
    # epoch 2: the returning worker starts neutral, so the group of 2 starts at an equal split and moves again
    end0 = max(_steps(tmp_path, 0), key=lambda r: r["step"])["sizes"]
    rows2 = sorted(_steps(tmp_path, 2), key=lambda r: r["step"])
    assert end0[0] > end0[1] and rows2[0]["sizes"] == [B // 2, B // 2] and rows2[-1]["sizes"][0] > rows2[-1][
        "sizes"][1], (end0, rows2[0]["sizes"], rows2[-1]["sizes"])
    assert [json.loads((tmp_path / f"rec.rank{r}.json").read_text())["restarts"] for r in range(2)] == [2, 2]


@pytest.mark.launch
@needs_ray
@pytest.mark.slow
def test_a_ray_train_epoch_split_by_tokens_equals_one_process_on_the_unpacked_union(tmp_path):
    """tests/scripts/ray_tokens.py (issue 49): two Ray Train workers split each step's documents by their tokens'
    fitted cost, padded and packed, with a token-mean loss; every step's rows are its window, every document of the
    epoch is seen once, and the parameters after each step equal one process on the unpacked union; under a token
    budget (packed, a sample-mean loss) the steps are the permutation's runs of varying counts. The padded and packed
    epochs replayed from their decisions (through JSON) give each step the run's rows on both workers and end with
    the run's parameters, deciding nothing; the record with the workers' costs swapped gives other rows."""
    import numpy as np

    from hetero.core.sampler import EpochPlan

    import tokenlm

    since = time.time()
    _run(tmp_path, str(tmp_path), script=ROOT / "tests" / "scripts" / "ray_tokens.py")
    _no_ray_left(since)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    n, b = 72, 24
    perm = EpochPlan(n, b, 0, 0).perm.tolist()
    _, tokens, labels = tokenlm.corpus(n)
    for collator in ("padded", "packed", "budget"):
        counts = [len(r0) + len(r1) for r0, r1 in zip(ranks[0][collator]["rows"], ranks[1][collator]["rows"])]
        ends = np.cumsum([0, *counts]) if collator == "budget" else np.arange(0, n + 1, b)
        assert collator != "budget" or (len(counts) == 3 and len(set(counts)) > 1), counts
        steps = []
        for s, (r0, r1) in enumerate(zip(ranks[0][collator]["rows"], ranks[1][collator]["rows"])):
            assert sorted(r0 + r1) == sorted(perm[ends[s]:ends[s + 1]]) and r0 and r1, f"{collator}: step {s}"
            steps.append(sorted(r0 + r1))
        assert sorted(i for s in steps for i in s) == list(range(n))
        want = tokenlm.reference(steps, tokens, labels, "samples" if collator == "budget" else "tokens", 0.5)
        for r in ranks:
            assert len(r[collator]["params"]) == 3
            assert max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
                       for g, w in zip(r[collator]["params"], want)) < 1e-9
    for collator in ("padded", "packed"):  # bal.replay of the run: its rows and parameters, no decision made
        for r in ranks:
            run, replay = r[collator], r[f"replay-{collator}"]
            assert len(run["decisions"]) >= 2
            assert replay["rows"] == run["rows"] and replay["params"] == run["params"] and replay["decisions"] == []
        assert any(r[f"swapped-{collator}"]["rows"] != r[collator]["rows"] for r in ranks)  # the costs swapped
