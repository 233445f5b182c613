"""Part `outside` of `make bench`: the balancers against stragglers hetero does not make (docs/benchmarks.md).
2 ranks pinned one per core; the last rank under a CFS quota of a third of a core, or sharing its core with a busy
process (the trainer's --straggler), every scheme, repeated; each row read exactly like the balance part's (its
own cost model, fitted from its steps). Then a neighbour that comes and goes: the bench itself starts a busy
process on the last rank's core after one epoch ends and stops it after a later one, and the shares over the
steps show how the sizes follow it both ways.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import numpy as np

from ..trainer import straggler
from .efficiency import read_row
from .launch import clean_env, torchrun_cmd
from .measure import add_speedup_vs_sync, launch
from .suite import Suite, kinds

WORLD = 2  # one rank per core on the 2-core host this part is sized for
MOVED = 0.02  # a share that moved less than this between the levels before and during the neighbour did not follow it


def needs_cgroup(kind: str) -> bool:
    """Whether an outside kind sets a CFS quota (its rows need a writable cpu cgroup; the staircase figure)."""
    return any(s.quota is not None for s in straggler.parse_straggler(kinds(WORLD)[kind][1]).values())


def cores(world: int) -> list[int]:
    """One core per rank (the last ranks share the last core when there are fewer cores)."""
    own = sorted(os.sched_getaffinity(0))
    return [own[min(r, len(own) - 1)] for r in range(world)]


@contextlib.contextmanager
def bench_cgroup():
    """The bench's own cgroup (below hetero's base) for its runs' groups, as $HETERO_CGROUP; on exit every group
    below it is removed, then it. None where the machine has no writable cpu cgroup (the quota rows are skipped)."""
    try:
        h = straggler.check_cgroups({})
    except straggler.StragglerError as e:
        yield None, str(e)
        return
    own = h.base / f"bench-p{os.getpid()}"
    own.mkdir(exist_ok=True)
    try:
        yield own, ""
    finally:
        straggler.sweep(own)
        for left in [p for p in own.iterdir() if p.is_dir()]:
            with contextlib.suppress(OSError):
                left.rmdir()
        with contextlib.suppress(OSError):
            own.rmdir()


def train(suite: Suite, out: Path, name: str, scheme: str, spec: str, group: Path | None, notes: list[str],
          epochs: int | None = None, rebalance_every: int = 0, watch=None) -> Path:
    """One trainer run (tiny model, synthetic data, one thread and one core per rank) with --straggler `spec`."""
    run_dir = out / "runs" / name
    env = clean_env(threads="1")
    if group is not None:
        env[straggler.ENV_CGROUP] = str(group)
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(run_dir, stop), daemon=True) if watch else None
    if watcher:
        watcher.start()
    try:
        launch(torchrun_cmd(WORLD, [
            "--model", "tiny", "--data", "synthetic", "--subset", str(suite.subset(WORLD)), "--test-subset", "256",
            "--global-batch", str(suite.global_batch(WORLD)), "--epochs", str(epochs or suite.epochs),
            "--scheme", scheme, "--straggler", spec, "--threads", "1",
            "--affinity", ",".join(map(str, cores(WORLD))), "--augment", "false",
            "--rebalance-every", str(rebalance_every), "--run-dir", str(run_dir)]), out / "logs" / f"{name}.log",
            900, env, done=run_dir / "summary.json", notes=notes)
    finally:
        stop.set()
        if watcher:
            watcher.join()
        if group is not None:
            straggler.sweep(group)  # a rank killed mid-run left its group: gone before the next run
    return run_dir


def rows(suite: Suite, out: Path, calib, group: Path | None, notes: list[str]) -> list[dict]:
    """Every outside row (kind x scheme), `suite.repeats` times, read like the balance part's rows."""
    found = []
    todo = {k: v for k, v in kinds(WORLD).items() if k in suite.outside}
    if group is None:  # no writable cgroup: no quota rows (the bench notes why)
        todo = {k: v for k, v in todo.items() if not needs_cgroup(k)}
    for repeat in range(suite.repeats):
        for kind, (label, spec) in todo.items():
            batch = []
            for scheme in suite.schemes:
                name = f"outside-{kind}-{scheme}-r{repeat}"
                print(f"bench: {name}", flush=True)
                d = train(suite, out, name, scheme, spec, group, notes)
                row = read_row(suite, d, calib, WORLD, (kind, label, ""), scheme, repeat, straggler.quotas(spec))
                batch.append({**row, "straggler": spec, "affinity": ",".join(map(str, cores(WORLD)))})
            add_speedup_vs_sync(batch)
            found += batch
    return found


# -- a neighbour that comes and goes ----------------------------------------------------------------------------
def _epochs_done(run_dir: Path) -> int:
    try:
        return max(0, len((run_dir / "epochs.csv").read_text().strip().splitlines()) - 1)
    except OSError:
        return 0


def come_and_go(suite: Suite, out: Path, notes: list[str]) -> list[dict]:
    """Per scheme in suite.come_and_go: a run whose last rank gets a busy neighbour (suite.come_busy spinning
    processes) on its core from the end of epoch `on` to the end of epoch `off` (suite.come_epochs = (on, off,
    epochs)); the shares per step and the decisions each way."""
    on_after, off_after, epochs = suite.come_epochs
    every = max(1, suite.steps // 4)
    found = []
    for scheme in suite.come_and_go:
        name = f"outside-come-and-go-{scheme}"
        print(f"bench: {name}", flush=True)
        events: dict[str, float] = {}

        def watch(run_dir: Path, stop: threading.Event) -> None:
            # started and paused now, as the run starts up: at `on` they only resume, so the neighbour arrives at
            # once, and its start-up (an interpreter each) never lands in the steps it is measured by
            busy: list = []
            try:
                for _ in range(suite.come_busy):
                    busy.append(straggler.start_busy({cores(WORLD)[-1]}, paused=True))
                while not stop.wait(0.02):
                    done = _epochs_done(run_dir)
                    if "on" not in events and done >= on_after:
                        for b in busy:
                            straggler.resume_busy(b)
                        events["on"] = done
                    if busy and "on" in events and done >= off_after:
                        for b in busy:
                            straggler.stop_busy(b)
                        busy, events["off"] = [], done
            finally:
                for b in busy:
                    straggler.stop_busy(b)

        d = train(suite, out, name, scheme, "", None, notes, epochs=epochs, rebalance_every=every, watch=watch)
        found.append({**read_come_and_go(d, scheme, suite.steps, every, on_after, off_after),
                      "neighbour_epochs": [events.get("on"), events.get("off")]})
    return found


def read_come_and_go(d: Path, scheme: str, steps: int, every: int, on_after: int, off_after: int) -> dict:
    """The last rank's share per global step, the steps the neighbour came and went (the first steps of the epochs
    after `on_after` and `off_after`), and how many decisions (of every `every` steps) its share took to move."""
    import pandas as pd

    st = pd.read_csv(d / "steps.csv")
    world = st["rank"].nunique()
    grid = st.pivot_table(index=["epoch", "step"], columns="rank", values="batch_size").to_numpy()
    share = grid[:, world - 1] / grid.sum(1)
    on, off = on_after * steps, off_after * steps
    before, during, after = (float(np.median(share[a:b])) for a, b in
                             ((max(0, on - steps), on), (off - steps, off), (len(share) - steps, len(share))))

    def decisions(start: int, falling: bool) -> int | None:
        """Decisions after `start` until the share has moved halfway from its level over the epoch before to its
        level over the epoch after (during the neighbour, or at the end); None if it never gets there."""
        was, to = (before, during) if falling else (during, after)
        if (was - to if falling else to - was) < MOVED:  # it did not move by a share worth the name
            return None
        mid = (was + to) / 2
        for k in range(len(share) - start):
            if (share[start + k] <= mid) if falling else (share[start + k] >= mid):
                return -(-k // every)  # whole decisions: steps over the decision interval, rounded up
        return None

    per = st.pivot_table(index=["epoch", "step"], columns="rank", values="compute_s").to_numpy() / np.maximum(grid, 1)
    rel = per[:, world - 1] / per[:, 0]  # rank 1's time per sample over rank 0's, per step
    tail = grid[off + 3 * every:]
    return {"scheme": scheme, "run_dir": str(d), "every": every, "on_step": on, "off_step": off,
            "share": share.round(4).tolist(), "share_before": before, "share_during": during, "share_after": after,
            "fall_decisions": decisions(on, True), "recover_decisions": decisions(off, False),
            # how much slower the neighbour made rank 1, relative to rank 0 (its epochs against the epochs before)
            "neighbour_slowdown": float(np.median(rel[on:off]) / np.median(rel[:on])),
            "changes_after": int((np.diff(tail, axis=0) != 0).any(1).sum()) if len(tail) > 1 else 0}


def figure(cg: list[dict], path: Path) -> Path | None:
    """The last rank's share over the steps, one line per scheme, the neighbour's on and off marked."""
    if not cg:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=120)
    for r in cg:
        ax.step(range(len(r["share"])), r["share"], where="post", label=r["scheme"])
    r = cg[0]
    ax.axvspan(r["on_step"], r["off_step"], color="0.85", zorder=0, label="busy neighbour on rank 1's core")
    for x, text in ((r["on_step"], "on"), (r["off_step"], "off")):
        ax.axvline(x, color="k", lw=0.8, ls="--")
        ax.annotate(text, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points")
    top = max(0.6, max(max(r["share"]) for r in cg) + 0.05)
    ax.set(xlabel="global step", ylabel="rank 1's share of the batch", ylim=(0, top),
           title=f"A neighbour that comes and goes (rebalancing every {r['every']} steps)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def staircase(rows: list[dict], steady_from: int, path: Path) -> Path | None:
    """Per quota kind, the last rank's compute time per step against its batch size over the steady epochs of
    every scheme's runs, beside the first rank's: a CFS quota is a staircase in the batch (a step whose CPU need
    fits in the period's quota runs at full speed; one sample more waits for the next period), not a line."""
    quota = [r for r in rows if needs_cgroup(r["kind"])]
    if not quota:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    labels = list(dict.fromkeys(r["effect"] for r in quota))
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 3.4), dpi=120, sharey=True, squeeze=False)
    for ax, label in zip(axes[0], labels):
        for k, r in enumerate(r for r in quota if r["effect"] == label):
            st = pd.read_csv(Path(r["run_dir"]) / "steps.csv")
            st = st[(st.epoch >= steady_from) & (st.batch_size > 0)]
            for rank, colour, name in ((0, "0.6", "rank 0 (a whole core)"),
                                       (WORLD - 1, "C3", f"rank {WORLD - 1} (the quota)")):
                mine = st[st["rank"] == rank]
                ax.scatter(mine.batch_size, 1000 * mine.compute_s, s=6, alpha=0.35, color=colour, lw=0,
                           label=None if k else name)
        ax.set(title=label, xlabel="the rank's batch size in the step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("its compute time in the step (ms)")
    fig.suptitle("Steady epochs of every scheme's runs", fontsize=10)
    axes[0][0].legend(loc="upper left", fontsize=8, markerscale=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def target_band(m: dict, within: float = 0.02) -> tuple[int, int]:
    """The last rank's batch sizes (lowest, highest) whose step, by a 2-rank run's cost model m, is within `within`
    of the ideal step plus the all-reduce: the misallocation target's width in samples around the best."""
    from .coupled import finish_s

    best = np.asarray(m["ideal_sizes"])
    total, ideal = int(best.sum()), m["ideal_step_s"]
    b = np.arange(1, total)
    step = finish_s(m["fixed_s"], m["per_sample_s"], np.stack([total - b, b], -1), m["cores"], m["factor"],
                    m["delay_s"]).max(-1)
    ok = b[step - ideal <= within * (ideal + m["allreduce_s"])]
    return int(ok.min()), int(ok.max())


def optimum_drift(rows: list[dict], path: Path, within: float = 0.02) -> Path | None:
    """Per outside straggler, the last rank's best batch size in each epoch (the run's cost model fitted to that
    epoch's steps alone) less its best over the steady epochs together, one line per run, over the band of sizes
    within the misallocation target (the median band of the row's runs): where the optimum itself wanders."""
    runs = [r for r in rows if r.get("cost_model", {}).get("epoch_best") and len(r["cost_model"]["ideal_sizes"]) == 2]
    if not runs:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["effect"] for r in runs))
    colours = {s: f"C{i}" for i, s in enumerate(dict.fromkeys(r["scheme"] for r in runs))}
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 3.4), dpi=120, sharey=True, squeeze=False)
    for ax, label in zip(axes[0], labels):
        mine = [r for r in runs if r["effect"] == label]
        bands = []
        for r in mine:
            m = r["cost_model"]
            best = m["ideal_sizes"][-1]
            lo, hi = target_band(m, within)
            bands.append((lo - best, hi - best))
            epochs = sorted(m["epoch_best"], key=int)
            ax.plot([int(e) for e in epochs], [m["epoch_best"][e][-1] - best for e in epochs], marker="o", ms=3,
                    lw=1, alpha=0.7, color=colours[r["scheme"]])
        lo, hi = np.median(bands, axis=0)
        ax.axhspan(lo - 0.5, hi + 0.5, color="0.85", zorder=0)
        ax.axhline(0, color="0.4", lw=0.8)
        ax.set(title=label, xlabel="epoch")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"rank {WORLD - 1}'s best batch in the epoch\nless its best over the steady epochs")
    handles = [plt.Line2D([], [], color=c, marker="o", ms=3, lw=1) for c in colours.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="0.85"))
    fig.legend(handles, [*colours, f"within {within:g}\nof the ideal"], fontsize=8, loc="center right")
    fig.suptitle("Each epoch's own best size for the slow rank, every run", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


TAG = "HETERO_OUTSIDE_TAG"  # the bench's outside part sets it in its environment: its busy neighbours inherit it


def leftovers(group: str | None, tag: str | None = None) -> dict:
    """What the part left behind: cgroups below the bench's own (or it), and busy neighbours still running; with
    `tag`, only those whose environment carries it (TAG), so that another job's busy process on this host, a test's
    beside it for one, is not counted as this part's."""
    busy, mine = [], f"{TAG}={tag}".encode()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if straggler.BUSY.encode() in Path(entry.path, "cmdline").read_bytes() and (
                        tag is None or mine in Path(entry.path, "environ").read_bytes().split(b"\0")):
                    busy.append(int(entry.name))
    left = [str(p) for p in Path(group).rglob("*") if p.is_dir()] if group and Path(group).is_dir() else []
    return {"cgroup": group, "cgroup_exists": bool(group and Path(group).is_dir()), "cgroups_left": left,
            "busy_left": busy, "tag": tag}
