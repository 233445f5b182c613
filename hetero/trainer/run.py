"""The heterogeneity-aware DDP trainer. Launch with torchrun:

    torchrun --standalone --nproc-per-node=2 -m hetero.trainer --model tiny --data synthetic --epochs 3 \
        --scheme edp --hetero 1:slowdown=3
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=job1 -m hetero.trainer --model vgg16          # and --node-rank=1 on the second node
    python -m hetero.trainer ...                                  # a world of one, no torchrun needed

This module is the command's life cycle, read top to bottom in `main`: every check before any process group
(`prepare`: arguments, resume and replay, the run folder's files and checkpoint, the data; rank 0 claims the folder
last), then the run (`train`: the process group, the Trainer, run metadata, signals, the launcher watchdog) and the
exit status. The run folder's files are runfolder.py's; the training loop is loop.py (on hetero.Balance).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.agree import HeteroError, named_identity
from . import runfolder, straggler
from .checkpoint import RUN_UID
from .cli import parse_args
from .config import Config, ConfigError, check_launch
from .data import DataError, DataSet, load_data
from .dist import World, apply_cpu_budget, env_world, setup, teardown
from .fit import check_checkpoint, check_owner
from .loop import Trainer, TrainingError, done_at, evaluate, limits_text  # noqa: F401 - evaluate: part of this API
from .provenance import provenance
from .resume import rejoined_config, resumed_config
from .runfolder import DiskError, RunFolder, RunLock, claim_run_dir, load_replay, membership_rows
from .straggler import StragglerError


def run_metadata(cfg: Config, world: World, run_dir: Path, identities: list[str] | None = None) -> dict:
    """What the run depends on besides its data: config, ranks' places, provenance (provenance.py), torchrun's ids."""
    ranks = [None] * world.size
    dist.all_gather_object(ranks, {"host": socket.gethostname(), "device": str(world.device),
                                   "threads": torch.get_num_threads()})
    for r, name in zip(ranks, identities or []):
        r["identity"] = name
    return {"config": cfg.to_dict(), "run_dir": str(run_dir), "world_size": world.size, "backend": world.backend,
            "ranks": ranks, **provenance(), "started": datetime.now().isoformat(timespec="seconds"),
            "torchrun": {k: os.environ[k] for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                                   "LOCAL_WORLD_SIZE") if k in os.environ}}


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


# A rank other than its node's local rank 0 that fails a check waits this long (s) before exiting, since torchrun
# stops every worker as soon as one exits: the speaker, slower to import, would be stopped before it printed.
QUIET_WAIT_S = 60.0


@dataclasses.dataclass
class Job:
    """What the checks before the process group found: the resolved config, whether it resumes, the data, a replay's
    sizes, the checkpoint (rank 0, verified) and rank 0's hold on the run folder."""
    cfg: Config
    resume: bool
    data: DataSet
    replay: dict | None
    saved: dict | None
    lock: RunLock | None
    run_uid: str = ""  # rank 0: the run's own id (checkpoint.RUN_UID), kept on resume, new on a fresh start


def prepare(argv: list[str] | None, rank: int, local_rank: int, world_size: int) -> Job | None:
    """Every check, on every rank, before any process group; ConfigError or DataError in one line. Only reads,
    until rank 0 claims the run folder last: a refused job changes no file there. None: --check passed."""
    check_launch(rank, local_rank, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                 os.environ.get("RDZV_ENDPOINT"))
    cfg, ns = parse_args(argv)
    try:
        named_identity()  # HETERO_WORKER_ID's form (a list, a template), before anything starts
    except HeteroError as e:
        raise ConfigError(str(e).removeprefix("hetero: ")) from None
    given_resume = bool(cfg.resume)
    if given_resume:  # continue with the recorded configuration
        cfg = resumed_config(cfg, ns.given, world_size)
    cfg, resume = runfolder.resolve(cfg)
    if resume and not given_resume:  # found by torchrun's run id: its settings are held to the record
        cfg = rejoined_config(cfg, world_size, os.environ.get("TORCHELASTIC_RUN_ID", ""))
    cfg.check_world(world_size, elastic=resume and not given_resume)
    first = rank - local_rank  # this node's ranks (under --check: LOCAL_WORLD_SIZE, else the whole world)
    cfg.check_host(range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", world_size))), world_size)
    run_dir = Path(cfg.run_dir)
    runfolder.check_files(run_dir, resume, cfg.tensorboard)  # every rank: no FIFO, socket or link where it writes
    saved, read = RunFolder(run_dir).load_trainer_checkpoint() if resume and rank == 0 else (None, None)
    data = load_data(cfg.data, cfg.data_dir, cfg.subset, cfg.test_subset)
    if cfg.global_batch > len(data.train_y):
        raise ConfigError(f"global batch {cfg.global_batch} exceeds the {len(data.train_y)} training samples")
    steps = len(data.train_y) // cfg.global_batch
    if saved is not None:
        # whose it is comes first: another run's checkpoint is refused as that, whatever else does not fit
        if warning := check_owner(saved, run_dir):  # this folder's run's, not one copied in from another
            print(warning, file=sys.stderr, flush=True)
        check_checkpoint(cfg, world_size, len(data.classes), steps, saved, run_dir / runfolder.CHECKPOINT)
    replay = load_replay(Path(cfg.replay), cfg, world_size) if cfg.replay else None
    missing = [e for e in range(1, cfg.epochs + 1) if replay is not None and len(replay.get(e, [])) != steps]
    if missing:
        raise ConfigError(f"cannot replay {cfg.replay}: it has no record of {steps} steps for epoch {missing[0]}")
    if replay is not None:  # the epochs this run trains (a record may hold more, or a partial one past them)
        replay = {e: replay[e] for e in range(1, cfg.epochs + 1)}
        if not cfg.sit_out and any((v == 0).any() for v in replay.values()):
            raise ConfigError(f"cannot replay {cfg.replay}: it gives a rank batch 0, which only --sit-out allows")
    lock = claim_run_dir(run_dir, resume, cfg.overwrite, read, cfg.tensorboard) if rank == 0 else None  # for good
    if ns.check:
        if lock is not None:
            lock.release(discard=True)  # a check leaves no empty folder behind
        return None
    # a checkpoint written before run uids (check_owner warned) gives its run one from this start on
    uid = (saved or {}).get(RUN_UID) or uuid.uuid4().hex
    return Job(cfg, resume, data, replay, saved, lock, uid)


def refuse(e: Exception, rank: int, local_rank: int) -> int:
    """Exit status 2 after one line per node: every rank failed the same check, its node's local rank 0 says so."""
    if local_rank != 0:  # the node's speaker fails the same check: let it print before torchrun stops it
        time.sleep(QUIET_WAIT_S)
        print(f"hetero: error: rank {rank}: {e}", file=sys.stderr, flush=True)  # it did not: say it here
    else:
        print(f"hetero: error: {e}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    rank, world_size, local_rank = env_world()
    try:
        job = prepare(argv, rank, local_rank, world_size)
    except (ConfigError, DataError) as e:
        return refuse(e, rank, local_rank)
    if job is None:
        return 0
    settings = job.cfg.rank_settings(world_size)
    own = settings[rank]
    cores = set(own.cores) if own.cores else None
    try:
        apply_cpu_budget(own.threads, cores, own.device)
    except OSError as e:
        return refuse(ConfigError(f"--affinity {job.cfg.affinity!r}: cannot pin rank {rank} to cores {sorted(cores)} "
                                  f"({e.strerror})"), rank, 0)

    def on_term(signum, frame):  # torchrun stops the other workers with SIGTERM when one dies
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(f"stopped by signal {signum} (another worker failed or the job was cancelled)")
    signal.signal(signal.SIGTERM, on_term)  # before the straggler's set-up: a SIGTERM during it undoes it
    try:  # an outside straggler (--straggler) is set up after pinning, so a neighbour shares the rank's cores
        outside = straggler.setup(job.cfg.straggler, rank)
    except StragglerError as e:
        return refuse(ConfigError(f"--straggler {job.cfg.straggler!r}: rank {rank}: {e}"), rank, 0)
    except SystemExit as e:  # the set-up closed what it had made
        print(f"hetero: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            exit_with_launcher(rank)
        return train(job, settings, rank, local_rank)
    finally:
        outside.close()  # the cgroup removed, the neighbour stopped (atexit does it too; a SIGKILL: its watcher)


def start_folder(trainer: Trainer, world: World, job: Job, meta: dict) -> None:
    """Rank 0, holding the lock: config.json (meta) and membership.csv written, the run's first line printed."""
    cfg, run_dir, limits = job.cfg, Path(job.cfg.run_dir), trainer.max_batches
    meta[RUN_UID] = job.run_uid  # sealed into every checkpoint from here on (RunFolder.save_checkpoint)
    meta["max_batches"] = None if limits is None else [None if v == float("inf") else int(v) for v in limits]
    if "probe" in cfg.max_batch:
        print(f"hetero: largest batch per rank (--max-batch {cfg.max_batch}): {limits_text(limits, world.size)} "
              f"('-': no limit; CPU ranks are not probed)", flush=True)
    done, step = done_at(trainer.balance.position)  # where the Balance resumed: what the checkpoint held
    old_ids, old_world = trainer.resumed_from or ([], 0)
    trainer.folder.start(meta, done if job.resume else None, cfg.overwrite)
    trainer.folder.append("membership", membership_rows(trainer.balance.workers, old_ids, old_world, done, step))
    where = "" if not job.resume else f", resuming after epoch {done}" + (
        f" at step {step} of epoch {done + 1}" if step else "") + (
        f" (the checkpoint's world had {old_world} rank(s))" if old_world and old_world != world.size else "")
    print(f"hetero: {cfg.model} {cfg.scheme} on {world.size} rank(s) ({world.backend}), run folder {run_dir}{where}",
          flush=True)


def train(job: Job, settings: list, rank: int, local_rank: int) -> int:
    """The run, from the process group to its teardown; exit status 0, 1 (a failure: one line, the run marked
    failed) or 2 (the backend cannot work where the ranks are)."""
    cfg = job.cfg
    trainer, ok, started = None, False, False
    try:
        try:
            world = setup([s.device for s in settings], cfg.backend, cfg.timeout_s)
        except ConfigError as e:  # the backend cannot work where the ranks are: the same on every rank
            return refuse(e, rank, local_rank) if local_rank == 0 else 2
        trainer = Trainer(cfg, world, job.data, Path(cfg.run_dir), job.replay)
        if job.resume:
            state = [job.saved]
            dist.broadcast_object_list(state, src=0)
            trainer.load_state_dict(state[0])
            job.saved = state = None
        meta = run_metadata(cfg, world, Path(cfg.run_dir), trainer.balance.workers)  # collective
        if world.is_main:
            started = True  # from here on a failure is this job's to record in the folder
            start_folder(trainer, world, job, meta)
        summary = trainer.fit()
        if world.is_main:
            trainer.folder.write_json(runfolder.SUMMARY, summary)
            print(f"hetero: done in {summary['train_time_s']:.1f} s of training; final test top-1 "
                  f"{100 * summary['final_test_top1']:.2f}%; {cfg.run_dir}", flush=True)
        ok = True
        return 0
    except BaseException as e:  # noqa: BLE001 - mark the run failed whatever stopped it, then re-raise or exit
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        plain = isinstance(e, (TrainingError, HeteroError, SystemExit, DiskError))  # lines meant for the user
        msg = str(e) if plain else f"{type(e).__name__}: {e}"
        if started and trainer is not None and trainer.folder is not None:  # rank 0, holding the lock
            try:
                trainer.folder.write_json(runfolder.SUMMARY, trainer.summary("failed", msg))
            except DiskError:
                pass  # no room even for the summary: readers show the run as interrupted once this job is gone
        print(f"hetero: rank {rank}: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr,
              flush=True)
        return 1
    finally:
        del trainer  # DDP's reducer and hook futures go before the process group they use
        gc.collect()
        teardown(ok)
