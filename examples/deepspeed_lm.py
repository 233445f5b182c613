"""A tiny GPT-2 on local text in a plain DeepSpeed loop, ZeRO-2, with hetero: per-rank batch sizes by speed.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node=2 examples/deepspeed_lm.py \
        --hetero 1:slowdown=3 --rebalance-every 5        # rank 1 emulated 3x slower: it gets about a quarter
    ... --checkpoint-dir runs/ds --save-every 4 [--resume]   # mid-epoch DeepSpeed checkpoints, hetero's state inside
    deepspeed --num_gpus 2 examples/deepspeed_lm.py --text docs/huggingface.md --micro-batch 4

What hetero needs from a DeepSpeed loop (docs/deepspeed.md): bal.attach(model_engine) after deepspeed.initialize (the
config's gradient_accumulation_steps 1, its batch sizes nominal: train_batch_size the global batch), hetero's batch
sampler in place of the DistributedSampler, bal.set_epoch, and each batch (or micro-batch) in `with bal.step():`,
with model_engine.step() where it was: hetero makes it a no-op before a rank's last micro-batch and reduces the step's
gradients there, once, weighted by b_i/B; with checkpoints, hetero's state in DeepSpeed's client_state.
"""
import argparse
import json
import os
import sys

import deepspeed
import torch
from torch.utils.data import DataLoader

import hetero

sys.path.insert(0, os.path.dirname(__file__))
from hf_trainer import CharText, tiny_gpt2  # noqa: E402  (the same local text and model as the Trainer example)


def config(args, world: int) -> dict:
    return {"train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": args.global_batch // world,
            "gradient_accumulation_steps": 1, "zero_optimization": {"stage": args.zero},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0, "steps_per_print": 10**9}


def main(args) -> int:
    try:
        with open(args.text) as f:
            ds = CharText(f.read(), args.length, args.subset)
    except (OSError, ValueError) as e:
        print(f"hetero: error: --text {args.text}: {e}", file=sys.stderr)
        return 2
    try:  # before any process group: a bad setting stops every rank alike, with one line
        bal = hetero.Balance(scheme=args.scheme, global_batch=args.global_batch, rebalance_every=args.rebalance_every,
                             micro_batch=args.micro_batch, seed=args.seed)
        bal.emulate(args.hetero)
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_gpt2(len(ds.vocab), args.length, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model_engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(args, world))
    bal.attach(model_engine)  # the weight b_i/B on the loss, one reduction a step, the step clock
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)))
    seen, losses = {}, []  # losses: each epoch's mean over its samples, every rank's summed (one all-reduce)
    ckpt, log = args.checkpoint_dir, open(f"{args.record}.rank{rank}.steps.jsonl", "a") if args.record else None
    if args.resume and ckpt and os.path.exists(os.path.join(ckpt, "latest")):
        _, client = model_engine.load_checkpoint(ckpt)  # DeepSpeed's files load with pickle: only your own
        bal.load_state_dict(client["hetero"])  # the shares, the position mid-epoch, the estimates
        losses = client["losses"]
        if rank == 0:
            print(f"resumed at step {bal.position.step} of epoch {bal.position.epoch}", flush=True)
    for epoch in range(bal.position.next_epoch, args.epochs):  # a resumed epoch goes on where it stopped
        bal.set_epoch(epoch)
        seen[epoch], total = [], torch.zeros(2, device=model_engine.device)
        for batch in loader:
            idx = batch.pop("idx")
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            step = bal.position.global_step
            with bal.step():
                loss = model_engine(**batch).loss  # this rank's mean over its tokens
                model_engine.backward(loss)
                model_engine.step()
            seen[epoch] += idx.tolist()
            total += torch.tensor([loss.item() * len(idx), len(idx)], device=total.device)
            if log:  # one line a batch, flushed: what a killed run had done
                print(json.dumps({"step": step, "epoch": epoch, "idx": idx.tolist()}), file=log, flush=True)
            done = bal.position.global_step
            if ckpt and args.save_every and done != step and done % args.save_every == 0:  # a step ended
                model_engine.save_checkpoint(ckpt, client_state={"hetero": bal.state_dict(), "losses": losses})
        torch.distributed.all_reduce(total)
        losses.append((total[0] / total[1]).item())
        if rank == 0:
            print(f"epoch {epoch}: train loss {losses[-1]:.3f}, batch sizes {bal.last_sizes}", flush=True)
    if args.record:
        with open(f"{args.record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "seen": seen, "losses": losses,
                       "decisions": [d.__dict__ for d in bal.decisions]}, f)
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
    p.add_argument("--zero", type=int, default=2, choices=range(4), help="ZeRO stage")
    p.add_argument("--scheme", default="edp", help="sync, dp, edp or affine")
    p.add_argument("--rebalance-every", type=int, default=5, help="decide every K steps (0: at epoch ends only)")
    p.add_argument("--micro-batch", type=int, default=0, help="m > 0: micro-batches of m, each rank its own count")
    p.add_argument("--hetero", default="", help='emulated heterogeneity, e.g. "1:slowdown=3"')
    p.add_argument("--checkpoint-dir", default="", help="save DeepSpeed checkpoints there (--save-every)")
    p.add_argument("--save-every", type=int, default=0, help="a checkpoint every N steps, mid-epoch too")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    sys.exit(main(p.parse_args()))
