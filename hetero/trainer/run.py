"""The heterogeneity-aware DDP trainer. Launch with torchrun:

    torchrun --standalone --nproc-per-node=2 -m hetero.trainer --model tiny --data synthetic --epochs 3 \
        --scheme edp --hetero 1:slowdown=3
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=job1 -m hetero.trainer --model vgg16          # and --node-rank=1 on the second node
    python -m hetero.trainer ...                                  # a world of one, no torchrun needed

This module is the command's life cycle: arguments, resume and replay resolution, the run folder's lock, run
metadata, signals, the launcher watchdog and the exit status. The training loop is trainer.py (on api.Balance).
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..core import safeio
from ..core.agree import HeteroError, named_identity, remap_identities
from .cli import parse_args
from .config import Config, ConfigError, check_launch, default_run_dir, shown
from .data import DataError, load_data
from .dist import World, apply_cpu_budget, env_world, setup, teardown
from .loop import Trainer, TrainingError, check_checkpoint, evaluate, limits_text  # noqa: F401 - evaluate: part of this API
from .provenance import provenance
from .resume import resumed_config
from .runlog import CHECKPOINT, DiskError, RunFolder, claim_run_dir


def run_metadata(cfg: Config, world: World, run_dir: Path, identities: list[str] | None = None) -> dict:
    """What the run depends on besides its data: config, ranks' places, provenance (measure.py), torchrun's ids."""
    ranks = [None] * world.size
    dist.all_gather_object(ranks, {"host": socket.gethostname(), "device": str(world.device),
                                   "threads": torch.get_num_threads()})
    for r, name in zip(ranks, identities or []):
        r["identity"] = name
    return {"config": cfg.to_dict(), "run_dir": str(run_dir), "world_size": world.size, "backend": world.backend,
            "ranks": ranks, **provenance(), "started": datetime.now().isoformat(timespec="seconds"),
            "torchrun": {k: os.environ[k] for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                                   "LOCAL_WORLD_SIZE") if k in os.environ}}


def membership_rows(trainer: Trainer, world: World) -> list[dict]:
    """membership.csv: one row per worker at each start of the run (the first, a --resume, a torchrun restart):
    when, after which epoch and step, the old and new world size, and each worker's identity with its rank in the
    new world and in the old (-1: not in it; a worker that left has rank -1)."""
    now, ids = datetime.now().isoformat(timespec="seconds"), trainer.balance.engine.plan.identities
    was = trainer.resumed_from or {"identities": [], "world": 0, "epoch": 0, "step": 0}
    old = was["identities"] or []
    src = remap_identities(old, was["world"], ids, world.size) if was["world"] else [None] * world.size
    base = {"time": now, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "epoch": was["epoch"],
            "step": was["step"], "old_world": was["world"], "world": world.size}
    rows = [{**base, "rank": r, "old_rank": -1 if src[r] is None else src[r], "identity": ids[r]}
            for r in range(world.size)]
    kept = {i for i in src if i is not None}
    return rows + [{**base, "rank": -1, "old_rank": i, "identity": name} for i, name in enumerate(old)
                   if i not in kept]


REPLAY_COLUMNS = ("epoch", "step", "rank", "batch_size")


def load_replay(run: Path, cfg: Config, world: int) -> dict[int, np.ndarray]:
    """Recorded batch sizes {epoch: [steps, world]} of an earlier run, to train with the same partition; a file
    that is not a complete record (empty, a column missing, text or negative sizes, duplicate or missing rows) is
    one ConfigError."""
    import io

    import pandas as pd

    path, where = run / "steps.csv", f"cannot replay {run}"
    if not path.exists():
        raise ConfigError(f"{where}: it has no steps.csv")
    try:
        df = pd.read_csv(io.BytesIO(safeio.read_bytes(path, "its steps file")))
    except safeio.UnsafeFile as e:
        raise ConfigError(f"{where}: {e.strerror}") from None
    except (OSError, ValueError, pd.errors.ParserError) as e:  # EmptyDataError, UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{where}: its steps.csv is unreadable ({type(e).__name__}: "
                          f"{shown(str(e).splitlines()[0] if str(e) else '', 80)})") from None
    if missing := [c for c in REPLAY_COLUMNS if c not in df.columns]:
        raise ConfigError(f"{where}: its steps.csv has no column {', '.join(missing)} (is it a hetero steps.csv?)")
    if df.empty:
        raise ConfigError(f"{where}: its steps.csv has no rows")
    for c in REPLAY_COLUMNS:
        if not pd.api.types.is_integer_dtype(df[c]) or (df[c] < 0).any():
            bad = df[c][pd.to_numeric(df[c], errors="coerce").isna() | (pd.to_numeric(df[c], errors="coerce") < 0)]
            raise ConfigError(f"{where}: its steps.csv column {c} holds {shown(bad.tolist()[0]) if len(bad) else 'a '}"
                              f"{'' if len(bad) else 'fraction'}, not a whole number >= 0")
    if (dup := df.duplicated(["epoch", "step", "rank"], keep=False)).any():
        e, st, r = df.loc[dup, ["epoch", "step", "rank"]].iloc[0]
        raise ConfigError(f"{where}: its steps.csv lists epoch {e} step {st} rank {r} twice")
    if sorted(df["rank"].unique()) != list(range(world)):
        raise ConfigError(f"{where}: it ran {df['rank'].nunique()} ranks, this run has {world}")
    out = {}
    for epoch, g in df.groupby("epoch"):
        table = g.pivot(index="step", columns="rank", values="batch_size")
        if list(table.index) != list(range(len(table))) or table.isna().any().any():
            raise ConfigError(f"{where}: its steps.csv has gaps in epoch {epoch} (every step 0.. needs all {world} "
                              f"ranks)")
        sizes = table.to_numpy(np.int64)
        if not np.all(sizes.sum(1) == cfg.global_batch):
            raise ConfigError(f"{where}: its global batch is not {cfg.global_batch}")
        out[int(epoch)] = sizes
    return out


def die_with_launcher() -> None:
    """Linux: ask the kernel to SIGKILL this worker when its launcher (the parent) dies. A stopped (SIGSTOP) worker
    cannot run the watchdog thread (exit_with_launcher), but SIGKILL ends it anyway, and its run folder's lock goes
    with it. Elsewhere, or where prctl is missing, the watchdog alone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def exit_with_launcher(rank: int, poll_s: float = 1.0) -> None:
    """Under torchrun, end this worker within ~poll_s of its launcher's death, writing nothing.

    torchrun starts workers in sessions of their own, so killing the launcher's process group leaves them running,
    re-parented; they would go on writing the run folder beside a resumed job. A daemon thread notices the new
    parent. os._exit skips every handler: the folder's lock goes with the process, a temporary file it was writing
    is removed at the next start."""
    parent = os.getppid()
    die_with_launcher()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(f"hetero: rank {rank}: error: its launcher (pid {parent}) is gone: stopping without writing",
                      file=sys.stderr, flush=True)
                os._exit(1)
    threading.Thread(target=watch, name="hetero-launcher-watch", daemon=True).start()


def same_torchrun_run(run_dir: Path, run_id: str) -> bool:
    """Whether the folder's run was started by this torchrun job (its config.json records the run id)."""
    if not run_id or run_id == "none":
        return False
    try:
        meta = json.loads(safeio.read_bytes(run_dir / "config.json"))
        return isinstance(meta, dict) and (meta.get("torchrun") or {}).get("TORCHELASTIC_RUN_ID") == run_id
    except (OSError, ValueError, AttributeError):
        return False


def run_id_folder(run_id: str) -> str:
    """A folder name for torchrun's run id, one per id: the id itself when it is a plain name, else its plain
    characters and a digest of the whole id (two ids that share a prefix never share a folder)."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", run_id):
        return run_id
    plain = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:40].lstrip("._-")
    return f"{plain}-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"


def resolve_run_dir(cfg: Config) -> tuple[Config, bool]:
    """The run folder and whether to resume: explicit, or after a torchrun restart the same one again."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    run_dir = cfg.resume or cfg.run_dir
    if not run_dir:
        if run_id and run_id != "none":  # stable over torchrun restarts and the same on every node
            run_dir = str(Path("runs") / f"{cfg.model}-{cfg.scheme}-{run_id_folder(run_id)}")
        else:
            run_dir = str(default_run_dir(cfg, datetime.now().strftime("%Y%m%d-%H%M%S")))
    has_checkpoint = (Path(run_dir) / "checkpoint.pt").exists()
    # torchrun restarts its workers when one fails (RESTART_COUNT grows) and when a node joins (it does not; a
    # joining node's workers start at 0): both continue their own run, known by torchrun's run id
    resume = bool(cfg.resume) or (has_checkpoint and (restarted or same_torchrun_run(Path(run_dir), run_id)))
    # a restart before the first checkpoint starts the run again in its own folder
    overwrite = cfg.overwrite or (restarted and not has_checkpoint)
    return dataclasses.replace(cfg, run_dir=run_dir, overwrite=overwrite and not resume), resume


# A rank other than its node's local rank 0 that fails a check waits this long (s) before exiting, since torchrun
# stops every worker as soon as one exits: the speaker, slower to import, would be stopped before it printed.
QUIET_WAIT_S = 60.0


def main(argv: list[str] | None = None) -> int:
    rank, world_size, local_rank = env_world()
    # Every rank checks the same things; one per node says so (the nodes' consoles are apart), before any group.
    say = (lambda msg: print(f"hetero: error: {msg}", file=sys.stderr, flush=True)) if local_rank == 0 \
        else (lambda m: None)
    lock = None  # rank 0's hold on the run folder (runlog.claim_run_dir), kept until this process ends
    try:
        check_launch(rank, local_rank, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                     os.environ.get("RDZV_ENDPOINT"))
        cfg, ns = parse_args(argv)
        try:
            named_identity()  # HETERO_WORKER_ID's form (a list, a template), before anything starts
        except HeteroError as e:
            raise ConfigError(str(e).removeprefix("hetero: ")) from None
        if cfg.resume:  # continue with the recorded configuration
            cfg = resumed_config(cfg, ns.given, world_size)
        given_resume = bool(cfg.resume)
        cfg, resume = resolve_run_dir(cfg)
        cfg.check_world(world_size, elastic=resume and not given_resume)
        first = rank - local_rank  # this node's ranks (under --check: LOCAL_WORLD_SIZE, else the whole world)
        cfg.check_host(range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", world_size))), world_size)
        saved_state = None
        if rank == 0:  # the folder's lock before anything is written into it; held until this process ends
            lock = claim_run_dir(Path(cfg.run_dir), resume, cfg.overwrite)
            if resume:  # loaded and checked now, so a bad checkpoint fails in one line before any process group
                saved_state = RunFolder(Path(cfg.run_dir)).load_trainer_checkpoint()
        data = load_data(cfg.data, cfg.data_dir, cfg.subset, cfg.test_subset)
        if cfg.global_batch > len(data.train_y):
            raise ConfigError(f"global batch {cfg.global_batch} exceeds the {len(data.train_y)} training samples")
        if saved_state is not None:
            check_checkpoint(cfg, world_size, len(data.classes), saved_state, Path(cfg.run_dir) / CHECKPOINT)
        replay = load_replay(Path(cfg.replay), cfg, world_size) if cfg.replay else None
        steps = len(data.train_y) // cfg.global_batch
        missing = [e for e in range(1, cfg.epochs + 1) if replay is not None and len(replay.get(e, [])) != steps]
        if missing:
            raise ConfigError(f"cannot replay {cfg.replay}: it has no record of {steps} steps for epoch {missing[0]}")
        if ns.check:
            if lock is not None:
                lock.release(discard=True)  # a check leaves no empty folder behind
            return 0
    except (ConfigError, DataError) as e:
        if lock is not None:
            lock.release(discard=True)
        if local_rank != 0:  # the node's speaker fails the same check: let it print before torchrun stops it
            time.sleep(QUIET_WAIT_S)
            print(f"hetero: error: rank {rank}: {e}", file=sys.stderr, flush=True)  # it did not: say it here
        say(e)
        return 2
    settings = cfg.rank_settings(world_size)
    own = settings[rank]
    cores = set(own.cores) if own.cores else None
    try:
        apply_cpu_budget(own.threads, cores, own.device)
    except OSError as e:
        say(f"--affinity {cfg.affinity!r}: cannot pin rank {rank} to cores {sorted(cores)} ({e.strerror})")
        return 2

    def on_term(signum, frame):  # torchrun stops the other workers with SIGTERM when one dies
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(f"stopped by signal {signum} (another worker failed or the job was cancelled)")
    signal.signal(signal.SIGTERM, on_term)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_launcher(rank)

    trainer, ok, started = None, False, False
    try:
        try:
            world = setup([s.device for s in settings], cfg.backend, cfg.timeout_s)
        except ConfigError as e:  # the backend cannot work where the ranks are: the same on every rank
            say(e)
            return 2
        run_dir = Path(cfg.run_dir)
        trainer = Trainer(cfg, world, data, run_dir, replay)
        if resume:
            state = [saved_state]
            dist.broadcast_object_list(state, src=0)
            trainer.load_state_dict(state[0])
            del saved_state, state
        meta = run_metadata(cfg, world, run_dir, trainer.balance.engine.plan.identities)
        limits = trainer.max_batches
        meta["max_batches"] = None if limits is None else [None if v == float("inf") else int(v) for v in limits]
        if world.is_main:
            if "probe" in cfg.max_batch:
                print(f"hetero: largest batch per rank (--max-batch {cfg.max_batch}): "
                      f"{limits_text(limits, world.size)} ('-': no limit; CPU ranks are not probed)", flush=True)
            trainer.folder.start(meta, trainer.epoch if resume else None, cfg.overwrite)
            started = True  # from here on a failure is this job's to record in the folder
            trainer.folder.append("membership", membership_rows(trainer, world))
            was = trainer.resumed_from
            where = "" if not resume else f", resuming after epoch {trainer.epoch}" + (
                f" at step {trainer.saved_step} of epoch {trainer.epoch + 1}" if trainer.saved_step else "") + (
                f" (the checkpoint's world had {was['world']} rank(s))" if was and was["world"] != world.size else "")
            print(f"hetero: {cfg.model} {cfg.scheme} on {world.size} rank(s) ({world.backend}), run folder "
                  f"{run_dir}{where}", flush=True)
        summary = trainer.fit()
        if world.is_main:
            trainer.folder.write_json("summary.json", summary)
            print(f"hetero: done in {summary['train_time_s']:.1f} s of training; final test top-1 "
                  f"{100 * summary['final_test_top1']:.2f}%; {run_dir}", flush=True)
        ok = True
        return 0
    except BaseException as e:  # noqa: BLE001 - mark the run failed whatever stopped it, then re-raise or exit
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        plain = isinstance(e, (TrainingError, HeteroError, SystemExit, DiskError))  # lines meant for the user
        msg = str(e) if plain else f"{type(e).__name__}: {e}"
        if started and trainer is not None and trainer.folder is not None:  # rank 0, holding the lock
            try:
                trainer.folder.write_json("summary.json", trainer.summary("failed", msg))
            except DiskError:
                pass  # no room even for the summary: readers show the run as interrupted once this job is gone
        print(f"hetero: rank {rank}: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr,
              flush=True)
        return 1
    finally:
        del trainer  # DDP's reducer and hook futures go before the process group they use
        gc.collect()
        teardown(ok)
