"""Bad inputs (issue 12, items 3, 5, 6): a checked resume, grid parameter files, bad values, image folders and
make variables. Each is one line `hetero: error: ...` and exit status 2, before any process group exists."""
from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

from hetero.lab import grid as hg
from hetero.trainer.config import Config
from hetero.trainer.resume import RESUMABLE

from helpers import ROOT, SMALL, _env, assert_one_line, check, image_folder, run_make, run_train


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """--check creates the default run folder (runs/<time>-...): keep it out of the checkout."""
    monkeypatch.chdir(tmp_path)


# -- item 6: values ----------------------------------------------------------------------------------------------
BAD = [
    (["--epoch", "3"], "unrecognized arguments: --epoch 3"),  # no abbreviations: --epoch is not --epochs
    (["--seed", "1e23"], "invalid int value: '1e23'"),
    (["--seed", str(10**23)], "seed must be a whole number of at most 2**63-1"),  # int64 first (issue 23)
    (["--seed", str(2**40)], "--seed must be at most 2**32-1"),
    (["--timeout-s", "1e15"], "--timeout-s must be at most 2592000"),
    (["--momentum", "3"], "--momentum must be in [0, 1)"),
    (["--momentum", "1"], "--momentum must be in [0, 1)"),
    (["--threads", "100000"], "asks for 100000 threads, more than the"),
    (["--hetero", "0:delay=0.1@cycle=10/0"], "need 0 < ON <= P"),
    (["--subset", "1000000000"], "--subset 1000000000 exceeds the largest synthetic set"),
]


@pytest.mark.parametrize("args,text", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_value_is_one_line_and_exit_2(args, text, monkeypatch, capsys):
    base = [a for a in SMALL if a not in ("--subset", "512")] if "--subset" in args else SMALL
    if "--threads" in args:
        base = SMALL[:-2]
    assert_one_line(*check([*base, *args], monkeypatch, capsys), text)


def test_affinity_refuses_cores_this_job_lacks(monkeypatch, capsys):
    allowed = os.sched_getaffinity(0)
    missing = max(allowed) + 1
    rc, err = check([*SMALL, "--affinity", f"0-{missing}"], monkeypatch, capsys)
    assert_one_line(rc, err, f"asks for core(s) {missing} that this job may not use")
    assert check([*SMALL, "--affinity", str(min(allowed))], monkeypatch, capsys)[0] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a GPU")
def test_cuda_without_gpu_is_refused_at_check(monkeypatch, capsys):
    assert_one_line(*check([*SMALL, "--device", "cuda"], monkeypatch, capsys), "torch sees none on this host")
    assert_one_line(*check([*SMALL, "--device", "cpu,cuda"], monkeypatch, capsys, world=2), "rank 1 wants a GPU")


def test_types_are_checked_for_python_callers():
    for kw, text in [({"epochs": 2.5}, "epochs must be a whole number"), ({"augment": "maybe"}, "augment must be "
                     "true or false"), ({"global_batch": "128"}, "global_batch must be a whole number"),
                     ({"lr": True}, "lr must be a number")]:
        with pytest.raises(ValueError, match=text):
            Config(**kw)
    assert Config(lr=1).lr == 1  # an int is a number


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# -- item 6: image folders ---------------------------------------------------------------------------------------
FOLDERS = [
    ("empty train", lambda r: [shutil.rmtree(r / "train"), (r / "train").mkdir()], "{r}/train has no class subfolders"),
    ("empty class", lambda r: [f.unlink() for f in (r / "test" / "dog").iterdir()], "class folder {r}/test/dog holds "
     "no images"),
    ("text as jpg", lambda r: (r / "train" / "dog" / "1.jpg").write_text("not an image"), "cannot decode image "
     "{r}/train/dog/1.jpg"),
    ("truncated", lambda r: _truncate(r / "train" / "cat" / "2.jpg"), "cannot decode image {r}/train/cat/2.jpg"),
    ("corrupt", lambda r: (r / "test" / "cat" / "0.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(200)),
     "cannot decode image {r}/test/cat/0.jpg"),
]


@pytest.mark.parametrize("name,damage,text", FOLDERS, ids=[f[0] for f in FOLDERS])
def test_bad_image_folder_names_the_file(name, damage, text, tmp_path, monkeypatch, capsys):
    root = image_folder(tmp_path / "images")
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    args = ["--model", "tiny", "--data", "imagefolder", "--data-dir", str(root), "--global-batch", "2",
            "--threads", "1"]
    assert check(args, monkeypatch, capsys)[0] == 0  # sound before the damage (and cached: the damage changes mtimes)
    shutil.rmtree(tmp_path / "cache")
    damage(root)
    assert_one_line(*check(args, monkeypatch, capsys), text.format(r=root))
    assert not list((tmp_path / "cache").glob("*.pt"))  # nothing half-decoded was cached


# -- item 5: grid parameter files --------------------------------------------------------------------------------
TINY_GRID = dict(model="tiny", data="synthetic", subset=256, test_subset=128, global_batch=64, epochs=1, device="cpu",
                 threads=1)


def test_grid_refuses_unknown_keys_and_types_by_name(tmp_path):
    bad = dict(TINY_GRID, epochz=3, epochs=2.5, augment="maybe", global_batch="128", lr=[0.1, True])
    with pytest.raises(hg.GridError) as e:
        hg.plan_grid(grid="g", runs_root=tmp_path, **bad)
    lines = str(e.value).splitlines()
    assert lines[0] == ("unknown parameter 'epochz' (did you mean 'epochs'?): not a Config field nor one of grid, "
                        "nproc, runs_root, run_timeout_s")
    assert sorted(lines[1:]) == ["augment must be true or false (got 'maybe', str)",
                                 "epochs must be a whole number (got 2.5, float)",
                                 "global_batch must be a whole number (got '128', str)",
                                 "lr must be a number (got True, bool)"]
    with pytest.raises(hg.GridError, match="nproc must be a positive whole number"):
        hg.plan_grid(grid="g", runs_root=tmp_path, nproc=1.5, **TINY_GRID)
    assert not (tmp_path / "g").exists()


def test_plan_grid_from_refuses_a_near_miss_of_a_parameter(tmp_path):
    ns = dict(TINY_GRID, grid="g", runs_root=str(tmp_path), epochz=3, hg=hg, table=None, In=["x"], Out={})
    with pytest.raises(hg.GridError, match="unknown parameter 'epochz' \\(did you mean 'epochs'\\?\\)"):
        hg.plan_grid_from(ns)
    del ns["epochz"]
    assert len(hg.plan_grid_from(ns).runs) == 1  # the notebook's other variables are left alone


def _parameters_cell() -> dict:
    nb = nbformat.read(ROOT / "notebooks" / "grid.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    return {t.id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body if isinstance(n, ast.Assign)
            for t in n.targets}


def test_grid_notebook_defaults_are_configs_and_demo_keeps_its_values():
    import yaml

    cell = _parameters_cell()
    defaults = {f.name: f.default for f in fields(Config)}
    assert {k: v for k, v in cell.items() if k in defaults} == {k: defaults[k] for k in cell if k in defaults}
    assert cell["nproc"] == 2 and cell["run_timeout_s"] == 3600.0  # plan_grid()'s defaults
    assert {"subset", "test_subset", "epochs", "data", "model"} <= set(cell)
    demo = yaml.safe_load((ROOT / "notebooks/params/demo.yaml").read_text())
    # the demo's values, formerly the notebook's, now all in demo.yaml: `make demo` runs what it ran
    assert demo == {"model": ["tiny"], "scheme": ["sync", "dp", "edp"], "hetero": ["1:slowdown=3"], "seed": [0, 1],
                    "epochs": 5, "nproc": 2, "data": "synthetic", "subset": 2048, "test_subset": 512,
                    "global_batch": 128, "device": "cpu", "run_timeout_s": 300}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a GPU")
def test_grid_says_a_host_problem_once(tmp_path):
    with pytest.raises(hg.GridError) as e:
        hg.plan_grid(grid="g", runs_root=tmp_path, **dict(TINY_GRID, device="cuda", scheme=["sync", "dp", "edp"]))
    assert str(e.value) == ("tiny-sync-none-s0: --device 'cuda': rank 0 wants a GPU but torch sees none on this host "
                            "(use --device cpu or auto)")


# the cases that launch processes
# -- item 3: resume ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    """A completed one-rank run of 2 epochs."""
    run = tmp_path_factory.mktemp("resume") / "run"
    run_train([*SMALL, "--epochs", "2", "--run-dir", str(run)], nproc=0)
    return run


def _copy(run: Path, tmp_path: Path, edit=None) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    if edit is not None:
        text = (dst / "config.json").read_text()
        (dst / "config.json").write_text(edit(text))
    return dst


def _with(field: str, value):
    def edit(text: str) -> str:
        meta = json.loads(text)
        meta["config"][field] = value
        return json.dumps(meta)
    return edit


CORRUPT = [
    ("truncated", lambda t: t[: len(t) // 2], "its config.json is unreadable or truncated"),
    ("empty", lambda t: "", "its config.json is unreadable or truncated"),
    ("binary", lambda t: "\udcff", "its config.json is unreadable or truncated"),
    ("a list", lambda t: "[1, 2]", "its config.json has no config record"),
    ("unknown field", _with("learning_rate", 0.1), "unknown field(s) 'learning_rate'"),
    ("wrong type", _with("epochs", "two"), "epochs must be a whole number"),
    ("bad value", _with("model", "alexnet"), "unknown model 'alexnet'"),
]


@pytest.mark.launch
@pytest.mark.parametrize("name,edit,text", CORRUPT, ids=[c[0] for c in CORRUPT])
def test_resume_refuses_a_bad_config_json(name, edit, text, done_run, tmp_path, monkeypatch, capsys):
    if name == "binary":
        run = _copy(done_run, tmp_path)
        (run / "config.json").write_bytes(b"\xff\xfe{")
    else:
        run = _copy(done_run, tmp_path, edit)
    for check_only in (True, False):  # the same line whether --check or a real start
        assert_one_line(*check(["--resume", str(run)], monkeypatch, capsys, check_only=check_only), text)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"  # nothing was written


def _ran_on(world: int, **fields):
    """config.json as if the run had `world` ranks, with these recorded fields."""
    def edit(text: str) -> str:
        meta = json.loads(text)
        meta["world_size"] = world
        meta["config"].update(fields)
        return json.dumps(meta)
    return edit


@pytest.mark.launch
@pytest.mark.parametrize("world", [2, 3])
def test_resume_onto_another_world_size_is_accepted(world, done_run, monkeypatch, capsys):
    # one value per setting applies to every rank of the new world (tests/trainer/test_elastic.py runs it)
    assert check(["--resume", str(done_run)], monkeypatch, capsys, world=world) == (0, [])


@pytest.mark.launch
def test_resume_onto_another_world_refuses_what_was_set_per_rank(done_run, tmp_path, monkeypatch, capsys):
    for i, (recorded, world, text) in enumerate([
            ({"threads": "1,1"}, 3, "its --threads '1,1' was given per rank for 2; give --threads anew"),
            ({"max_batch": "64,0"}, 1, "its --max-batch '64,0' was given per rank for 2; give --max-batch anew"),
            ({"hetero": "2:delay=0.1"}, 2, "its --hetero '2:delay=0.1' emulates rank 2, outside this world")]):
        run = _copy(done_run, tmp_path / str(i), _ran_on(3 if "hetero" in recorded else 2, **recorded))
        assert_one_line(*check(["--resume", str(run)], monkeypatch, capsys, world=world), text)
    # given anew for the new world: accepted
    run = _copy(done_run, tmp_path / "anew", _ran_on(2, threads="1,1"))
    assert check(["--resume", str(run), "--threads", "1,1,1"], monkeypatch, capsys, world=3) == (0, [])


@pytest.mark.launch
def test_resume_refuses_changed_flags_by_name(done_run, monkeypatch, capsys):
    rc, err = check(["--resume", str(done_run), "--epochs", "4", "--lr", "0.5", "--scheme", "sync"], monkeypatch,
                    capsys)
    assert_one_line(rc, err, "with another --scheme (recorded 'edp'), --lr (recorded 0.1)")
    assert "only --epochs, --timeout-s" in err[0] and "--epochs (" not in err[0]
    for args, text in [(["--epochs", "1"], "--epochs 1: it has completed 2 epochs already"),
                       (["--run-dir", str(done_run.parent / "elsewhere")], "a resumed run stays in its folder"),
                       (["--overwrite"], "--resume and --overwrite contradict each other")]:
        assert_one_line(*check(["--resume", str(done_run), *args], monkeypatch, capsys), text)


@pytest.mark.launch
def test_resume_accepts_allowed_and_unchanged_flags(done_run, monkeypatch, capsys):
    allowed = ["--epochs", "5", "--timeout-s", "60", "--eval-batch", "100", "--threads", "1", "--device", "cpu",
               "--backend", "gloo", "--data-dir", "data"]
    same = ["--model", "tiny", "--lr", "0.1", "--scheme", "edp", "--subset", "512"]  # as recorded: no change
    assert check(["--resume", str(done_run), *allowed, *same], monkeypatch, capsys) == (0, [])
    assert {a[2:].replace("-", "_") for a in allowed[::2]} <= set(RESUMABLE)


@pytest.mark.launch
def test_resume_with_more_epochs_relays_the_cosine_schedule(done_run, tmp_path):
    """The stated rule: after k epochs, epoch k+1 of a run extended to E epochs uses lr (1 + cos(pi k / E)) / 2."""
    run = _copy(done_run, tmp_path)
    run_train(["--resume", str(run), "--epochs", "4"], nproc=0)
    epochs = pd.read_csv(run / "epochs.csv")
    assert list(epochs["epoch"]) == [1, 2, 3, 4]
    expected = [0.1, 0.05] + [0.1 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (2, 3)]
    assert epochs["lr"].to_numpy() == pytest.approx(expected)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs"] == summary["epochs_completed"] == 4
    assert json.loads((run / "config.json").read_text())["config"]["epochs"] == 4


@pytest.mark.launch
@pytest.mark.slow
def test_resume_under_torchrun_with_a_per_rank_list_of_another_world_is_one_line(done_run, tmp_path):
    """Both ranks refuse before any process group; one line in all (local rank 0 speaks), the run untouched."""
    run = _copy(done_run, tmp_path, _ran_on(3, threads="1,1,1"))
    before = (run / "summary.json").read_text()
    p = run_train(["--resume", str(run)], nproc=2, check=False, timeout=180)
    assert p.returncode != 0
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "hetero: error:" in ln]
    assert len(lines) == 1 and "was given per rank for 3; give --threads anew" in lines[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr.split("hetero: error:")[0]
    assert (run / "summary.json").read_text() == before


def _grid_check(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero.lab.grid", "--check", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)


# -- item 5: grid parameter files --------------------------------------------------------------------------------
@pytest.mark.launch
@pytest.mark.slow
def test_grid_check_prints_plain_lines(tmp_path):
    params = tmp_path / "bad.yaml"
    params.write_text("model: [tiny]\nepochz: 3\nepochs: 2.5\naugment: maybe\nglobal_batch: \"128\"\n")
    p = _grid_check(["-f", str(params), "-p", "grid", "bad", "-p", "runs_root", str(tmp_path)])
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 4 and all(ln.startswith("hetero: error: ") for ln in lines), p.stderr
    assert "did you mean 'epochs'" in lines[0]
    for args, text in [(["-f", str(tmp_path / "none.yaml")], "cannot read the parameter file"),
                       (["-y", "epochs: ["], "-y: not YAML"), (["-y", "[1, 2]"], "expected name: value lines")]:
        p = _grid_check([*args, "-p", "grid", "x"])
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and text in p.stderr, p.stderr


@pytest.mark.launch
def test_grid_check_merges_like_papermill(tmp_path):
    """-f, then -y, then -p (papermill's order and typing): the demo's file with make's overrides plans."""
    p = _grid_check(["-f", str(ROOT / "notebooks/params/demo.yaml"), "-y", "epochs: 3", "-y", "seed: [0, 1, 2]",
                     "-p", "nproc", "2", "-p", "grid", "demo", "-p", "runs_root", str(tmp_path)])
    assert p.returncode == 0 and p.stdout.startswith("grid demo: 9 runs of 2 ranks"), p.stderr


@pytest.mark.launch
def test_grid_notebook_with_no_completed_run_shows_no_traceback(tmp_path, monkeypatch):
    """Every run stopped by run_timeout_s before its first epoch: the results cells say so and the notebook ends."""
    import papermill as pm

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    params = dict(grid="none", runs_root=str(tmp_path), model="tiny", scheme="sync", data="synthetic", subset=256,
                  test_subset=128, global_batch=64, epochs=1, nproc=1, device="cpu", run_timeout_s=0.5)
    pm.execute_notebook(ROOT / "notebooks" / "grid.ipynb", tmp_path / "grid.ipynb", parameters=params,
                        kernel_name="python3", cwd=str(ROOT), progress_bar=False)
    nb = nbformat.read(tmp_path / "grid.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "no run completed, so there is nothing to show" in text
    assert pd.read_csv(tmp_path / "none" / "grid.csv")["status"].tolist() == ["timeout"]


# -- item 6: make ------------------------------------------------------------------------------------------------
@pytest.mark.launch
def test_make_refuses_a_misspelled_variable():
    p = run_make("experiment", "EPOCH=3")
    assert p.returncode == 2 and "hetero: error: unknown make variable EPOCH (did you mean EPOCHS?)" in p.stderr
    p = run_make("experiment", "NPROC=1;touch x")
    assert p.returncode == 2 and "NPROC must be a whole number" in p.stderr
    p = run_make("test", "JOBS=2'; touch x; echo '")  # the count of pytest-xdist processes: a number, never shell
    assert p.returncode == 2 and "JOBS must be a whole number" in p.stderr and not (ROOT / "x").exists()


@pytest.mark.launch
@pytest.mark.slow
def test_make_variable_with_a_quote_runs_no_shell_code(tmp_path):
    marker = tmp_path / "ran"
    p = run_make("experiment", "NPROC=1", f"MODEL=x'; touch {marker}; echo '")
    assert p.returncode == 2 and not marker.exists()
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and "unknown model \"x'; touch" in lines[0], p.stderr
    p = run_make("grid", f"GRID=g'; touch {marker}; echo '", f"HETERO=1:delay=0.1'; touch {marker}; echo '")
    assert p.returncode == 2 and not marker.exists() and "Traceback" not in p.stderr


@pytest.mark.launch
def test_make_grid_prints_the_problems_as_plain_lines(tmp_path):
    p = run_make("grid", "GRID=badtypes", "EPOCHS=2.5", "AUGMENT=maybe", "GLOBAL_BATCH='128'")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "papermill" not in p.stderr.lower(), p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: error:")]
    assert [ln.split(": ", 2)[2].split(" must")[0] for ln in lines] == ["epochs", "global_batch", "augment"]
    assert not (ROOT / "runs" / "badtypes").exists()


@pytest.mark.launch
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a GPU")
def test_make_experiment_stops_at_check_without_gpu():
    p = run_make("experiment", "NPROC=2", "DEVICE=cuda", "MODEL=tiny", "DATA=synthetic")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hetero: error:")]
    assert p.returncode == 2 and len(lines) == 1 and "torch sees none on this host" in lines[0], p.stderr
    assert "torchrun" not in p.stdout + p.stderr
