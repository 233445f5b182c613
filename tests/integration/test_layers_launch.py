"""The package's four layers, from its import graph: the core imports nothing from the integrations, the trainer or
the lab; the integrations and the trainer only the core. And the core alone loads none of the
lab's or the trainer's libraries.
Here the cases that launch processes; those in one process: tests/unit/test_layers.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_core_loads_none_of_the_lab_or_trainer_libraries():
    # measured against `import torch` alone: torch itself imports tqdm when it is installed (as it is here)
    libs = ("pandas", "matplotlib", "seaborn", "papermill", "yaml", "torchvision", "tqdm", "lightning", "transformers",
            "accelerate", "IPython", "PIL")
    code = (f"import sys, torch; before = set(sys.modules); import hetero; hetero.Balance; hetero.HeteroError; "
            f"import hetero.core.fsdp; print(sorted(m for m in {libs!r} if m in sys.modules and m not in before))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
