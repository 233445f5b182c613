"""The HF loss rule in the usual LLM setting: per_device_train_batch_size=1 (m = 1), gradient_accumulation_steps G in
{2, 4, 8}, 2 gloo ranks with unequal counts of micro-batches, every loss kind of test_hf_losses' matrix plus a
per-sample mean and a plain token sum. Each case steps as the plain single-process Trainer on the union, or is refused
in one line on both ranks; never a wrong rule (issue 48, item 1: the probe once took "tokens" for every loss that
ignores num_items_in_batch when it saw one row).

- rows of one shape (fixed-length blocks, padded labels): hetero joins a rank's one-row micro-batches and tells the
  count; a rank with one row agrees to what the other finds;
- rows of their own lengths, unpadded (the usual collator with m = 1): nothing joins, so a mean's count cannot be
  told and is refused unless HeteroTrainer(loss_mean=...) says it; said, the step is exact;
- m = 2 whose first micro-batches are all unpadded: tokens, shifted tokens and rows are proportional, refused alike;
- a said rule that the loss contradicts is refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
os.environ["HF_HUB_OFFLINE"] = "1"  # noqa: E402  (before transformers reads it)
import transformers as tf  # noqa: E402
from test_hf_losses import CASES, MODELS, N, Rows, T, _rows, _shifted_ce  # noqa: E402

import hetero  # noqa: E402
from hetero.core.sampler import EpochPlan  # noqa: E402
from hetero.integrations.hf import HeteroTrainer  # noqa: E402

from helpers import max_diff, spawned  # noqa: E402

# about 90 one-step Trainer runs in two processes, then their references
pytestmark = [pytest.mark.launch, pytest.mark.slow]
LR, SEED = 0.5, 5
SIZES = {2: [1, 3], 4: [3, 5], 8: [3, 13]}  # G: the ranks' micro-batches of one row (k_i), summing to 2 x G


def row_mean(outputs, labels, num_items_in_batch=None):
    """A per-sample mean: each row's mean over its shifted valid tokens, then the mean over rows (kind "rows")."""
    logits = outputs["logits"][:, :-1]
    each = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
    return (each.sum(1) / labels[:, 1:].ne(-100).sum(1)).mean()


def token_sum(outputs, labels, num_items_in_batch=None):
    """A token sum that ignores the count: no mean at all (refused)."""
    return F.cross_entropy(*_shifted_ce(outputs, labels), ignore_index=-100, reduction="sum")


# name: (model, fields, compute_loss_func, the kind a rank's joined rows name, or None: refused)
KINDS = {name: case for name, case in CASES.items()}
KINDS["bert_seqcls"] = ("BertForSequenceClassification", "seqcls", None, None)  # one label per row: tokens = rows
KINDS["func_rows"] = ("LlamaForCausalLM", "lm", row_mean, "rows")
KINDS["func_token_sum"] = ("LlamaForCausalLM", "lm", token_sum, None)
SAID = {"bert_seqcls": "tokens", "bert_mlm": "tokens", "t5": "tokens", "func_mean": "shifted", "func_rows": "rows"}
CONTRADICTED = {"func_mean": "tokens", "llama": "rows", "func_rows": "trainer", "func_aux": "shifted"}


class OwnRows(torch.utils.data.Dataset):
    """test_hf_losses' rows cut to their own lengths (2 to 8 tokens, every label valid), with an attention mask:
    what a padding collator hands out with one row per micro-batch."""

    def __init__(self, fields: str, only: list[int] | None = None):
        rows = Rows(fields).items
        valid = [int(r["attention_mask"].sum()) for r in _rows()]
        cut = [{k: v[:n] if v.dim() and len(v) == T else v for k, v in row.items()} for n, row in zip(valid, rows)]
        for row in cut:
            row.setdefault("attention_mask", torch.ones_like(row["input_ids"]))
            if fields == "lm":
                row["labels"] = row["input_ids"].clone()
        self.items = [cut[i] for i in (only if only is not None else range(N))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Unpadded(Rows):
    """Full-length rows, every label valid: tokens, shifted tokens and rows proportional in every batch."""

    def __init__(self, fields: str, only: list[int] | None = None):
        super().__init__(fields, only)
        for row in self.items:
            row["labels"] = row["input_ids"].clone()


def pad(rows: list[dict]) -> dict:
    """The union's padding collator: ids and mask with 0 on the right, labels with -100 (ignored)."""
    out = {}
    for k in rows[0]:
        if rows[0][k].dim() == 0:
            out[k] = torch.stack([r[k] for r in rows])
            continue
        value = -100 if k == "labels" else 0
        out[k] = torch.nn.utils.rnn.pad_sequence([r[k] for r in rows], batch_first=True, padding_value=value)
    return out


DATA = {"block": Rows, "own": OwnRows, "unpadded": Unpadded}


def _args(out: str, batch: int, accumulate: int) -> tf.TrainingArguments:
    return tf.TrainingArguments(output_dir=out, per_device_train_batch_size=batch,
                                gradient_accumulation_steps=accumulate, max_steps=1, optim="sgd", learning_rate=LR,
                                lr_scheduler_type="constant",
                                max_grad_norm=0.0, use_cpu=True, save_strategy="no", logging_strategy="no",
                                report_to=[], disable_tqdm=True, remove_unused_columns=False,
                                ddp_find_unused_parameters=False)


def _runs() -> list[tuple]:
    """(key, case, data, m, G, sizes, said) for every run of the matrix."""
    runs = []
    for g, sizes in SIZES.items():
        for case in KINDS:
            runs.append((f"block/{case}/{g}", case, "block", 1, g, sizes, None))
            if case != "vit":  # images have one shape
                runs.append((f"own/{case}/{g}", case, "own", 1, g, sizes, None))
        for case, said in SAID.items():
            runs.append((f"own/{case}/{g}/{said}", case, "own", 1, g, sizes, said))
    for case, said in CONTRADICTED.items():
        runs.append((f"block/{case}/2/{said}", case, "block", 1, 2, SIZES[2], said))
    for case in ("t5", "func_mean", "func_rows"):  # m = 2, k = [1, 3]: 2 x 2 x 2 = 8
        runs.append((f"unpadded/{case}/2", case, "unpadded", 2, 2, [2, 6], None))
        runs.append((f"unpadded/{case}/2/{SAID[case]}", case, "unpadded", 2, 2, [2, 6], SAID[case]))
    return runs


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    for key, case, data, m, g, sizes, said in _runs():
        model, fields, func, _ = KINDS[case]
        bal = hetero.Balance(global_batch=2 * m * g, micro_batch=m, seed=SEED)
        bal.replay({0: [sizes] * (N // (2 * m * g))})  # a record covers the epoch; the run stops after one
        trainer = HeteroTrainer(model=MODELS[model](), args=_args(f"{out}/{key}", m, g),
                                train_dataset=DATA[data](fields), compute_loss_func=func, balance=bal, loss_mean=said)
        try:
            trainer.train()
        except ValueError as e:
            result[key] = str(e)
            continue
        params = [p.detach().flatten().tolist() for p in trainer.model.parameters()]
        result[key] = {"kind": trainer._loss_kind, "sizes": bal.last_sizes, "params": params}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return spawned(_worker, tmp_path_factory.mktemp("hf_loss_rule"))


_REFERENCES: dict[tuple, list[torch.Tensor]] = {}


def _reference(case: str, data: str, batch: int, out) -> list[torch.Tensor]:
    """The plain transformers.Trainer in one process, one SGD step on the union of the ranks' micro-batches."""
    if (case, data, batch) not in _REFERENCES:
        model, fields, func, _ = KINDS[case]
        union = EpochPlan(N, batch, SEED, 0).perm[:batch].tolist()
        trainer = tf.Trainer(model=MODELS[model](), args=_args(str(out), batch, 1),
                             train_dataset=DATA[data](fields, union), compute_loss_func=func,
                             data_collator=pad if data == "own" else None)
        trainer.train()
        _REFERENCES[case, data, batch] = [p.detach().flatten() for p in trainer.model.parameters()]
    return _REFERENCES[case, data, batch]


def _exact(got: list[dict], case: str, data: str, batch: int, sizes: list[int], out) -> None:
    model = KINDS[case][0]
    want = _reference(case, data, batch, out)
    moved = max_diff([p.detach().flatten().tolist() for p in MODELS[model]().parameters()], want)
    assert moved > 1e-3, f"{case}: the step barely moves the parameters, so exactness would prove little"
    for rank in got:
        assert rank["sizes"] == sizes and rank["kind"] == got[0]["kind"]
        assert max_diff(rank["params"], want) < 1e-5, f"{case}: not the union's step (the step moved {moved:.3g})"


def _refused(got: list, what: str) -> str:
    assert isinstance(got[0], str) and got[0] == got[1], f"not refused alike on both ranks: {got}"
    assert got[0].startswith("hetero: ") and "\n" not in got[0] and what in got[0], got[0]
    return got[0]


AMBIGUOUS = "cannot tell which count it is a mean over"
NOT_A_MEAN = "is neither divided by the Trainer's num_items_in_batch nor a mean"


@pytest.mark.parametrize("g", SIZES)
@pytest.mark.parametrize("case", KINDS)
def test_one_row_micro_batches_of_one_shape_are_joined_and_told(trained, tmp_path, case, g):
    got = [rank[f"block/{case}/{g}"] for rank in trained]
    kind = KINDS[case][3]
    if kind is None:
        _refused(got, AMBIGUOUS if case == "bert_seqcls" else NOT_A_MEAN)
        return
    assert got[0]["kind"] == kind, f"{case}: took {got[0]['kind']!r}"
    _exact(got, case, "block", 2 * g, SIZES[g], tmp_path)


@pytest.mark.parametrize("g", SIZES)
@pytest.mark.parametrize("case", [c for c in KINDS if c != "vit"])
def test_one_row_micro_batches_of_their_own_lengths_are_exact_or_refused(trained, tmp_path, case, g):
    """Nothing joins (rows of different lengths but the odd pair): the Trainer's count is still told by doubling it,
    a sum by doubling the batch; a mean's count is told only where two rows of one length happen to meet, else
    refused naming loss_mean. Said, every mean steps as the union."""
    got = [rank[f"own/{case}/{g}"] for rank in trained]
    kind = KINDS[case][3]
    if kind == "trainer":
        assert got[0]["kind"] == "trainer"
        _exact(got, case, "own", 2 * g, SIZES[g], tmp_path)
    elif kind is None:
        _refused(got, AMBIGUOUS if case == "bert_seqcls" else NOT_A_MEAN if case == "func_token_sum" else "hetero: ")
    elif isinstance(got[0], str):
        assert "loss_mean=" in _refused(got, AMBIGUOUS)
    else:  # two rows of one length met on a rank and told the count
        assert got[0]["kind"] == kind, f"{case}: took {got[0]['kind']!r}"
        _exact(got, case, "own", 2 * g, SIZES[g], tmp_path)
    if case in SAID:
        said = [rank[f"own/{case}/{g}/{SAID[case]}"] for rank in trained]
        assert said[0]["kind"] == SAID[case]
        _exact(said, case, "own", 2 * g, SIZES[g], tmp_path)


@pytest.mark.parametrize("case", ["t5", "func_mean", "func_rows"])
def test_unpadded_first_micro_batches_cannot_tell_the_count(trained, tmp_path, case):
    """m = 2, every label valid: each count is proportional to the others, so the loss's count is refused unless
    said; said, the step is the union's."""
    _refused([rank[f"unpadded/{case}/2"] for rank in trained], AMBIGUOUS)
    said = [rank[f"unpadded/{case}/2/{SAID[case]}"] for rank in trained]
    assert said[0]["kind"] == SAID[case]
    _exact(said, case, "unpadded", 8, [2, 6], tmp_path)


@pytest.mark.parametrize("case", CONTRADICTED)
def test_a_said_rule_the_loss_contradicts_is_one_line(trained, case):
    said = CONTRADICTED[case]
    line = _refused([rank[f"block/{case}/2/{said}"] for rank in trained], f'hetero: loss_mean="{said}" says ')
    assert line.count("hetero") == 1
