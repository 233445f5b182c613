"""What a Hugging Face model's loss does with the Trainer's token count, found by running it, not read from a signature.

The Trainer passes `num_items_in_batch` to every model whose forward takes `**kwargs` (`model_accepts_loss_kwargs`)
and to a `compute_loss_func`, and then treats the loss as (sum over valid label tokens) / num_items_in_batch: with
average_tokens_across_devices it multiplies each rank's loss by world. Many heads take `**kwargs` and never read the
count (BertForSequenceClassification, BertForMaskedLM, T5, BART, ViT: a plain mean), so the signature says nothing
(transformers #47688). hetero weights each rank's gradient, so it needs the truth. At the first step of each train()
every rank evaluates its own first batch (eval mode, no gradient, forward only, before the step clock starts):

- given num_items_in_batch c and then 2c, a loss that halves divides by the count: kind "trainer", the Trainer's
  own count is the denominator (exact in both settings of average_tokens_across_devices);
- a loss that does not move ignores the count, so it is a mean over some count of its own: the whole batch's loss
  must then be the count-weighted mean of its rows' losses (up to PROBE_ROWS rows, one forward each), which names
  the count: "tokens" (labels != -100),
  "shifted" (labels[..., 1:] != -100, a causal LM's own mean) or "rows" (a per-sample mean).

The ranks combine their findings with a MIN all-reduce (a rank that cannot tell, with a loss of 0 or one row,
agrees to everything) and take the first kind every rank agrees with. None fits (a loss with an extra term, a sum
without the count): refused in one line naming the class, on every rank alike.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

MEANS = ("tokens", "shifted", "rows")  # a mean's own count, in the order preferred when several fit (classifiers)
RTOL = 1e-5  # float32 losses of one batch summed in two orders agree to ~1e-7; a wrong count is off by ~1e-3
PROBE_ROWS = 16  # rows whose losses are taken one by one at the first step (forwards without gradient)


def rows(inputs: dict[str, Any]) -> int | None:
    """The batch's number of samples (the first dimension of its first tensor), None without tensors."""
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


def _findings(trainer, inputs: dict[str, Any], num_items) -> list[int]:
    """This rank's verdicts [divides, ignores, tokens, shifted, rows]: 1 where its batch agrees (or cannot tell)."""
    found = [1] * (2 + len(MEANS))
    loss = lambda batch, n: float(trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=n))  # noqa: E731
    whole = loss(inputs, num_items)
    if not math.isfinite(whole) or whole == 0.0:
        return found  # nothing to learn from this rank's batch
    if num_items is not None:  # the Trainer passes a count: does the loss divide by it?
        doubled = loss(inputs, num_items * 2)
        found[0], found[1] = int(_close(whole, 2 * doubled)), int(_close(whole, doubled))
    else:
        found[0] = 0
    n = min(rows(inputs) or 0, PROBE_ROWS)
    if found[1] and n >= 2:  # a mean: which count makes the whole the count-weighted mean of its rows' losses?
        some = _part(inputs, rows(inputs), slice(0, n))
        whole = loss(some, num_items)
        each = [_part(some, n, slice(r, r + 1)) for r in range(n)]
        losses = [loss(row, num_items) for row in each]
        for i, kind in enumerate(MEANS):
            if kind != "rows" and not torch.is_tensor(inputs.get("labels")):
                found[2 + i] = 0
                continue
            c = [count(row, kind) for row in each]
            found[2 + i] = int(sum(c) > 0 and _close(whole * sum(c), sum(ci * li for ci, li in zip(c, losses))))
    return found


def decide(trainer, inputs: dict[str, Any], num_items, device: torch.device) -> str:
    """Collective: the loss's kind ("trainer" or one of MEANS), the same on every rank; one-line ValueError if none.
    num_items: what the Trainer passes to the loss (None where it passes nothing)."""
    model = trainer.model
    was_training = model.training
    model.eval()  # no dropout, no BatchNorm statistics: the same function of the rows at every call
    try:
        with torch.no_grad():
            found = _findings(trainer, trainer._prepare_inputs(inputs), num_items)
    finally:
        model.train(was_training)
    flags = torch.tensor(found, dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    divides, ignores, *means = flags.tolist()
    if num_items is not None and divides:
        return "trainer"
    if ignores and (kind := next((k for k, ok in zip(MEANS, means) if ok), None)):
        return kind
    name = type(trainer.accelerator.unwrap_model(model)).__name__
    what = "its compute_loss_func" if trainer.compute_loss_func is not None else f"{name}'s loss"
    raise ValueError(f"hetero: {what} is neither divided by the Trainer's num_items_in_batch nor a mean over the "
                     f"samples or the valid label tokens (an extra term such as an auxiliary loss, or a sum?), so "
                     f"hetero cannot weight {name}'s gradient exactly: make the loss one of these")
