"""hetero for PyTorch Lightning: a Callback that attaches a Balance to the strategy's model and brackets its steps.

    bal = hetero.Balance(scheme="edp", global_batch=256, rebalance_every=10)
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)), num_workers=2)
    trainer = L.Trainer(strategy="ddp", use_distributed_sampler=False, callbacks=[hetero.BalanceCallback(bal)])
    trainer.fit(module, loader)

Under torchrun and under Lightning's own launchers (`python train.py` with devices=N and strategy "ddp" or
"ddp_spawn") alike: Lightning's launcher sets neither RANK nor, when the callback is built, WORLD_SIZE, so the
Balance learns its rank and world in `setup`, from the trainer (Balance.set_world), and `attach` then checks them
against the process group on every rank.

Checkpoints: the callback's state_dict is the Balance's (collective: Lightning builds a checkpoint on every rank),
so a fit resumed with `trainer.fit(ckpt_path=...)` keeps every estimate, the sizes and, from a mid-epoch
checkpoint, the position: the sampler then hands out the epoch's remaining steps, which Lightning numbers on from
the saved batch index.

Per-rank accumulation (Balance(micro_batch=m)): manual optimisation, training_step(self, dataloader_iter) pulling
this rank's micro-batches, each in `with bal.step():`, the optimizer stepped where bal.sync_now. One Lightning batch
must be one step on every rank: Lightning 2.6 broadcasts a flag from rank 0 at every batch
(training_epoch_loop.py, advance -> _broadcast_sigterm_tensor), so ranks running k_i Lightning batches each would
pair their collectives wrongly and hang. accumulate_grad_batches (one count on every rank) is refused.

FSDP2: under ModelParallelStrategy (fully_shard in configure_model) Lightning wraps nothing; the callback attaches
to the one outermost fully_shard'ed module, whose reduce-scatter hetero weights (core/fsdp.py).

Why a callback and not DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...): Lightning 2.6 registers a comm hook
only when the root device is CUDA (DDPStrategy._register_ddp_hooks), so on CPU ranks it would silently keep DDP's
plain mean. The callback registers the hook itself on every device; do not pass ddp_comm_hook as well.
"""
from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from ..core.agree import HeteroError
from ..core.balance import Balance
from ..core.fsdp import fsdp_modules
from ..core.metrics import metrics


class BalanceCallback(Callback):
    """Per-rank batch sizes (automatic optimisation) or per-rank counts of micro-batches (manual, on dataloader_iter),
    the exact weighting and rebalancing in a Lightning fit, under DDPStrategy or ModelParallelStrategy (FSDP2)."""

    def __init__(self, balance: Balance):
        self.balance = balance
        self._decided, self._ddp, self._steps = 0, False, 0  # decisions logged; attached to DDP; steps ended

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # in every launched process, before any batch: the rank and world Lightning assigned
            self.balance.set_world(trainer.global_rank, trainer.world_size)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:  # one count on every rank, where hetero's counts differ
            raise ValueError("hetero: accumulate_grad_batches is one count on every rank: set Balance(micro_batch=m) "
                             "and accumulate per rank in manual optimisation (docs/lightning.md#accumulation)")
        if self.balance.settings.micro_batch and (getattr(pl_module, "automatic_optimization", True) or not
                                                  is_param_in_hook_signature(pl_module.training_step,
                                                                             "dataloader_iter", explicit=True)):
            raise ValueError("hetero: micro_batch is not supported with Lightning's automatic optimisation: set "
                             "self.automatic_optimization = False and take this rank's micro-batches in "
                             "training_step(self, dataloader_iter) (docs/lightning.md#accumulation)")
        self.balance.attach(_model(trainer, pl_module))
        self._ddp = isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.balance.settings.micro_batch:
            # an epoch Lightning resumes mid-way gets no on_train_epoch_start (fit_loop.py, on_advance_start skips it
            # when restarted mid-epoch): without its length set here Lightning ran len(loader), the micro-batches'
            # upper bound, and called training_step once more on an exhausted dataloader_iter
            self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.balance.set_epoch(trainer.current_epoch)  # also done by Lightning through the sampler's set_epoch
        if self.balance.settings.micro_batch:
            # one Lightning batch (one training_step on the dataloader_iter) is one step; len(loader) counts this
            # rank's micro-batches. Every rank must run as many batches: Lightning broadcasts at each one
            # (training_epoch_loop.py, _broadcast_sigterm_tensor). So the epoch is the steps, with Lightning's own
            # val_check_batch rule (fit_loop.py, setup_data) applied to them.
            steps = trainer.fit_loop.max_batches = self.balance.position.steps_per_epoch
            if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch is not None:
                trainer.val_check_batch = max(1, int(steps * trainer.val_check_interval))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if not self.balance.settings.micro_batch:  # with micro_batch, `with bal.step()` begins the step
            self.balance.begin_step(batch_idx, from_loader=True)  # the batch is the sampler's: checked
        self._steps = self.balance.position.global_step  # one training_step is one step (with micro_batch: checked)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss) -> None:
        if self.balance.settings.micro_batch and self.balance.position.global_step != self._steps:
            _past_the_step()  # the next step's first backward, on every rank alike: before its collective
        if self.balance.settings.micro_batch and self._ddp:
            # Lightning runs training_step inside one DDP forward, which began before the step: each of the step's
            # micro-batches is counted at its backward instead (a rank running one too many stops here)
            self.balance.engine.count_forward(trainer.strategy.model, ())

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.balance.settings.micro_batch:
            if (s := self.balance.engine.running(required=False)) is not None:
                raise HeteroError(f"hetero: training_step returned after {s.expected - s.left} of this rank's "
                                  f"{s.expected} micro-batches: run them all, each in `with bal.step():`, and step "
                                  f"the optimizer where bal.sync_now (docs/lightning.md#accumulation)")
            if self.balance.position.global_step - self._steps > 1:  # a loop that never called manual_backward
                _past_the_step()
            decided = len(self.balance.decisions) != self._decided
        else:
            decided = self.balance.end_step() is not None
        self._decided, every = len(self.balance.decisions), trainer.log_every_n_steps
        if trainer.loggers and (decided or (every and trainer.global_step % every == 0)):
            read = metrics(self.balance)  # the hetero/ read-out, through the trainer's loggers (rank 0 writes)
            for logger in trainer.loggers:
                logger.log_metrics(read, step=trainer.global_step)

    def state_dict(self) -> dict:
        """The Balance's complete state (collective: Lightning calls it on every rank)."""
        return self.balance.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        try:  # every rank gets the same state, so every rank stops with the same line
            self.balance.load_state_dict(state_dict)
        except ValueError as e:
            raise ValueError(f"hetero: the checkpoint's BalanceCallback state does not fit this Balance: {e}") from None


def _past_the_step():
    raise HeteroError("hetero: training_step went on past its optimizer step into the next step's micro-batches: "
                      "one training_step is one step; break out of the dataloader_iter loop after stepping the "
                      "optimizer where bal.sync_now (docs/lightning.md#accumulation)")


def _model(trainer: Trainer, pl_module: LightningModule) -> torch.nn.Module:
    """What the Balance attaches to: the strategy's DDP wrapper, or under ModelParallelStrategy the one FSDP2 root
    that configure_model made (Lightning wraps nothing there); one line for what hetero cannot weight."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(trainer.strategy, ModelParallelStrategy):
        return trainer.strategy.model  # DDP (else the core refuses it in one line)
    if trainer.strategy.device_mesh["tensor_parallel"].size() > 1:
        raise ValueError("hetero: ModelParallelStrategy with tensor_parallel_size > 1: hetero weights data-parallel "
                         "ranks only; set data_parallel_size to the world size and tensor_parallel_size=1")
    sharded = fsdp_modules(pl_module)
    nested = {id(m) for o in sharded for m in o.modules() if m is not o}
    roots = [m for m in sharded if id(m) not in nested]
    if len(roots) != 1:
        raise ValueError(f"hetero: ModelParallelStrategy needs one fully_shard root in configure_model; found "
                         f"{len(roots)}: fully_shard the module that holds the model's blocks too")
    inside = {id(p) for p in roots[0].parameters()}
    if outside := [n for n, p in pl_module.named_parameters() if p.requires_grad and id(p) not in inside]:
        raise ValueError(f"hetero: {outside[0]} is outside the fully_shard root, and ModelParallelStrategy syncs no "
                         f"gradient there: fully_shard a module that holds every trainable parameter")
    return roots[0]
