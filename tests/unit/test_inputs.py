"""Bad inputs (issue 12, items 3, 5, 6): a checked resume, grid parameter files, bad values, image folders and
make variables. Each is one line `hetero: error: ...` and exit status 2, before any process group exists.
Here the cases in one process; those that launch processes: tests/integration/test_inputs_launch.py."""
from __future__ import annotations

import ast
import os
import shutil
from dataclasses import fields
from pathlib import Path

import nbformat
import pytest
import torch

from hetero.lab import grid as hg
from hetero.trainer.config import Config

from helpers import ROOT, SMALL, assert_one_line, check, image_folder


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
