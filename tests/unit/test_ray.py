"""hetero.integrations.ray's pure parts, in one process (no Ray cluster): an emulation spec and per-worker settings
follow the workers' identities when Ray renumbers the ranks or the group shrinks; the example's bad settings stop
before Ray starts. The launches: tests/integration/test_ray_launch.py (slow tier)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hetero.integrations import ray as hetero_ray  # its pure parts load without Ray
from hetero.lab.launch import clean_env

from helpers import ROOT


def test_the_emulation_follows_the_worker_not_the_rank():
    first = ["h/gpu uuid A", "h/gpu uuid B"]
    assert hetero_ray.for_this_world("1:slowdown=3", first, first) == "1:slowdown=3"
    # Ray put worker B on rank 0 this time: the slowness goes with B
    assert hetero_ray.for_this_world("1:slowdown=3,0:delay=0.1@s5-", first, first[::-1]) == \
        "0:slowdown=3,1:delay=0.1@s5-"
    assert hetero_ray.for_this_world("1:slowdown=3", first, ["h/gpu uuid A"]) == ""  # B is gone
    assert hetero_ray.for_this_world("", first, first) == ""


def test_a_spec_naming_a_worker_the_first_start_lacked_or_a_bad_spec_is_one_line():
    with pytest.raises(ValueError, match="hetero names worker 2, but the first start had 2 worker"):
        hetero_ray.for_this_world("2:slowdown=3", ["a", "b"], ["a", "b"])
    with pytest.raises(ValueError):
        hetero_ray.for_this_world("1:fast=3", ["a", "b"], ["a", "b"])


def test_per_worker_settings_by_identity():
    assert hetero_ray.by_worker({"b": 48}, ["b", "a", "c"], None) == [48, None, None]


@pytest.mark.slow  # the example imports Ray (seconds of imports on a busy machine)
def test_the_example_refuses_a_bad_setting_in_one_line_before_ray_starts():
    pytest.importorskip("ray.train", reason="the [ray] extra is not installed")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_train.py"), "--scheme", "fast"], cwd=ROOT,
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "hetero: error: unknown scheme 'fast' (choose from sync, dp, edp, affine)"]
