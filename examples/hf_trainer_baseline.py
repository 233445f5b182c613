"""A tiny GPT-2 on local text with the plain transformers Trainer (the baseline of hf_trainer.py: `diff` the two).

    torchrun --standalone --nproc-per-node=2 examples/hf_trainer_baseline.py --text docs/huggingface.md

No downloads: the model is built from a config and the tokens are the text's characters.
"""
import argparse
import json
import os
import sys

import torch
from torch.utils.data import Dataset, Subset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class CharText(Dataset):
    """Rows of `length` character ids cut from a local text, each with its index (--record writes them)."""

    def __init__(self, text: str, length: int, n_samples: int):
        self.vocab = sorted(set(text))
        pos = {c: i for i, c in enumerate(self.vocab)}
        ids = torch.tensor([pos[c] for c in text[:n_samples * length]])
        if len(ids) < n_samples * length:
            raise ValueError(f"the text has {len(text)} characters, too few for {n_samples} rows of {length}")
        self.rows = ids[:n_samples * length].view(n_samples, length)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i], "idx": i}


def tiny_gpt2(vocab: int, length: int, seed: int) -> GPT2LMHeadModel:
    """Two layers of width 64, no dropout, the same weights on every rank (built from a config: no download)."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=length, n_embd=64, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                       eos_token_id=None))
    # the class name matches no loss in transformers 5: named, the Trainer counts the shifted labels as the loss does
    model.loss_type = "ForCausalLM"
    return model


def load_model(args, vocab: int):
    """The tiny config, or --pretrained NAME from the Hugging Face cache; offline and not cached: one line."""
    if not args.pretrained:
        return tiny_gpt2(vocab, args.length, args.seed)
    try:
        return GPT2LMHeadModel.from_pretrained(args.pretrained)
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        raise ValueError(f"--pretrained {args.pretrained}: not in the local Hugging Face cache and downloads are "
                         f"off (HF_HUB_OFFLINE=1): build the model from a config or fill the cache first" if offline
                         else f"--pretrained {args.pretrained}: {str(e).splitlines()[0]}") from None


class RecordingTrainer(Trainer):
    """Notes the indices of every training batch per epoch and its size per step (--record)."""
    seen: dict
    batches: list

    def compute_loss(self, model, inputs, **kwargs):
        if model.training:
            self.seen.setdefault(int(self.state.epoch), []).extend(inputs["idx"].tolist())
            self.batches.append([self.state.global_step, len(inputs["idx"])])
        return super().compute_loss(model, {k: v for k, v in inputs.items() if k != "idx"}, **kwargs)


def deepspeed_config(stage: int) -> dict:
    """A DeepSpeed config for TrainingArguments(deepspeed=...): the batch numbers "auto", the Trainer fills them."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}


def main(args) -> int:
    try:
        with open(args.text) as f:
            rows = CharText(f.read(), args.length, args.subset + args.eval_rows)
    except (OSError, ValueError) as e:
        print(f"hetero: error: --text {args.text}: {e}", file=sys.stderr)
        return 2
    try:
        model = load_model(args, len(rows.vocab))
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    ds, evalset = Subset(rows, range(args.subset)), Subset(rows, range(args.subset, len(rows)))
    world = int(os.environ.get("WORLD_SIZE", 1))
    micro = args.global_batch // (world * args.grad_accum)  # the plain Trainer's per-device micro-batch
    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=micro,
                              gradient_accumulation_steps=args.grad_accum,
                              num_train_epochs=args.epochs, max_steps=args.max_steps, learning_rate=args.lr,
                              lr_scheduler_type="constant", logging_steps=args.log_every,
                              report_to=args.report_to.split(",") if args.report_to else [],
                              save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                              disable_tqdm=True, seed=args.seed, remove_unused_columns=False,
                              dataloader_num_workers=args.workers, use_cpu=not torch.cuda.is_available(),
                              eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every or None,
                              deepspeed=deepspeed_config(args.deepspeed) if args.deepspeed >= 0 else None)
    trainer = RecordingTrainer(model=model, args=targs, train_dataset=ds,
                               eval_dataset=evalset if args.eval_every else None)
    trainer.seen, trainer.batches = {}, []
    trainer.train(resume_from_checkpoint=args.resume or None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    if args.record:
        with open(f"{args.record}.rank{targs.process_index}.json", "w") as f:
            json.dump({"rank": targs.process_index, "seen": trainer.seen, "batches": trainer.batches,
                       "losses": losses, "eval_losses": evals}, f)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default="docs/huggingface.md", help="a local text file: its characters are the tokens")
    p.add_argument("--out", default="runs/hf_trainer", help="the Trainer's output_dir")
    p.add_argument("--pretrained", default="", help="a Hugging Face model (cached) instead of the tiny one")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps (-1: the epochs)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (micro-batches per step)")
    p.add_argument("--length", type=int, default=32, help="characters per row")
    p.add_argument("--subset", type=int, default=320, help="rows cut from the text")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--log-every", type=int, default=5, help="log the loss every this many steps")
    p.add_argument("--report-to", default="", help='the Trainer\'s report_to, e.g. "tensorboard" (default: none)')
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every this many steps (0: never)")
    p.add_argument("--eval-rows", type=int, default=64, help="rows after the training rows, for evaluation")
    p.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every this many steps (0: none)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    p.add_argument("--deepspeed", type=int, default=-1, choices=range(-1, 4), help="a ZeRO stage (-1: no DeepSpeed)")
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    code = main(p.parse_args())
    sys.stdout.flush(), sys.stderr.flush()  # then os._exit, not sys.exit: a plain script's gloo threads can abort
    os._exit(code)  # a finished run at interpreter shutdown (pytorch/pytorch#190489; hetero/core/settle.py)
