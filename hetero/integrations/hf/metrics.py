"""The hetero/ read-out (hetero.core.metrics) in the Hugging Face Trainer's logs: at every `logging_steps` the
Trainer's training log gains hetero's numbers, so every `report_to` backend (tensorboard, wandb, mlflow, ...) gets
them beside the loss (TensorBoard shows them as train/hetero/...). HeteroTrainer registers it; nothing to call.
"""
from __future__ import annotations

from transformers import Trainer, TrainerCallback

from ...core.metrics import metrics


class BalanceMetrics(TrainerCallback):
    """Adds metrics(balance) to each training log before the reporting callbacks see it (it runs first)."""

    def __init__(self, balance):
        self.balance = balance

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and not any(k.startswith(("eval_", "test_")) for k in logs):  # training logs only
            read = metrics(self.balance)
            logs.update(read)
            if state.log_history:  # the Trainer recorded this log just before on_log: trainer_state.json keeps them
                state.log_history[-1].update(read)


def register(trainer: Trainer, balance) -> None:
    """Put BalanceMetrics first among the Trainer's callbacks: report_to's callbacks then receive the numbers in
    the same logs dict (a callback added last would see the logs only after they were written)."""
    trainer.callback_handler.callbacks.insert(0, BalanceMetrics(balance))
