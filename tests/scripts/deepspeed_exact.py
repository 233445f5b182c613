"""Three optimizer steps of a DeepSpeed engine with unequal per-rank work, and the same steps in one DeepSpeed process
on the union of their samples.

    torchrun --nproc-per-node 2 deepspeed_exact.py OUT CASE [CASE ...]       # hetero's ranks
    torchrun --nproc-per-node 1 deepspeed_exact.py OUT --ref CASE [CASE ...]  # the reference, from their records

CASE is STAGE:MODE:OPT[:BREAK], every case an engine of its own in the same processes (one launch, many checks):
STAGE: ZeRO stage 0-3. MODE: micro (micro_batch 4, replayed counts k = [1, 3]), batch (no micro_batch, sizes [3, 13]),
clock (even sizes, rank 1 emulated 1 s slower a step) or resume (micro, and after two steps a DeepSpeed checkpoint
with hetero's state in its client_state, loaded into a new engine and Balance that run the third), or split by
tokens (tests/tokenlm.py's documents; each rank records its rows, and the test computes the reference in one process):
tokens (padded, token mean), tokmicro (packed, micro-batches of 2, sample mean), budget (a token budget, padded,
micro-batches of 2, sample mean) or decide (tokens, rank 1 emulated 20 ms a step slower, a decision every step: its
decisions are recorded). OPT: sgd or adamw.
BREAK (negative controls): double (rank 0's weight doubled), remove (scheme "sync": the mean of the ranks' means),
equal (even counts [2, 2] in place of [1, 3]), samples (by tokens: sample weights, the loop's loss a token mean),
replay and swapped (decide: bal.replay of the decisions of this launch's decide case through JSON, as they were or
with the ranks' fitted costs swapped);
other settings: bf16 (the config's bf16: on ZeRO 1-3 trained, on ZeRO-0 refused), sum (gradient_allreduce_op "sum":
hetero's factor is 1), pair (the model returns the loss and the logits it came from, as a Hugging Face model does: the
weight must reach the logits' gradient once). Refusals at attach are recorded as {"refused": line} and the launch goes
on: gas (gradient_accumulation_steps 2), data (deepspeed.initialize given training_data), deepcompile, bf16 on ZeRO-0,
again (a second Balance on the engine). Refusals in a step are a line on stderr and exit status 2, and end the launch:
missing (no engine.step()), early (engine.step() before the backward), torch (loss.backward() in place of
engine.backward(loss)); every refusal in a step is also tested in one process (tests/core/test_deepspeed.py).
Each rank writes OUT.CASE.rankR.json (CASE with "-" for ":"): every step's sample indices, the parameters after the
first and third steps (gathered under ZeRO-3), and every step's clock; the reference writes OUT.CASE.ref.json.
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import hetero  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the variable-length model of tokenlm.py
import tokenlm  # noqa: E402

N, B, M, STEPS = 64, 16, 4, 3  # 4 steps per epoch of the global batch 16; three are trained
# ZeRO-3 partitions every parameter (none kept whole for being small): each forward and backward gathers them
PARTITIONED = {"stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0}
X = torch.randn(N, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))


class Indexed(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return X[i], Y[i], i


def net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


class Pair(torch.nn.Module):
    """The net as a Hugging Face model: given the labels, it returns the loss and the logits it came from."""

    def __init__(self):
        super().__init__()
        self.net = net()

    def forward(self, x, y):
        logits = self.net(x)
        return F.cross_entropy(logits, y), logits


def engine_for(stage: int, opt: str, world: int, broken: str = ""):
    model = Pair() if broken == "pair" else net()
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.5) if opt == "sgd" else
                 torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1))
    config = {"train_micro_batch_size_per_gpu": B // world, "gradient_accumulation_steps": 2 if broken == "gas" else 1,
              "zero_optimization": {"stage": stage, **PARTITIONED}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if broken == "gas":
        config["train_micro_batch_size_per_gpu"] //= 2
    if broken == "bf16":
        config["bf16"] = {"enabled": True}
    if broken == "sum":
        config["gradient_allreduce_op"] = "sum"
    if broken == "deepcompile":
        config["compile"] = {"deepcompile": True}
    data = Indexed() if broken == "data" else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, training_data=data)
    return engine


def params(engine) -> list[float]:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # a no-op below ZeRO-3
        return torch.cat([p.detach().flatten() for p in engine.module.parameters()]).tolist()


def balance(mode: str, broken: str) -> hetero.Balance:
    micro = mode in ("micro", "resume")
    sizes = [B // 2] * 2 if mode == "clock" or broken == "equal" else [M, B - M] if micro else [3, B - 3]
    bal = hetero.Balance(scheme="sync" if broken == "remove" else "edp", global_batch=B, micro_batch=M if micro else 0)
    bal.replay({0: np.array([sizes] * (N // B))})
    if mode == "clock":
        bal.emulate("1:delay=1.0")
    return bal


def train(bal: hetero.Balance, engine, steps: list, after: dict, upto: int, broken: str) -> None:
    """The loop, from where the Balance is to step `upto` of epoch 0; every step's indices into `steps`, the
    parameters after steps 1 and STEPS into `after`."""
    loader = DataLoader(Indexed(), batch_sampler=bal.batch_sampler(N))
    dtype = next(engine.module.parameters()).dtype
    bal.set_epoch(0)
    for x, y, idx in loader:
        at = bal.position.step
        if at == upto:
            break
        steps[at] += idx.tolist()
        with bal.step():
            if broken == "double" and bal.rank == 0:
                bal.set_weight(2 * bal.engine.running().weight)
            if broken == "pair":
                loss = engine(x, y)[0]
            else:
                loss = F.cross_entropy(engine(x.to(dtype)), y)  # bf16: the engine casts the model, not the inputs
            if broken == "early":
                engine.step()
            if broken == "torch":
                loss.backward()
            else:
                engine.backward(loss)
            if broken != "missing":
                engine.step()
        if bal.position.step in (1, STEPS) and bal.position.step != at:
            after[bal.position.step] = params(engine)


# variable-length documents split by tokens (issue 49): tests/tokenlm.py's corpus and model, 3 steps of 24 documents
# (or of a 6,400-token budget: 28, 21 and 23), the loop of tests/core/test_tokens.py with engine.backward/step
TN, TB, BUDGET, TLR = 72, 24, 6400, 0.5
TOKEN_MODES = {"tokens": ("padded", "tokens", 0), "tokmicro": ("packed", "samples", 2),  # collator, mean, micro
               "budget": ("padded", "samples", 2),  # and Balance(token_budget=BUDGET) in place of global_batch
               "decide": ("padded", "tokens", 0)}  # and rank 1 slower, a decision every step
RECORD: list[dict] = []  # the decisions of this launch's decide case, for its replay


def run_tokens(stage: int, mode: str, broken: str) -> dict:
    """A split by tokens on a DeepSpeed engine: every step's rows on this rank and the parameters after each step.
    BREAK samples: the Balance weighs a sample mean where the loop's loss is a token mean (must miss)."""
    collator, mean, m = TOKEN_MODES[mode]
    lengths, tokens, labels = tokenlm.corpus(TN)
    counted = np.array([int((y != tokenlm.IGNORE).sum()) for y in labels])
    budget, weighs = mode == "budget", "samples" if broken == "samples" else mean
    bal = hetero.Balance(global_batch=None if budget else TB, token_budget=BUDGET if budget else None,
                         collator=collator, loss_mean=weighs,
                         micro_batch=m,  # the prior's split (equal cost), the same every run, but decide's
                         rebalance_every=1 if mode == "decide" else 0)
    if mode == "decide":
        bal.emulate("1:delay=0.02")  # rank 1 slower per step: the fitted costs move the split
        if broken:
            record = RECORD if broken == "replay" else [
                {**d, "fixed_s": d["fixed_s"][::-1], "per_unit_s": d["per_unit_s"][::-1]} for d in RECORD]
            bal.replay(json.loads(json.dumps(record)))  # as a run's decisions come back from a JSON file
    model = tokenlm.PrefixLM().float()  # DeepSpeed reduces no float64 gradient
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, **PARTITIONED}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=TLR),
                                      config=config)
    bal.attach(engine)
    sampler = bal.batch_sampler(TN, lengths=lengths, loss_tokens=counted if weighs == "tokens" else None)
    bal.set_epoch(0)
    rows, after, forwards = [], [], []
    for idx in sampler:
        step = bal.position.step
        if len(rows) == step:
            rows.append([])
        rows[step] += idx
        scale = tokenlm.micro_scale(idx, sampler.rows_at(0, step), counted, mean) if m else 1.0
        with bal.step(len(idx)):
            forwards.append(bal.micro_batches)
            engine.backward(scale * tokenlm.loss(engine, tokenlm.collate(idx, tokens, labels, collator), mean,
                                                 len(idx)))
            engine.step()
        if bal.position.step > step:
            after.append(params(engine))
    decisions = [dataclasses.asdict(d) for d in bal.decisions]
    if mode == "decide" and not broken:
        RECORD[:] = decisions
    return {"rows": rows, "params": after, "micro_batches": forwards, "decisions": decisions}


def run(out: str, case: str) -> None:
    stage, mode, opt, broken = (case.split(":") + [""])[:4]
    stage, name = int(stage), case.replace(":", "-")
    if mode in TOKEN_MODES:
        record = run_tokens(stage, mode, broken)
        with open(f"{out}.{name}.rank{dist.get_rank()}.json", "w") as f:
            json.dump(record, f)
        return
    bal = balance(mode, broken)
    engine = engine_for(stage, opt, bal.world, broken)
    try:
        bal.attach(engine)
        if broken == "again":  # a second Balance on the same engine
            balance(mode, "").attach(engine)
    except ValueError as e:  # refused at attach, on every rank alike and before any collective: the launch goes on
        with open(f"{out}.{name}.rank{bal.rank}.json", "w") as f:
            json.dump({"refused": str(e)}, f)
        return
    steps, after = [[] for _ in range(STEPS)], {}
    if mode == "resume":  # two steps, a checkpoint with hetero's state in client_state, a new engine and Balance
        train(bal, engine, steps, after, 2, broken)
        engine.save_checkpoint(f"{out}.{name}.ckpt", client_state={"hetero": bal.state_dict()})
        bal, engine = balance(mode, broken), engine_for(stage, opt, bal.world, broken)
        bal.attach(engine)
        _, client = engine.load_checkpoint(f"{out}.{name}.ckpt")
        bal.load_state_dict(client["hetero"])
    train(bal, engine, steps, after, STEPS, broken)
    clock = [{"compute_s": r.compute_s, "wait_s": r.wait_s, "delay_s": r.delay_s} for r in bal.epoch_records()]
    with open(f"{out}.{name}.rank{bal.rank}.json", "w") as f:
        json.dump({"steps": steps, "params": [after[1], after[STEPS]], "clock": clock,
                   "ds_global_steps": engine.global_steps, "ds_global_samples": engine.global_samples}, f)


def reference(out: str, case: str) -> None:
    """One DeepSpeed process, the same config, each step on the union of the ranks' samples (a mean over B)."""
    stage, _, opt, broken = (case.split(":") + [""])[:4]
    name = case.replace(":", "-")
    ranks = [json.load(open(f"{out}.{name}.rank{r}.json")) for r in range(2)]
    engine, after = engine_for(int(stage), opt, 1, "bf16" if broken == "bf16" else ""), []
    dtype = next(engine.module.parameters()).dtype
    for step in range(STEPS):
        union = sorted(ranks[0]["steps"][step] + ranks[1]["steps"][step])
        engine.backward(F.cross_entropy(engine(X[union].to(dtype)), Y[union]))
        engine.step()
        if step + 1 in (1, STEPS):
            after.append(params(engine))
    with open(f"{out}.{name}.ref.json", "w") as f:
        json.dump({"params": after}, f)


def main(out: str, *cases: str) -> int:
    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference's op: no compile (docs/deepspeed.md)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    if cases[0] == "--ref":
        for case in cases[1:]:
            reference(out, case)
        return 0
    for case in cases:
        try:
            run(out, case)
        except hetero.HeteroError as e:  # one write: the two ranks share the launcher's stderr
            os.write(2, (str(e).splitlines()[0] + "\n").encode())
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
