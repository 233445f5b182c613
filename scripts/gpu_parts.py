"""The GPU check's sizes, the parts that need no trainer (the raw training step, the memory probe) and its
markdown report. Imported by scripts/gpu_check.py, which puts the checkout on sys.path first."""
from __future__ import annotations

import time
from dataclasses import dataclass

from hetero.lab.measure import markdown_table

SKIPPED = "skipped: "  # an error text starting so is a part the time did not allow, not a failure


@dataclass(frozen=True)
class Sizes:
    device: str
    models: tuple[str, ...]       # throughput part
    batch: int                    # global batch everywhere
    raw_steps: int                # timed raw steps (after `warmup`)
    warmup: int
    subset: int                   # training samples of a single-rank trainer run
    epochs: int
    pair_model: str               # two-rank part
    pair_subset: int
    pair_epochs: int
    pair_hetero: str
    test_subset: int
    mixed_devices: str            # the mixed part: --device, --threads, --affinity of its ranks
    mixed_threads: str
    mixed_affinity: str
    mixed_subset: int
    mixed_epochs: int
    probe_model: str
    probe_hi: int                 # the probe's largest try
    probe_limit_s: float          # the probe's own time limit (checked between its trials)
    delay_model: str              # the delay part: two ranks on one device, rank 1 delayed
    delay_subset: int
    delay_epochs: int
    delay_hetero: str
    budget_s: float               # the whole check stops starting new parts after this long
    # the token probe (max_tokens "probe"): a causal language model of (vocab, width, layers, heads), rows of at most
    # token_length tokens, tries up to token_hi tokens in one forward
    token_model: tuple[int, int, int, int] = (64, 32, 1, 2)
    token_length: int = 64
    token_hi: int = 256


GPU = Sizes("cuda", ("vgg16", "resnet50"), 256, 40, 10, 12800, 3, "vgg16", 7680, 3, "1:slowdown=3", 1000,
            "cuda,cpu,cpu", "0,4,2", "auto", 10240, 4, "vgg16", 1 << 17, 45, "resnet50", 5120, 2, "1:delay=0.02", 270,
            token_model=(32000, 1024, 8, 16), token_length=4096, token_hi=1 << 19)
SMOKE = Sizes("cpu", ("tiny",), 32, 4, 2, 256, 2, "tiny", 256, 2, "1:slowdown=2", 64,
              "cpu,cpu", "1,1", "", 256, 2, "tiny", 64, 30, "tiny", 256, 1, "1:delay=0.02", 600)


def _sgd(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)


def raw_samples_s(name: str, s: Sizes, sync_each: bool, fast: bool = False) -> float:
    """Samples/s of plain forward, backward and SGD step on one fixed batch held on the device (fast: bf16
    autocast and channels-last, as the trainer's --bf16 --channels-last)."""
    import torch
    import torch.nn.functional as F

    from hetero.trainer.models import build_model

    dev = torch.device(s.device)
    if dev.type == "cpu":  # as the trainer's CPU runs (--threads 1)
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fmt = torch.channels_last if fast else torch.contiguous_format
    torch.manual_seed(0)
    model = build_model(name).to(dev, memory_format=fmt)
    opt = _sgd(model)
    x = torch.randn(s.batch, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (s.batch,), device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=fast)

    def step() -> None:
        with autocast:
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync_each:
            sync()
    for _ in range(s.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(s.raw_steps):
        step()
    sync()
    rate = s.batch * s.raw_steps / (time.perf_counter() - t0)
    model = opt = x = y = None  # let the step's tensors go before empty_cache (step() holds these names)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rate


def probe(s: Sizes, left) -> dict:
    """The largest batch of probe_model that fits on the device (as --max-batch probe finds it, with hi = the
    largest try instead of the global batch), then one real SGD-with-momentum step at that batch."""
    import torch
    import torch.nn.functional as F

    from hetero.core.memory import probe_max_batch
    from hetero.trainer.models import build_model

    def loss_at(model, b, dev):
        return F.cross_entropy(model(torch.zeros(b, 3, 32, 32, device=dev)), torch.arange(b, device=dev) % 10), {}
    return _probe_part(s, left, {"model": s.probe_model, "hi": s.probe_hi}, "max_batch",
                       lambda: build_model(s.probe_model),
                       lambda model, dev, limit_s: probe_max_batch(model, (3, 32, 32), 10, dev, lo=1, hi=s.probe_hi,
                                                                   limit_s=limit_s),
                       lambda model, found, dev: loss_at(model, found or s.batch, dev))


def causal_lm(vocab: int, width: int, layers: int, heads: int):
    """A causal language model of torch's own layers (the GPU machine may lack transformers), returning its loss the
    Hugging Face way for model(input_ids=..., labels=...): what the token probe tries."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, width)
            self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                                         batch_first=True, norm_first=True), layers,
                                              enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)

        def forward(self, input_ids, labels, position_ids=None):
            n = input_ids.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=input_ids.device)
            logits = self.head(self.body(self.emb(input_ids), mask=mask, is_causal=True))
            return {"loss": F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())}
    return LM()


def token_probe(s: Sizes, left) -> dict:
    """The most tokens one forward of a causal language model holds on the device (as max_tokens "probe" finds it,
    padded: rows of token_length), then two real SGD-with-momentum steps at that many tokens in that layout, which
    must fit."""
    import torch

    from hetero.core.memory import probe_max_tokens, token_batch

    def loss_at(model, found, dev):
        batch = token_batch(found or s.token_length, s.token_length, "padded", dev)
        return model(**batch)["loss"], {"rows": list(batch["input_ids"].shape)}

    def build():
        torch.manual_seed(0)
        return causal_lm(*s.token_model)
    return _probe_part(s, left, {"model": list(s.token_model), "max_length": s.token_length, "hi": s.token_hi},
                       "max_tokens", build,
                       lambda model, dev, limit_s: probe_max_tokens(model, dev, lo=1, hi=s.token_hi,
                                                                    max_length=s.token_length, limit_s=limit_s),
                       loss_at)


def _probe_part(s: Sizes, left, res: dict, key: str, build, search, loss_at) -> dict:
    """A probe part: build() the model on the device, search(model, device, limit_s) its limit (res[key]; None: no
    limit, a CPU), then two SGD-with-momentum steps at it (loss_at(model, limit, device): the loss and what to
    report of its batch), which must fit (the second has the momentum buffers: training's peak), and the peak."""
    import torch

    if left() < 30:
        return {**res, "error": f"{SKIPPED}out of time"}
    dev = torch.device(s.device)
    try:
        model = build().to(dev)
        t0 = time.perf_counter()
        found = search(model, dev, min(s.probe_limit_s, max(left() - 10, 1)))
        res["probe_s"] = time.perf_counter() - t0
        res[key] = None if found == float("inf") else int(found)
        if dev.type == "cuda":
            res["total_gib"] = torch.cuda.get_device_properties(dev).total_memory / 2 ** 30
            torch.cuda.reset_peak_memory_stats(dev)
        opt = _sgd(model)
        for _ in range(2):
            loss, about = loss_at(model, res[key], dev)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
        res.update(about, step_at_max_fits=True)
        if dev.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
        del model, opt
    except TimeoutError as e:  # the search's own limit: out of time, not a fault
        res["error"] = f"{SKIPPED}{e}"
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _fmt(r: dict, key: str, fmt: str) -> str:
    """A figure of a row, or the row's error (cut short), or "-"."""
    return format(r[key], fmt) if isinstance(r.get(key), float) else (r.get("error", "")[:60] or "-")


def markdown(res: dict) -> str:
    """The check's figures as a markdown document (what it measured so far)."""
    m = res["meta"]
    lines = [f"# GPU check, {m['date']}, {m['host']}: {m['device_name']} (torch {m['versions'].get('torch')})",
             "", f"`{m['command']}`", "", "## Throughput, one rank (samples/s)", ""]
    lines += markdown_table(
        ["model", "path", "batch", "raw step", "raw, synced each step", "trainer", "trainer / raw",
         "trainer / raw synced"],
        [[r["model"], r["path"], r["batch"], _fmt(r, "raw_samples_s", ".0f"), _fmt(r, "raw_synced_samples_s", ".0f"),
          _fmt(r, "trainer_samples_s", ".0f"), _fmt(r, "trainer_over_raw", ".3f"),
          _fmt(r, "trainer_over_raw_synced", ".3f")] for r in res.get("throughput", []) + res.get("fast", [])])
    if p := res.get("delay"):
        lines += ["", f"## Delay counted as compute: two ranks on one device, {p['model']}, --hetero {p['hetero']}, "
                      f"sync, --backend {p['backend']}", ""]
        if "compute_s" not in p:
            lines.append(f"error: {p.get('error', '')}")
        else:
            lines += markdown_table(["rank", "compute s/step", "wait s/step", "delay s/step"],
                                    [[r, f"{p['compute_s'][r]:.4f}", f"{p['wait_s'][r]:.4f}", f"{p['delay_s'][r]:.4f}"]
                                     for r in (0, 1)])
            lines += ["", f"rank 1 - rank 0: {p['excess_s'] * 1e3:.1f} ms per step over {p['steps']} steps = "
                          f"{p['excess_over_delay']:.2f} x the delay: "
                          f"{'within' if p['within_10pct'] else 'NOT within'} 10%. `{p['backend_line']}`"]
    if p := res.get("mixed"):
        lines += ["", f"## Mixed job: devices {p['devices']}, threads {p['threads']}, cores {p['affinity'] or '-'} "
                      f"({p['backend']}), {p['model']}, no emulated delay", ""] + _scheme_table(p["rows"])
    if p := res.get("pair"):
        lines += ["", f"## Two ranks on one GPU ({p['backend']}), {p['model']}, --hetero {p['hetero']}", ""] + \
            _scheme_table(p["rows"])
    if p := res.get("probe"):
        lines += _probe_lines(p, f"Largest batch that fits ({p['model']}, float32; --max-batch probe)", "max_batch",
                              lambda: f"{p['max_batch']} samples (90% of the largest that fit; tries up to {p['hi']})"
                                      f", found in {p['probe_s']:.1f} s; an SGD step at that size fits")
    if p := res.get("tokens"):
        v, w, n, h = p["model"]
        lines += _probe_lines(p, f"Most tokens one forward holds (a causal LM of width {w}, {n} layers, {h} heads, "
                                 f"vocab {v}; float32; max_tokens \"probe\", padded rows of {p['max_length']})",
                              "max_tokens",
                              lambda: f"{p['max_tokens']} tokens (90% of the most that fit; tries up to {p['hi']}), "
                                      f"found in {p['probe_s']:.1f} s; two SGD steps on {p['rows'][0]} x "
                                      f"{p['rows'][1]} tokens fit")
    return "\n".join(lines) + "\n"


def _probe_lines(p: dict, title: str, key: str, found) -> list[str]:
    """A probe part's section: its error, no limit on a CPU, or what it found (found(): the line) and its peak."""
    lines = ["", f"## {title}", ""]
    if "error" in p:
        return lines + [f"error: {p['error']}"]
    if p[key] is None:
        return lines + ["not probed: a CPU device has no limit (host memory does not fail cleanly)"]
    return lines + [found() + (f" (peak {p['peak_gib']:.1f} of {p['total_gib']:.1f} GiB)" if "peak_gib" in p else "")]


def _scheme_table(rows: list[dict]) -> list[str]:
    """One line per scheme: steady-state epoch time, speedup over sync, final shares, balance efficiency."""
    cells = []
    for r in rows:
        if "epoch_s" not in r:
            cells.append([r["scheme"], r.get("error", "")[:80], "", "", ""])
            continue
        speedup = f"{r['speedup_vs_sync']:.2f}x" if r.get("speedup_vs_sync") is not None else "-"
        cells.append([r["scheme"], f"{r['epoch_s']:.3f}", speedup, "/".join(f"{v:.2f}" for v in r["shares"]),
                      f"{r['balance_eff']:.2f}"])
    return markdown_table(["scheme", "epoch s", "speedup vs sync", "shares", "balance"], cells)
