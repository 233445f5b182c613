"""hetero for PyTorch Lightning: a Callback that attaches a Balance to the strategy's DDP model and brackets steps.

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

Why a callback and not DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...): Lightning 2.6 registers a comm hook
only when the root device is CUDA (DDPStrategy._register_ddp_hooks), so on CPU ranks it would silently keep DDP's
plain mean. The callback registers the hook itself on every device; do not pass ddp_comm_hook as well.
"""
from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

from ..core.balance import Balance
from ..core.metrics import metrics


class BalanceCallback(Callback):
    """Per-rank batch sizes, the b_i/B weighting and rebalancing in a Lightning fit (automatic optimisation)."""

    def __init__(self, balance: Balance):
        self.balance = balance

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # in every launched process, before any batch: the rank and world Lightning assigned
            self.balance.set_world(trainer.global_rank, trainer.world_size)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.balance.settings.micro_batch:  # Lightning accumulates one fixed count on every rank; k_i differs
            raise ValueError("hetero: micro_batch is not supported with Lightning: use it in your own loop")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError("hetero: accumulate_grad_batches is not supported: raise global_batch instead")
        self.balance.attach(trainer.strategy.model)  # the DistributedDataParallel wrapper, built by now

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.balance.set_epoch(trainer.current_epoch)  # also done by Lightning through the sampler's set_epoch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.balance.engine.begin(batch_idx, from_loader=True)  # the batch is the sampler's: checked

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        decided, every = self.balance.end_step(), trainer.log_every_n_steps
        if trainer.loggers and (decided is not None or (every and trainer.global_step % every == 0)):
            read = metrics(self.balance)  # the hetero/ read-out, through the trainer's loggers (rank 0 writes)
            for logger in trainer.loggers:
                logger.log_metrics(read, step=trainer.global_step)

    def state_dict(self) -> dict:
        """The Balance's complete state (collective: Lightning calls it on every rank)."""
        return self.balance.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.balance.load_state_dict(state_dict)
