"""The run configuration: one frozen dataclass whose field names are the CLI flags, Make variables and
notebook parameters (`global_batch` = `--global-batch` = `GLOBAL_BATCH=`). Validation needs no process group."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..core import safeio
from ..core.rules import check_sit_out, micro_batch_too_big


class ConfigError(ValueError):
    """A bad input: reported as one line, exit status 2."""


# Bounds that keep a value inside what torch, numpy and the C++ timers take (an overflow would only show once
# training started). The seed feeds numpy's 32-bit seeding; timedelta and the collectives' millisecond clocks
# overflow near 1e13 s, and no single collective should wait more than 30 days.
MAX_SEED = 2**32 - 1
MAX_TIMEOUT_S = 30 * 86400.0
# Below a few seconds a collective times out while a peer merely starts up or imports torch (c10d then prints
# dozens of lines on every rank instead of one).
MIN_TIMEOUT_S = 5.0
# Every whole number fits torch's int64 (and a float's exponent): larger ones are refused before any conversion.
MAX_INT = 2**63 - 1
MAX_CORE = 65535  # the largest CPU core number --affinity takes (a range is expanded into a set)
_KINDS = {"int": int, "float": float, "str": str, "bool": bool}
_PATHS = ("run_dir", "resume", "replay", "data_dir")


def shown(value: object, limit: int = 60) -> str:
    """A value as an error line shows it: its repr, shortened past `limit` characters (a 400-digit number, a
    226 MB string from a YAML alias bomb), never converted in a way that can fail."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        try:
            return f"a {len(str(abs(value)))}-digit number"
        except ValueError:  # past str()'s 4,300 digits
            return f"a number of about {int(value.bit_length() * 0.30103)} digits"
    if isinstance(value, (list, tuple, dict)):  # nested values may share (YAML aliases): repr only a bounded part
        r = reprlib.Repr()
        r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxlong, r.maxother = 3, 6, 6, 40, 40, 40
        try:
            text = r.repr(value)
        except ValueError:  # an int past Python's 4,300-digit str() limit inside
            text = f"a {type(value).__name__} of {len(value)} values"
        return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"
    text = repr(value[:limit] if isinstance(value, str) else value)
    n = len(value) if isinstance(value, str) else len(text)
    return text if len(text) <= limit and n <= limit else f"{text[:limit - 20]}... ({n} characters)"


def type_problem(name: str, value: object) -> str:
    """Why `value` cannot be Config field `name` ("" if it can): an int field takes whole numbers (within int64),
    a float field numbers, a bool field true/false, a str field text; bool is no number here."""
    kind = _KINDS[str(next(f.type for f in fields(Config) if f.name == name))]
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > MAX_INT:
            return f"{name} must be a number of at most 2**63-1 (got {shown(value)})"
        ok = True
    if ok and kind is int and abs(value) > MAX_INT:
        return f"{name} must be a whole number of at most 2**63-1 (got {shown(value)})"
    if ok:
        return ""
    what = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}[kind]
    return f"{name} must be {what} (got {shown(value)}, {type(value).__name__})"


def _whole(text: str) -> bool:
    """A per-rank number as text: ASCII digits only ('²'.isdigit() is true), at most 18 of them (int64)."""
    return re.fullmatch(r"[0-9]{1,18}", text.strip()) is not None


# Choices of the enumerated fields (models.MODELS and partition.SCHEMES hold the same names; a test checks it).
MODEL_CHOICES = ("vgg11", "vgg13", "vgg16", "vgg19", "resnet18", "resnet34", "resnet50", "tiny", "tiny_nobn")
SCHEME_CHOICES = ("sync", "dp", "edp", "affine")
DATA_CHOICES = ("cifar10", "imagefolder", "synthetic")
BACKEND_CHOICES = ("auto", "gloo", "nccl")


def _opt(default, help: str, choices: tuple[str, ...] = ()):  # noqa: A002 - argparse's word
    """A Config field with its --help text (and choices): the one source for the parser, make help and the docs."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class Config:
    model: str = _opt("vgg16", "the network", MODEL_CHOICES)
    scheme: str = _opt("edp", "how work is split: sync, dp, edp are the paper's, affine is model-based", SCHEME_CHOICES)
    hetero: str = _opt("", 'heterogeneity emulation spec, e.g. "1:delay=0.1" (the grammar: docs/trainer.md)')
    straggler: str = _opt("", 'outside straggler, imposed for real: "1:quota=0.33" (a CFS quota of 1/3 core), '
                               '"1:neighbour=busy", "1:threads=1" (docs/trainer.md; a quota needs cgroup write access)')
    epochs: int = _opt(150, "training epochs")
    global_batch: int = _opt(256, "samples per step over all ranks (B)")
    min_batch: int = _opt(1, "smallest per-rank batch any scheme may assign")
    micro_batch: int = _opt(0, "fixed micro batch m on every rank: balance how many each rank runs per step, "
                               "accumulated under no_sync (0: balance batch sizes)")
    sit_out: bool = _opt(False, "affine: a rank whose fixed cost alone exceeds the balanced step sits out")
    max_batch: str = _opt("0", 'largest batch per rank (0: no limit; probe: find it on a GPU); or per rank "256,64"')
    lr: float = _opt(0.1, "SGD learning rate (Nesterov momentum, cosine schedule over the epochs)")
    momentum: float = _opt(0.9, "SGD momentum")
    weight_decay: float = _opt(5e-4, "SGD weight decay")
    data: str = _opt("cifar10", "imagefolder: DATA_DIR/train/<class>/*, DATA_DIR/test/...", DATA_CHOICES)
    data_dir: str = _opt("data", "cifar10 is downloaded here when missing; the image folder's root")
    subset: int = _opt(0, "train on this many samples (0: all)")
    test_subset: int = _opt(0, "evaluate on this many test samples (0: the full test set)")
    augment: bool = _opt(True, "random crop (4-pixel padding) and horizontal flip, as the paper")
    seed: int = _opt(0, "seeds the model, the shuffles and the emulated delays")
    device: str = _opt("auto", 'auto, cpu, cuda (cuda:LOCAL_RANK) or cuda:K; or one per global rank "cuda,cpu"')
    backend: str = _opt("auto", "auto: nccl when every rank has a GPU, else gloo", BACKEND_CHOICES)
    threads: str = _opt("0", 'torch CPU threads (0: the host\'s cores / local ranks); or one per rank "4,1"')
    affinity: str = _opt("", 'CPU cores per rank, e.g. "0,1" or "0-3,4-7" ("": not pinned)')
    rebalance_every: int = _opt(0, "re-decide batch sizes every K steps (0: at epoch ends only)")
    smoothing: float = _opt(0.0, "weight of the previous estimate in the balancer's moving average, in [0, 1)")
    deadband: float = _opt(0.0, "keep batch sizes unless the predicted step time drops by more than this fraction")
    significance: float = _opt(1.0, "keep batch sizes unless the predicted gain exceeds this many standard "
                                    "errors of the measured step times (0: off)")
    timeout_s: float = _opt(300.0, "collective timeout in seconds: a dead peer ends the run after this long")
    run_dir: str = _opt("", "the run folder (empty: runs/<model>-<scheme>-<torchrun's run id>; "
                                 "outside torchrun runs/<time>-<model>-<scheme>)")
    overwrite: bool = _opt(False, "replace a run folder that already holds a run")
    resume: str = _opt("", "a run folder to continue from its last checkpoint (its config is reused)")
    replay: str = _opt("", "a run folder whose recorded batch sizes this run reuses")
    checkpoint_every: int = _opt(0, "also checkpoint every K steps inside an epoch, for an exact mid-epoch resume "
                                    "(0: at epoch ends only)")
    eval_batch: int = _opt(1000, "per-rank evaluation batch size")
    bf16: bool = _opt(False, "bf16 autocast for forward and loss (GPU fast path)")
    channels_last: bool = _opt(False, "channels-last memory format for model and batches (GPU fast path)")
    tensorboard: bool = _opt(False, "also write TensorBoard event files into RUN_DIR/tensorboard (rank 0; the "
                                    "[tensorboard] extra)")

    def __post_init__(self):
        from ..core.emulator import longest_delay_s, parse_hetero
        from ..core.partition import SCHEMES
        from .models import MODELS
        from .straggler import parse_straggler

        for f in fields(self):  # argparse types the flags; Python callers and grid files may not
            if problem := type_problem(f.name, getattr(self, f.name)):
                raise ConfigError(problem)
        for name in _PATHS:
            if problem := safeio.path_problem(getattr(self, name)):
                raise ConfigError(f"--{_flag(name)} {shown(getattr(self, name), 50)} {problem}")
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}: choose one of {', '.join(MODELS)}")
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown scheme {self.scheme!r}: choose one of {', '.join(SCHEMES)}")
        if self.data not in ("cifar10", "imagefolder", "synthetic"):
            raise ConfigError(f"unknown data set {self.data!r}: choose cifar10, imagefolder or synthetic")
        for d in self.device.split(","):
            if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", d.strip()):
                raise ConfigError(f"unknown device {d!r} in --device {self.device!r}: use auto, cpu, cuda or cuda:K")
        for v in self.threads.split(","):
            if not _whole(v):
                raise ConfigError(f"--threads {shown(self.threads)}: expected whole numbers >= 0 (at most 18 digits), "
                                  f"one or one per rank")
        for v in self.max_batch.split(","):
            if not (_whole(v) or v.strip() == "probe"):
                raise ConfigError(f"--max-batch {shown(self.max_batch)}: expected whole numbers >= 0 (at most 18 "
                                  f"digits) or probe, one or one per rank")
        if self.affinity:
            for part in filter(None, self.affinity.split(",")):  # an empty entry leaves that rank unpinned
                try:
                    parse_cores(part)
                except ValueError as e:
                    raise ConfigError(f"--affinity {shown(self.affinity)}: {shown(part, 30)} is not a core list like "
                                      f"0-3 or 4+6{f' ({e})' if str(e) else ''}") from None
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"unknown backend {self.backend!r}: choose auto, gloo or nccl")
        for name in ("epochs", "global_batch", "lr", "timeout_s", "eval_batch"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"--{_flag(name)} must be positive (got {v})")
        if self.min_batch < 1:  # under DDP every rank joins every all-reduce, so every rank computes something
            raise ConfigError(f"--min-batch must be at least 1 (got {self.min_batch})")
        for name in ("weight_decay", "subset", "test_subset", "rebalance_every", "seed", "micro_batch",
                     "checkpoint_every"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"--{_flag(name)} must be non-negative (got {v})")
        if self.seed > MAX_SEED:
            raise ConfigError(f"--seed must be at most 2**32-1 = {MAX_SEED} (got {self.seed})")
        if self.timeout_s < MIN_TIMEOUT_S:
            raise ConfigError(f"--timeout-s must be at least {MIN_TIMEOUT_S:g} s (got {self.timeout_s:g}): a shorter "
                              f"one times out while a peer is still starting")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"--timeout-s must be at most {MAX_TIMEOUT_S:.0f} (30 days; got {self.timeout_s:g})")
        if not 0 <= self.significance <= 100:
            raise ConfigError(f"--significance must be in [0, 100] standard errors (got {self.significance})")
        for name in ("momentum", "smoothing", "deadband"):  # momentum >= 1 makes SGD's velocity grow without bound
            v = getattr(self, name)
            if not (0 <= v < 1):
                raise ConfigError(f"--{_flag(name)} must be in [0, 1) (got {v})")
        if self.tensorboard:
            from importlib.util import find_spec
            if find_spec("tensorboard") is None:  # torch's SummaryWriter needs it
                raise ConfigError("--tensorboard needs the tensorboard package: pip install 'hetero[tensorboard]'")
        if self.subset and self.subset < self.global_batch:
            raise ConfigError(f"--subset {self.subset} is smaller than the global batch {self.global_batch}")
        try:
            check_sit_out(self.sit_out, self.scheme, self.micro_batch, spell=_as_flag)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.micro_batch:
            self._check_micro_batch()
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: choose one")
        try:
            rank, delay_s = longest_delay_s(parse_hetero(self.hetero))
        except ValueError as e:
            raise ConfigError(f"bad --hetero {shown(self.hetero)}: {e}") from None
        if delay_s >= self.timeout_s:  # the peers would wait longer than the timeout each step: a dead rank to them
            raise ConfigError(f"bad --hetero {shown(self.hetero)}: rank {rank} is delayed {delay_s:g} s per step, "
                              f"not below --timeout-s {self.timeout_s:g}")
        try:
            parse_straggler(self.straggler)
        except ValueError as e:
            raise ConfigError(f"bad --straggler {shown(self.straggler)}: {e}") from None
        if any(m.strip().isdigit() and 0 < int(m) < self.min_batch for m in self.max_batch.split(",")):
            raise ConfigError(f"--max-batch {self.max_batch} is below --min-batch {self.min_batch}")

    def _check_micro_batch(self) -> None:
        """The micro-batch mode: B a multiple of m; max batch bounds m (memory), no sit-out (k_i >= 1)."""
        m, B = self.micro_batch, self.global_batch
        if B % m:
            down, up = B - B % m, B - B % m + m
            raise ConfigError(f"--global-batch {B} is not a multiple of --micro-batch {m}: use --global-batch "
                              f"{f'{down} or ' if down else ''}{up}")
        given = [int(v) if v.strip().isdigit() else 0 for v in self.max_batch.split(",")]  # 0, probe: no bound yet
        if (r := micro_batch_too_big(m, given)) is not None:
            raise ConfigError(f"--micro-batch {m} exceeds --max-batch {given[r]} (it bounds the micro-batch)")

    def check_world(self, world: int, elastic: bool = False) -> None:
        """The checks that need the world size (known once torchrun has started us, or from NPROC). elastic: a
        torchrun restart resuming its own run, where a --hetero rank past a smaller world emulates nobody."""
        from ..core.emulator import parse_hetero
        from ..core.partition import check_feasible
        from .straggler import parse_straggler

        bad = [r for r in parse_hetero(self.hetero) if r >= world]
        if bad and not elastic:
            raise ConfigError(f"bad --hetero {self.hetero!r}: rank {bad[0]} is not below the world size {world}")
        bad = [r for r in parse_straggler(self.straggler) if r >= world]
        if bad and not elastic:
            raise ConfigError(f"bad --straggler {self.straggler!r}: rank {bad[0]} is not below the world size {world}")
        for name in ("device", "threads", "max_batch", "affinity"):
            n = len(getattr(self, name).split(",")) if getattr(self, name) else 0
            if n not in (0, 1, world):
                raise ConfigError(f"--{_flag(name)} {getattr(self, name)!r} lists {n} ranks; give one value or "
                                  f"{world} (the world size)")
        devices = [r.device for r in self.rank_settings(world)]
        if self.backend == "nccl" and not all(d.startswith("cuda") or d == "auto" for d in devices):  # auto: setup
            raise ConfigError(f"--backend nccl needs every rank on a GPU (devices {','.join(devices)}); mixed "
                              f"CPU/GPU jobs use gloo (--backend auto picks it)")
        try:
            check_feasible(world, self.global_batch, self.min_batch,
                           None if self.micro_batch else self.max_batches(world), max(self.micro_batch, 1))
        except ValueError as e:
            raise ConfigError(f"{e} (world size {world})") from None

    def check_host(self, ranks: range, world: int) -> None:
        """The checks of the ranks `ranks` against this host: GPUs present, cores it has, threads it can run.
        Ranks on another node are checked there (every rank checks its own node's ranks before the group)."""
        import torch

        from .straggler import StragglerError, check_cgroups, parse_straggler

        allowed = sorted(os.sched_getaffinity(0))
        settings = self.rank_settings(world)
        outside = parse_straggler(self.straggler)
        if any(outside[r].quota is not None for r in ranks if r in outside):
            try:
                check_cgroups()  # a quota here is real or refused: never emulated instead
            except StragglerError as e:
                raise ConfigError(f"--straggler {self.straggler!r}: {e}") from None
        for r in ranks:
            if r in outside and (n := outside[r].threads) is not None and n > (os.cpu_count() or 1):
                raise ConfigError(f"--straggler {self.straggler!r}: rank {r} asks for {n} threads, more than the "
                                  f"{os.cpu_count() or 1} cores of this host")
        for r in ranks:
            device = settings[r].device
            if device.startswith("cuda"):
                n = torch.cuda.device_count() if torch.cuda.is_available() else 0
                index = int(device.split(":")[1]) if ":" in device else 0
                if n == 0:
                    raise ConfigError(f"--device {self.device!r}: rank {r} wants a GPU but torch sees none on this "
                                      f"host (use --device cpu or auto)")
                if index >= n:
                    raise ConfigError(f"--device {self.device!r}: rank {r} wants {device} but this host has {n} "
                                      f"GPU(s)")
            own = settings[r].cores
            if own and (missing := sorted(own - set(allowed))):
                raise ConfigError(f"--affinity {self.affinity!r}: rank {r} asks for core(s) "
                                  f"{_cores_text(missing)} that this job may not use (it has cores "
                                  f"{_cores_text(allowed)})")
            threads = settings[r].threads
            if threads > (cores := os.cpu_count() or 1):
                raise ConfigError(f"--threads {self.threads!r}: rank {r} asks for {threads} threads, more than the "
                                  f"{cores} cores of this host")

    def _for_rank(self, name: str, rank: int, world: int) -> str:
        """This global rank's text of a per-rank field (one value for all, or one per rank)."""
        values = getattr(self, name).split(",")
        return values[rank if len(values) == world else 0].strip()

    def rank_settings(self, world: int) -> list[RankSettings]:
        """Every global rank's device, threads, maximum batch and cores, parsed from the per-rank fields."""
        out = []
        for r in range(world):
            text = {name: self._for_rank(name, r, world) for name in ("device", "threads", "max_batch", "affinity")}
            probe = text["max_batch"] == "probe"
            out.append(RankSettings(text["device"], int(text["threads"]),
                                    float("inf") if probe else int(text["max_batch"]) or float("inf"), probe,
                                    frozenset(parse_cores(text["affinity"])) if self.affinity else None))
        return out

    def max_batches(self, world: int, probed: list[float] | None = None) -> list[float] | None:
        """Per-rank maximum batch sizes for the partitioner (None: no limit anywhere). A rank set to `probe` has
        no limit until probed: `probed` holds every rank's probe result (memory.probe_max_batch)."""
        m = [(probed[r] if probed is not None else s.max_batch) if s.probe else s.max_batch
             for r, s in enumerate(self.rank_settings(world))]
        return None if all(v == float("inf") for v in m) else m

    def probes(self, rank: int, world: int) -> bool:
        """Whether this rank's largest batch is to be probed."""
        return self.rank_settings(world)[rank].probe

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RankSettings:
    """One global rank's typed settings (Config.rank_settings): parsed once from the per-rank fields."""
    device: str                   # cpu, cuda, cuda:K or auto
    threads: int                  # torch threads; 0: the default budget (dist.apply_cpu_budget)
    max_batch: float              # largest batch; inf: no limit (also while a probe is pending)
    probe: bool                   # the largest batch is probed on the rank's GPU
    cores: frozenset[int] | None  # cores to pin the rank to; None: not pinned


def parse_cores(text: str) -> set[int]:
    """CPU cores from "0-3", "4+6" or "5" (ranges joined by +)."""
    cores: set[int] = set()
    for part in text.strip().split("+"):
        a, _, b = part.partition("-")
        if not (_whole(a) and (not b or _whole(b))):
            raise ValueError("")
        lo, hi = int(a), int(b or a)
        if hi > MAX_CORE:  # checked before the range is expanded: 0-99999999 would take gigabytes
            raise ValueError(f"core numbers go up to {MAX_CORE}")
        if lo < 0 or hi < lo:
            raise ValueError("")
        cores.update(range(lo, hi + 1))
    return cores


def _cores_text(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _as_flag(name: str) -> str:
    """A setting named as its command-line flag (the core's rules name it as an argument)."""
    return "--" + _flag(name)


def check_launch(rank: int, local_rank: int, world: int, local_world: int, endpoint: str | None) -> None:
    """The launch's own numbers, before anything indexes by them: this node's ranks inside the world (NODE_RANK
    below NNODES), and a rendezvous endpoint (RDZV_ENDPOINT) of the form host:port."""
    first = rank - local_rank
    if not (0 <= local_rank < local_world and 0 <= first and first + local_world <= world):
        raise ConfigError(f"rank {first} (this node's first) with {local_world} local rank(s) is outside the world of "
                          f"{world}: NODE_RANK must be below NNODES")
    if endpoint is not None:
        host, port = (endpoint.rsplit(":", 1) + [""])[:2] if not endpoint.startswith("[") else \
            (endpoint.rsplit("]:", 1)[0] + "]", endpoint.rsplit("]:", 1)[1] if "]:" in endpoint else "")
        if not (re.fullmatch(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]", host)
                and re.fullmatch(r"[0-9]{1,5}", port) and 0 < int(port) < 65536):
            raise ConfigError(f"RDZV_ENDPOINT {shown(endpoint)} is not HOST:PORT (a host name or address and a port "
                              f"1-65535)")


def default_run_dir(cfg: Config, stamp: str) -> Path:
    return Path("runs") / f"{stamp}-{cfg.model}-{cfg.scheme}"
