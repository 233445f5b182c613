"""hetero for Hugging Face transformers: `HeteroTrainer`, the Trainer on hetero's per-rank batch sizes.

- trainer.py: HeteroTrainer and its callback (the data, the step's weight, the checkpoints);
- loss.py: what the loss does with the Trainer's count (the loss rule, found or checked);
- accumulate.py: per-rank gradient accumulation inside the Trainer's fixed loop;
- fsdp.py: the Trainer on FSDP2;
- metrics.py: hetero's read-out in the Trainer's logs;
- resume.py: hetero's part of a Trainer checkpoint.
Accelerate, another partner, is hetero/integrations/accelerate.py.
"""
from .trainer import HeteroTrainer

__all__ = ["HeteroTrainer"]
