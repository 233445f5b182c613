"""hetero for Hugging Face transformers: a Trainer on hetero's per-rank batch sizes, with the exact gradient.

    bal = hetero.Balance(scheme="edp", global_batch=32, rebalance_every=5)
    args = TrainingArguments(per_device_train_batch_size=16, ...)     # x world = the Balance's global_batch
    trainer = HeteroTrainer(balance=bal, model=model, args=args, train_dataset=ds, data_collator=collate)
    trainer.train()                                                    # under torchrun, one process per device

What it changes in the Trainer (docs/huggingface.md):
- the train DataLoader takes hetero's batch sampler and is NOT passed to accelerator.prepare: prepare would wrap it
  in a BatchSamplerShard, which hands rank r every world-th of its own batches and breaks hetero's slices; wherever
  the samples' lengths vary, the sampler splits each step by their cost (token_lengths; docs/tokens.md);
- a callback brackets every optimizer step (begin_step at on_step_begin, end_step at on_step_end: the step clock,
  decisions every K steps and at epoch ends) and attaches the comm hook to the Trainer's DDP model;
- training_step sets the step's gradient weight from the loss convention the Trainer used (gradient_weight);
- hetero's state is saved in every checkpoint folder and read back by train(resume_from_checkpoint=...) (resume.py).
- on FSDP2 (fsdp_config fsdp_version 2) the Balance attaches to the fully_shard'ed root: hetero's weighted
  reduce-scatter in place of the comm hook, its micro-batch schedule in place of no_sync (fsdp.py).
- with deepspeed= a config (ZeRO 0-3, accelerate's DeepSpeed plugin) the Balance attaches to the DeepSpeed engine
  (hetero.core.deepspeed, marked `hosted`: the config's gradient_accumulation_steps is the Trainer's G, which the
  Trainer keeps from dividing the loss and from counting the boundary): hetero weights the loss the Trainer hands
  engine.backward and reduces once, at the engine.step() accelerate calls after the rank's last micro-batch; on
  ZeRO-3 the loss probe runs its forwards in lockstep over the ranks (loss.decide, aligned).

The loss conventions, said by the user (loss_mean=) or found at each train()'s first step from what the loss does,
and checked there either way (hf_loss.decide, collective), never read from the forward's signature (BERT's
forward(**kwargs) takes num_items_in_batch and never reads it):
(a) the loss divides by the Trainer's count ("trainer"), average_tokens_across_devices=True (the default): the
    Trainer gathers the global count N, each rank's loss is world * (its token-loss sum) / N, and DDP's mean over
    ranks is the exact global token mean. hetero must not weight again: weight 1/world.
(b) the loss divides by the Trainer's count, average_tokens_across_devices=False: each rank's loss is its own sum
    over its count n_i; the weight is the count share n_i / sum(n) (one scalar all-reduce per step).
(c) the loss is a mean over a count of its own ("tokens", "shifted" or "rows", said or found): the weight is
    this rank's share of that count (an all-reduce for tokens; b_i/B for rows), divided by world where the Trainer
    multiplied the loss by world taking it for (a).
A loss that fits none (an extra term, a sum), or a count the first step cannot tell and the user did not say, is
refused in one line on every rank.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker

from ...core import deepspeed, fsdp, safeio
from ...core.balance import Balance, tokens_refusal
from . import accumulate as hf_accumulate
from . import fsdp as hf_fsdp
from . import loss as hf_loss
from . import resume as hf_resume
from .metrics import register as register_metrics

STATE_NAME = hf_resume.STATE_NAME  # in each checkpoint-N folder, beside trainer_state.json


class HeteroTrainer(Trainer):
    """transformers.Trainer with hetero's per-rank batch sizes, b_i/B (or token-share) weighting and rebalancing."""

    def __init__(self, *args, balance: Balance, loss_mean: str | None = None, by_tokens: bool | None = None,
                 **kwargs):
        """The Trainer's arguments, and:

        Args:
            balance: the hetero.Balance that sizes each rank's share of the Trainer's global batch.
            loss_mean: what the loss divides by: "trainer" (the Trainer's num_items_in_batch), "tokens"
                (labels != -100), "shifted" (labels[..., 1:] != -100) or "rows" (a per-sample mean); checked at the
                first step. None: found there, and refused in one line where the batches cannot tell it.
            by_tokens: how each step's samples are split among the ranks. None (the default): by their cost in
                tokens wherever the data set's lengths vary and the Balance can split by them, else by counts. False:
                by counts (b_i samples each, in the permutation's order) whatever the lengths. True: by tokens, or a
                one-line refusal saying why not. A Balance built with a collator splits by tokens.

        Raises:
            TypeError: balance is not a hetero.Balance.
            ValueError: loss_mean is none of these, by_tokens is not None, True or False, or by_tokens=False on a
                Balance built with a collator."""
        if loss_mean is not None and loss_mean not in hf_loss.KINDS:
            raise ValueError(f"hetero: HeteroTrainer(loss_mean={loss_mean!r}) takes one of "
                             f"{', '.join(map(repr, hf_loss.KINDS))} or None (found from the loss)")
        if by_tokens is not None and not isinstance(by_tokens, bool):
            raise ValueError(f"hetero: HeteroTrainer(by_tokens={by_tokens!r}) takes None (by tokens where the "
                             f"lengths vary), True or False")
        if by_tokens is False and isinstance(balance, Balance) and balance.settings.collator is not None:
            raise ValueError(f"hetero: HeteroTrainer(by_tokens=False) splits by counts, and the Balance was built "
                             f"with collator={balance.settings.collator!r}, which splits by tokens: say one")
        self.by_tokens = by_tokens
        if not isinstance(balance, Balance):
            raise TypeError(f"hetero: HeteroTrainer(balance=...) takes a hetero.Balance, not {type(balance).__name__} "
                            f"{balance!r}: build one, e.g. hetero.Balance(scheme=\"edp\", global_batch=32)")
        self.balance, self._resumed = balance, None  # _resumed: hetero's checkpoint state, applied at train begin
        self.loss_mean = loss_mean  # the user's word on the loss's count, checked by hf_loss.decide
        self._loss_kind: str | None = None  # what the loss does with the Trainer's count (hf_loss.decide), per train()
        self._share: float | None = None  # this step's share of the count the loss averages over (get_batch_samples)
        self._micro_scale = 1.0  # the running micro-batch's share of this rank's count (training_step)
        super().__init__(*args, **kwargs)
        self.add_callback(_BalanceSteps(self))
        register_metrics(self, balance)  # the hetero/ read-out in every training log (metrics.py)

    # -- what the Trainer must not do with hetero -----------------------------------------------------------------
    def _refuse(self) -> None:
        """One clear line for each Trainer setting hetero cannot honour (the same on every rank: no rank hangs)."""
        a, bal = self.args, self.balance
        if bal.world < 2:
            raise ValueError("hetero: HeteroTrainer needs several processes (torchrun --nproc-per-node=N); "
                             "one process has nothing to balance: use transformers.Trainer")
        m, g = a.per_device_train_batch_size, a.gradient_accumulation_steps
        if g != 1 and bal.settings.micro_batch != m:
            raise ValueError(f"hetero: gradient_accumulation_steps {g} needs Balance(micro_batch="
                             f"per_device_train_batch_size={m}): hetero then decides each rank's count of "
                             f"micro-batches (got micro_batch={bal.settings.micro_batch})")
        if bal.settings.micro_batch and bal.settings.micro_batch != m:
            raise ValueError(f"hetero: the Balance's micro_batch {bal.settings.micro_batch} must equal "
                             f"per_device_train_batch_size {m}: the Trainer's micro-batch")
        # under a token_budget each step holds as many samples as its tokens make: no count to match
        if not bal.settings.budgeted and m * g * bal.world != bal.settings.global_batch:
            raise ValueError(f"hetero: per_device_train_batch_size x gradient_accumulation_steps x world ({m} x {g} "
                             f"x {bal.world}) must equal the Balance's global_batch {bal.settings.global_batch}: the "
                             f"plain Trainer's batch, which it logs and schedules with; hetero decides each "
                             f"rank's share")
        if getattr(a, "train_sampling_strategy", "random") not in ("random", "sequential", *BY_LENGTH):
            raise ValueError(f"hetero: train_sampling_strategy={a.train_sampling_strategy!r} is not supported: "
                             f"hetero's sampler decides every rank's samples")
        if a.auto_find_batch_size:
            raise ValueError("hetero: auto_find_batch_size is not supported: set the Balance's max_batch")
        if (why := hf_fsdp.refusal(self)) is not None:
            raise ValueError(why)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Trainer.train, and hetero's sizes and decisions read back from the checkpoint folder when resuming."""
        self._refuse()
        self._loss_kind = None  # decided again at the first step: the model may have changed
        if resume_from_checkpoint is True:  # resolved here as the Trainer does, to read hetero's file from it
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"hetero: no checkpoint in {self.args.output_dir} to resume from")
        self._resumed = hf_resume.read(resume_from_checkpoint) if resume_from_checkpoint else None
        if self._resumed is not None:  # hetero's sampler starts at the saved step: the Trainer must not skip again
            self.args.ignore_data_skip = True
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    # -- the data: hetero's batch sampler, not sharded again by accelerate ------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """This rank's slices of each step's window (hetero.core.sampler), with the Trainer's collator and workers."""
        ds, a = self.train_dataset, self.args
        if ds is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(ds, IterableDataset) or not hasattr(ds, "__len__"):
            raise ValueError("hetero: the train dataset needs a length (an IterableDataset has none): hetero cuts "
                             "each step's window of one permutation of it")
        collate = self.data_collator
        if hasattr(ds, "column_names") and hasattr(ds, "remove_columns"):  # a datasets.Dataset
            ds = self._remove_unused_columns(ds, description="Training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="Training")
        workers = a.dataloader_num_workers
        # not accelerator.prepare(...): its BatchSamplerShard would give this rank every world-th of its own batches
        split = token_lengths(self, ds)
        if (strategy := getattr(a, "train_sampling_strategy", "random")) in BY_LENGTH and not split:
            raise ValueError(f"hetero: train_sampling_strategy={strategy!r} asks for batches by length, and hetero "
                             f"splits this run by counts ({_by_counts(self.balance, ds, self)}): leave it 'random'")
        sampler = self.balance.batch_sampler(len(ds), **split)
        if self.balance.settings.micro_batch:  # G entries per step for the Trainer's loop (hf_accumulate)
            spe = self.balance.position.steps_per_epoch
            sampler = hf_accumulate.StepLength(sampler, spe, a.gradient_accumulation_steps)
        # the Trainer's start method for workers too (dataloader_multiprocessing_context: "forkserver" forks no rank,
        # whose gloo threads enter Python; hetero/core/settle.py)
        context = getattr(a, "dataloader_multiprocessing_context", None) if workers else None
        return DataLoader(ds, batch_sampler=sampler, collate_fn=collate, multiprocessing_context=context,
                          num_workers=workers, pin_memory=a.dataloader_pin_memory,
                          persistent_workers=a.dataloader_persistent_workers and workers > 0,
                          prefetch_factor=a.dataloader_prefetch_factor if workers else None,
                          worker_init_fn=partial(seed_worker, num_workers=workers, rank=a.process_index))

    # -- one step: the weight of this rank's gradient ---------------------------------------------------------
    def _scaled(self, num_items_in_batch) -> bool:
        """Whether compute_loss multiplied this rank's loss by world (the Trainer's token averaging across devices)."""
        counted = num_items_in_batch is not None and bool(self.model_accepts_loss_kwargs or self.compute_loss_func)
        return counted and self.args.average_tokens_across_devices

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer's batches and count; at a train()'s first step also what the loss does with the count
        (hf_loss.decide), and at every step this rank's share of the count its loss averages over. Both are
        collective and run here, beside the Trainer's own gather, so that their waits fall before the step clock."""
        micro = bool(self.balance.settings.micro_batch)
        if micro:  # this rank's own count k_i for the step, not the Trainer's G; asked once the sampler has begun
            head = next(epoch_iterator, None)
            if head is None:
                return [], None
            epoch_iterator = itertools.chain([head], epoch_iterator)
        batches, num_items = super().get_batch_samples(epoch_iterator, self._micro_count(num_batches) if micro
                                                       else num_batches, device)
        if not batches:
            return batches, num_items
        dev = self.args.device if dist.get_backend() == "nccl" else torch.device("cpu")  # NCCL: device tensors
        passed = num_items if self.model_accepts_loss_kwargs or self.compute_loss_func else None
        if self._loss_kind is None:  # FSDP2: the probe's forwards, unequal per rank, must not all-gather
            zero3 = deepspeed.is_engine(self.model_wrapped) and self.model_wrapped.zero_optimization_stage() == 3
            with hf_fsdp.gathered(self.model_wrapped):  # ZeRO-3 gathers in every forward: as many on every rank
                self._loss_kind = hf_loss.decide(self, batches, passed, dev, self.loss_mean, aligned=zero3)
        kind, own = self._loss_kind, None
        if kind == "trainer" and passed is not None and not self.args.average_tokens_across_devices:
            own = float(num_items)  # (b) with the Trainer's count: this rank's own (not gathered)
        elif kind in ("tokens", "shifted"):
            own = float(sum(hf_loss.count(b, kind) for b in batches))
        self._share = None
        if own is not None:
            n = torch.tensor([own], dtype=torch.float64, device=dev)
            total = n.clone()
            dist.all_reduce(total)
            self._share = float(n / total) if total.item() else 1.0 / self.balance.world
        if micro:
            return hf_accumulate.pack(batches, num_batches), num_items
        return batches, num_items

    def _micro_count(self, entries: int) -> int:
        """This rank's micro-batches in the next step (k_i; the Trainer's loop would take its G entries)."""
        return self.balance.micro_batches

    def gradient_weight(self, inputs: dict[str, Any], num_items_in_batch) -> float:
        """This rank's gradient weight for the step (module docstring: (a), (b)); the ranks' weights, times the
        factor world by which the Trainer scaled a loss it took for token-normalised, sum to 1."""
        bal = self.balance
        if self._loss_kind == "trainer":  # the loss divides by the Trainer's count
            if not bal.settings.weighted or self.args.average_tokens_across_devices:
                return 1.0 / bal.world  # (a): the Trainer normalised over every rank; DDP's mean is exact
            return self._share  # (b): this rank's share of the step's counted tokens
        # a mean over its own count: this rank's share of it, undoing the Trainer's world factor where applied
        sizes = bal.last_sizes  # they sum to the step's samples (global_batch, or a token budget's)
        share = self._share if self._share is not None else sizes[bal.rank] / sum(sizes)
        if not bal.settings.weighted:
            share = 1.0 / bal.world
        return share / (bal.world if self._scaled(num_items_in_batch) else 1)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if inputs is hf_accumulate.PLACEHOLDER:  # one of the G - 1 empty entries of an accumulated step
            return torch.zeros((), device=self.args.device)
        bal = self.balance
        micro = inputs if isinstance(inputs, hf_accumulate.Micro) else [inputs]
        weight = self.gradient_weight(micro[0], num_items_in_batch)
        bal.set_weight(weight)
        kind = self._loss_kind
        counts = [1.0] * len(micro) if kind == "trainer" else [hf_loss.count(b, kind) for b in micro]
        loss = torch.zeros((), device=self.args.device)
        if bal.settings.collator == "packed" and "position_ids" not in micro[0]:  # alike on every rank
            raise ValueError("hetero: collator='packed' needs each packed row's position_ids "
                             "(DataCollatorWithFlattening(return_position_ids=True)): without them the model attends "
                             "across the samples of a row, and hetero cannot count them")
        for j, batch in enumerate(micro):
            # a mean's micro-batch counts by its share of this rank's count (the Trainer's own count already does)
            self._micro_scale = counts[j] / sum(counts) if kind != "trainer" else 1.0
            self.current_gradient_accumulation_steps = 1  # the weights carry the accumulation, not a division by G
            # the core's one micro-batch door: the schedule's check, DDP's no_sync or FSDP2's schedule for all but
            # the last; the callback ends the step after the optimizer step
            with bal.engine.micro(hf_loss.rows(batch), ends_step=False):
                loss = loss + super().training_step(model, batch, num_items_in_batch)
        self._micro_scale = 1.0
        # the Trainer logs the mean of the ranks' losses: scaled so, it is the weighted mean, the global batch's
        return loss * (weight * bal.world)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer.compute_loss, times this micro-batch's share of the rank's count (1 without accumulation)."""
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self._micro_scale == 1.0 or not model.training:
            return out
        return (out[0] * self._micro_scale, out[1]) if return_outputs else out * self._micro_scale

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, hf_accumulate.Micro):
            return sum(super(HeteroTrainer, self).floating_point_ops(b) for b in inputs)
        return super().floating_point_ops(inputs)


class _BalanceSteps(TrainerCallback):
    """Attaches the Balance to the Trainer's DDP or FSDP2 model, brackets its optimizer steps and saves its state."""

    def __init__(self, trainer: HeteroTrainer):
        self.trainer, self._ddp = trainer, None

    def on_train_begin(self, args, state, control, **kwargs):
        bal, ddp = self.trainer.balance, self.trainer.model_wrapped
        engine = deepspeed.is_engine(ddp)
        if not isinstance(ddp, DistributedDataParallel) and not fsdp.is_fsdp(ddp) and not engine:
            hint = ("; on CPU ranks set TrainingArguments(use_cpu=True), or accelerate runs no DDP" if
                    args.parallel_mode.value != "distributed" else ": model parallelism is not supported")
            raise ValueError(f"hetero: the Trainer's model is a {type(ddp).__name__}, neither DistributedDataParallel, "
                             f"an FSDP2 root (fsdp_config fsdp_version 2) nor a DeepSpeed engine (deepspeed=), which "
                             f"hetero weights{hint}")
        if engine:  # the config's gradient_accumulation_steps is the Trainer's G: the Trainer owns the boundary
            deepspeed.hosted(ddp)
        if ddp is not self._ddp:  # a second train() on the same DDP model keeps its hook (DDP takes one)
            bal.attach(ddp)
            self._ddp = ddp
        if self.trainer._resumed is not None:  # after attach (the workers' identities) and the sampler (its length)
            hf_resume.restore(bal, self.trainer._resumed)
            self.trainer._resumed = None
        if bal.position.global_step != state.global_step:  # the Trainer and hetero count the same steps
            raise ValueError(f"hetero: the Trainer is at step {state.global_step}, the Balance at step "
                             f"{bal.position.global_step}: resume with train(resume_from_checkpoint=...) from a "
                             f"checkpoint HeteroTrainer saved (its {STATE_NAME} holds the Balance)")

    def on_epoch_begin(self, args, state, control, **kwargs):
        bal = self.trainer.balance
        bal.set_epoch(bal.position.next_epoch)  # before the Trainer iterates the loader; a resumed epoch goes on

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.balance.begin_step(from_loader=True)  # the batch is the sampler's: checked

    def on_step_end(self, args, state, control, **kwargs):
        bal = self.trainer.balance
        bal.end_step()  # after the optimizer step; decides every K steps and at the epoch's end
        # the Trainer counts the epoch's fraction from its own batch counter, which a resume without its data skip
        # (hf_resume) restarts at 0: the fraction from hetero's position instead
        pos = bal.position
        state.epoch = pos.epoch + pos.step / pos.steps_per_epoch

    def on_save(self, args, state, control, **kwargs):
        saved = hf_resume.checkpoint(self.trainer.balance)  # every rank
        if args.should_save:  # the folder _save_checkpoint just wrote (hyperparameter search runs elsewhere)
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            # written beside the Trainer's files, never through a link
            safeio.atomic_write(Path(folder) / hf_resume.STATE_NAME, lambda f: torch.save(saved, f))


# the Trainer's samplers by length: hetero's split by tokens does their job (each step's rows by cost; padded, runs
# of similar lengths per rank), so they are taken where it splits by tokens and refused where it splits by counts
BY_LENGTH = ("group_by_length", "batch_rebalance")


def _by_counts(bal, ds, trainer: Trainer) -> str:
    """Why a run the Trainer would group by length splits by counts: what to change, in a few words."""
    if getattr(trainer, "by_tokens", None) is False:
        return "HeteroTrainer(by_tokens=False)"
    if (why := tokens_refusal(bal, "padded")) is not None:
        return why.removeprefix("hetero: ")
    return "the samples' lengths do not vary" if measured(trainer, ds) is not None else \
        f"the items have no '{_input_name(trainer)}' to measure"


def token_lengths(trainer: Trainer, ds) -> dict:
    """batch_sampler's lengths (and collator) for a HeteroTrainer: by tokens whenever the Balance names a collator,
    and by default whenever the data set's lengths vary and the Balance can split by them (no replay, an edp or
    affine scheme, no sit_out or max_batch); {}: by counts. The lengths are found as the Trainer's
    train_sampling_strategy="batch_rebalance" finds them (measured). The collator must be the Trainer's: "packed" with
    DataCollatorWithFlattening, "padded" with any other."""
    from transformers import DataCollatorWithFlattening

    bal, choice = trainer.balance, getattr(trainer, "by_tokens", None)
    layout = "packed" if isinstance(trainer.data_collator, DataCollatorWithFlattening) else "padded"
    said = bal.settings.collator
    if said is None and choice is False:  # by counts, as asked
        return {}
    if said is None:  # the default: by tokens where the lengths vary and nothing rules it out; True: or refuse
        lengths = measured(trainer, ds)
        if choice and (why := tokens_refusal(bal, layout)) is not None:
            raise ValueError(f"{why}: HeteroTrainer(by_tokens=True) cannot split by tokens")
        if choice and lengths is None:
            raise ValueError(f"hetero: HeteroTrainer(by_tokens=True), and the train dataset's items have no "
                             f"'{_input_name(trainer)}' to measure: add a '{trainer.args.length_column_name}' column "
                             f"(args.length_column_name)")
        if tokens_refusal(bal, layout) is not None or lengths is None or len(set(lengths)) < 2 and not choice:
            return {}
        return {"lengths": lengths, "collator": layout}
    if layout != said:
        raise ValueError(f"hetero: the Balance's collator={said!r}, but the Trainer's data_collator is "
                         f"{type(trainer.data_collator).__name__}: set collator={layout!r} (how it lays out a rank's "
                         f"rows)")
    if (lengths := measured(trainer, ds)) is None:
        raise ValueError(f"hetero: collator={said!r} splits by tokens, and the train dataset's items have no "
                         f"'{_input_name(trainer)}' to measure: add a '{trainer.args.length_column_name}' column "
                         f"(args.length_column_name)")
    return {"lengths": lengths}


def _input_name(trainer: Trainer) -> str:
    return (getattr(trainer.processing_class, "model_input_names", None) or ["input_ids"])[0]


def measured(trainer: Trainer, ds) -> list[int] | None:
    """Every sample's length, as batch_rebalance finds it: the length column (args.length_column_name) of a
    datasets.Dataset, else the length of each item's model input (the processing class's first input name, else
    input_ids); None where an item has none."""
    column = trainer.args.length_column_name
    if hasattr(ds, "column_names") and column in ds.column_names:
        return [int(n) for n in ds[column]]
    name, lengths = _input_name(trainer), []
    if hasattr(ds, "column_names") and name in ds.column_names:  # a datasets.Dataset: the column at once
        return [len(x) for x in ds[name]]
    for i in range(len(ds)):
        item = ds[i]
        if not isinstance(item, Mapping) or name not in item or not hasattr(item[name], "__len__"):
            return None
        lengths.append(len(item[name]))
    return lengths
