"""The grid and report notebooks run headless with papermill; their tables match the run folders. Plus the
analysis maths on hand-made run folders, and notebooks committed without outputs.
Here the cases that launch processes; those in one process: tests/unit/test_notebooks.py."""
from __future__ import annotations

import json

import nbformat
import pandas as pd
import pytest

from hetero.lab.launch import ROOT

pytestmark = pytest.mark.slow  # papermill runs of the grid and report notebooks
FIGURES = ["curves_epoch", "curves_time", "shares", "step_times", "time_breakdown"]


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
