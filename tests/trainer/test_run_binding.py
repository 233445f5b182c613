"""Issue 48, items 3 and 5, through the real command line: a checkpoint resumes only the run that wrote it (another
run's checkpoint.pt copied into the folder is refused in one line and changes nothing; one written before run uids
is bound by its history), and --tensorboard never writes or deletes through a link planted at RUN_DIR/tensorboard
(a fresh run, --overwrite and --resume each refuse it in one line)."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetero.trainer.checkpoint import sealed

from helpers import ROOT, _env

BOUND_S = 300
RUN = ["--model", "tiny", "--data", "synthetic", "--subset", "1024", "--test-subset", "256", "--global-batch", "128",
       "--threads", "1", "--epochs", "1"]


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero.trainer", *args], cwd=ROOT,
                          env={**_env(), "WORLD_SIZE": "1"}, capture_output=True, text=True, timeout=BOUND_S)


def _ran(args: list[str]) -> None:
    p = _cli(args)
    assert p.returncode == 0, p.stderr[-3000:]


def _refused(p: subprocess.CompletedProcess, text: str) -> None:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("hetero: error: ") and text in lines[0], lines[0]


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Finished one-epoch runs of the same model and global batch: `own`, and others with another seed or --subset."""
    root = tmp_path_factory.mktemp("runs")
    out = {"own": root / "own", "seed": root / "seed", "subset": root / "subset"}
    _ran([*RUN, "--run-dir", str(out["own"])])
    _ran([*RUN, "--seed", "1", "--run-dir", str(out["seed"])])
    _ran([*RUN, "--subset", "2048", "--run-dir", str(out["subset"])])  # 16 steps an epoch against 8
    return out


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    (to / ".lock").unlink(missing_ok=True)
    return to


@pytest.mark.parametrize("other", ["seed", "subset"])
def test_another_runs_checkpoint_is_refused_and_changes_nothing(runs, tmp_path, other):
    run = _copy(runs["own"], tmp_path / "run")
    shutil.copyfile(runs[other] / "checkpoint.pt", run / "checkpoint.pt")
    before = _files(run)
    _refused(_cli(["--resume", str(run), "--epochs", "2"]), "was written by another run")
    assert _files(run) == before


def test_the_runs_own_checkpoint_resumes_in_a_copy_of_its_folder(runs, tmp_path):
    run = _copy(runs["own"], tmp_path / "moved")  # a run moves with its whole folder
    uid = json.loads((run / "config.json").read_text())["run_uid"]
    assert torch.load(run / "checkpoint.pt", weights_only=True)["run_uid"] == uid
    _ran(["--resume", str(run), "--epochs", "2"])
    assert json.loads((run / "config.json").read_text())["run_uid"] == uid  # kept on resume, and in the checkpoint
    assert torch.load(run / "checkpoint.pt", weights_only=True)["run_uid"] == uid
    assert (run / "epochs.csv").read_text().count("\n") == 3  # the header and epochs 1 and 2


def _unbound(run: Path) -> None:
    """The folder as hetero wrote it before run uids: none in config.json nor in the (sealed) checkpoint."""
    meta = json.loads((run / "config.json").read_text())
    del meta["run_uid"]
    (run / "config.json").write_text(json.dumps(meta))
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["run_uid"], state["sha256"]
    torch.save(sealed({k: v for k, v in state.items() if k != "format"}), run / "checkpoint.pt")


def test_a_checkpoint_without_a_run_uid_is_bound_by_its_history(runs, tmp_path):
    own = _copy(runs["own"], tmp_path / "own")
    _unbound(own)
    p = _cli(["--resume", str(own), "--epochs", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "hetero: warning:" in p.stderr and "history matching epochs.csv" in p.stderr
    assert json.loads((own / "config.json").read_text())["run_uid"]  # bound from this start on
    foreign = _copy(runs["own"], tmp_path / "foreign")
    other = _copy(runs["seed"], tmp_path / "other")
    _unbound(foreign)
    _unbound(other)
    shutil.copyfile(other / "checkpoint.pt", foreign / "checkpoint.pt")
    before = _files(foreign)
    _refused(_cli(["--resume", str(foreign), "--epochs", "2"]), "does not belong to this folder's run")
    assert _files(foreign) == before


# -- --tensorboard and a planted link -------------------------------------------------------------------------------
def _planted(run: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """RUN_DIR/tensorboard made a link to another folder holding someone's event file."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "events.out.tfevents.1.host.1.0").write_bytes(b"not hetero's")
    if (run / "tensorboard").exists():
        shutil.rmtree(run / "tensorboard")
    run.mkdir(exist_ok=True)
    (run / "tensorboard").symlink_to(theirs, target_is_directory=True)
    return theirs, _files(theirs)


def test_tensorboard_never_writes_or_deletes_through_a_planted_link(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    _ran([*RUN, "--tensorboard", "--run-dir", str(run)])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    theirs, before = _planted(run, tmp_path)
    link = "its tensorboard folder is a symbolic link"
    _refused(_cli([*RUN, "--tensorboard", "--overwrite", "--run-dir", str(run)]), link)
    _refused(_cli(["--resume", str(run), "--epochs", "2"]), link)  # --tensorboard recorded, kept on resume
    fresh, elsewhere = tmp_path / "fresh", tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs_too, before_too = _planted(fresh, elsewhere)  # a new run folder holding only the link
    _refused(_cli([*RUN, "--tensorboard", "--run-dir", str(fresh)]), link)
    assert _files(theirs) == before and _files(theirs_too) == before_too
    assert sorted(p.name for p in fresh.iterdir()) == ["tensorboard"]
