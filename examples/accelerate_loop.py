"""A tiny GPT-2 on local text in a plain loop on accelerate.Accelerator with hetero: per-rank batch sizes by speed.

    torchrun --standalone --nproc-per-node=2 examples/accelerate_loop.py --text docs/huggingface.md \
        --hetero 1:slowdown=3 --rebalance-every 5       # rank 1 emulated 3x slower: it gets about a quarter
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --text docs/huggingface.md \
        --hetero 1:slowdown=3

(--multi_gpu is accelerate's torchrun launcher, also for CPU ranks: the script asks for Accelerator(cpu=True) when
there is no GPU; `--cpu` would start one process.)

What hetero needs from Accelerate: hetero.integrations.accelerate.prepare(accelerator, bal, model, opt, sched)
instead of accelerator.prepare (the model becomes DDP and bal.attach installs the weighting hook on it; the LR
scheduler steps once per optimizer step, where accelerate's would step once per process: the schedule is sized by
bal.position.steps_per_epoch, the steps of the global batch), and hetero's loader left out of prepare: prepare
would wrap its batch sampler in a BatchSamplerShard, giving each rank every world-th of its own batches. The
batches are moved to accelerator.device by hand instead. The loss is each rank's own mean: hetero weights it by b_i/B.
"""
import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

import hetero
from hetero.integrations.accelerate import prepare

sys.path.insert(0, os.path.dirname(__file__))
from hf_trainer import CharText, tiny_gpt2  # noqa: E402  (the same local text and model as the Trainer example)


def main(args) -> int:
    try:
        with open(args.text) as f:
            ds = CharText(f.read(), args.length, args.subset)
    except (OSError, ValueError) as e:
        print(f"hetero: error: --text {args.text}: {e}", file=sys.stderr)
        return 2
    try:  # before any process group: a bad setting stops every rank alike, with one line
        bal = hetero.Balance(scheme=args.scheme, global_batch=args.global_batch, rebalance_every=args.rebalance_every,
                             seed=args.seed)
        bal.emulate(args.hetero)
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    model = tiny_gpt2(len(ds.vocab), args.length, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)))  # not prepared: hetero's slices stay whole
    # upstream's sizing (accelerate's nlp_example.py) by the steps: len(loader) is them only without micro_batch
    sched = get_linear_schedule_with_warmup(opt, 0, bal.position.steps_per_epoch * args.epochs)
    # accelerator.prepare, bal.attach on the DDP model (weight b_i/B, step clock, emulated delay), one LR step per step
    model, opt, sched = prepare(accelerator, bal, model, opt, sched)
    seen, losses, lrs = {}, [], []
    for epoch in range(args.epochs):
        bal.set_epoch(epoch)
        seen[epoch] = []
        for batch in loader:
            idx = batch.pop("idx")
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with bal.step():
                loss = model(**batch).loss  # this rank's mean over its tokens
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            seen[epoch] += idx.tolist()
            # the global batch's mean: each rank's mean weighted by its share of the samples
            losses.append(accelerator.reduce(loss.detach() * len(idx), "sum").item() / args.global_batch)
        lrs.append(sched.get_last_lr()[0])
        if rank == 0:
            print(f"epoch {epoch}: train loss {losses[-1]:.3f}, lr {lrs[-1]:.2g}, batch sizes {bal.last_sizes}",
                  flush=True)
    if args.record:
        with open(f"{args.record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "seen": seen, "losses": losses, "lrs": lrs,
                       "decisions": [d.__dict__ for d in bal.decisions]}, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default="docs/huggingface.md", help="a local text file: its characters are the tokens")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--length", type=int, default=32, help="characters per row")
    p.add_argument("--subset", type=int, default=320, help="rows cut from the text")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheme", default="edp", help="sync, dp, edp or affine")
    p.add_argument("--rebalance-every", type=int, default=5, help="decide every K steps (0: at epoch ends only)")
    p.add_argument("--hetero", default="", help='emulated heterogeneity, e.g. "1:slowdown=3"')
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    sys.exit(main(p.parse_args()))
