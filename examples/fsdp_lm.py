"""A small decoder-only transformer on character-level text with FSDP2 and hetero: per-rank batch sizes balanced by
measured speed, with the exact global-batch gradient (docs/fsdp.md).

    torchrun --standalone --nproc-per-node=2 examples/fsdp_lm.py --hetero 1:slowdown=3 --rebalance-every 5
    torchrun --standalone --nproc-per-node=2 examples/fsdp_lm.py --micro-batch 4 --checkpoint-dir runs/lm --resume

The text is this checkout's own *.md and hetero/*.py files unless --data names a file or a folder.
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

import hetero

ROOT = Path(__file__).resolve().parents[1]


class CharWindows(Dataset):
    """(tokens, next tokens, index): non-overlapping windows of seq_len + 1 bytes of the text."""

    def __init__(self, text: bytes, seq_len: int, n_samples: int = 0):
        self.tokens, self.seq_len = torch.frombuffer(bytearray(text), dtype=torch.uint8).long(), seq_len
        self.n = min(n_samples or len(self.tokens), (len(self.tokens) - 1) // seq_len)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        w = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return w[:-1], w[1:], i


def read_text(data: str) -> bytes:
    """The bytes of --data (a file, or every *.md, *.py and *.txt under a folder), else of this checkout's files."""
    if not data:
        files = sorted(ROOT.glob("*.md")) + sorted((ROOT / "hetero").rglob("*.py"))
    elif os.path.isfile(data):
        files = [Path(data)]
    else:
        files = sorted(p for ext in ("md", "py", "txt") for p in Path(data).rglob(f"*.{ext}"))
    return b"\n".join(p.read_bytes() for p in files)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    """Bytes in, next-byte logits out: embeddings, `layers` blocks, a final norm and an untied head."""

    def __init__(self, seq_len: int, dim: int, heads: int, layers: int, vocab: int = 256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).flatten(0, 1))  # [B*T, vocab]: flat, so FSDP hooks no view


def save(folder: Path, model, opt, extra: dict) -> None:
    """The sharded model and optimizer (torch.distributed.checkpoint) and plain `extra` (rank 0), all or nothing."""
    tmp = folder.with_name(folder.name + ".tmp")
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        torch.save(extra, tmp / "extra.pt")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)  # a run killed before this line leaves the previous epoch's checkpoint whole
    dist.barrier()


def load(folder: Path, model, opt) -> dict:
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(folder / "extra.pt", weights_only=True)


def main(args) -> int:
    try:  # before any process group: a bad setting stops every rank alike, with one line
        bal = hetero.Balance(scheme=args.scheme, global_batch=args.global_batch, rebalance_every=args.rebalance_every,
                             seed=args.seed, micro_batch=args.micro_batch)
        bal.emulate(args.hetero)
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ds = CharWindows(read_text(args.data), args.seq_len, args.subset)
    torch.manual_seed(args.seed)  # the same initial model on every rank; fully_shard keeps each rank's shard
    model = LM(args.seq_len, args.dim, args.heads, args.layers).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    try:
        bal.attach(model)  # gradient weight b_i/B in the reduce-scatter, the step clock, the emulated delay
    except ValueError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    loader = DataLoader(ds, batch_sampler=bal.batch_sampler(len(ds)), num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ckpt, start, record = Path(args.checkpoint_dir) if args.checkpoint_dir else None, 0, {}
    if args.resume and ckpt and (done := sorted(ckpt.glob("epoch[0-9]*[0-9]"))):
        extra = load(done[-1], model, opt)
        bal.load_state_dict(extra["balance"])
        start, record = extra["epoch"] + 1, json.loads(extra["records"][rank])
        if rank == 0:
            print(f"resumed from {done[-1]}", flush=True)
    seen, sizes, losses = record.get("seen", {}), record.get("sizes", {}), record.get("losses", [])
    for epoch in range(start, args.epochs):
        bal.set_epoch(epoch)
        seen[str(epoch)], total = [], torch.zeros(2, dtype=torch.float64)
        for x, y, idx in loader:
            x, y = x.to(device), y.to(device)
            with bal.step():
                loss = F.cross_entropy(model(x), y.flatten())
                loss.backward()
                if bal.sync_now:  # always, without --micro-batch
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sizes[str(bal.position.global_step)] = bal.last_sizes
            seen[str(epoch)] += idx.tolist()
            total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total[0].item() / total[1].item())
        if rank == 0:
            print(f"epoch {epoch}: train loss {losses[-1]:.4f}, batch sizes {bal.last_sizes}", flush=True)
        record = {"rank": rank, "seen": seen, "sizes": sizes, "losses": losses,
                  "decisions": [d.__dict__ for d in bal.decisions]}
        if ckpt:  # the Balance's state is plain data: torch.load(weights_only=True) reads it
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, json.dumps(record))
            save(ckpt / f"epoch{epoch:04d}", model, opt, {"balance": bal.state_dict(), "epoch": epoch,
                                                          "records": records})
    if args.record:
        with open(f"{args.record}.rank{rank}.json", "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="", help="a text file or a folder of them (default: this checkout's files)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=32, help="tokens (bytes) per sample")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks, each fully_shard'ed")
    p.add_argument("--subset", type=int, default=0, help="train on this many samples (0: all)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--checkpoint-dir", default="", help="save a checkpoint there at every epoch's end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--scheme", default="edp", help="sync, dp, edp or affine")
    p.add_argument("--rebalance-every", type=int, default=10, help="decide every K steps (0: at epoch ends only)")
    p.add_argument("--hetero", default="", help='emulated heterogeneity, e.g. "1:slowdown=3"')
    p.add_argument("--micro-batch", type=int, default=0, help="fixed micro-batch; ranks run unequal counts")
    p.add_argument("--record", default="", help="write the indices each rank consumed to RECORD.rankR.json")
    sys.exit(main(p.parse_args()))
