"""What a Hugging Face model's loss does with the Trainer's token count, found by running it, not read from a signature.

The Trainer passes `num_items_in_batch` to every model whose forward takes `**kwargs` (`model_accepts_loss_kwargs`)
and to a `compute_loss_func`, and then treats the loss as (sum over valid label tokens) / num_items_in_batch: with
average_tokens_across_devices it multiplies each rank's loss by world. Many heads take `**kwargs` and never read the
count (BertForSequenceClassification, BertForMaskedLM, T5, BART, ViT: a plain mean), so the signature says nothing
(transformers #47688). hetero weights each rank's gradient, so it needs the truth: the user may say it
(HeteroTrainer(loss_mean=...), one of KINDS), and at the first step of each train() every rank checks it on the
step's micro-batches (eval mode, no gradient, forward only, before the step clock starts):

- given num_items_in_batch c and then 2c, a loss that halves divides by the count: kind "trainer", the Trainer's
  own count is the denominator (exact in both settings of average_tokens_across_devices);
- a loss that does not move ignores the count. It is a mean only if the batch taken twice over gives the same loss
  (a sum doubles), and then the whole batch's loss must be the count-weighted mean of its rows' losses (up to
  PROBE_ROWS rows, one forward each), which names the count: "tokens" (labels != -100), "shifted"
  (labels[..., 1:] != -100, a causal LM's own mean) or "rows" (a per-sample mean). Micro-batches whose tensors differ
  only in their rows are joined first, so that micro-batches of one row still make batches of several.

On DeepSpeed ZeRO-3 every forward gathers the parameters, a collective: the ranks then run the probe's forwards in
lockstep (a MAX all-reduce before each says whether any rank has one left; a rank without runs its first batch again).
The ranks combine their findings with a MIN all-reduce (a rank that cannot tell agrees to everything). A loss that
fits no kind (an extra term, a sum) is refused in one line naming the class, on every rank alike, and so is a kind
the user said that the loss contradicts. Where several means fit (one row per micro-batch, each of its own length;
rows whose counts are proportional, such as unpadded ones or one label per row) the count cannot be told: hetero
takes the user's word, and without it refuses in one line naming loss_mean. It never picks one of them itself.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

MEANS = ("tokens", "shifted", "rows")  # a mean's own count
KINDS = ("trainer", *MEANS)  # what HeteroTrainer(loss_mean=...) takes: the loss's denominator
SAY = ('HeteroTrainer(loss_mean="tokens") for a mean over labels != -100, "shifted" for labels[..., 1:] != -100 '
       '(a causal LM\'s own mean) or "rows" for a per-sample mean')
RTOL = 1e-5  # float32 losses of one batch summed in two orders agree to ~1e-7; a wrong count is off by ~1e-3
PROBE_ROWS = 16  # rows whose losses are taken one by one at the first step (forwards without gradient)


def rows(inputs: dict[str, Any]) -> int | None:
    """The batch's number of samples (the first dimension of its first tensor), None without tensors; a packed row
    (DataCollatorWithFlattening: one row, position_ids restarting at 0 for each sample) counts its samples."""
    pos = inputs.get("position_ids")
    if torch.is_tensor(pos) and pos.dim() == 2 and len(pos) == 1:
        return int(pos.eq(0).sum())
    return next((len(v) for v in inputs.values() if torch.is_tensor(v) and v.dim()), None)


def count(inputs: dict[str, Any], kind: str) -> int:
    """This batch's count of `kind` (one of MEANS): the denominator of a loss that is a mean over it."""
    if kind == "rows":
        return rows(inputs) or 0
    labels = inputs["labels"]
    return int((labels[..., 1:] if kind == "shifted" else labels).ne(-100).sum())


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12)


def _part(inputs: dict[str, Any], n: int, part: slice) -> dict[str, Any]:
    return {k: v[part] if torch.is_tensor(v) and v.dim() and len(v) == n else v for k, v in inputs.items()}


def _per_row(v, n: int) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 and len(v) == n


def _joinable(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two batches differ only in their rows: the same keys, row tensors of one shape past the first
    dimension and one dtype, everything else identical (no padding is invented: rows of other shapes stay apart)."""
    na, nb = rows(a), rows(b)
    if a.keys() != b.keys() or not na or not nb:
        return False
    for k, x in a.items():
        y = b[k]
        if _per_row(x, na) != _per_row(y, nb):
            return False
        if _per_row(x, na):
            if x.shape[1:] != y.shape[1:] or x.dtype != y.dtype:
                return False
        elif not (x is y or (torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x, y))
                  or (not torch.is_tensor(x) and not torch.is_tensor(y) and x == y)):
            return False
    return True


def _join(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    na = rows(a)
    return {k: torch.cat([v, b[k]]) if _per_row(v, na) else v for k, v in a.items()}


def _groups(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step's micro-batches joined where they differ only in rows (up to PROBE_ROWS rows a group)."""
    groups: list[dict[str, Any]] = []
    for b in batches:
        i = next((i for i, g in enumerate(groups) if rows(g) < PROBE_ROWS and _joinable(g, b)), None)
        if i is None:
            groups.append(b)
        else:
            groups[i] = _join(groups[i], b)
    return groups


def _findings(batches: list[dict[str, Any]], num_items, loss) -> list[int]:
    """This rank's verdicts [divides, ignores, a mean, tokens, shifted, rows]: 1 where its batches agree (or
    cannot tell). loss(batch, num_items): the loss of one forward."""
    found = [1] * (3 + len(MEANS))
    first = next(((b, w) for b in batches if math.isfinite(w := loss(b, num_items)) and w != 0.0), None)
    if first is None:
        return found  # nothing to learn from this rank's batches
    batch, whole = first
    if num_items is not None:  # the Trainer passes a count: does the loss divide by it?
        doubled = loss(batch, num_items * 2)
        found[0], found[1] = int(_close(whole, 2 * doubled)), int(_close(whole, doubled))
    else:
        found[0] = 0
    if not found[1]:
        return found
    found[2] = int(_close(whole, loss(_join(batch, batch), num_items)))  # a mean of the batch twice over is its own
    labels = batch.get("labels")
    for i, kind in enumerate(MEANS):  # no labels to count, or none past the rows to shift (one label per row)
        if kind != "rows" and not (torch.is_tensor(labels) and labels.dim() >= (2 if kind == "shifted" else 1)):
            found[3 + i] = 0
    budget = PROBE_ROWS
    for group in _groups(batches):
        n = min(rows(group) or 0, budget)
        if n < 2:  # one row says nothing about the count
            continue
        budget -= n  # a mean: which count makes the whole the count-weighted mean of its rows' losses?
        some = _part(group, rows(group), slice(0, n))
        whole = loss(some, num_items)
        each = [_part(some, n, slice(r, r + 1)) for r in range(n)]
        losses = [loss(row, num_items) for row in each]
        for i, kind in enumerate(MEANS):
            if not found[3 + i]:
                continue
            c = [count(row, kind) for row in each]
            found[3 + i] &= int(sum(c) > 0 and _close(whole * sum(c), sum(ci * li for ci, li in zip(c, losses))))
    return found


def decide(trainer, batches: list[dict[str, Any]], num_items, device: torch.device, said: str | None = None,
           aligned: bool = False) -> str:
    """Collective: the loss's kind (one of KINDS), the same on every rank; a one-line ValueError where the loss fits
    none, contradicts `said` (the user's HeteroTrainer(loss_mean=...)), or fits several means and `said` is None.
    batches: this rank's micro-batches of the first step; num_items: what the Trainer passes to the loss (None where
    it passes nothing); aligned: every forward is collective (DeepSpeed ZeRO-3 gathers the parameters in each), so
    the ranks run theirs in lockstep: before each forward they agree whether any rank has one to run (a MAX
    all-reduce), and a rank with none left runs its first batch again, until none has."""
    model, together = trainer.model, dist.is_available() and dist.is_initialized()
    aligned = aligned and together
    was_training = model.training
    model.eval()  # no dropout, no BatchNorm statistics: the same function of the rows at every call

    def wanted(mine: int) -> bool:  # a forward to run this round on some rank (aligned only)
        flag = torch.tensor([mine], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def loss(batch: dict[str, Any], n) -> float:
        if aligned:
            wanted(1)
        return float(trainer.compute_loss(model, dict(batch), num_items_in_batch=n))
    try:
        with torch.no_grad():
            prepared = [trainer._prepare_inputs(b) for b in batches]
            found = _findings(prepared, num_items, loss)
            while aligned and wanted(0):  # another rank has forwards left: run as many
                trainer.compute_loss(model, dict(prepared[0]), num_items_in_batch=num_items)
    finally:
        model.train(was_training)
    flags = torch.tensor(found, dtype=torch.int64, device=device)
    if together:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    divides, ignores, mean, *means = flags.tolist()
    name = type(trainer.accelerator.unwrap_model(model)).__name__
    what = "its compute_loss_func" if trainer.compute_loss_func is not None else f"{name}'s loss"
    fit = [k for k, ok in zip(MEANS, means) if ok] if ignores and mean else []
    divides = divides and num_items is not None
    if said == "trainer" or (said is None and divides and not ignores):
        if divides:
            return "trainer"
        why = ("the Trainer passes it no num_items_in_batch (a forward without **kwargs and no compute_loss_func)"
               if num_items is None else "it does not halve when the Trainer's num_items_in_batch doubles")
        raise ValueError(f"hetero: loss_mean=\"trainer\" says {what} is divided by the Trainer's num_items_in_batch, "
                         f"but {why}: leave loss_mean out, or name the count it is a mean over")
    if said is not None:
        if said in fit:
            return said
        why = ("it is divided by the Trainer's num_items_in_batch: use loss_mean=\"trainer\"" if divides and not
               ignores else "it doubles when its batch is taken twice over (a sum?)" if not mean else
               f"the first step's loss is not the {said}-weighted mean of its rows' losses (it fits "
               f"{' or '.join(fit) or 'no count'})")
        raise ValueError(f"hetero: loss_mean=\"{said}\" says {what} is a mean over {said}, but {why}")
    if len(fit) == 1:
        return fit[0]
    if fit:
        raise ValueError(f"hetero: {what} ignores the Trainer's num_items_in_batch, and the first step's batches "
                         f"cannot tell which count it is a mean over ({', '.join(fit)} all fit: one row per "
                         f"micro-batch, or rows whose counts are proportional), so hetero cannot weight {name}'s "
                         f"gradient without a guess: say it with {SAY}")
    raise ValueError(f"hetero: {what} is neither divided by the Trainer's num_items_in_batch nor a mean over the "
                     f"samples or the valid label tokens (an extra term such as an auxiliary loss, or a sum?), so "
                     f"hetero cannot weight {name}'s gradient exactly: make the loss one of these")
