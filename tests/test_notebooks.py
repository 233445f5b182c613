"""The grid and report notebooks run headless with papermill; their tables match the run folders. Plus the
analysis maths on hand-made run folders, and notebooks committed without outputs."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest

from hetero.lab import analysis
from hetero.lab.launch import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIGURES = ["curves_epoch", "curves_time", "shares", "step_times", "time_breakdown"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), f"strip the outputs of {path.name}"
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1
    assert nb.metadata.kernelspec.name == "hetero"


def _fake_run(root: Path, name: str, scheme: str, seed: int, times: list[float], top1: list[float]) -> None:
    d = root / name
    d.mkdir(parents=True)
    cfg = {"model": "tiny", "scheme": scheme, "hetero": "1:delay=0.1", "seed": seed, "global_batch": 64,
           "epochs": len(times)}
    (d / "config.json").write_text(json.dumps({"config": cfg, "world_size": 2}))
    (d / "summary.json").write_text(json.dumps({"status": "completed", "error": "", "epochs_completed": len(times),
                                                "train_time_s": times[-1], "final_test_top1": top1[-1],
                                                "final_test_loss": 0.5, "mean_balance_eff": 0.8}))
    epochs = range(1, len(times) + 1)
    pd.DataFrame({"epoch": epochs, "train_time_s": times, "eval_time_s": 0.5, "test_loss": 1.0, "test_top1": top1}
                 ).to_csv(d / "epochs.csv", index=False)
    pd.DataFrame([{"epoch": e, "rank": r, "share": 0.5, "batch_size": 32, "compute_s": 1.0 + r, "wait_s": 1.0 - r,
                   "delay_s": 0.5 * r} for e in epochs for r in (0, 1)]).to_csv(d / "ranks.csv", index=False)
    pd.DataFrame([{"epoch": e, "step": 0, "rank": r, "batch_size": 32, "compute_s": 0.1, "wait_s": 0.0,
                   "delay_s": 0.0} for e in epochs for r in (0, 1)]).to_csv(d / "steps.csv", index=False)


def test_summary_table_speedup_target_and_spread(tmp_path):
    _fake_run(tmp_path, "sync-0", "sync", 0, [10, 20], [0.5, 0.9])
    _fake_run(tmp_path, "sync-1", "sync", 1, [12, 22], [0.6, 0.7])
    _fake_run(tmp_path, "dp-0", "dp", 0, [5, 10], [0.8, 0.9])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"config": {
        "model": "tiny", "scheme": "dp", "hetero": "1:delay=0.1", "seed": 1, "global_batch": 64, "epochs": 2}}))
    frames = analysis.load(tmp_path)
    assert list(frames.runs["status"]).count("completed") == 3 and len(frames.runs) == 4
    t = analysis.summary_table(frames, target_top1=0.75).set_index("scheme")
    assert list(t.index) == ["sync", "dp"]  # Sync-SGD first; the unfinished run left out
    assert t.loc["sync", "seeds"] == 2 and t.loc["sync", "train_time_s_mean"] == 21
    assert t.loc["sync", "train_time_s_sd"] == pytest.approx(np.std([20, 22], ddof=1))
    assert t.loc["dp", "speedup_vs_sync"] == pytest.approx(21 / 10)
    assert t.loc["sync", "reached_target"] == 1 and t.loc["sync", "time_to_target_s_mean"] == 20  # seed 1 never
    assert t.loc["dp", "time_to_target_s_mean"] == 5
    assert t.loc["sync", "final_test_top1_mean"] == pytest.approx(0.8)
    auto = analysis.summary_table(frames)  # 95% of the worst scheme's mean final top-1 (sync: 0.8)
    assert auto["target_top1"].iloc[0] == pytest.approx(0.76)
    tb = analysis.time_breakdown(frames).set_index(["scheme", "rank", "part"])["seconds"]
    assert tb[("sync", 1, "own compute")] == 2 * (2.0 - 0.5) and tb[("sync", 1, "emulated slowdown")] == 1.0
    assert tb[("dp", 0, "waiting for other ranks")] == 2.0 and tb[("dp", 0, "evaluation")] == 1.0
    text = analysis.format_summary(analysis.summary_table(frames, 0.75))
    assert text.loc[0, "scheme"] == "Sync-SGD" and "(1/2 seeds)" in text.loc[0, "time to target (s)"]


def test_labels_read_as_words():
    assert analysis.hetero_label("1:delay=0.01") == "rank 1 +10 ms/step"
    assert analysis.hetero_label("1:slowdown=3") == "rank 1 3\u00d7 slower"
    assert analysis.hetero_label("") == "homogeneous"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The grid notebook on a tiny grid (2 runs), then the report notebook on its folder."""
    import papermill as pm

    tmp = tmp_path_factory.mktemp("nb")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(ROOT))  # the kernel imports this checkout
    params = dict(grid="nb", runs_root=str(tmp), model=["tiny"], scheme=["sync", "edp"], hetero=["1:slowdown=3"],
                  seed=[0], epochs=2, nproc=2, data="synthetic", subset=512, test_subset=256, global_batch=128,
                  device="cpu", run_timeout_s=240)
    try:
        pm.execute_notebook(ROOT / "notebooks" / "grid.ipynb", tmp / "grid.ipynb", parameters=params,
                            kernel_name="python3", cwd=str(ROOT), progress_bar=False)
        out = tmp / "report"
        out.mkdir()
        pm.execute_notebook(ROOT / "notebooks" / "report.ipynb", out / "report.ipynb", kernel_name="python3",
                            parameters=dict(grid_dir=str(tmp / "nb"), out_dir=str(out)), cwd=str(ROOT),
                            progress_bar=False)
    finally:
        mp.undo()
    return tmp


NOISE = ("<Figure size", "Styler at 0x", "Markdown object>", "Empty DataFrame")  # reprs printed into logs


def _plain_text(nb) -> str:
    """What papermill --log-output prints of a notebook: streams and the text/plain of every output."""
    return "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_notebook_outputs_have_no_object_reprs(executed):
    grid = nbformat.read(executed / "grid.ipynb", as_version=4)
    report = nbformat.read(executed / "report" / "report.ipynb", as_version=4)
    for nb in (grid, report):
        text = _plain_text(nb)
        assert not [n for n in NOISE if n in text], text
    assert "every run completed" in _plain_text(grid)
    assert "Sync-SGD" in _plain_text(report)  # the summary table as plain text


def test_grid_notebook_runs_the_grid_and_shows_figures(executed):
    table = pd.read_csv(executed / "nb" / "grid.csv", keep_default_na=False)
    assert list(table["status"]) == ["completed", "completed"], table["error"].tolist()
    nb = nbformat.read(executed / "grid.ipynb", as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == len(FIGURES)
    assert all(o["metadata"]["image/png"]["alt"] for o in images)  # shown once each, by plots.show


def test_report_files_and_table_match_the_run_folders(executed):
    out = executed / "report"
    for name in FIGURES:
        assert (out / f"{name}.png").stat().st_size > 10_000 and (out / f"{name}.svg").stat().st_size > 10_000
    table = pd.read_csv(out / "summary.csv")
    assert list(table["scheme"]) == ["sync", "edp"] and set(table["seeds"]) == {1}
    for row in table.itertuples():
        run = executed / "nb" / f"tiny-{row.scheme}-1-slowdown3-s0"
        summary = json.loads((run / "summary.json").read_text())
        epochs = pd.read_csv(run / "epochs.csv")
        assert row.train_time_s_mean == pytest.approx(summary["train_time_s"])
        assert row.train_time_s_mean == pytest.approx(epochs["train_time_s"].iloc[-1])
        assert row.final_test_top1_mean == pytest.approx(epochs["test_top1"].iloc[-1])
        assert row.balance_eff_mean == pytest.approx(epochs["balance_eff"].mean())
    sync_s = table.loc[table["scheme"] == "sync", "train_time_s_mean"].item()
    assert table["speedup_vs_sync"].to_numpy() == pytest.approx(sync_s / table["train_time_s_mean"].to_numpy())


def test_report_exports_html_without_code(executed):
    from nbconvert import HTMLExporter

    nb = nbformat.read(executed / "report" / "report.ipynb", as_version=4)
    html, _ = HTMLExporter(exclude_input=True).from_notebook_node(nb)
    assert "plots.show(" not in html and "from hetero import" not in html
    assert html.count("<img") == len(FIGURES)
    assert html.count('alt="Test loss and accuracy against') == 2  # alternative text: each figure's title and note
    assert 'alt="Where each rank' in html and 'alt="No description' not in html
    assert "Sync-SGD" in html and "EDP-SGD" in html and "speedup vs Sync-SGD" in html
