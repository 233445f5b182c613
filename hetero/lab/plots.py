"""Seaborn figures of a grid's runs (from analysis.Frames); each is saved as PNG and SVG by save().

Lines are means over seeds with a band of one standard deviation; facets are one model and heterogeneity level.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
import seaborn as sns

from ..core import safeio
from ..core.partition import SCHEMES
from .analysis import Frames, slowed_ranks, time_breakdown

SCHEME_HELP = ("Sync-SGD: equal batches on every rank.  DP-SGD: batches re-sized each epoch to each rank's "
               "measured speed.  EDP-SGD: as DP-SGD, gradients weighted by batch size.")
PARTS = {"own compute": "#4c72b0", "emulated slowdown": "#dd8452", "waiting for other ranks": "#b0b0b0",
         "evaluation": "#55a868"}


def theme() -> None:
    sns.set_theme(context="notebook", style="whitegrid", font_scale=0.95)


def _palette(labels) -> dict[str, tuple]:
    colors = sns.color_palette("colorblind", len(SCHEMES) + 4)
    known = {s.label: colors[i] for i, s in enumerate(SCHEMES.values())}
    extra = iter(colors[len(SCHEMES):])
    return {label: known.get(label) or next(extra) for label in labels}


def _order(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["scheme_label"]))


def _seeds(df: pd.DataFrame) -> str:
    n = df.groupby(["setting", "scheme"])["seed"].nunique()
    lo, hi = int(n.min()), int(n.max())
    return f"{lo} seed{'s' if hi > 1 else ''}" if lo == hi else f"{lo}-{hi} seeds"


def _rank_labels(df: pd.DataFrame) -> pd.Series:
    slowed = {h: slowed_ranks(h) for h in df["hetero"].unique()}
    words = {"slowed": " (slowed)", "outside": " (outside straggler)"}
    return pd.Series([f"rank {r}" + words.get(slowed[h].get(r), "") for r, h in zip(df["rank"], df["hetero"])],
                     index=df.index)


def _title(fig: plt.Figure, title: str, note: str) -> None:
    """A bold title and a wrapped grey note, stacked above everything already drawn (legend included)."""
    width_chars = int(fig.get_figwidth() * 13)
    note = "\n".join(textwrap.fill(par, width_chars, break_on_hyphens=False) for par in note.split("\n"))
    y = _top(fig) + 0.1 / fig.get_figheight()
    text = fig.text(0.5, y, note, ha="center", va="bottom", fontsize="small", color="0.3")
    fig.text(0.5, _top(fig, text) + 0.08 / fig.get_figheight(), title, ha="center", va="bottom",
             fontsize="large", fontweight="bold")


def _top(fig: plt.Figure, artist=None) -> float:
    """The top edge, in figure coordinates, of an artist or of everything drawn on the figure."""
    renderer = fig.canvas.get_renderer()
    box = artist.get_window_extent(renderer) if artist is not None else fig.get_tightbbox(renderer)
    height_px = fig.get_figheight() * (fig.dpi if artist is not None else 1)
    return box.y1 / height_px


def _legend_on_top(g: sns.FacetGrid, ncol: int) -> None:
    sns.move_legend(g, "lower center", bbox_to_anchor=(0.5, 1.0), ncol=ncol, title=None, frameon=False)
    g.figure.tight_layout()


def _mark_changes(g: sns.FacetGrid, frames: Frames, x: str = "epoch") -> None:
    """A dotted line where a run's world size changed (membership.csv), in each panel of its setting; on a time
    axis at the seed-mean training time interpolated between the epochs around it."""
    for (row, _col), ax in g.axes_dict.items():  # row: the setting (both figures facet by row and column)
        for c in frames.changes[frames.changes.setting == row].itertuples():
            at = c.at_epoch
            if x == "time":
                t = frames.epochs[frames.epochs.setting == row].groupby("epoch")["train_time_s"].mean()
                at = float(np.interp(at, [0, *t.index], [0.0, *t.to_numpy()]))
            ax.axvline(at, color="0.4", linestyle=":", linewidth=1)
            ax.annotate(f"{c.old_world}\u2192{c.world}", (at, 1), xycoords=("data", "axes fraction"),
                        fontsize="x-small", color="0.3", ha="left", va="top")


def curves(frames: Frames, x: str = "epoch") -> plt.Figure:
    """Test loss and top-1 against epoch (x="epoch") or against training wall time (x="time")."""
    df = frames.epochs.copy()
    df["test top-1 accuracy (%)"] = 100 * df["test_top1"]
    df["test loss (cross-entropy)"] = df["test_loss"]
    if x == "time":  # seeds differ in time: place each epoch at its seed-mean time so the band is over seeds
        df["x"] = df.groupby(["setting", "scheme", "epoch"])["train_time_s"].transform("mean")
        xlabel, what = "training wall time (s, evaluation excluded)", "training wall time"
    else:
        df["x"], xlabel, what = df["epoch"], "epoch", "epoch"
    long = df.melt(id_vars=["setting", "scheme_label", "seed", "epoch", "x"], var_name="metric", value_name="value",
                   value_vars=["test loss (cross-entropy)", "test top-1 accuracy (%)"])
    order = _order(df)
    g = sns.relplot(data=long, x="x", y="value", hue="scheme_label", hue_order=order, palette=_palette(order),
                    style="scheme_label", style_order=order, dashes=False, markers=True, markersize=5,
                    row="setting", col="metric", kind="line", errorbar="sd", height=2.8, aspect=1.5,
                    facet_kws={"sharey": False, "sharex": x == "epoch", "margin_titles": False})
    g.set_titles(template="{row_name}")
    for ax_row in g.axes:  # every panel labelled: models differ in time scale and loss
        for ax, metric in zip(ax_row, g.col_names):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(metric)
            ax.xaxis.set_tick_params(labelbottom=True)
            if x == "epoch":
                ax.xaxis.set_major_locator(mticker.MaxNLocator(integer=True))
    g.figure.tight_layout()
    _mark_changes(g, frames, x)
    _legend_on_top(g, len(order))
    _title(g.figure, f"Test loss and accuracy against {what}",
           f"Line: mean over {_seeds(df)}; band: \u00b11 standard deviation. One row per model and "
           f"heterogeneity level.\n{SCHEME_HELP}")
    return g.figure


def _wrap_titles(g, width: int = 38) -> None:
    """Panel titles wrapped to the panel (a long heterogeneity label would run into its neighbour's)."""
    for ax in g.axes.flat:
        ax.set_title("\n".join(textwrap.fill(line, width, break_on_hyphens=False)
                               for line in ax.get_title().split("\n")))


def shares(frames: Frames) -> plt.Figure:
    """Each rank's share of the global batch per epoch; the right axis reads it as a per-step batch size."""
    df = frames.ranks.copy()
    df["rank_label"] = _rank_labels(df)
    ranks = sorted(df["rank_label"].unique())
    g = sns.relplot(data=df, x="epoch", y="share", hue="rank_label", hue_order=ranks, style="rank_label",
                    style_order=ranks, markers=True, markersize=5, row="setting", col="scheme_label",
                    col_order=_order(df), kind="line", errorbar="sd", height=2.6, aspect=1.3, palette="Set1",
                    facet_kws={"margin_titles": False})
    g.set_titles(template="{col_name}\n{row_name}")
    _wrap_titles(g)
    g.set(ylim=(0, 1))
    g.set_axis_labels("epoch", "share of the global batch")
    g.axes[-1, 0].xaxis.set_major_locator(mticker.MaxNLocator(integer=True))
    batch = frames.runs.groupby("setting")["global_batch"].first()
    for ax_row, setting in zip(g.axes, g.row_names):  # the batch-size axis once per row, on the right
        b = float(batch[setting])
        sec = ax_row[-1].secondary_yaxis("right", functions=(lambda s, b=b: s * b, lambda n, b=b: n / b))
        sec.set_ylabel(f"batch size per step\n(samples; global batch {b:g})", fontsize="small")
    _mark_changes(g, frames)
    _legend_on_top(g, len(ranks))
    _title(g.figure, "How each step's global batch is split between the ranks, epoch by epoch",
           f"Share = the rank's samples / all samples of the epoch (the shares sum to 1). Line: mean over "
           f"{_seeds(df)}; band: \u00b11 sd.\n{SCHEME_HELP}")
    return g.figure


def step_hist(frames: Frames) -> plt.Figure:
    """Histograms of each rank's per-step compute time, before it waits for the others (the paper's
    process-time histograms)."""
    df = frames.steps.copy()
    df["rank_label"] = _rank_labels(df)
    df["compute_ms"] = 1000 * df["compute_s"].clip(lower=1e-6)
    ranks = sorted(df["rank_label"].unique())
    g = sns.displot(data=df, x="compute_ms", hue="rank_label", hue_order=ranks, row="setting", col="scheme_label",
                    col_order=_order(df), kind="hist", element="step", log_scale=True, bins=40, height=2.6,
                    aspect=1.3, palette="Set1", facet_kws={"sharey": False, "margin_titles": False})
    g.set_titles(template="{col_name}\n{row_name}")
    _wrap_titles(g)
    g.set_axis_labels("compute time per step (ms, log scale)", "steps")
    for ax in g.axes.flat:
        ax.xaxis.set_major_locator(mticker.LogLocator(base=10, subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(mticker.NullFormatter())
    _legend_on_top(g, len(ranks))
    _title(g.figure, "How long each rank computes per training step",
           "Compute time = from the start of a step until the rank's gradients are ready (its own work plus any "
           f"emulated slowdown), before it waits for the other ranks. All steps of {_seeds(df)}.\n"
           "Balanced schemes move the ranks' distributions together, so neither waits long for the other (DP-SGD "
           "and EDP-SGD start from equal shares: their first epoch looks like Sync-SGD's).")
    return g.figure


def breakdown(frames: Frames) -> plt.Figure:
    """Stacked bars: each rank's seconds of own compute, emulated slowdown, waiting and evaluation, per scheme."""
    tb = time_breakdown(frames)
    settings = list(dict.fromkeys(tb["setting"]))
    n_bars = tb.groupby("setting")[["scheme_label", "rank"]].apply(lambda d: len(d.drop_duplicates())).max()
    fig, axes = plt.subplots(len(settings), 1, figsize=(8, 0.42 * n_bars * len(settings) + 1.0), squeeze=False,
                             sharex=True)
    for ax, setting in zip(axes[:, 0], settings):
        t = tb[tb["setting"] == setting]
        wide = t.pivot_table(index=["scheme_label", "rank"], columns="part", values="seconds", sort=False,
                             observed=True).reindex(columns=list(PARTS))
        labels = [f"{s}, rank {r}" for s, r in wide.index]
        left = np.zeros(len(wide))
        for part, color in PARTS.items():
            ax.barh(labels, wide[part], left=left, color=color, label=part, height=0.7)
            left += wide[part].to_numpy()
        ax.invert_yaxis()
        ax.set_title(setting, fontsize="medium")
    axes[-1, 0].set_xlabel("seconds over the whole run (mean over seeds)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, names, loc="lower center", bbox_to_anchor=(0.5, _top(fig)), ncol=4, frameon=False,
               fontsize="small")
    _title(fig, "Where each rank's time goes",
           "Own compute + emulated slowdown + waiting = training wall time. Waiting = idle at the gradient "
           "all-reduce until the slowest rank is ready; balancing the batch sizes removes it.")
    return fig


def save(fig: plt.Figure, out_dir: str | Path, name: str) -> list[Path]:
    """Write name.png (150 dpi) and name.svg into out_dir; the figure stays open for display."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    for p in paths:  # through safeio: a link planted at a figure is replaced, its target untouched
        safeio.atomic_write(p, lambda fh: fig.savefig(fh, format=p.suffix[1:], dpi=150, bbox_inches="tight"))
    return paths


def show(fig: plt.Figure, out_dir: str | Path | None = None, name: str = "", alt: str = "") -> None:
    """In a notebook: save the figure when out_dir is given, display it once with alternative text (default: its
    title and note), and close it. The PNG goes out twice: as image/png, and as an <img> with an alt attribute in
    text/html, which HTML exports and JupyterLab show first (nbconvert's default template drops image metadata)."""
    import html

    from IPython.core.pylabtools import print_figure
    from IPython.display import display

    if out_dir is not None:
        save(fig, out_dir, name)
    alt = alt or " ".join(" ".join(t.get_text().split()).rstrip(".") + "." for t in reversed(fig.texts)) or name
    png = print_figure(fig, "png", bbox_inches="tight", base64=True)  # what the inline backend would show
    # text/plain is what logs and consoles print (papermill --log-output): a short label, not "<Figure size ...>"
    display({"image/png": png, "text/plain": f"[figure{' ' + name if name else ''}: {alt[:100]}]",
             "text/html": f'<img src="data:image/png;base64,{png}" alt="{html.escape(alt)}" style="max-width: 100%">'},
            raw=True, metadata={"image/png": {"alt": alt}})
    plt.close(fig)


def markdown(text: str) -> None:
    """Display Markdown, with the text itself (not an object's repr) as its plain-text form for logs."""
    from IPython.display import display

    display({"text/markdown": text, "text/plain": text}, raw=True)


def table(df: pd.DataFrame) -> None:
    """Display a table without its index: HTML in the notebook, the plain table (not a Styler's repr) in logs."""
    from IPython.display import display

    display({"text/html": df.style.hide(axis="index").to_html(), "text/plain": df.to_string(index=False)}, raw=True)


FIGURES = {"curves_epoch": lambda f: curves(f, "epoch"), "curves_time": lambda f: curves(f, "time"),
           "shares": shares, "step_times": step_hist, "time_breakdown": breakdown}


def figures(frames: Frames, out_dir: str | Path | None = None) -> None:
    """Show every figure with show() (none when no run completed), saving each into out_dir when given."""
    if frames.epochs.empty:
        print("no completed run: nothing to plot")
        return
    for name, make in FIGURES.items():
        show(make(frames), out_dir, name)
