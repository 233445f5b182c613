"""The HF Trainer's loss convention decided from what each model's loss does (hetero.integrations.hf.loss), as a
matrix of real model classes built from tiny configs: one HeteroTrainer SGD step on 2 gloo ranks with sizes 3 and 13
equals one step of the plain single-process Trainer on the union of the two batches (padded rows included), with
average_tokens_across_devices True and False; a loss that fits no convention is refused in one line naming the class.
BertForSequenceClassification takes **kwargs but never reads num_items_in_batch: deciding from the signature (the
Trainer's model_accepts_loss_kwargs) sums the ranks' means, 0.05 off. Its count, one label per row, is said
(loss_mean="tokens"): tokens and rows cannot be told apart there (test_hf_loss_rule.py: refused unsaid)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
os.environ["HF_HUB_OFFLINE"] = "1"  # noqa: E402  (before transformers reads it)
import transformers as tf  # noqa: E402

import hetero  # noqa: E402
from hetero.core.sampler import EpochPlan  # noqa: E402
from hetero.integrations.hf import HeteroTrainer  # noqa: E402

from helpers import max_diff, spawned  # noqa: E402

B, SIZES, T, VOCAB, LR, SEED, N = 16, [3, 13], 8, 16, 0.5, 5, 24  # N rows; step 0's window is 16 of them
# 2 x 18 Trainer steps in two processes, then 16 single-process references: ~40 s
pytestmark = [pytest.mark.launch, pytest.mark.slow]


def _seeded(make):
    def build():
        torch.manual_seed(0)
        return make()
    return build


MODELS = {
    "LlamaForCausalLM": _seeded(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=T))),
    "GPT2LMHeadModel": _seeded(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))),
    "BertForSequenceClassification": _seeded(lambda: tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=T, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))),
    "BertForMaskedLM": _seeded(lambda: tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=T, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))),
    "T5ForConditionalGeneration": _seeded(lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))),
    "ViTForImageClassification": _seeded(lambda: tf.ViTForImageClassification(tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))),
}


def _rows() -> list[dict]:
    """N rows of every input any model above reads; row i has VALID[i] valid label tokens (the rest -100)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (N, T), generator=g)
    valid = torch.tensor([2 + (5 * i) % (T - 1) for i in range(N)])
    keep = torch.arange(T) < valid[:, None]
    masked = (torch.rand(N, T, generator=g) < 0.4) & keep
    masked[:, 0] = True  # every MLM row has a target
    return [{"input_ids": ids[i], "attention_mask": keep[i].long(), "lm": torch.where(keep[i], ids[i], -100),
             "mlm": torch.where(masked[i], ids[i], -100), "cls": torch.randint(3, (), generator=g),
             "pixels": torch.randn(3, 8, 8, generator=g)} for i in range(N)]


FIELDS = {"lm": lambda r: {"input_ids": r["input_ids"], "labels": r["lm"]},
          "seqcls": lambda r: {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "labels": r["cls"]},
          "mlm": lambda r: {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "labels": r["mlm"]},
          "image": lambda r: {"pixel_values": r["pixels"], "labels": r["cls"]}}


class Rows(torch.utils.data.Dataset):
    def __init__(self, fields: str, only: list[int] | None = None):
        rows = _rows()
        self.items = [FIELDS[fields](rows[i]) for i in (only if only is not None else range(N))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _shifted_ce(outputs, labels):
    logits = outputs["logits"][:, :-1].flatten(0, 1)
    return logits, labels[:, 1:].flatten()


def sum_over_count(outputs, labels, num_items_in_batch=None):
    """A custom loss that divides a token sum by the Trainer's count (as transformers' own LM losses do)."""
    logits, target = _shifted_ce(outputs, labels)
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / num_items_in_batch


def own_mean(outputs, labels, num_items_in_batch=None):
    """A custom loss that ignores the count: the batch's own mean over its shifted valid tokens."""
    return F.cross_entropy(*_shifted_ce(outputs, labels), ignore_index=-100)


def with_aux(outputs, labels, num_items_in_batch=None):
    """A token mean plus a per-row term: a mean over no single count (refused)."""
    return own_mean(outputs, labels) + 0.5 * outputs["logits"].float().pow(2).mean()


# name: (model, fields, compute_loss_func, the kind hf_loss decides, or None: refused)
CASES = {
    "llama": ("LlamaForCausalLM", "lm", None, "trainer"),
    "gpt2": ("GPT2LMHeadModel", "lm", None, "trainer"),
    "bert_seqcls": ("BertForSequenceClassification", "seqcls", None, "tokens"),  # said (SAID): tokens = rows
    "bert_mlm": ("BertForMaskedLM", "mlm", None, "tokens"),
    "t5": ("T5ForConditionalGeneration", "lm", None, "tokens"),
    "vit": ("ViTForImageClassification", "image", None, "trainer"),  # its loss_function reads the count
    "func_sum": ("LlamaForCausalLM", "lm", sum_over_count, "trainer"),
    "func_mean": ("LlamaForCausalLM", "lm", own_mean, "shifted"),
    "func_aux": ("LlamaForCausalLM", "lm", with_aux, None),
}
SAID = {"bert_seqcls": "tokens"}  # HeteroTrainer(loss_mean=...): one label per row cannot tell tokens from rows


def _args(out: str, average: bool, batch: int) -> tf.TrainingArguments:
    return tf.TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=1, optim="sgd",
                                learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0,
                                average_tokens_across_devices=average, use_cpu=True, save_strategy="no",
                                logging_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False,
                                ddp_find_unused_parameters=False)


class SignatureTrainer(HeteroTrainer):
    """The convention read from the signature, as before: the Trainer's count for every model taking **kwargs."""
    _loss_kind = property(lambda self: "trainer", lambda self, value: None)


def _worker(rank: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = {}
    for name, (model, fields, func, _) in [*CASES.items(), ("signature", CASES["bert_seqcls"])]:
        said = SAID.get("bert_seqcls" if name == "signature" else name)
        for average in (True, False):
            bal = hetero.Balance(global_batch=B, seed=SEED)
            bal.replay({0: [SIZES]})
            cls = SignatureTrainer if name == "signature" else HeteroTrainer
            trainer = cls(model=MODELS[model](), args=_args(f"{out}/{name}", average, B // 2),
                          train_dataset=Rows(fields), compute_loss_func=func, balance=bal, loss_mean=said)
            try:
                trainer.train()
            except ValueError as e:
                result[f"{name}/{average}"] = str(e)
                continue
            params = [p.detach().flatten().tolist() for p in trainer.model.parameters()]
            result[f"{name}/{average}"] = {"kind": trainer._loss_kind, "sizes": bal.last_sizes, "params": params}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    return spawned(_worker, tmp_path_factory.mktemp("hf_losses"))


def _reference(model: str, fields: str, func, average: bool, out) -> list[torch.Tensor]:
    """The plain transformers.Trainer in one process, one SGD step on the union of the two ranks' batches."""
    union = EpochPlan(N, B, SEED, 0).perm[:B].tolist()
    trainer = tf.Trainer(model=MODELS[model](), args=_args(str(out), average, B), train_dataset=Rows(fields, union),
                         compute_loss_func=func)
    trainer.train()
    return [p.detach().flatten() for p in trainer.model.parameters()]


@pytest.mark.parametrize("average", [True, False], ids=["average_tokens", "per_rank"])
@pytest.mark.parametrize("case", CASES)
def test_every_model_class_steps_as_one_process_on_the_union_or_is_refused(trained, tmp_path, case, average):
    model, fields, func, kind = CASES[case]
    got = [rank[f"{case}/{average}"] for rank in trained]
    if kind is None:
        assert got[0] == got[1] == ("hetero: its compute_loss_func is neither divided by the Trainer's "
                                    "num_items_in_batch nor a mean over the samples or the valid label tokens (an "
                                    "extra term such as an auxiliary loss, or a sum?), so hetero cannot weight "
                                    f"{model}'s gradient exactly: make the loss one of these")
        return
    want = _reference(model, fields, func, average, tmp_path)
    moved = max_diff([p.detach().flatten().tolist() for p in MODELS[model]().parameters()], want)
    assert moved > 1e-3, f"{case}: the step barely moves the parameters, so exactness would prove little"
    for rank in got:
        assert rank["sizes"] == SIZES and rank["kind"] == kind
        assert max_diff(rank["params"], want) < 1e-5, f"{case}: not the union's step (the step moved {moved:.3g})"


def test_the_signature_alone_would_sum_berts_means(trained, tmp_path):
    """What deciding from model_accepts_loss_kwargs did: BERT's per-rank means summed, not weighted."""
    want = _reference("BertForSequenceClassification", "seqcls", None, True, tmp_path)
    assert max_diff(trained[0]["signature/True"]["params"], want) > 1e-2
