"""Issue 23 (Reliability III), the trainer's and the lab's side: the data set is what is on disk, writers never
follow a link they did not create, every bad input is one line (exit 2) before any process group, a full disk
says so, and nothing hangs. Each case goes through the command line (`--check`, make, the grid check) or the
public API, as a user would meet it; a case that could hang runs in a subprocess with a timeout."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
import torch

import hetero.trainer.runfolder as runfolder
from hetero.core import safeio
from hetero.lab import analysis
from hetero.lab import grid as hg
from hetero.trainer import run as train
from hetero.trainer.checkpoint import sealed
from hetero.trainer.data import load_data

from helpers import MARKER, ROOT, SMALL, _env, assert_one_line, check, image_folder, launch_pids, run_make, torchrun_cmd

LONG = "a" * 300  # one name past NAME_MAX
VICTIM = "the victim's own content\n"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))


def _one_line(p: subprocess.CompletedProcess, text: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("hetero: error: ") and text in lines[0], lines[0]


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text(VICTIM)
    return v


# -- 1. the data set is what is on disk -------------------------------------------------------------------------
IMAGES = ["--model", "tiny", "--data", "imagefolder", "--global-batch", "2", "--threads", "1"]


@pytest.mark.parametrize("target", [".", "..", "../../train"])
def test_a_folder_link_in_an_image_folder_is_refused_by_name(target, tmp_path, monkeypatch, capsys):
    root = image_folder(tmp_path / "images")
    (root / "train" / "cat" / "loop").symlink_to(target)
    rc, err = check([*IMAGES, "--data-dir", str(root)], monkeypatch, capsys)
    assert_one_line(rc, err, f"{root}/train/cat/loop is a symbolic link to a folder")


def test_a_class_folder_link_is_refused_and_file_links_are_followed(tmp_path, monkeypatch, capsys):
    root = image_folder(tmp_path / "images")
    (root / "train" / "cat" / "3.jpg").symlink_to(root / "train" / "cat" / "0.jpg")  # a file link cannot loop
    assert len(load_data("imagefolder", str(root)).train_y) == 7
    (root / "train" / "bird").symlink_to(root / "train" / "dog")
    rc, err = check([*IMAGES, "--data-dir", str(root)], monkeypatch, capsys)
    assert_one_line(rc, err, "class folder bird is a symbolic link to a folder")


def test_the_cache_follows_added_and_replaced_images(tmp_path):
    from PIL import Image

    root = image_folder(tmp_path / "images")
    first = load_data("imagefolder", str(root))
    assert len(first.train_y) == 6
    for i in (3, 4):  # two more cats
        Image.fromarray(np.full((32, 32, 3), 7 * i, np.uint8)).save(root / "train" / "cat" / f"{i}.png")
    second = load_data("imagefolder", str(root))
    assert len(second.train_y) == 8 and int((second.train_y == 0).sum()) == 5
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(root / "train" / "dog" / "0.jpg", quality=100)
    third = load_data("imagefolder", str(root))
    assert not torch.equal(third.train_x, second.train_x) and abs(int(third.train_x[5].float().mean()) - 200) < 3


def test_a_cache_that_does_not_match_its_manifest_is_rebuilt(tmp_path):
    root = image_folder(tmp_path / "images")
    good = load_data("imagefolder", str(root))
    (cache,) = (tmp_path / "cache").glob("imagefolder-*.pt")
    torch.save({"train_x": torch.zeros(6, 3, 8, 8, dtype=torch.uint8), "train_y": torch.full((6,), 99),
                "test_x": torch.zeros(6, 3, 8, 8, dtype=torch.uint8), "test_y": torch.full((6,), 99)}, cache)
    again = load_data("imagefolder", str(root))
    assert torch.equal(again.train_x, good.train_x) and torch.equal(again.train_y, good.train_y)
    assert tuple(torch.load(cache, weights_only=True)["train_x"].shape) == (6, 3, 32, 32)  # rebuilt in place


# -- 2. writers never follow a link they did not create ---------------------------------------------------------
def test_a_link_at_the_lock_or_config_is_refused_and_the_target_untouched(tmp_path, monkeypatch, capsys):
    victim = _victim(tmp_path)
    for name in (".lock", "config.json"):
        run = tmp_path / f"run-{name}"
        run.mkdir()
        (run / name).symlink_to(victim)
        rc, err = check([*SMALL, "--run-dir", str(run)], monkeypatch, capsys)
        assert rc == 2 and len(err) == 1, err
        assert victim.read_text() == VICTIM


def test_links_planted_at_every_run_file_leave_their_targets_untouched(tmp_path, monkeypatch, capsys):
    """A link at any file the trainer writes (replaced or appended) is refused by name before the run (issue 36:
    the trainer never makes links in a run folder), and its target stays untouched."""
    victim = _victim(tmp_path)
    for name in ("summary.json", "checkpoint.pt", "epochs.csv", "membership.csv"):
        run = tmp_path / f"run-{name}"
        run.mkdir()
        (run / name).symlink_to(victim)
        assert_one_line(*check([*SMALL, "--epochs", "1", "--run-dir", str(run)], monkeypatch, capsys,
                               check_only=False), f"its {name} is a symbolic link")
        assert victim.read_text() == VICTIM and (run / name).is_symlink()


def test_a_run_dir_that_is_a_link_to_a_folder_is_fine(tmp_path, monkeypatch, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert check([*SMALL, "--run-dir", str(tmp_path / "link" / "run")], monkeypatch, capsys)[0] == 0


def test_safe_writes_replace_a_planted_link(tmp_path):
    victim = _victim(tmp_path)
    for name, write in (("out", lambda p: safeio.write_text(p, "new")),
                        ("summary.csv", lambda p: analysis.save_table(pd.DataFrame({"a": [1]}), p)),
                        ("checkpoint.pt",
                         lambda p: runfolder.RunFolder(p.parent).save_checkpoint({"x": torch.ones(2)}))):
        target = tmp_path / name
        target.symlink_to(victim)
        write(target)
        assert victim.read_text() == VICTIM and not target.is_symlink()
    with pytest.raises(runfolder.DiskError, match="is a symbolic link"):
        (tmp_path / "steps.csv").symlink_to(victim)
        runfolder.RunFolder(tmp_path).append("steps", [{"a": 1}])
    assert victim.read_text() == VICTIM


def test_links_in_the_cache_are_never_written_through(tmp_path, monkeypatch, capsys):
    victim = _victim(tmp_path)
    root = image_folder(tmp_path / "images")
    load_data("imagefolder", str(root))
    (cache,) = (tmp_path / "cache").glob("imagefolder-*.pt")
    cache.unlink()
    cache.symlink_to(victim)  # not a cache: decoded again, and the link replaced
    load_data("imagefolder", str(root))
    assert victim.read_text() == VICTIM and not cache.is_symlink()
    lock = tmp_path / "cache" / ".hetero.lock"
    lock.unlink()
    lock.symlink_to(victim)
    rc, err = check([*IMAGES, "--data-dir", str(root)], monkeypatch, capsys)
    assert_one_line(rc, err, "is a symbolic link")
    assert victim.read_text() == VICTIM


def _grid_check(*args: str, capsys=None) -> subprocess.CompletedProcess:
    """`python -m hetero.lab.grid --check ARGS`: its main() in this process (importing papermill takes seconds)."""
    rc = hg.main(["--check", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


GRID = ["-p", "model", "tiny", "-p", "data", "synthetic", "-p", "subset", "512", "-p", "global_batch", "128",
        "-p", "nproc", "1", "-p", "device", "cpu", "-p", "threads", "1"]


@pytest.mark.parametrize("name", ["..", ".", "a/b"])
def test_grid_names_are_plain_names(name, tmp_path, capsys):
    _one_line(_grid_check(*GRID, "-p", "grid", name, "-p", "runs_root", str(tmp_path), capsys=capsys),
              "must be a plain folder name")


@pytest.mark.parametrize("name", ["grid.json", "grid.ipynb", "grid.csv"])
def test_a_link_in_the_grid_folder_is_refused(name, tmp_path, capsys):
    victim = _victim(tmp_path)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / name).symlink_to(victim)
    _one_line(_grid_check(*GRID, "-p", "grid", "g", "-p", "runs_root", str(tmp_path), capsys=capsys),
              f"g/{name} is a symbolic link")
    assert victim.read_text() == VICTIM


def test_a_link_in_the_report_folder_is_refused(tmp_path, capsys):
    victim = _victim(tmp_path)
    run = tmp_path / "g" / "r"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.html").symlink_to(victim)
    rc = analysis.main(["--check", str(tmp_path / "g"), str(tmp_path / "out")])
    _one_line(subprocess.CompletedProcess([], rc, "", capsys.readouterr().err), "report.html is a symbolic link")


# -- 3. everything checkable is checked before the process group ------------------------------------------------
HUGE = "9" * 400
BEFORE_GROUP = [
    (["--epochs", HUGE], "epochs must be a whole number of at most 2**63-1 (got a 400-digit number)"),
    (["--eval-batch", HUGE], "eval_batch must be a whole number of at most 2**63-1"),
    (["--threads", "²"], "--threads '²': expected whole numbers"),
    (["--max-batch", HUGE], "--max-batch '9999999999"),
    (["--affinity", "0-99999999"], "core numbers go up to 65535"),
    (["--hetero", "0:delay=1e300"], "'1e300' is too large"),
    (["--hetero", "0:exp=1e300"], "'1e300' is too large"),
    (["--hetero", "0:slowdown=1e300"], "'1e300' is too large"),
    (["--hetero", "0:gamma=1e200/1e200"], "'1e200' is too large"),
    (["--hetero", f"0:delay=0.1@cycle={HUGE}/1"], "cycle period 99999999999999999999... is too large"),
    (["--hetero", "0:delay=400"], "rank 0 is delayed 400 s per step, not below --timeout-s 300"),
    (["--timeout-s", "0.001"], "--timeout-s must be at least 5 s"),
    (["--run-dir", LONG], "--run-dir 'aaaa"),
    (["--resume", LONG], "--resume 'aaaa"),
    (["--replay", LONG], "--replay 'aaaa"),
    (["--data-dir", LONG], "--data-dir 'aaaa"),
]


@pytest.mark.parametrize("args,text", BEFORE_GROUP, ids=[f"{a[0]} {a[1][:20]}" for a, _ in BEFORE_GROUP])
def test_bad_values_are_one_line_before_the_group(args, text, monkeypatch, capsys):
    assert_one_line(*check([*SMALL, *args], monkeypatch, capsys), text)


def test_launch_numbers_are_checked_before_anything_indexes_by_them(monkeypatch, capsys):
    """make experiment NNODES=2 NODE_RANK=5 runs --check with these (RANK = NODE_RANK * NPROC)."""
    for k, v in {"WORLD_SIZE": "4", "RANK": "10", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    rc = train.main(["--check", *SMALL])
    assert_one_line(rc, capsys.readouterr().err.splitlines(), "NODE_RANK must be below NNODES")
    monkeypatch.setenv("RDZV_ENDPOINT", "x;y")
    assert_one_line(*check(SMALL, monkeypatch, capsys), "RDZV_ENDPOINT 'x;y' is not HOST:PORT")
    monkeypatch.setenv("RDZV_ENDPOINT", "node-1.example:29500")
    assert check(SMALL, monkeypatch, capsys) == (0, [])


def test_a_grid_run_name_too_long_is_one_line(tmp_path, capsys):
    p = _grid_check(*GRID, "-p", "grid", "g", "-p", "runs_root", str(tmp_path), "-y",
                    "hetero: " + json.dumps(",".join(["0:delay=0.001"] * 30)), capsys=capsys)
    _one_line(p, "its run folder has a name longer than the system allows")


# -- 4. grids and reports ---------------------------------------------------------------------------------------
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "model: *i\n"
GRID_FILES = [
    ("not utf-8", b"model: tiny\nscheme: \xff\xfe\n", "not UTF-8 text (byte 0xff"),
    ("runs_root 5", b"runs_root: 5\n", "runs_root must be a folder path (got 5)"),
    ("alias bomb", BOMB.encode(), "its aliases expand past 100000 values"),
    ("duplicate keys", b"model: tiny\nepochs: 2\nepochs: 3\n", "duplicate key 'epochs'"),
    ("empty axis", b"model: []\n", "parameter 'model' is an empty list"),
]


@pytest.mark.parametrize("name,text,message", GRID_FILES, ids=[g[0] for g in GRID_FILES])
def test_bad_grid_files_are_one_short_line(name, text, message, tmp_path, capsys):
    (tmp_path / "p.yaml").write_bytes(text)
    t0 = time.monotonic()
    given = ["-f", str(tmp_path / "p.yaml")] + ([] if name == "runs_root 5" else ["-p", "runs_root", str(tmp_path)])
    p = _grid_check(*GRID[3:], *given, "-p", "grid", "g", capsys=capsys)
    _one_line(p, message)
    assert len(p.stderr) < 1000 and time.monotonic() - t0 < 60


# -- 6. a full disk says so, and the summary never claims more than the checkpoint ------------------------------
def test_disk_full_inside_torch_save_says_disk_full(tmp_path, monkeypatch, capsys):
    """The file's write raises ENOSPC during a real torch.save, which wraps it as `unexpected pos`."""
    run, writes = tmp_path / "run", []

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            writes.append(len(data))
            if len(writes) > 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    real_save = torch.save
    saves = []

    def save(obj, fh):  # the second checkpoint's file runs out of room half-way
        saves.append(1)
        return real_save(obj, Full(fh) if len(saves) == 2 else fh)
    monkeypatch.setattr(runfolder.torch, "save", save)
    term = signal.getsignal(signal.SIGTERM)
    try:
        rc, err = check([*SMALL, "--epochs", "3", "--run-dir", str(run)], monkeypatch, capsys, check_only=False)
    finally:
        signal.signal(signal.SIGTERM, term)
    assert rc == 1 and "disk full writing" in err[-1] and "unexpected pos" not in err[-1], err
    summary = json.loads((run / "summary.json").read_text())
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    b = state["balance"]  # the one position, the Balance's: epoch 1 complete
    assert (b["epoch"], b["step"]) == (1, b["steps_per_epoch"])
    assert summary["epochs_completed"] == 1 and "disk full" in summary["error"]


# -- 7. no hangs -------------------------------------------------------------------------------------------------
def test_a_grid_folder_with_an_unreadable_config_is_one_line(tmp_path, capsys):
    run = tmp_path / "g" / "tiny-edp-none-s0"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{not json")
    _one_line(_grid_check(*GRID, "-p", "grid", "g", "-p", "runs_root", str(tmp_path), capsys=capsys),
              "holds an unreadable config.json")


# the cases that launch processes
BOUND_S = 120  # no case may take longer (a hang would block for ever)




def _cli(args: list[str], env_extra: dict | None = None, module: str = "hetero.trainer") -> subprocess.CompletedProcess:
    env = {**_env(), "WORLD_SIZE": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BOUND_S)




# -- 1. the data set is what is on disk -------------------------------------------------------------------------


@pytest.mark.launch
def test_a_fifo_in_an_image_folder_is_refused_without_opening_it(tmp_path):
    root = image_folder(tmp_path / "images")
    os.mkfifo(root / "train" / "cat" / "f.jpg")
    p = _cli(["--check", *IMAGES, "--data-dir", str(root)], {"HETERO_CACHE": str(tmp_path / "cache")})
    _one_line(p, f"{root}/train/cat/f.jpg is a FIFO, not a regular file")


# -- 3. everything checkable is checked before the process group ------------------------------------------------
@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    """A completed one-process run of SMALL (copied by each test that changes it)."""
    run = tmp_path_factory.mktemp("done") / "run"
    p = subprocess.run([sys.executable, "-m", "hetero.trainer", *SMALL, "--epochs", "1", "--run-dir", str(run)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    (dst / runfolder.LOCK).unlink(missing_ok=True)
    return dst


def _set(*path, value):
    def edit(state):
        d = state
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return edit


CHECKPOINTS = [
    ("shapes", _set("model", "fc.weight", value=lambda t: torch.zeros(3, 3))),
    ("model={}", _set("model", value={})),
    ("history='abc'", _set("history", value="abc")),
    ("torch rng", _set("rng", "torch", value=torch.zeros(7, dtype=torch.uint8))),
    ("numpy rng", _set("rng", "numpy", value=["MT19937", [1, 2], 0, 0, 0.0])),
    ("balancer", _set("balance", "balancer", "shares", value=[0.2, 0.3, 0.5])),
    ("balancer sizes", _set("balance", "balancer", "sizes", value=[7])),
    ("epoch=True", _set("balance", "epoch", value=True)),  # the position is the Balance's (checkpoint format 3)
    ("epoch=10**18", _set("balance", "epoch", value=10**18)),
    ("momentum", _set("optimizer", "state", 0, "momentum_buffer", value=lambda t: torch.zeros(5))),
]


@pytest.mark.launch
@pytest.mark.parametrize("name,edit", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_a_checkpoint_that_does_not_fit_is_one_line_at_check(name, edit, done_run, tmp_path, monkeypatch, capsys):
    run = _copy(done_run, tmp_path)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["sha256"]
    if name == "shapes":
        key = next(k for k, v in state["model"].items() if v.ndim == 2)
        edit = _set("model", key, value=lambda t: torch.zeros(t.shape[0] + 1, t.shape[1]))
    edit(state)
    torch.save(sealed(state), run / "checkpoint.pt")  # resealed: the content checks, not the digest, refuse it
    rc, err = check(["--resume", str(run)], monkeypatch, capsys)
    assert_one_line(rc, err, "cannot resume")
    assert "integrity" not in err[0]


@pytest.mark.launch
def test_the_sound_checkpoint_passes_the_same_check(done_run, tmp_path, monkeypatch, capsys):
    rng = torch.get_rng_state()
    assert check(["--resume", str(_copy(done_run, tmp_path)), "--epochs", "2"], monkeypatch, capsys) == (0, [])
    assert torch.equal(torch.get_rng_state(), rng)  # the check left this process's RNG as it was


def _steps(run: Path, edit) -> None:
    df = pd.read_csv(run / "steps.csv")
    out = edit(df)
    (run / "steps.csv").write_text(out if isinstance(out, str) else out.to_csv(index=False))


def _negative(df):
    df.loc[0, "batch_size"], df.loc[1, "batch_size"] = -64, df.loc[1, "batch_size"] + 64 + df.loc[0, "batch_size"]
    return df


REPLAYS = [
    ("empty", lambda df: "", "its steps.csv is unreadable"),
    ("no rank", lambda df: df.drop(columns="rank"), "has no column rank"),
    ("duplicate rows", lambda df: pd.concat([df, df.iloc[:1]]), "lists epoch 1 step 0 rank 0 twice"),
    ("text sizes", lambda df: df.astype({"batch_size": str}).assign(batch_size="many"), "column batch_size holds"),
    ("negative sizes", _negative, "column batch_size holds -64"),
]


@pytest.mark.launch
@pytest.mark.parametrize("name,edit,text", REPLAYS, ids=[r[0] for r in REPLAYS])
def test_a_bad_replay_file_is_one_line(name, edit, text, done_run, tmp_path, monkeypatch, capsys):
    run = _copy(done_run, tmp_path)
    _steps(run, edit)
    rc, err = check([*SMALL, "--epochs", "1", "--replay", str(run)], monkeypatch, capsys)
    assert_one_line(rc, err, text)


# -- 4. grids and reports ---------------------------------------------------------------------------------------
@pytest.mark.launch
def test_make_report_of_a_missing_grid_and_sim_bench_nan_are_one_line():
    for args, text in ((("report", "GRID=nope"), "runs/nope holds no run folders"),
                       (("sim-bench", "NOISE=nan"), "0 <= --noise <= 10")):
        p = run_make(*args)
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: error:")]
        assert p.returncode == 2 and len(lines) == 1 and text in lines[0], p.stderr
        assert "Traceback" not in p.stderr and "papermill" not in p.stderr.lower()


# -- 5. make values reach the recipes literally -----------------------------------------------------------------
@pytest.mark.launch
def test_make_refuses_make_syntax_and_keeps_a_dollar_literally(tmp_path):
    marker = tmp_path / "ran"
    p = run_make("experiment", f"MODEL=$(shell touch {marker})")
    assert p.returncode == 2 and not marker.exists() and "MODEL holds make syntax" in p.stderr, p.stderr
    p = run_make("experiment", "MODEL=tiny", "DATA=synthetic", f"REPLAY={tmp_path}/done$X2")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and f"cannot replay {tmp_path}/done$X2: it has no steps.csv" in lines[0], p.stderr


# -- 7. no hangs -------------------------------------------------------------------------------------------------
@pytest.mark.launch
def test_a_fifo_as_the_checkpoint_is_refused_without_opening_it(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    (run / "checkpoint.pt").unlink()
    os.mkfifo(run / "checkpoint.pt")
    _one_line(_cli(["--check", "--resume", str(run)]), "checkpoint.pt is a FIFO")


@pytest.mark.launch
@pytest.mark.slow  # a launch of about 10 s: the slow tier keeps make test near 5 minutes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stopped_worker_dies_with_its_launcher_and_frees_the_folder(tmp_path):
    run = tmp_path / "run"
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(torchrun_cmd(1, [*SMALL, "--epochs", "1000", "--run-dir", str(run)]), cwd=ROOT,
                            env={**_env(), MARKER: marker}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + BOUND_S
        while not (run / "epochs.csv").exists():  # training: the lock is held
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        (worker,) = [p for p in launch_pids(marker) if p != proc.pid]
        assert runfolder.is_busy(run)
        os.kill(worker, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15  # the kernel's SIGKILL is at once; exiting a big process takes a moment
        while (psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE
               or runfolder.is_busy(run)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not launch_pids(marker) and not runfolder.is_busy(run)
    finally:
        for pid in launch_pids(marker):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
