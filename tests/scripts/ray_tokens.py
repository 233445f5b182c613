"""Ray Train split by tokens (issue 49): two CPU workers of a local Ray cluster (TorchTrainer, gloo) run an epoch of
documents of 1-512 tokens with Balance(collator=..., loss_mean="tokens"), padded then packed, then packed under a
token budget with a sample-mean loss (3 steps of 28, 21 and 23 documents), worker 1 delayed 20 ms a step so the
fitted costs move the split. The padded and packed epochs are then replayed from their decisions (through JSON), and
from them with the workers' costs swapped. Each worker writes its rows, the parameters after each step and the
decisions made (OUT/rank{r}.json); tests/integrations/test_ray.py compares them with one process on the unpacked union.

    PYTHONPATH=tests/raystub:.:tests python tests/scripts/ray_tokens.py OUT_DIR
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

N, B, LR, BUDGET = 72, 24, 0.5, 6400  # 3 steps an epoch
CASES = {"padded": ("padded", None), "packed": ("packed", None), "budget": ("packed", BUDGET)}  # collator, budget
REPLAYED = ("padded", "packed")


def train_fn(cfg: dict) -> None:
    """Run by each Ray Train worker: the own-loop recipe of docs/tokens.md."""
    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetero

    import tokenlm

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    lengths, tokens, labels = tokenlm.corpus(N)
    counted = [int((y != tokenlm.IGNORE).sum()) for y in labels]

    def epoch(collator: str, budget: int | None, record: list[dict] | None = None) -> dict:
        mean = "samples" if budget else "tokens"
        bal = hetero.Balance(global_batch=None if budget else B, token_budget=budget, collator=collator,
                             loss_mean=mean, rebalance_every=1)
        bal.emulate("1:delay=0.02")
        if record is not None:
            bal.replay(json.loads(json.dumps(record)))  # as a run's decisions come back from a JSON file
        ddp = DDP(tokenlm.PrefixLM())
        bal.attach(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        sampler = bal.batch_sampler(N, lengths=lengths, loss_tokens=None if budget else counted)
        bal.set_epoch(0)
        rows, params = [], []
        for idx in sampler:
            rows.append(idx)
            with bal.step(len(idx)):
                tokenlm.loss(ddp, tokenlm.collate(idx, tokens, labels, collator), mean, len(idx)).backward()
                opt.step()
                opt.zero_grad()
            params.append(torch.cat([p.detach().flatten() for p in ddp.parameters()]).tolist())
        return {"rows": rows, "params": params, "decisions": [dataclasses.asdict(d) for d in bal.decisions]}

    out = {name: epoch(*case) for name, case in CASES.items()}
    for name in REPLAYED:  # the run replayed from its decisions, and from them with the ranks' costs swapped
        run = out[name]["decisions"]
        out[f"replay-{name}"] = epoch(*CASES[name], record=run)
        out[f"swapped-{name}"] = epoch(*CASES[name], record=[
            {**d, "fixed_s": d["fixed_s"][::-1], "per_unit_s": d["per_unit_s"][::-1]} for d in run])
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def main(out: str) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # its own cluster, beside any `ray start` one
    try:
        result = TorchTrainer(train_fn, train_loop_config={"out": os.path.abspath(out)},
                              scaling_config=ScalingConfig(num_workers=2),
                              run_config=RunConfig(name="tokens", storage_path=os.path.abspath(f"{out}/storage"))).fit()
    finally:
        ray.shutdown()
    if result.error is not None:
        print(f"hetero: error: the Ray run failed: {result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
