"""Memory-aware limits: the largest-batch search, the probe's bookkeeping (on the CPU, with a model that raises
CUDA's out-of-memory error above a size), `--max-batch probe` in the config and in a real run."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from hetero.core.memory import fitting_batch, largest_fitting, probe_max_batch, shared_gpus
from hetero.trainer.config import Config, ConfigError

from helpers import TINY, read_run, run_train


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 64), (3, 100), (1, 1000), (16, 17)])
def test_largest_fitting_matches_brute_force_in_few_calls(lo, hi):
    for limit in sorted({0, lo - 1, lo, lo + 1, hi - 1, hi, hi + 5, (lo + hi) // 2, 37, 2 * lo + 1}):
        calls = []

        def fits(b):
            assert lo <= b <= hi, b          # never tries outside the range
            calls.append(b)
            return b <= limit

        want = max((b for b in range(lo, hi + 1) if b <= limit), default=0)
        assert largest_fitting(fits, lo, hi) == want, (lo, hi, limit)
        assert len(calls) <= 2 * math.ceil(math.log2(hi / lo + 1)) + 2, (lo, hi, limit, calls)


def test_largest_fitting_rejects_an_empty_range():
    with pytest.raises(ValueError):
        largest_fitting(lambda b: True, 5, 4)


class OomAbove(nn.Module):
    """A small batch-norm CNN that raises CUDA's out-of-memory error for batches above `limit`, as a GPU would."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.tried = limit, []
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 10))

    def forward(self, x):
        self.tried.append(len(x))
        if len(x) > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (batch {len(x)})")
        return self.body(x)


@pytest.mark.parametrize("limit,hi,want", [(1000, 256, 256),    # all of the global batch fits
                                           (200, 256, 180),     # 200 fits, 201 does not: 0.9 x 200
                                           (283, 256, 254),     # headroom applies below hi as well
                                           (1, 256, 1)])        # never below the smallest allowed batch
def test_probe_search_headroom_and_a_model_left_as_found(limit, hi, want):
    torch.manual_seed(0)
    model = OomAbove(limit)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    got = fitting_batch(model, (3, 8, 8), 10, torch.device("cpu"), lo=1, hi=hi)
    assert got == want
    assert max(b for b in model.tried if b <= limit) == min(limit, math.ceil(hi / 0.9))  # found the real edge
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # BN statistics restored
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)  # dropout in the trials did not move the run's RNG


def test_probe_fails_clearly_when_nothing_fits_and_skips_cpu_ranks():
    with pytest.raises(RuntimeError, match="not even 4 sample"):
        fitting_batch(OomAbove(3), (3, 8, 8), 10, torch.device("cpu"), lo=4, hi=64)
    assert probe_max_batch(OomAbove(3), (3, 8, 8), 10, torch.device("cpu"), lo=1, hi=64) == math.inf


def test_config_takes_probe_per_rank():
    cfg = Config(max_batch="probe,40", data="synthetic")
    cfg.check_world(2)
    assert cfg.probes(0, 2) and not cfg.probes(1, 2)
    assert cfg.max_batches(2) == [math.inf, 40] and cfg.max_batches(2, probed=[90.0, math.inf]) == [90.0, 40]
    for bad in ("prob", "probe;4", "-1"):
        with pytest.raises(ConfigError, match="expected whole numbers >= 0 .*or probe"):
            Config(max_batch=bad)


def test_probe_refuses_ranks_that_share_a_gpu():
    places = [("a", "cuda:0", "uuid A"), ("a", "cuda:0", "uuid A"), ("b", "cuda:0", "uuid B"), ("a", "cpu", ""),
              ("a", "cpu", "")]
    assert shared_gpus(places, [True] * 5) == [[0, 1]]           # same host and GPU; CPU ranks may share
    assert shared_gpus(places, [False, True, True, True, True]) == [[0, 1]]
    assert shared_gpus(places, [False, False, True, True, True]) == []  # given limits for both: nothing probed there
    assert shared_gpus([("a", "cuda:0", "uuid A"), ("a", "cuda:1", "uuid B")], [True, True]) == []
    # one GPU visible per rank (SLURM --gpus-per-task): every rank's is cuda:0, but they are different GPUs
    assert shared_gpus([("a", "cuda:0", "uuid A"), ("a", "cuda:0", "uuid B")], [True, True]) == []
    # and the same GPU under two names (cuda:0 and cuda:1 with different CUDA_VISIBLE_DEVICES) is shared
    assert shared_gpus([("a", "cuda:0", "uuid A"), ("a", "cuda:1", "uuid A")], [True, True]) == [[0, 1]]


# -- max_tokens "probe" (split by tokens): the most tokens one forward of a language model holds -------------------

class LmOomAbove(nn.Module):
    """A tiny language model with a dropout and a buffer that raises CUDA's out-of-memory error for a forward of more
    than `limit` tokens or a row longer than `longest`, as a GPU would; it returns its loss under the key `loss` (a
    ModelOutput's) and records what it was given: (rows, length, position_ids given)."""

    def __init__(self, limit: int, longest: int = 10**9):
        super().__init__()
        self.limit, self.longest, self.tried = limit, longest, []
        self.emb, self.drop, self.head = nn.Embedding(16, 8), nn.Dropout(0.5), nn.Linear(8, 16)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, input_ids, labels, position_ids=None):
        self.tried.append((*input_ids.shape, position_ids is not None))
        if input_ids.numel() > self.limit or input_ids.shape[1] > self.longest:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({input_ids.numel()} tokens)")
        self.seen += 1
        logits = self.head(self.drop(self.emb(input_ids)))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


@pytest.mark.parametrize("collator,limit,longest,want", [
    ("padded", 1000, 10**9, 900),    # 1000 tokens fit, 1001 do not: 0.9 x 1000
    ("padded", 10**6, 10**9, 4096),  # all a forward could be given fits
    ("padded", 5000, 300, 270),      # rows longer than 300 do not fit: no more than one such row
    ("packed", 1000, 10**9, 900),
    ("packed", 5000, 700, 630)])     # packed, one row of them all
def test_the_token_probe_finds_the_most_tokens_one_forward_holds_in_its_costliest_layout(collator, limit, longest,
                                                                                       want):
    """Padded, the trials run rows as long as the model takes (max_length 512), as few as hold the tokens (the longest
    rows cost the most for their tokens); packed, one row of them all with restarting position_ids. The cap is the
    largest count that fits, times the headroom, within [lo, hi]; the model comes back as it was (no gradient, its
    buffer, the random state)."""
    from hetero.core.memory import fitting_tokens, token_batch

    shape = lambda t: tuple(token_batch(t, 512, "padded", torch.device("cpu"))["input_ids"].shape)  # noqa: E731
    assert shape(1000) == (2, 500) and shape(1025) == (3, 342) and shape(300) == (1, 300)
    packed = token_batch(1030, 512, "packed", torch.device("cpu"))
    assert packed["input_ids"].shape == (1, 1030) and packed["position_ids"][0, [0, 511, 512, 1029]].tolist() == \
        [0, 511, 0, 5]
    torch.manual_seed(0)
    model = LmOomAbove(limit, longest)
    rng = torch.get_rng_state()
    got = fitting_tokens(model, torch.device("cpu"), lo=1, hi=4096, max_length=512, collator=collator)
    assert got == want
    if collator == "padded":
        assert all(n <= 512 and r * n >= 1 and not pos for r, n, pos in model.tried)
    else:
        assert all(r == 1 and pos for r, n, pos in model.tried)
    assert float(model.seen) == 0 and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_token_probe_fails_clearly_and_skips_cpu_ranks():
    from hetero.core.memory import fitting_tokens, probe_max_tokens

    with pytest.raises(RuntimeError, match="^max_tokens probe: not even 64 token"):
        fitting_tokens(LmOomAbove(10), torch.device("cpu"), lo=64, hi=4096, max_length=512)
    assert probe_max_tokens(LmOomAbove(10), torch.device("cpu"), lo=1, hi=4096, max_length=512) == math.inf
    with pytest.raises(TypeError, match="must return its loss for model"):
        fitting_tokens(_NoLoss(), torch.device("cpu"), lo=1, hi=8, max_length=8)


class _NoLoss(nn.Module):
    def forward(self, input_ids, labels):
        return object()


def _token_balance(max_tokens, micro_batch: int = 1):
    import hetero

    bal = hetero.Balance(global_batch=8, collator="padded", micro_batch=micro_batch, max_tokens=max_tokens)
    bal.set_world(0, 1)
    return bal


def test_max_tokens_probe_sets_the_caps_the_split_cuts_by(monkeypatch):
    """bal.probe with max_tokens "probe": a GPU's search (here on the CPU with a model out of memory above 120
    tokens, probe_max_tokens taking the CPU as a GPU) gives the cap (0.9 x 120 = 108), which the sampler's micro-batches
    then keep; a CPU rank gets none; attach before the probe, a probe with nothing set to "probe", and one without
    max_length on a model without a config are each one line; a sample longer than the probed cap is refused."""
    import numpy as np

    from hetero.core import memory, probe
    from hetero.core.agree import HeteroError

    bal = _token_balance("probe")
    with pytest.raises(ValueError, match='max_tokens "probe": call bal.probe'):
        bal.attach(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match='max_tokens "probe" needs the longest row'):
        bal.probe(LmOomAbove(120), device=torch.device("cpu"))
    assert bal.probe(LmOomAbove(120), device=torch.device("cpu"), max_length=64) == [math.inf]  # a CPU rank
    with pytest.raises(ValueError, match="nothing to probe"):
        _token_balance(None).probe(LmOomAbove(120), device=torch.device("cpu"))

    monkeypatch.setattr(probe, "probe_max_tokens", memory.fitting_tokens)  # the search, with the CPU as a GPU
    bal = _token_balance("probe", micro_batch=4)
    lengths = np.random.default_rng(0).integers(1, 60, 64)
    bal.sampler = bal.batch_sampler(len(lengths), lengths=lengths)
    assert bal.probe(LmOomAbove(120), device=torch.device("cpu"), max_length=64) == [108.0]
    bal.set_epoch(0)
    handed = list(bal.sampler)
    assert sorted(i for b in handed for i in b) == list(range(64))
    assert all(len(b) * lengths[b].max() <= 108 for b in handed)  # padded: rows x the longest
    assert any(len(b) < 4 for b in handed)  # the cap bound: some micro-batch closed before 4 rows

    bal = _token_balance("probe")
    bal.sampler = bal.batch_sampler(3 * 8, lengths=[100] * 24)
    with pytest.raises(HeteroError, match="^hetero: after the probe, hetero: sample 0 is 100 tokens long, more than "
                                          "any rank's max_tokens \\(the largest is 81\\)"):
        bal.probe(LmOomAbove(90), device=torch.device("cpu"), max_length=128)


# the cases that launch processes
@pytest.mark.launch
@pytest.mark.slow
def test_probe_on_cpu_ranks_means_no_limit_and_limits_still_hold(tmp_path):
    run = tmp_path / "run"
    # epoch 0 measures, epoch 1 runs the decision: rank 1 would take about 3/4 of 128, and its limit of 40 holds
    p = run_train([*TINY, "--epochs", "2", "--scheme", "dp", "--hetero", "0:slowdown=3", "--threads", "1",
                   "--max-batch", "probe,40", "--run-dir", str(run)], nproc=2)
    assert "largest batch per rank (--max-batch probe,40): -,40" in p.stdout
    r = read_run(run)
    assert r["config"]["max_batches"] == [None, 40]
    assert r["steps"][r["steps"]["rank"] == 1].batch_size.max() == 40  # rank 1 would take more: the limit holds
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
