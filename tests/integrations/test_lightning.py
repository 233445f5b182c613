"""Lightning's own launcher (`python script.py` with devices=2 and strategy ddp or ddp_spawn) sets neither RANK nor,
when the callback is built, WORLD_SIZE: the Balance must learn its rank and world from the trainer, never train on
duplicated data, and move the shares as under torchrun. A tiny model on 8-vectors, 2 CPU processes."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hetero.core.sampler import EpochPlan

from helpers import ROOT, clean_env, max_diff, sgd_step

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
SCRIPT = ROOT / "tests" / "scripts" / "lightning_inside.py"
EXACT = ROOT / "tests" / "scripts" / "lightning_exact.py"


@pytest.mark.slow  # three Lightning launches, about 15 s each on 2 quiet cores
@pytest.mark.parametrize("how", [[], ["--inside"], ["--spawn"]], ids=["ddp", "built-in-the-processes", "ddp_spawn"])
def test_lightnings_own_launcher_covers_every_sample_and_moves_shares(tmp_path, how):
    out = tmp_path / "rec"
    p = subprocess.run([sys.executable, str(SCRIPT), str(out), *how], cwd=tmp_path, env=clean_env(threads="1"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1"):
        seen = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(seen) == list(range(256)), f"epoch {epoch}: not every sample exactly once"
    d = ranks[0]["decisions"]
    assert d == ranks[1]["decisions"] and len(d) == 8            # every 2 of 8 steps, 2 epochs, on both ranks alike
    assert d[-1]["sizes"][0] > d[-1]["sizes"][1]                # the 3x slower rank 1 gives work away


@pytest.mark.slow
def test_a_fit_resumed_from_a_mid_epoch_checkpoint_keeps_the_slow_ranks_share_and_its_coverage(tmp_path):
    """BalanceCallback's state_dict is the Balance's: stopped at step 11 (3 steps into epoch 1) and resumed with
    trainer.fit(ckpt_path=...), the resumed run's first step already gives the 3x slower rank 1 less than half
    (no reset to an even split), and epoch 1's steps before and after the checkpoint consume each sample once."""
    script, out, folder = ROOT / "tests" / "scripts" / "lightning_resume.py", tmp_path / "rec", tmp_path / "ckpt"
    for phase in ("first", "again"):
        p = subprocess.run([sys.executable, str(script), str(out), str(folder), phase], cwd=tmp_path,
                           env=clean_env(threads="1"), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
    first, again = ([json.loads((tmp_path / f"rec.{ph}.rank{r}.json").read_text()) for r in range(2)]
                    for ph in ("first", "again"))
    assert sorted(first[0]["seen"]["0"] + first[1]["seen"]["0"]) == list(range(256))   # epoch 0, all of it
    epoch1 = [i for run in (first, again) for r in run for i in r["seen"].get("1", [])]
    assert sorted(epoch1) == list(range(256)), "epoch 1 across the resume: not every sample exactly once"
    assert again[0]["first"]["epoch"] == 1 and again[0]["first"]["batch_idx"] == 3     # goes on at its step
    sizes = again[0]["first"]["sizes"]
    assert sizes == again[1]["first"]["sizes"] and sizes[1] < sizes[0]               # the estimate came back
    # #48 item 2: the resumed process's first step (step 3, its warm-up) is no window of its own: no decision there
    assert [(d["epoch"], d["step"]) for d in again[0]["decisions"]] == [(1, 5), (1, 7)]



def _resume(tmp_path, *args: str, phases=("first", "again")) -> list[subprocess.CompletedProcess]:
    script, out, folder = ROOT / "tests" / "scripts" / "lightning_resume.py", tmp_path / "rec", tmp_path / "ckpt"
    return [subprocess.run([sys.executable, str(script), str(out), str(folder), ph, *a], cwd=tmp_path,
                           env=clean_env(threads="1"), capture_output=True, text=True, timeout=600)
            for ph, a in zip(phases, args)]


@pytest.mark.slow  # two Lightning launches
def test_an_accumulation_fit_resumed_mid_epoch_runs_each_remaining_step_once_and_no_empty_training_step(tmp_path):
    """Lightning calls no on_train_epoch_start in an epoch it resumes mid-way: the callback still sets the epoch's
    length to its steps, so the resumed epoch runs its 5 remaining steps, one training_step each, and not a sixth on
    an exhausted dataloader_iter (which the example's loss logging failed on); every sample of epoch 1 once."""
    for p in _resume(tmp_path, ["micro"], ["micro"]):
        assert p.returncode == 0, p.stderr[-4000:]
    first, again = ([json.loads((tmp_path / f"rec.{ph}.rank{r}.json").read_text()) for r in range(2)]
                    for ph in ("first", "again"))
    for r in range(2):
        assert [e for e, _ in again[r]["counts"]] == [1] * 5, again[r]["counts"]     # steps 3..7 of epoch 1
        assert all(n > 0 for _, n in again[r]["counts"])
    assert [a[1] + b[1] for a, b in zip(again[0]["counts"], again[1]["counts"])] == [8] * 5  # B/m per step
    assert again[0]["first"]["epoch"] == 1 and again[0]["first"]["batch_idx"] == 3
    epoch1 = [i for run in (first, again) for r in run for i in r["seen"].get("1", [])]
    assert sorted(epoch1) == list(range(256)), "epoch 1 across the resume: not every sample exactly once"
    assert again[0]["decisions"] == again[1]["decisions"]
    # none at step 3: the resumed process's first step (its warm-up) is no window of its own (#48 item 2)
    assert [(d["epoch"], d["step"]) for d in again[0]["decisions"]] == [(1, 5), (1, 7)]


@pytest.mark.slow
def test_an_accumulation_recipe_that_never_breaks_at_sync_now_is_refused_in_one_line_on_every_rank(tmp_path):
    """A training_step that runs on past the optimizer step into the next step's micro-batches (with a replay it
    ran the iterator into an epoch the replay does not have: KeyError, no hetero line): refused at the next step's
    first backward, the same line on both ranks, exit status 2."""
    (p,) = _resume(tmp_path, ["nobreak"], phases=("first",))
    assert p.returncode == 2, p.stderr[-4000:]
    line = ("hetero: training_step went on past its optimizer step into the next step's micro-batches: one "
            "training_step is one step; break out of the dataloader_iter loop after stepping the optimizer where "
            "bal.sync_now (docs/lightning.md#accumulation)")
    assert p.stderr.count(line) == 2 and "Traceback" not in p.stderr, p.stderr[-4000:]  # both ranks (one stderr)


@pytest.mark.slow
def test_a_resume_with_another_global_batch_is_refused_at_load_in_one_line_on_every_rank(tmp_path):
    """Checkpointed with global_batch 32, resumed with 64: the sampler cut 64 from sizes summing to 32 (a ValueError
    from deep inside); now refused when Lightning hands the callback its state, on both ranks."""
    first, again = _resume(tmp_path, ["batch", "32"], ["batch", "64"])
    assert first.returncode == 0, first.stderr[-4000:]
    assert again.returncode == 2, again.stderr[-4000:]
    line = ("hetero: the checkpoint's BalanceCallback state does not fit this Balance: a state of the global batch "
            "32, but this Balance's is 64: resume with global_batch=32")
    assert again.stderr.count(line) == 2 and "Traceback" not in again.stderr, again.stderr[-4000:]

# -- per-rank accumulation and FSDP2: one optimizer step against one process on the union ----------------------
def _exact_run(tmp_path, *cases: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXACT), str(tmp_path / "rec"), *cases], cwd=tmp_path,
                          env=clean_env(threads="1"), capture_output=True, text=True, timeout=600)


# strategy:mode[:broken]: every case that must train, each a fit of its own in one Lightning launch
CASES = ["ddp:micro", "fsdp:micro", "fsdp:batch", "ddp:micro:double", "ddp:micro:remove", "ddp:micro:equal",
         "ddp:tokens", "ddp:budget", "ddp:decide", "ddp:decide:replay", "ddp:decide:swapped"]


@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> dict[str, list[dict]]:
    """The ranks' records of every case in CASES, by case."""
    tmp_path = tmp_path_factory.mktemp("exact")
    p = _exact_run(tmp_path, *CASES)
    assert p.returncode == 0, p.stderr[-4000:]
    named = {case: "-".join((case.split(":") + ["ok"])[:3]) for case in CASES}  # the script's file names
    return {case: [json.loads((tmp_path / f"rec.{name}.rank{r}.json").read_text()) for r in range(2)]
            for case, name in named.items()}


def _script():
    spec = importlib.util.spec_from_file_location("lightning_exact", EXACT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(mod, parts: list[list[int]]) -> list[torch.Tensor]:
    """One process, one SGD step on the mean over ranks of each part's mean loss (one part: the union's mean)."""
    model = mod.net()
    sum(F.cross_entropy(model(mod.X[p]), mod.Y[p]) / len(parts) for p in parts).backward()
    return sgd_step(model, lr=mod.LR)


def _check(ranks: list[dict], lens: list[list[int]]) -> float:
    """The step trained on the sampler's first window, each sample once, as batches of `lens` per rank, and every
    rank's parameters are one single-process SGD step on that union; returns the largest difference."""
    mod = _script()
    per_rank = [[i for b in r["batches"] for i in b] for r in ranks]
    window = EpochPlan(mod.N, mod.B, 0, 0).perm[:mod.B].tolist()
    assert sorted(sum(per_rank, [])) == sorted(window), "not the step's global batch, each sample once"
    exact, means = _reference(mod, [window]), _reference(mod, per_rank)
    assert max_diff([p.tolist() for p in exact], means) > 1e-3, "cannot tell b_i/B from the mean of rank means"
    assert [[len(b) for b in r["batches"]] for r in ranks] == lens
    worst = max(max_diff(r["params"], exact) for r in ranks)
    assert worst < 1e-5, f"not the single-process step ({worst:.2e} away)"
    return worst


MICRO = [[4], [4, 4, 4]]  # micro_batch 4, counts k = [1, 3]


@pytest.mark.slow  # one Lightning launch for every case of CASES, 20 to 30 s on 2 quiet cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_per_rank_accumulation_is_one_single_process_step_on_the_union(exact, strategy):
    """Manual optimisation on Lightning's dataloader_iter, micro-batches of 4, k = [1, 3] (DDPStrategy, and
    ModelParallelStrategy with fully_shard in configure_model): the same parameters as one process's SGD step."""
    _check(exact[f"{strategy}:micro"], MICRO)


@pytest.mark.slow
def test_model_parallel_strategy_with_per_rank_batch_sizes_is_exact(exact):
    """Automatic optimisation, FSDP2 through ModelParallelStrategy, sizes [3, 13]: b_i/B in the reduce-scatter."""
    _check(exact["fsdp:batch"], [[3], [13]])


@pytest.mark.slow
@pytest.mark.parametrize(("broken", "fails"), [("double", "not the single-process step"),
                                               ("remove", "not the single-process step"),
                                               ("equal", "cannot tell")])
def test_the_exactness_check_fails_when_the_weighting_is_doubled_or_removed_or_the_counts_equal(exact, broken, fails):
    """Negative controls of the check above (DDP): this rank's weight doubled (bal.set_weight), no b_i/B
    weighting (scheme "sync": the mean of rank means), and counts [2, 2], where the two cannot be told apart."""
    ranks = exact[f"ddp:micro:{broken}"]
    with pytest.raises(AssertionError, match=fails):
        _check(ranks, MICRO)


def test_accumulate_grad_batches_with_hetero_is_refused_in_one_line_pointing_to_the_recipe(tmp_path):
    """In one process (the refusal reads the Trainer's setting at fit start, before any collective: the same line on
    every rank), a real Trainer(accumulate_grad_batches=2) fit."""
    import lightning as L

    import hetero

    mod = _script()
    bal = hetero.Balance(global_batch=mod.B)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, accumulate_grad_batches=2, logger=False,
                        callbacks=[hetero.BalanceCallback(bal)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(mod.Indexed(), batch_sampler=bal.batch_sampler(mod.N))
    with pytest.raises(ValueError, match=r"^hetero: accumulate_grad_batches is one count on every rank: set "
                                         r"Balance\(micro_batch=m\) .*docs/lightning.md#accumulation\)$"):
        trainer.fit(mod.Module(bal, str(tmp_path / "rec"), "ddp", "batch", ""), loader)


@pytest.mark.slow
def test_model_parallel_strategy_with_tensor_parallelism_is_refused_in_one_line(tmp_path):
    p = _exact_run(tmp_path, "fsdp:micro:tp")
    assert p.returncode == 2 and "hetero: ModelParallelStrategy with tensor_parallel_size > 1" in p.stderr, \
        p.stderr[-4000:]


@pytest.mark.slow  # one Lightning launch, about 20 s on 2 quiet cores
def test_the_accumulation_example_on_fsdp2_covers_every_sample_and_moves_micro_batches_off_the_slow_rank(tmp_path):
    """examples/lightning_lm.py --fsdp (ModelParallelStrategy) with rank 1 3x slower: every sample of each epoch once,
    the slow rank's count of micro-batches falls below the fast rank's, the loss falls."""
    out = tmp_path / "rec"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_lm.py"), "--devices", "2", "--fsdp",
                        "--hetero", "1:slowdown=3,1:delay=0.05", "--subset", "512", "--record", str(out)], cwd=tmp_path,
                       env=clean_env(threads="1"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1"):
        assert sorted(ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]) == list(range(512))
    counts = [r["counts"] for r in ranks]
    assert len(counts[0]) == len(counts[1]) == 2 * 512 // 32                  # one training_step per step
    assert all(a + b == 8 for a, b in zip(*counts))                           # 8 micro-batches of 4 per step
    assert counts[1][-1] < counts[0][-1]                                      # direction only: no timing asserted
    losses = [float(x) for x in re.findall(r"train loss ([\d.]+)", p.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.slow  # in the launch of CASES
def test_a_step_split_by_tokens_is_one_process_on_the_unpacked_union(exact):
    """Lightning with Balance(collator="padded", loss_mean="tokens") and the BalanceCallback: each rank's rows chosen
    by their cost, a token-mean loss, the engine's n_i / N; one process's SGD step on the step's window, each document
    alone (tests/tokenlm.py; its launch without Lightning: test_tokens.py)."""
    import tokenlm

    mod = _script()
    ranks = exact["ddp:tokens"]
    window = EpochPlan(mod.N, mod.B, 0, 0).perm[:mod.B].tolist()
    assert sorted(i for r in ranks for b in r["batches"] for i in b) == sorted(window)
    want = tokenlm.reference([window], mod.TOKENS, mod.LABELS, "tokens", mod.LR)[0]
    for r in ranks:
        got = [v for p in r["params"] for v in p]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-9


@pytest.mark.slow  # in the launch of CASES
def test_an_epoch_by_tokens_under_lightning_is_the_union_and_its_replay_gives_each_batch_the_runs_rows(exact):
    """A fit by tokens over a whole epoch (two steps, rank 1 slower, a decision every step) covers every document
    once and ends as one process on each step's unpacked union. bal.replay(its decisions, through JSON) in a second
    fit under Lightning's launcher and the BalanceCallback: on each rank every batch of the epoch's two steps is the
    run's, the parameters end as the run's to the bit, and the replay makes no decision. The control: the record
    with the ranks' costs swapped (rank 1 was the slower) gives other rows."""
    import tokenlm

    mod = _script()
    run, replay, swapped = (exact[f"ddp:decide{b}"] for b in ("", ":replay", ":swapped"))
    perm = EpochPlan(mod.N, mod.B, 0, 0).perm.tolist()
    steps = [sorted(a + b) for a, b in zip(run[0]["batches"], run[1]["batches"])]  # one batch a rank a step
    assert [sorted(perm[i * mod.B:(i + 1) * mod.B]) for i in range(2)] == steps  # each step its window: the epoch
    assert [len(b) for b in run[1]["batches"]] != [mod.B // 2] * 2  # the decisions moved the split
    want = tokenlm.reference(steps, mod.TOKENS, mod.LABELS, "tokens", mod.LR)[-1]  # after both steps
    for r in run:
        assert max(abs(a - b) for a, b in zip((v for p in r["params"] for v in p), want)) < 1e-9
    for r in range(2):
        assert len(run[r]["decisions"]) >= 1 and len(run[r]["batches"]) == 2
        assert replay[r]["batches"] == run[r]["batches"] and replay[r]["params"] == run[r]["params"]
        assert replay[r]["decisions"] == []
    assert any(swapped[r]["batches"] != run[r]["batches"] for r in range(2))


@pytest.mark.slow  # in the launch of CASES
def test_a_step_of_a_token_budget_is_one_process_on_the_unpacked_union(exact):
    """Lightning with Balance(token_budget=360, collator="padded"): the first step is the permutation's first run of
    about a quarter of the tokens (7 documents here, where global_batch said 16), split by cost; a sample-mean loss
    weighed b_i over that step's count equals one process's step on it."""
    import tokenlm

    mod = _script()
    ranks = exact["ddp:budget"]
    rows = sorted(i for r in ranks for b in r["batches"] for i in b)
    perm, lengths = EpochPlan(mod.N, mod.B, 0, 0).perm.tolist(), mod.LENGTHS
    window = perm[:len(rows)]
    assert rows == sorted(window) and all(r["batches"] for r in ranks)
    assert abs(lengths[window].sum() - lengths.sum() / 4) <= lengths.max() and len(window) != mod.B
    want = tokenlm.reference([window], mod.TOKENS, mod.LABELS, "samples", mod.LR)[0]
    for r in ranks:
        got = [v for p in r["params"] for v in p]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-9
