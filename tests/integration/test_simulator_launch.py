"""The simulator: its mechanics, the claims of the README (affine within 2% of the optimum after its first rebalance,
the paper's rule needing epochs), the paper's own numbers, changing speeds, stability, 4096 workers, notebook.
Here the cases that launch processes; those in one process: tests/unit/test_simulator.py."""

import nbformat
import pytest

from hetero.lab.launch import ROOT


@pytest.mark.slow
def test_balancers_notebook_runs(tmp_path, monkeypatch):
    import papermill as pm

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "balancers.ipynb"
    pm.execute_notebook(ROOT / "notebooks" / "balancers.ipynb", out, kernel_name="python3", cwd=str(ROOT),
                        parameters=dict(epochs=3, steps_per_epoch=30, many=32), progress_bar=False)
    nb = nbformat.read(out, as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 6  # each once (plots.show closes what it displayed), each with alternative text
    assert all(o.metadata["image/png"]["alt"].startswith(("Step time", "Mean step time", "Steady epoch time"))
               for o in images)
