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

from helpers import ROOT

# the slow tier, as when these shared a module with the papermill runs (tests/lab/test_notebooks.py)
pytestmark = pytest.mark.slow

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), f"strip the outputs of {path.name}"
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1
    assert nb.metadata.kernelspec.name == "hetero"


def _fake_run(root: Path, name: str, scheme: str, seed: int, times: list[float], top1: list[float],
              hetero: str = "1:delay=0.1", straggler: str | None = None, steps: list[dict] | None = None) -> None:
    d = root / name
    d.mkdir(parents=True)
    cfg = {"model": "tiny", "scheme": scheme, "hetero": hetero, "seed": seed, "global_batch": 64,
           "epochs": len(times), **({} if straggler is None else {"straggler": straggler})}
    (d / "config.json").write_text(json.dumps({"config": cfg, "world_size": 2}))
    (d / "summary.json").write_text(json.dumps({"status": "completed", "error": "", "epochs_completed": len(times),
                                                "train_time_s": times[-1], "final_test_top1": top1[-1],
                                                "final_test_loss": 0.5, "mean_balance_eff": 0.8}))
    epochs = range(1, len(times) + 1)
    pd.DataFrame({"epoch": epochs, "train_time_s": times, "eval_time_s": 0.5, "test_loss": 1.0, "test_top1": top1}
                 ).to_csv(d / "epochs.csv", index=False)
    pd.DataFrame([{"epoch": e, "rank": r, "share": 0.5, "batch_size": 32, "compute_s": 1.0 + r, "wait_s": 1.0 - r,
                   "delay_s": 0.5 * r} for e in epochs for r in (0, 1)]).to_csv(d / "ranks.csv", index=False)
    pd.DataFrame(steps or [{"epoch": e, "step": 0, "rank": r, "batch_size": 32, "compute_s": 0.1, "wait_s": 0.0,
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


def test_outside_stragglers_are_levels_of_their_own(tmp_path):
    """Issue 34's grid: runs with hetero "" under two outside stragglers are two settings, each with its own Sync-SGD
    for the speedup, not one setting that mixes them."""
    for kind, (sync_s, dp_s) in {"1:quota=0.33": (30, 15), "1:neighbour=busy": (20, 16)}.items():
        for scheme, t in (("sync", sync_s), ("dp", dp_s)):
            _fake_run(tmp_path, f"{scheme}-{kind[2:6]}", scheme, 0, [t / 2, t], [0.5, 0.9], "", kind)
    frames = analysis.load(tmp_path)
    t = analysis.summary_table(frames)
    speed = {(h, s): v for h, s, v in zip(t["heterogeneity"], t["scheme"], t["speedup_vs_sync"])}
    assert speed == {("rank 1 under a quota of 0.33 core (outside)", "sync"): 1.0,
                     ("rank 1 under a quota of 0.33 core (outside)", "dp"): 2.0,
                     ("rank 1 beside a busy neighbour (outside)", "sync"): 1.0,
                     ("rank 1 beside a busy neighbour (outside)", "dp"): 1.25}
    from hetero.lab import plots  # the report's figures read the key too (the shares figure once raised on it)
    fig = plots.shares(frames)
    assert {t.get_text() for t in fig.legends[0].get_texts()} == {"rank 0", "rank 1 (outside straggler)"}
    assert analysis.slowed_ranks(analysis.heterogeneity("1:slowdown=2", "0:quota=0.5")) == {1: "slowed", 0: "outside"}


def test_the_cost_models_speedup_is_fitted_from_the_settings_own_steps(tmp_path):
    """Issue 34's report: per scheme, the speedup against Sync-SGD and against the cost model's prediction. Rank 0
    takes 20 ms + 1 ms per sample, rank 1 20 ms + 3 ms (sync's 32/32 and dp's 48/16 give each rank's slope), the
    all-reduce 4 ms: equal sizes 116 + 4 ms, the best (48/16) 68 + 4 ms, so the model predicts 120 / 72."""
    def steps(sizes):  # epoch 1 (a warm-up the fit leaves out) is off the model on purpose
        return [{"epoch": e, "step": k, "rank": r, "batch_size": b, "wait_s": 0.004, "delay_s": 0.0,
                 "compute_s": (9.0 if e == 1 else 0.02 + (0.001, 0.003)[r] * b)}
                for e in (1, 2) for k in range(3) for r, b in enumerate(sizes)]
    _fake_run(tmp_path, "sync-0", "sync", 0, [1.0, 2.4], [0.5, 0.9], steps=steps((32, 32)))
    _fake_run(tmp_path, "dp-0", "dp", 0, [1.0, 1.6], [0.5, 0.9], steps=steps((48, 16)))
    t = analysis.summary_table(analysis.load(tmp_path)).set_index("scheme")
    assert t.loc["sync", "predicted_speedup"] == 1.0
    assert t.loc["dp", "predicted_speedup"] == pytest.approx(0.120 / 0.072)
    assert t.loc["dp", "speedup_vs_sync"] == pytest.approx(2.4 / 1.6)  # the whole run, its first epoch included
    assert t.loc["dp", "steady_speedup"] == pytest.approx(1.4 / 0.6)  # epochs 2..: sync 2.4 - 1.0, dp 1.6 - 1.0
    assert t.loc["dp", "of_predicted"] == pytest.approx((1.4 / 0.6) / (0.120 / 0.072))
    text = analysis.format_summary(analysis.summary_table(analysis.load(tmp_path))).set_index("scheme")
    assert text.loc["DP-SGD", "cost model's speedup"] == "1.67\u00d7"
    assert text.loc["DP-SGD", "after epoch 1"] == "2.33\u00d7"  # the runs' times are made up, not the steps' sums:
    assert text.loc["DP-SGD", "after epoch 1 / model's"] == "1.40"  # this checks the arithmetic, not a fit


def test_labels_read_as_words():
    assert analysis.hetero_label("1:delay=0.01") == "rank 1 +10 ms/step"
    assert analysis.hetero_label("1:slowdown=3") == "rank 1 3\u00d7 slower"
    assert analysis.hetero_label("") == "homogeneous"


def test_the_cost_model_reads_a_quotad_rank_by_the_cpu_its_quota_sustains(tmp_path):
    """Under 1:quota=0.5 rank 1's compute looks like rank 0's (1 ms a sample: its steps started with quota banked),
    but its steps were charged 10 ms + 1 ms a sample of CPU, at half a core 20 ms + 2 ms a sample, less the 4 ms
    all-reduce: 16 ms + 2 ms. Equal sizes 80 + 4 ms, the best (48/16) 48 + 4 ms: the model predicts 84 / 52, where
    the staircase alone would predict no gain (both ranks at 1 ms a sample)."""
    def steps(sizes):
        return [{"epoch": e, "step": k, "rank": r, "batch_size": b, "wait_s": 0.004, "delay_s": 0.0,
                 "compute_s": 0.001 * b, "cpu_s": 0.001 * b + (0.0, 0.01)[r]}
                for e in (1, 2) for k in range(3) for r, b in enumerate(sizes)]
    for scheme, sizes in (("sync", (32, 32)), ("dp", (40, 24))):
        _fake_run(tmp_path, f"{scheme}-0", scheme, 0, [1.0, 2.0], [0.5, 0.9], "", "1:quota=0.5", steps(sizes))
    t = analysis.summary_table(analysis.load(tmp_path)).set_index("scheme")
    assert t.loc["dp", "predicted_speedup"] == pytest.approx(0.084 / 0.052)


# the cases that launch processes
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


@pytest.mark.launch
def test_notebook_outputs_have_no_object_reprs(executed):
    grid = nbformat.read(executed / "grid.ipynb", as_version=4)
    report = nbformat.read(executed / "report" / "report.ipynb", as_version=4)
    for nb in (grid, report):
        text = _plain_text(nb)
        assert not [n for n in NOISE if n in text], text
    assert "every run completed" in _plain_text(grid)
    assert "Sync-SGD" in _plain_text(report)  # the summary table as plain text


@pytest.mark.launch
def test_grid_notebook_runs_the_grid_and_shows_figures(executed):
    table = pd.read_csv(executed / "nb" / "grid.csv", keep_default_na=False)
    assert list(table["status"]) == ["completed", "completed"], table["error"].tolist()
    nb = nbformat.read(executed / "grid.ipynb", as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == len(FIGURES)
    assert all(o["metadata"]["image/png"]["alt"] for o in images)  # shown once each, by plots.show


@pytest.mark.launch
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


@pytest.mark.launch
def test_report_exports_html_without_code(executed):
    from nbconvert import HTMLExporter

    nb = nbformat.read(executed / "report" / "report.ipynb", as_version=4)
    html, _ = HTMLExporter(exclude_input=True).from_notebook_node(nb)
    assert "plots.show(" not in html and "from hetero import" not in html
    assert html.count("<img") == len(FIGURES)
    assert html.count('alt="Test loss and accuracy against') == 2  # alternative text: each figure's title and note
    assert 'alt="Where each rank' in html and 'alt="No description' not in html
    assert "Sync-SGD" in html and "EDP-SGD" in html and "speedup vs Sync-SGD" in html
