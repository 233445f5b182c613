"""A tiny variable-length language model for the tests of balancing by tokens (issue 49): documents of 1-512 tokens,
a model whose every position reads the mean of its document's tokens so far (so a packed row must keep its
documents apart, as transformers does from `position_ids`), the padded and the packed collators, and the token-mean
and sample-mean losses. The reference is one process on the unpacked union of a step's samples."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

VOCAB, WIDTH, IGNORE = 23, 6, -100


def corpus(n: int, seed: int = 0, longest: int = 512) -> tuple[np.ndarray, list[torch.Tensor], list[torch.Tensor]]:
    """n documents: their lengths (1..longest), their tokens and their labels (each document's first label is
    ignored, as a causal model's shift leaves it: its loss counts length - 1 tokens)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, size=n)
    tokens = [torch.from_numpy(rng.integers(0, VOCAB, size=int(L))) for L in lengths]
    labels = []
    for t in tokens:
        y = torch.from_numpy(rng.integers(0, VOCAB, size=len(t)))
        y[0] = IGNORE
        labels.append(y)
    return lengths, tokens, labels


class PrefixLM(torch.nn.Module):
    """Each position predicts its label from its token and the mean of its document's tokens up to it. `documents`
    False makes a packed row one document (the negative control: packing without the document mask)."""

    def __init__(self, seed: int = 0, documents: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB)
        self.documents = documents
        self.double()

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """ids, position_ids: [rows, T]; a document starts where position_ids is 0 (padding continues the row's
        last document and is never counted). Returns logits [rows, T, VOCAB]."""
        h = self.emb(ids)
        total = h.cumsum(1)
        start = position_ids == 0 if self.documents else torch.zeros_like(ids, dtype=torch.bool).index_fill_(
            1, torch.tensor([0]), True)
        # the running sum at the position before each document's start, carried along the document
        before = torch.where(start[..., None], total - h, torch.zeros_like(h))
        idx = torch.where(start, torch.arange(ids.shape[1]).expand_as(ids), torch.zeros_like(ids)).cummax(1).values
        base = before.gather(1, idx[..., None].expand_as(h))
        count = (torch.arange(ids.shape[1]).expand_as(ids) - idx + 1)[..., None]
        return self.out(torch.tanh(h + (total - base) / count))


def collate(rows: list[int], tokens, labels, collator: str) -> tuple[torch.Tensor, ...]:
    """ids, position_ids, labels and each token's document (row index in `rows`): padded [rows, longest] (padding
    labelled IGNORE) or packed [1, sum of lengths] (DataCollatorWithFlattening's layout)."""
    if collator == "packed":
        ids = torch.cat([tokens[i] for i in rows])[None]
        pos = torch.cat([torch.arange(len(tokens[i])) for i in rows])[None]
        lab = torch.cat([labels[i] for i in rows])[None]
        doc = torch.cat([torch.full((len(tokens[i]),), j) for j, i in enumerate(rows)])[None]
        return ids, pos, lab, doc
    T = max(len(tokens[i]) for i in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    lab = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for j, i in enumerate(rows):
        ids[j, :len(tokens[i])], lab[j, :len(tokens[i])] = tokens[i], labels[i]
    pos = torch.arange(T).expand(len(rows), T)
    doc = torch.arange(len(rows))[:, None].expand(len(rows), T)
    return ids, pos, lab, doc


def loss(model, batch, mean: str, n_docs: int) -> torch.Tensor:
    """The batch's loss: "tokens" averages over the tokens it counts, "samples" over its documents (each its own
    token mean; a document counting no token adds 0)."""
    ids, pos, lab, doc = batch
    per = F.cross_entropy(model(ids, pos).flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="none")
    counted = (lab.flatten() != IGNORE).to(per.dtype)
    if mean == "tokens":
        return (per * counted).sum() / counted.sum().clamp(min=1)
    sums = torch.zeros(n_docs, dtype=per.dtype).index_add(0, doc.flatten(), per * counted)
    counts = torch.zeros(n_docs, dtype=per.dtype).index_add(0, doc.flatten(), counted)
    return (sums / counts.clamp(min=1)).sum() / n_docs


def micro_scale(idx: list[int], mine: list[int], counted, mean: str) -> float:
    """With per-rank accumulation, a micro-batch's loss (a mean over its own rows) as its sum over this rank's count
    for the step (docs/tokens.md): idx the micro-batch's samples, mine the rank's for the step (sampler.rows_at),
    counted each sample's counted tokens."""
    return float(counted[idx].sum() / counted[mine].sum()) if mean == "tokens" else len(idx) / len(mine)


def reference(steps: list[list[int]], tokens, labels, mean: str, lr: float, seed: int = 0) -> list[list[float]]:
    """Plain SGD in one process on each step's samples, every document in a batch of its own (unpacked): the
    parameters after each step, flattened."""
    model, after = PrefixLM(seed), []
    for rows in steps:
        model.zero_grad()
        counted = sum(int((labels[i] != IGNORE).sum()) for i in rows)
        for i in rows:  # each document's share of the step's mean
            part = loss(model, collate([i], tokens, labels, "padded"), mean, 1)
            weight = int((labels[i] != IGNORE).sum()) / max(counted, 1) if mean == "tokens" else 1 / len(rows)
            (weight * part).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
    return after
