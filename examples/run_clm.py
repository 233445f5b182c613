"""transformers' examples/pytorch/language-modeling/run_clm.py, ported to hetero: causal language modelling on a local
text file with the Trainer, per-rank batch sizes balanced by measured speed, gradient accumulation per rank.

    torchrun --standalone --nproc-per-node=2 examples/run_clm.py --train_file docs/huggingface.md \
        --model_type gpt2 --config_overrides n_embd=64,n_layer=2,n_head=2,n_positions=64 --block_size 32 \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --num_train_epochs 2 \
        --do_train --do_eval --output_dir runs/run_clm --use_cpu --hetero 1:slowdown=3 --rebalance_every 5

The port keeps upstream's three argument dataclasses and its flags, its tokenize / group_texts pipeline, its Trainer
calls and its perplexity, and changes what docs/huggingface.md#run-clm lists: the Trainer becomes HeteroTrainer
with a Balance (global_batch = per_device_train_batch_size x gradient_accumulation_steps x world, the plain
Trainer's; micro_batch = per_device_train_batch_size when accumulating), a fourth dataclass for hetero's flags, and,
as nothing is downloaded here, the text read by lines without `datasets`, a byte-level BPE tokenizer trained on it
with `tokenizers` (upstream refuses to build one), and no `evaluate` accuracy.
"""
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import torch
import transformers
from tokenizers import ByteLevelBPETokenizer
from torch.utils.data import Dataset
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import hetero
from hetero.integrations.hf import HeteroTrainer

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """The model, built from a config (training from scratch, as upstream without --model_name_or_path)."""
    model_type: str = field(default="gpt2", metadata={"help": "a model type of transformers' CONFIG_MAPPING"})
    config_overrides: str = field(default="", metadata={"help": "e.g. n_embd=64,n_layer=2,n_head=2"})
    vocab_size: int = field(default=320, metadata={"help": "the BPE tokenizer trained on the text: its vocabulary"})


@dataclass
class DataTrainingArguments:
    """The local text and its blocks."""
    train_file: str = field(default=None, metadata={"help": "a text file"})
    validation_split_percentage: int = field(default=5, metadata={"help": "the last lines, for evaluation"})
    block_size: int = field(default=128, metadata={"help": "tokens per training row"})
    max_train_samples: int = field(default=None, metadata={"help": "truncate the training rows"})

    def __post_init__(self):
        if self.train_file is None or not self.train_file.endswith((".txt", ".md")):
            raise ValueError("--train_file: a local .txt or .md file is needed")


@dataclass
class HeteroArguments:
    """hetero's settings (Balance(...) and its emulated slow ranks)."""
    scheme: str = field(default="edp", metadata={"help": "sync, dp, edp or affine"})
    rebalance_every: int = field(default=5, metadata={"help": "decide every K steps (0: at epoch ends only)"})
    hetero: str = field(default="", metadata={"help": 'emulated heterogeneity, e.g. "1:slowdown=3"'})


class Rows(Dataset):
    """The dict rows group_texts makes (upstream's datasets.Dataset), as a torch Dataset."""

    def __init__(self, columns: dict[str, list]):
        self.columns, self.n = columns, len(columns["input_ids"])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {k: torch.tensor(v[i]) for k, v in self.columns.items()}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, HeteroArguments))
    model_args, data_args, training_args, hetero_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    set_seed(training_args.seed)

    # upstream: load_dataset("text", data_files=...) and a validation split of the first percent
    with open(data_args.train_file) as f:
        lines = [line for line in f.read().splitlines(keepends=True) if line.strip()]
    cut = len(lines) * (100 - data_args.validation_split_percentage) // 100
    raw = {"train": lines[:cut], "validation": lines[cut:]}

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    # upstream loads a pretrained tokenizer: here a byte-level BPE trained on the training text (no download)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(raw["train"], vocab_size=model_args.vocab_size, min_frequency=2)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    config.vocab_size, config.bos_token_id, config.eos_token_id = len(tokenizer), None, None
    model = AutoModelForCausalLM.from_config(config)
    model.loss_type = "ForCausalLM"  # the Trainer then counts the shifted labels, as the model's loss does

    block_size = data_args.block_size

    def group_texts(examples):  # upstream's: concatenate, drop the remainder, cut blocks, labels = inputs
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    lm = {split: group_texts(dict(tokenizer(text))) for split, text in raw.items()}
    if data_args.max_train_samples is not None:
        lm["train"] = {k: v[:data_args.max_train_samples] for k, v in lm["train"].items()}
    train_dataset, eval_dataset = Rows(lm["train"]), Rows(lm["validation"])

    # hetero: the plain Trainer's global batch, each rank's share (and count of micro-batches) by its speed
    m, g = training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps
    try:
        balance = hetero.Balance(global_batch=m * g * training_args.world_size, micro_batch=m if g > 1 else 0,
                                 scheme=hetero_args.scheme, rebalance_every=hetero_args.rebalance_every,
                                 seed=training_args.seed)
        balance.emulate(hetero_args.hetero)
    except ValueError as e:
        print(f"hetero: error: {str(e).removeprefix('hetero: ')}", file=sys.stderr)
        return 2
    trainer = HeteroTrainer(
        balance=balance,
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
