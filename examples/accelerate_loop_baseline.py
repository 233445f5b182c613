"""A tiny GPT-2 on local text in a plain loop on accelerate.Accelerator (the baseline of accelerate_loop.py: `diff`).

    torchrun --standalone --nproc-per-node=2 examples/accelerate_loop_baseline.py --text docs/huggingface.md
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop_baseline.py --text docs/huggingface.md
"""
import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

sys.path.insert(0, os.path.dirname(__file__))
from hf_trainer import CharText, tiny_gpt2  # noqa: E402  (the same local text and model as the Trainer example)


def main(args) -> int:
    try:
        with open(args.text) as f:
            ds = CharText(f.read(), args.length, args.subset)
    except (OSError, ValueError) as e:
        print(f"hetero: error: --text {args.text}: {e}", file=sys.stderr)
        return 2
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    model = tiny_gpt2(len(ds.vocab), args.length, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(ds, batch_size=args.global_batch // world, shuffle=True, drop_last=True)
    # upstream's sizing (accelerate's nlp_example.py), from the loader before prepare shards it
    sched = get_linear_schedule_with_warmup(opt, 0, len(loader) * args.epochs)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    seen, losses, lrs = {}, [], []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        seen[epoch] = []
        for batch in loader:
            idx = batch.pop("idx")
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
            print(f"epoch {epoch}: train loss {losses[-1]:.3f}, lr {lrs[-1]:.2g}", flush=True)
    if args.record:
        with open(f"{args.record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "seen": seen, "losses": losses, "lrs": lrs}, f)
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
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    code = main(p.parse_args())
    sys.stdout.flush(), sys.stderr.flush()  # then os._exit, not sys.exit: a plain script's gloo threads can abort
    os._exit(code)  # a finished run at interpreter shutdown (pytorch/pytorch#190489; hetero/core/settle.py)
