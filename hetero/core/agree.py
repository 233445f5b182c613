"""What every rank of a Balance must agree on, and how a rank tells the others why it stopped.

- launcher_world: the rank and world from an initialised process group, else torchrun's RANK and WORLD_SIZE;
  None when neither says (Lightning's own launcher builds the callback before either exists).
- agree: every rank's fingerprint (plain JSON data) gathered in rank order; any field that differs raises the same
  HeteroError on every rank, naming the field and each rank's value.
- post / peer_error: a mistake only one rank can see (its optimizer stepped on gradients that were not all-reduced)
  leaves the others blocked in a collective with it. That rank posts its line on the process group's store and
  waits for the others to read it; the others raise it instead of gloo's "Connection closed by peer" or its
  timeout. Closing the group does not free them: a DDP model keeps the group, and its gloo sockets, alive after
  destroy_process_group for as long as the model lives (a script's global: until the process exits). So a rank
  that waits in a gloo collective looks for a posted line every POLL_S (finish, watched): the DDP hook's all-reduce
  and hetero's own gathers end within seconds of a peer's refusal, not at the group's timeout.
- worker identities (default_identity, remap_identities): which worker a rank is, so that a balancer's state
  saved by one world is carried to another worker by worker.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .settle import settle

_KEY = "hetero/error/"
_POSTED = _KEY + "posted"  # how many ranks posted a line (post): a waiting rank reads this one key per poll


class HeteroError(RuntimeError):
    """A misuse of hetero that stops every rank alike; its message is one line starting with "hetero: "."""


def launcher_world() -> tuple[int, int] | None:
    """(rank, world) from an initialised process group, else from torchrun's RANK and WORLD_SIZE; else None."""
    if dist.is_available() and dist.is_initialized():
        settle.collectives()
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def lone_world() -> tuple[int, int]:
    """(0, 1) for a Balance first used with no launcher's world; a WORLD_SIZE without RANK or a process group is
    refused, never guessed."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise HeteroError("hetero: WORLD_SIZE is set but neither RANK nor a process group: build the Balance after "
                          "init_process_group, run under torchrun, or (Lightning) use hetero.BalanceCallback")
    return 0, 1


def gather_json(obj, device: torch.device) -> list:
    """Every rank's JSON-able obj, in rank order (plain data only: nothing unpickled from a peer)."""
    settle.collectives()
    data = torch.tensor(list(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(n) for _ in range(world)]
    finish(dist.all_gather(lengths, n, async_op=True))
    size = max(int(k.item()) for k in lengths)
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[:len(data)] = data
    buf = buf.to(device)
    out = [torch.empty_like(buf) for _ in range(world)]
    finish(dist.all_gather(out, buf, async_op=True))
    return [json.loads(bytes(o[:int(k.item())].cpu().tolist()).decode()) for o, k in zip(out, lengths)]


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def agree(fingerprint: dict, device: torch.device, where: str) -> None:
    """Collective: raise the same HeteroError on every rank when any field of the ranks' fingerprints differs.
    The fields `rank` and `world` are checked against the process group first (a Balance built on a guess)."""
    rows = gather_json(fingerprint, device)
    world = dist.get_world_size()
    wrong = [r for r, row in enumerate(rows) if (row["rank"], row["world"]) != (r, world)]
    if wrong:
        r = wrong[0]
        raise HeteroError(f"hetero: at {where}, rank {r} of the process group's {world} holds a Balance for rank "
                          f"{rows[r]['rank']} of {rows[r]['world']}: it was built before its launcher set the rank "
                          f"and world; build it after init_process_group or under torchrun, or (Lightning) pass it to "
                          f"hetero.BalanceCallback")
    for key in (k for k in fingerprint if k != "rank"):
        values = [row.get(key) for row in rows]
        if any(v != values[0] for v in values):
            each = ", ".join(f"rank {r} has {_short(v)}" for r, v in enumerate(values))
            raise HeteroError(f"hetero: at {where}, the ranks disagree on {key}: {each} (every rank must build its "
                              f"Balance with the same settings and call set_epoch with the same epoch)")


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):  # no process group, or a torch without the helper
        return None


def post(message: str, grace_s: float = 3.0, linger_s: float = 0.5) -> None:
    """This rank's last words: put them on the store, destroy the process group, and give the peers `grace_s` to
    read them (a peer waiting in a collective reads within POLL_S), then `linger_s` to raise them, before this
    rank raises: its exit ends the store if it hosts it, and under torchrun makes the agent stop every worker."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    if store is None:
        return
    try:
        store.set(_KEY + str(rank), message)
        store.add(_POSTED, 1)
        dist.destroy_process_group()  # the store object stays alive with this reference (rank 0 may host it)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(store.check([f"{_KEY}read/{r}"]) for r in range(world)
                                                      if r != rank):
            time.sleep(0.05)
        time.sleep(linger_s)
    except Exception:  # noqa: BLE001 - the line is raised here whatever the store does
        pass


def same_steps(epoch: int, ran: int, planned: int) -> None:
    """At the end of an epoch, before any collective: a rank that ran fewer steps than the epoch has may have left
    it early (a `break`) while its peers wait for it inside a step, where a collective of ours would pair with
    theirs and hang. So each rank puts its count on the store; one that ran short waits there for every rank's
    count (the store's timeout: the process group's). All short alike (a limit on the batches) goes on; a peer
    still in the epoch never answers, and both sides then raise the posted line instead of a socket timeout."""
    store, rank, world = _store(), dist.get_rank(), dist.get_world_size()
    if store is None:
        return
    key = f"hetero/ran/{epoch}/"
    store.set(key + str(rank), str(ran))
    if ran >= planned:
        return
    why = (f"hetero: rank {rank} left epoch {epoch} after {ran} of its {planned} steps while another rank went on: "
           f"every rank must run the same steps of each epoch")
    store.set(_KEY + str(rank), why)
    try:
        store.wait([key + str(r) for r in range(world)])
    except Exception:  # noqa: BLE001 - the store's timeout: a peer is still inside the epoch
        raise HeteroError(why) from None
    store.delete_key(_KEY + str(rank))


def peer_error() -> str | None:
    """The line a peer posted before it stopped, if any (read after one of this rank's collectives failed)."""
    store = _store()
    if store is None:
        return None
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        for r in range(world):
            if r != rank and store.check([_KEY + str(r)]):
                message = store.get(_KEY + str(r)).decode()
                store.set(f"{_KEY}read/{rank}", "1")
                return message
    except Exception:  # noqa: BLE001 - no store to read: the original error stands
        return None
    return None


# -- waits that a peer's refusal ends ---------------------------------------------------------------------------
POLL_S = 0.5  # a gloo collective waiting this long looks for a posted line, every POLL_S after that
DRAIN_S = 3.0  # once the line is read, how long the collective may take to fail by itself (the peer's exit)


def polled() -> bool:
    """Collectives here block the host (gloo); NCCL's are queued on a stream, and its own watchdog ends them. (A comm
    hook reads it once, at attach: get_backend is dear on a step's path.)"""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo" and \
        dist.get_world_size() > 1


def _posted() -> str | None:
    """A line a peer posted (post), without marking it read: one store round trip (the count of posted lines)
    while there is none."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.add(_POSTED, 0):
            return None
        rank = dist.get_rank()
        for r in range(dist.get_world_size()):
            if r != rank and store.check([_KEY + str(r)]):
                return store.get(_KEY + str(r)).decode()
    except Exception:  # noqa: BLE001 - no store to read
        return None
    return None


def finish(work) -> None:
    """Wait for a collective (its Work); when a peer posts its line meanwhile, raise that line within a second
    instead of waiting out the group's timeout."""
    if not polled():
        work.wait()
        return
    while True:
        try:
            work.wait(timeout=timedelta(seconds=POLL_S))
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
        if _posted() is not None and (why := peer_error()) is not None:
            try:  # as the watcher does: the peer's exit may end this collective now
                work.wait(timeout=timedelta(seconds=DRAIN_S))
            except Exception:  # noqa: BLE001 - failed or still waiting: the line is what this rank raises
                pass
            raise HeteroError(why)


class _Watched:
    """One collective the watcher may complete: its caller's future (`out`), what `then` makes of the collective's
    result, and what to do when a peer posted its line while it waited."""
    __slots__ = ("out", "then", "value", "on_peer", "since", "done")

    def __init__(self, then, value, on_peer):
        self.out, self.then, self.value, self.on_peer = torch.futures.Future(), then, value, on_peer
        self.since, self.done = time.monotonic(), False


class _Watcher:
    """One daemon thread per process: it completes the watched futures of collectives that wait more than POLL_S
    once a peer has posted its line (DDP's reducer waits on a comm hook's future, a wait hetero cannot bound),
    within DRAIN_S of reading it.

    Cheap per collective (issue 51): a watch is one future, one callback and a set entry under a lock. The thread is
    not woken for it: while collectives come it looks every POLL_S on its own, and it sleeps until the next watch only
    after a whole POLL_S in which none came (only that watch notifies it)."""

    def __init__(self):
        self._cond, self._pending, self._thread = threading.Condition(), set(), None
        self._added, self._asleep = 0, False

    def watch(self, fut: torch.futures.Future, then, value, on_peer) -> torch.futures.Future:
        e = _Watched(then, value, on_peer)

        def settled(f):
            with self._cond:
                if e.done:
                    return
                e.done = True
                self._pending.discard(e)
            try:
                e.out.set_result(e.then(f))
            except Exception as err:  # noqa: BLE001 - the collective's own error, passed on
                e.out.set_exception(err)
        with self._cond:
            self._pending.add(e)
            self._added += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hetero-peer-watch", daemon=True)
                self._thread.start()
            elif self._asleep:
                self._cond.notify()
        fut.add_done_callback(settled)
        return e.out

    def _run(self) -> None:
        seen = 0
        while True:
            with self._cond:
                if not self._pending and seen == self._added:  # a whole POLL_S without a collective: sleep
                    self._asleep = True
                    while not self._pending:
                        self._cond.wait()
                    self._asleep = False
                seen = self._added
                self._cond.wait(POLL_S)  # never notified while awake: a look every POLL_S
                now = time.monotonic()
                waiting = any(now - e.since >= POLL_S for e in self._pending)
            if not waiting or _posted() is None or (why := peer_error()) is None:
                continue
            with self._cond:
                stopped = [e for e in self._pending if not e.done]
            for e in stopped:
                e.on_peer(why)
            # the line is read, so the peer goes on to exit, which fails these collectives at once: let them end so
            # (nothing is left in flight to fail later, in this process's teardown); if it stays, free them anyway
            deadline = time.monotonic() + DRAIN_S
            while time.monotonic() < deadline and not all(e.done for e in stopped):
                time.sleep(0.05)
            with self._cond:
                stopped = [e for e in stopped if not e.done]
                for e in stopped:
                    e.done = True
                    self._pending.discard(e)
            for e in stopped:
                e.out.set_result(e.value)


_watcher = _Watcher()


def watched(fut: torch.futures.Future, then, value, on_peer, watch: bool = True) -> torch.futures.Future:
    """fut.then(then), or (watch: gloo, several ranks; `polled()`) a future that also completes, with `value` and
    after on_peer(line), when a peer posts its line while it waits: for a comm hook, whose future DDP's reducer
    waits on."""
    return _watcher.watch(fut, then, value, on_peer) if watch else fut.then(then)


def gather_rows(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """All ranks' float64 rows, stacked in rank order: [world, *values.shape], on the CPU."""
    settle.collectives()
    t = values.to(device=device, dtype=torch.float64).contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    finish(dist.all_gather(out, t, async_op=True))
    return torch.stack(out).cpu()


def sum_all(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Element-wise float64 sum over ranks (exact metric totals)."""
    settle.collectives()
    t = values.to(device=device, dtype=torch.float64, copy=True)
    finish(dist.all_reduce(t, async_op=True))
    return t.cpu()


def guarded(fn, *args):
    """Run a collective; when it fails because a peer stopped with a posted line (post), raise that line."""
    try:
        return fn(*args)
    except HeteroError:
        raise
    except Exception as e:  # noqa: BLE001 - a collective's failure: a peer's own reason, when it left one
        if (why := peer_error()) is not None:
            raise HeteroError(why) from None
        raise e


# -- worker identities ------------------------------------------------------------------------------------------
# What a balancer's per-rank estimate belongs to across restarts and changes of world size. A rank number names a
# place in one world; after a restart with more or fewer workers, rank 1 may be another machine. By default a
# worker is its host and device (a GPU's UUID; on a CPU the cores it is pinned to, else its local rank on the
# host), or the name a user gives it: Balance(worker_id=...), else HETERO_WORKER_ID in the worker's environment.
# A name given is the identity as written, whatever the local rank: a worker started on another local rank (srun,
# a scheduler that sets LOCAL_RANK per process) keeps its estimate. One agent that starts several workers with one
# environment names each of them with a list (one name per local rank) or a template holding {local_rank}.
IDENTITY_ENV = "HETERO_WORKER_ID"
LOCAL_RANK_FIELD = "{local_rank}"


def named_identity(value: str | None = None, local_rank: int | None = None,
                   local_world: int | None = None) -> str | None:
    """The worker's name from HETERO_WORKER_ID (None: unset or blank): `name` as written; `a,b,c` one name per local
    rank (as many as LOCAL_WORLD_SIZE); `node7/gpu{local_rank}` the local rank filled in. Raises HeteroError (one
    line) for a list of the wrong length, an empty entry or another {field}."""
    value = os.environ.get(IDENTITY_ENV, "") if value is None else value
    if not value.strip():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    where = f"{IDENTITY_ENV}={_short(value)}"
    if "," in value:
        names = [n.strip() for n in value.split(",")]
        if not all(names):
            raise HeteroError(f"hetero: {where} has an empty name in its list (one name per local rank, "
                              f"comma-separated)")
        if len(names) != local_world or not 0 <= local_rank < len(names):
            raise HeteroError(f"hetero: {where} lists {len(names)} names for the {local_world} worker(s) of this "
                              f"node (LOCAL_WORLD_SIZE): give one per local rank, or one name holding "
                              f"{LOCAL_RANK_FIELD}")
        if len(set(names)) != len(names):
            raise HeteroError(f"hetero: {where} lists a name twice: every worker needs its own")
        return names[local_rank]
    name = value.strip()
    rest = name.replace(LOCAL_RANK_FIELD, "")
    if "{" in rest or "}" in rest:
        raise HeteroError(f"hetero: {where}: the only field a name may hold is {LOCAL_RANK_FIELD}")
    return name.replace(LOCAL_RANK_FIELD, str(local_rank))


def default_identity(device: torch.device) -> str:
    """This worker's identity: HETERO_WORKER_ID if set (named_identity), else host and device (GPU UUID, pinned
    cores, local rank)."""
    try:
        named = named_identity()
    except HeteroError as e:  # the other ranks may be named well and already wait in the gather: tell them
        post(str(e))
        raise
    if named:
        return named
    host = socket.gethostname()
    if device.type == "cuda":
        from .memory import gpu_identity

        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{host}/gpu {gpu_identity(torch.cuda.get_device_properties(index), index)}"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores and len(cores) < (os.cpu_count() or len(cores)):
        return f"{host}/cpu cores {'+'.join(map(str, cores))}"
    # unpinned CPU workers on one host are told apart by their local rank (the launcher's order on the host)
    return f"{host}/cpu local rank {os.environ.get('LOCAL_RANK', '0')}"


def duplicate_identity(identities: list[str]) -> tuple[int, int] | None:
    """The first two ranks holding one identity (None: all distinct)."""
    seen: dict[str, int] = {}
    for r, name in enumerate(identities):
        if name in seen:
            return seen[name], r
        seen[name] = r
    return None


def gather_identities(worker_id: str | None, device: torch.device, coll: torch.device) -> list[str]:
    """Collective: every rank's identity, in rank order. Named ones must differ; default ones that coincide
    (unpinned CPU workers of two agents on one host) are told apart by their rank."""
    named = bool(worker_id or os.environ.get(IDENTITY_ENV, "").strip())
    own = [worker_id or default_identity(device), named]
    pairs = [own]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        pairs = guarded(gather_json, own, coll)  # plain data: nothing unpickled from a peer
    ids = [name for name, _ in pairs]
    while (pair := duplicate_identity(ids)) is not None:
        if pairs[pair[0]][1] or pairs[pair[1]][1]:
            raise HeteroError(f"hetero: ranks {pair[0]} and {pair[1]} are both worker {ids[pair[0]]!r}: give "
                              f"each worker its own name (HETERO_WORKER_ID, or Balance(worker_id=...))")
        same = ids[pair[0]]
        ids = [f"{n} (rank {r})" if n == same else n for r, n in enumerate(ids)]
    return ids


def remap_identities(saved: list[str] | None, saved_world: int, now: list[str] | None, world: int) -> list[int | None]:
    """For every rank of this world, the saved rank whose state it takes (None: a worker not seen before). By
    identity where both worlds' identities are known; else rank r keeps rank r's state (the same world, or a state
    without identities: ranks past the saved world are new)."""
    if saved and now and len(saved) == saved_world:
        where = {name: r for r, name in enumerate(saved)}
        return [where.get(name) for name in now]
    return [r if r < saved_world else None for r in range(world)]
