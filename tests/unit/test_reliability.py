"""Reliability: bad input gives one line and exit 2; a dying worker never hangs the others; checkpoints are
atomic; --resume continues without duplicated or missing epochs; --replay reproduces a run bit for bit.
Here the cases in one process; those that launch processes: tests/integration/test_reliability_launch.py."""

import pytest
import torch

from hetero.trainer.runfolder import RunFolder

from helpers import TINY

BAD = [
    (["--model", "alexnet"], "unknown model 'alexnet'"),
    (["--scheme", "fast"], "unknown scheme 'fast'"),
    (["--data", "mnist"], "unknown data set 'mnist'"),
    (["--hetero", "1:delay"], "bad --hetero"),
    (["--hetero", "1:delay=-0.1"], "non-negative"),
    (["--hetero", "1:delay=inf"], "finite"),
    (["--hetero", "2:delay=0.1"], "rank 2 is not below the world size 2"),
    (["--global-batch", "3", "--min-batch", "2"], "smaller than 2 ranks x min batch"),
    (["--subset", "100"], "--subset 100 is smaller than the global batch 128"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--lr", "-0.1"], "--lr must be positive"),
    (["--lr", "nan"], "--lr must be positive"),
    (["--epochs", "two"], "invalid int value"),
    (["--run-dir", "/proc/hetero-run"], "is not writable"),
    (["--resume", "/nonexistent/run"], "cannot resume"),
    (["--data", "imagefolder", "--data-dir", "/nonexistent"], "has no train/ subfolder"),
    (["--min-batch", "0"], "--min-batch must be at least 1"),
    (["--device", "tpu"], "unknown device"),
]


def _main(argv: list[str]) -> int:
    """hetero.trainer.run.main in this process (no torch import per case); an argparse error exits like the CLI."""
    from hetero.trainer.run import main
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("extra,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_one_line_exit_2(extra, message, monkeypatch, capsys):
    for var in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _main([*TINY, *extra, "--check"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetero: error: ") and message in lines[0], lines


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    folder = RunFolder(tmp_path)
    folder.save_checkpoint({"epoch": 1, "w": torch.ones(3)})
    real_save = torch.save

    def dies_half_way(obj, fh):  # a process killed while writing: half a file, then the error
        real_save(obj, fh)
        raise RuntimeError("killed while writing")
    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(RuntimeError):
        folder.save_checkpoint({"epoch": 2, "w": torch.zeros(1000)})
    monkeypatch.setattr(torch, "save", real_save)
    state = folder.load_checkpoint()
    assert state["epoch"] == 1 and torch.equal(state["w"], torch.ones(3)) and not list(tmp_path.glob(".*.tmp"))
