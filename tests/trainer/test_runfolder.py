"""Issue 36 (Reliability IV), the run folder's side, through the real command line: an edited or damaged checkpoint
is one line and changes no file (a SHA-256 digest, and a step checkpoint's position checked against the epoch);
a checkpoint of the previous format loads with a warning; a torchrun run id reused with other settings is refused
by name; nothing but a regular file is opened at any run file, fresh or resumed, before any process group; and a
resume without a checkpoint is refused on every rank."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from hetero.trainer.checkpoint import digest, sealed
from hetero.trainer.runfolder import FILES

from helpers import ROOT, _env, assert_one_line, check, free_port, torchrun_cmd

BOUND_S = 150  # no case may take longer (a FIFO opened would block for ever)
STEPS = 8  # 1024 samples // 128
RUN = ["--model", "tiny", "--data", "synthetic", "--subset", "1024", "--test-subset", "256", "--global-batch", "128",
       "--threads", "1"]


def _cli(args: list[str], env_extra: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**_env(), "WORLD_SIZE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "hetero.trainer", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=BOUND_S)


def _hetero_lines(p: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.startswith("hetero:")]


def _one_line(p: subprocess.CompletedProcess, text: str) -> None:
    lines = _hetero_lines(p)
    assert p.returncode != 0 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("hetero: error: ") and text in lines[0], lines[0]
    if "ChildFailedError" not in p.stderr:  # torchrun's own report is a traceback; the workers print none
        assert "Traceback" not in p.stderr, p.stderr[-3000:]


def _files(run: Path) -> dict[str, str]:
    """Every file in the folder (the lock included) by its bytes' digest: what must not change."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def step_run(tmp_path_factory) -> Path:
    """A one-process run killed after a step checkpoint (--checkpoint-every 3) inside epoch 1 of 2."""
    run = tmp_path_factory.mktemp("step") / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hetero.trainer", *RUN, "--epochs", "2", "--checkpoint-every", "3",
                             "--hetero", "0:delay=0.4", "--run-dir", str(run)], cwd=ROOT,
                            env={**_env(), "WORLD_SIZE": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            try:
                s = json.loads((run / "summary.json").read_text())
                if s["epochs_completed"] == 0 and s["checkpoint_step"] >= 3:
                    break
            except (OSError, ValueError, KeyError):
                pass
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        else:
            raise AssertionError("no step checkpoint in epoch 1")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _raw(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)


# -- item 4: an edited or damaged checkpoint ---------------------------------------------------------------------
def test_a_step_moved_by_one_fails_the_digest_and_changes_nothing(step_run, tmp_path):
    run = _copy(step_run, tmp_path)
    state = _raw(run)
    state["balance"]["step"] += 1  # 3 -> 4: one step's samples would never be trained
    torch.save(state, run / "checkpoint.pt")
    before = _files(run)
    _one_line(_cli(["--resume", str(run)]), "fails its integrity check")
    assert _files(run) == before


def _where(path: Path, place: str) -> int:
    """An offset in the checkpoint's zip: the middle of the file, inside the largest tensor's bytes, the local
    header of the middle entry (its name and padding, which the content never shows), the central directory."""
    size = path.stat().st_size
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        big = max(infos, key=lambda i: i.file_size)
        if place == "mid":
            return size // 2
        if place == "tensor":
            return big.header_offset + 30 + len(big.filename) + 200
        if place == "header":
            return infos[len(infos) // 2].header_offset + 30
        return z.start_dir + 10 if hasattr(z, "start_dir") else size - 200


@pytest.mark.parametrize("place", ["mid", "tensor", "header", "directory"])
def test_64_bytes_overwritten_are_one_line_and_change_nothing(place, step_run, tmp_path):
    run = _copy(step_run, tmp_path)
    data = bytearray((run / "checkpoint.pt").read_bytes())
    mid = _where(run / "checkpoint.pt", place)
    data[mid:mid + 64] = bytes(range(64))
    (run / "checkpoint.pt").write_bytes(bytes(data))
    before = _files(run)
    _one_line(_cli(["--resume", str(run)]), "cannot resume")
    assert _files(run) == before


def _resealed(edit):
    def apply(state):
        del state["sha256"]
        edit(state)
        return sealed(state)  # a deliberate edit that recomputes the digest: the position checks must hold
    return apply


def _step(value):
    def edit(state):  # the one position: the Balance's (the trainer's partial record holds none)
        state["balance"]["step"] = value(state["balance"]["step"]) if callable(value) else value
    return edit


POSITIONS = [
    ("moved by one", _step(lambda k: k + 1), "does not record steps"),
    ("the epoch's length", _step(STEPS), f"an epoch of this run has {STEPS} steps"),
    ("past it", _step(STEPS + 5), f"step 1..{STEPS - 1}"),
    ("1e9", _step(10**9), "step 1000000000"),
    ("zero", _step(0), "step 0"),
    ("balance elsewhere", lambda s: s["balance"].update(epoch=s["balance"]["epoch"] + 1), "its balance state is at"),
]


@pytest.mark.parametrize("name,edit,text", POSITIONS, ids=[p[0] for p in POSITIONS])
def test_a_resealed_position_outside_the_epoch_is_one_line_at_check(name, edit, text, step_run, tmp_path,
                                                                    monkeypatch, capsys):
    run = _copy(step_run, tmp_path)
    torch.save(_resealed(edit)(_raw(run)), run / "checkpoint.pt")
    before = _files(run)
    assert_one_line(*check(["--resume", str(run)], monkeypatch, capsys), text)
    assert _files(run) == before


@pytest.mark.slow  # a two-rank torchrun launch
def test_a_position_past_the_epoch_stops_before_the_process_group_on_two_ranks(step_run, tmp_path):
    run = _copy(step_run, tmp_path)
    torch.save(_resealed(_step(10**9))(_raw(run)), run / "checkpoint.pt")
    p = subprocess.run(torchrun_cmd(2, ["--resume", str(run)]), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=BOUND_S)
    _one_line(p, "its step checkpoint is at epoch 1 step 1000000000")
    assert "Connection closed" not in p.stderr and "rank 1: error" not in p.stderr


def _format_2(state: dict) -> dict:
    """A step checkpoint as format 2 wrote it: sealed, with the trainer's own position beside the Balance's (the epochs
    completed, and the partial epoch's epoch, step and identities)."""
    s = {k: v for k, v in state.items() if k not in ("sha256", "format")}
    b = s["balance"]
    s["epoch"] = b["epoch"] - 1
    s["partial"] = {**s["partial"], "epoch": b["epoch"], "step": b["step"], "identities": b["identities"]}
    body = {**s, "format": 2}
    return {**body, "sha256": digest(body)}


def _format_1(state: dict) -> dict:
    """The checkpoint as the first trainer wrote it: no digest, the Balance's state spread at the top level."""
    s = {k: v for k, v in _format_2(state).items() if k not in ("sha256", "format", "balance")}
    b = state["balance"]
    return {**s, "balancer": b["balancer"], "global_step": b["global_step"], "identities": b["identities"]}


def test_a_previous_format_checkpoint_passes_check_with_one_warning(step_run, tmp_path, monkeypatch, capsys):
    run = _copy(step_run, tmp_path)
    torch.save(_format_1(_raw(run)), run / "checkpoint.pt")
    rc, err = check(["--resume", str(run)], monkeypatch, capsys)
    assert rc == 0 and len(err) == 1 and err[0].startswith("hetero: warning: ") and "no integrity digest" in err[0]


@pytest.mark.slow  # a resumed run to its end
def test_a_previous_format_checkpoint_resumes_with_a_warning(step_run, tmp_path):
    run = _copy(step_run, tmp_path)
    step = _raw(run)["balance"]["step"]
    torch.save(_format_1(_raw(run)), run / "checkpoint.pt")
    p = _cli(["--resume", str(run)])
    assert p.returncode == 0, p.stderr[-3000:]
    warn = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: warning:")]
    assert len(warn) == 1 and "older hetero (no integrity digest)" in warn[0], p.stderr
    assert f"at step {step} of epoch 1" in p.stdout
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert "sha256" in _raw(run) and "balance" in _raw(run)  # saved again in the current format


def test_a_checkpoint_keeps_one_position_the_balances(step_run):
    """Issue 46: the trainer keeps no epoch or step of its own beside the Balance's state: its step checkpoint's
    record holds what the Balance does not (totals, segments, RNG states, buffers, time), the position is the
    Balance's (here 3 steps of epoch 1 of 8)."""
    state = _raw(step_run)
    assert state["format"] == 3 and "epoch" not in state
    assert sorted(state["partial"]) == ["buffers", "loader", "segments", "totals", "train_s"]
    b = state["balance"]
    assert (b["epoch"], b["step"], b["steps_per_epoch"]) == (1, 3, STEPS)


def test_a_format_2_step_checkpoint_passes_check_without_a_warning(step_run, tmp_path, monkeypatch, capsys):
    run = _copy(step_run, tmp_path)
    torch.save(_format_2(_raw(run)), run / "checkpoint.pt")
    assert check(["--resume", str(run)], monkeypatch, capsys) == (0, [])


def test_a_format_2_checkpoint_whose_two_positions_disagree_is_one_line(step_run, tmp_path, monkeypatch, capsys):
    run = _copy(step_run, tmp_path)
    state = _format_2(_raw(run))
    del state["sha256"]
    state["partial"]["step"] += 1  # the trainer's copy says 4, the Balance's 3: which one ran is not guessed
    torch.save({**state, "sha256": digest(state)}, run / "checkpoint.pt")
    assert_one_line(*check(["--resume", str(run)], monkeypatch, capsys),
                    "its balance state is at epoch 1 step 3, the checkpoint at epoch 1 step 4")


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory) -> Path:
    """A one-process run of one complete epoch: its checkpoint is at the epoch's end."""
    run = tmp_path_factory.mktemp("epoch") / "run"
    p = _cli([*RUN, "--epochs", "1", "--run-dir", str(run)])
    assert p.returncode == 0, p.stderr[-3000:]
    return run


def _resumed_to_2_epochs(run: Path) -> subprocess.CompletedProcess:
    p = _cli(["--resume", str(run), "--epochs", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming after epoch 1" in p.stdout and "at step" not in p.stdout, p.stdout
    steps = [ln.split(",")[:3] for ln in (run / "steps.csv").read_text().splitlines()[1:]]
    assert sorted(int(s) for e, s, _ in steps if e == "2") == list(range(STEPS))  # epoch 2, every step once
    assert sorted(int(s) for e, s, _ in steps if e == "1") == list(range(STEPS))  # epoch 1 kept, not run again
    assert json.loads((run / "summary.json").read_text())["epochs_completed"] == 2
    return p


@pytest.mark.slow  # a run resumed for one epoch
def test_an_epoch_end_checkpoint_resumes_into_the_next_epoch_with_every_step(epoch_run, tmp_path):
    run = _copy(epoch_run, tmp_path)
    b = _raw(run)["balance"]
    assert (b["epoch"], b["step"]) == (1, STEPS)  # a complete epoch: step = steps_per_epoch
    _resumed_to_2_epochs(run)


@pytest.mark.slow  # a run resumed for one epoch
def test_a_format_2_epoch_end_checkpoint_of_a_version_2_balance_state_resumes_into_the_next_epoch(epoch_run,
                                                                                                    tmp_path):
    run = _copy(epoch_run, tmp_path)
    s = {k: v for k, v in _raw(run).items() if k not in ("sha256", "format")}
    s = {**s, "epoch": 1, "balance": {**s["balance"], "version": 2, "step": 0}, "format": 2}  # 2: an end is step 0
    torch.save({**s, "sha256": digest(s)}, run / "checkpoint.pt")
    p = _resumed_to_2_epochs(run)
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith("hetero:")], p.stderr
    assert _raw(run)["format"] == 3  # saved again in the current format


def test_a_current_layout_without_its_digest_is_refused(step_run, tmp_path, monkeypatch, capsys):
    run = _copy(step_run, tmp_path)
    state = _raw(run)
    del state["sha256"]
    torch.save(state, run / "checkpoint.pt")
    assert_one_line(*check(["--resume", str(run)], monkeypatch, capsys), "has no integrity digest")


# -- item 5: a torchrun run id that names an existing folder -----------------------------------------------------
def _torchrun_with_id(run_id: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}", f"--log-dir={os.devnull}",
           "-m", "hetero.trainer", *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=BOUND_S)


@pytest.mark.slow  # three torchrun launches, about 40 s
def test_a_reused_run_id_with_other_settings_is_refused_by_name_and_the_same_settings_resume(tmp_path):
    base = [*RUN, "--lr", "0.1"]
    first = _torchrun_with_id("job36", [*base, "--epochs", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()  # the default folder, named after the run id
    config = (run / "config.json").read_text()
    p = _torchrun_with_id("job36", [*RUN, "--lr", "0.5", "--epochs", "2"], tmp_path)
    _one_line(p, "with another --lr (recorded 0.1)")
    assert "run id 'job36'" in _hetero_lines(p)[0]
    assert (run / "config.json").read_text() == config
    again = _torchrun_with_id("job36", [*base, "--epochs", "2"], tmp_path)
    assert again.returncode == 0 and "resuming after epoch 1" in again.stdout, again.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["epochs_completed"] == 2


# -- item 6: nothing but a regular file is opened in a run folder ------------------------------------------------
def _plant(path: Path, kind: str, victim: Path) -> socket.socket | None:
    path.unlink(missing_ok=True)
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "symbolic link":
        path.symlink_to(victim)
    else:
        s, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        os.chdir(path.parent)  # a socket's path is limited to ~108 bytes: bound by its name
        try:
            s.bind(path.name)
        finally:
            os.chdir(cwd)
        return s
    return None


KINDS = ("FIFO", "socket", "folder", "symbolic link")


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_run_file_that_is_not_a_regular_file_is_refused_by_name(kind, resume, step_run, tmp_path,
                                                                      monkeypatch, capsys):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    for name in FILES:
        run = _copy(step_run, tmp_path / name) if resume else tmp_path / name / "run"
        run.mkdir(parents=True, exist_ok=True)
        sock = _plant(run / name, kind, victim)
        try:
            args = ["--resume", str(run)] if resume else [*RUN, "--run-dir", str(run)]
            rc, err = check(args, monkeypatch, capsys)
        finally:
            if sock is not None:
                sock.close()
        assert_one_line(rc, err, f"its {name} is a {kind}")
        assert victim.read_text() == "keep"


@pytest.mark.slow  # a two-rank torchrun launch
def test_a_fifo_at_a_table_of_a_fresh_run_stops_two_ranks_before_the_group(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "steps.csv")
    p = subprocess.run(torchrun_cmd(2, [*RUN, "--epochs", "1", "--run-dir", str(run)]), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=BOUND_S)
    _one_line(p, "its steps.csv is a FIFO, not a regular file")
    assert sorted(q.name for q in run.iterdir()) == ["steps.csv"]


def test_a_fifo_at_membership_on_resume_is_refused_without_hanging(step_run, tmp_path):
    run = _copy(step_run, tmp_path)
    (run / "membership.csv").unlink()
    os.mkfifo(run / "membership.csv")
    before = _files(run)
    _one_line(_cli(["--resume", str(run)]), "its membership.csv is a FIFO")
    assert _files(run) == before


# -- item 7: a resume without a checkpoint -----------------------------------------------------------------------
def test_a_resume_without_a_checkpoint_is_refused_on_every_rank(step_run, tmp_path):
    run = _copy(step_run, tmp_path)
    (run / "checkpoint.pt").unlink()
    # rank 1 as its node's speaker (local rank 0), as on a second node: it refused nothing before (rank 0 did)
    p = _cli(["--resume", str(run), "--check"], {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0",
                                                 "LOCAL_WORLD_SIZE": "1"})
    _one_line(p, f"cannot resume: {run} holds no checkpoint (checkpoint.pt)")
