"""A tiny GPT-2 on local text in a plain DeepSpeed loop, ZeRO-2 (the baseline of deepspeed_lm.py: `diff`).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node=2 examples/deepspeed_lm_baseline.py
    deepspeed --num_gpus 2 examples/deepspeed_lm_baseline.py --text docs/huggingface.md
"""
import argparse
import json
import os
import sys

import deepspeed
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

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
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_gpt2(len(ds.vocab), args.length, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model_engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(args, world))
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)
    seen, losses = {}, []  # losses: each epoch's mean over its samples, every rank's summed (one all-reduce)
    ckpt, log = args.checkpoint_dir, open(f"{args.record}.rank{rank}.steps.jsonl", "a") if args.record else None
    at = (0, 0)  # the next step: (epoch, step in it)
    if args.resume and ckpt and os.path.exists(os.path.join(ckpt, "latest")):
        _, client = model_engine.load_checkpoint(ckpt)  # DeepSpeed's files load with pickle: only your own
        at, losses = tuple(client["at"]), client["losses"]
        if rank == 0:
            print(f"resumed at step {at[1]} of epoch {at[0]}", flush=True)
    for epoch in range(at[0], args.epochs):  # a resumed epoch goes on where it stopped
        sampler.set_epoch(epoch)
        seen[epoch], total = [], torch.zeros(2, device=model_engine.device)
        for i, batch in enumerate(loader):
            if epoch == at[0] and i < at[1]:
                continue
            idx = batch.pop("idx")
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            step = epoch * len(loader) + i
            loss = model_engine(**batch).loss  # this rank's mean over its tokens
            model_engine.backward(loss)
            model_engine.step()
            seen[epoch] += idx.tolist()
            total += torch.tensor([loss.item() * len(idx), len(idx)], device=total.device)
            if log:  # one line a batch, flushed: what a killed run had done
                print(json.dumps({"step": step, "epoch": epoch, "idx": idx.tolist()}), file=log, flush=True)
            done = step + 1
            if ckpt and args.save_every and done % args.save_every == 0:
                at = divmod(done, len(loader))
                model_engine.save_checkpoint(ckpt, client_state={"at": at, "losses": losses})
        torch.distributed.all_reduce(total)
        losses.append((total[0] / total[1]).item())
        if rank == 0:
            print(f"epoch {epoch}: train loss {losses[-1]:.3f}", flush=True)
    if args.record:
        with open(f"{args.record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "seen": seen, "losses": losses}, f)
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
    p.add_argument("--checkpoint-dir", default="", help="save DeepSpeed checkpoints there (--save-every)")
    p.add_argument("--save-every", type=int, default=0, help="a checkpoint every N steps, mid-epoch too")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    code = main(p.parse_args())
    sys.stdout.flush(), sys.stderr.flush()  # then os._exit, not sys.exit: a plain script's gloo threads can abort
    os._exit(code)  # a finished run at interpreter shutdown (pytorch/pytorch#190489; hetero/core/settle.py)
