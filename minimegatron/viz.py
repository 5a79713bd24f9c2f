"""Every figure of the book, in one place: the algorithms keep their records, this draws them.

    draw_rank_grid         the 5D rank layout: one panel per group key    (parallel_state)
    plot_memory_breakdown  params / grads / optimizer / activations bars  (analysis.report)
    plot_bucket_timeline   DDP: backward and each bucket's all-reduce     (dp.timeline.BucketTimeline)
    plot_memory_profile    ZeRO-3: parameter bytes at every gather/free   (dp.fsdp.MemoryEvent)
    plot_timeline          a pipeline schedule, one row per stage         (pp.timeline.Interval)

and one measuring helper for them, `wait_until`: gloo's worker thread lets go of a finished
collective's tensors a moment after wait() returns, so a measurement of what is still alive
(FullyShardedDataParallel.memory_profile(settle=wait_until)) may poll for a moment first. The
algorithms themselves never sleep or poll.

Every function builds a matplotlib Figure on its own Agg canvas (no pyplot, no backend switch:
a notebook's backend is left alone), saves it to `path` if given, and returns it.
This module sits late in the import order: chapters, notebooks, tests and benchmarks import
it; no algorithm module does.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Callable

from .analysis.report import GiB
from .parallel_state import KEYS, rank_groups

if TYPE_CHECKING:                  # the records drawn here (only their fields are read)
    from .dp.fsdp import MemoryEvent
    from .dp.timeline import BucketTimeline
    from .pp.timeline import Interval

__all__ = ["draw_rank_grid", "plot_memory_breakdown", "plot_bucket_timeline", "plot_memory_profile",
           "plot_timeline", "wait_until", "plot_losses"]


def _new_figure(**kwargs):
    """A matplotlib Figure with its own Agg canvas (pyplot and its backend untouched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


# --------------------------------------------------------------------- the rank layout

def _colour(i: int, n: int):
    import matplotlib

    if n <= 10:
        return matplotlib.colormaps["tab10"](i)
    if n <= 20:  # dark shades first, so neighbouring groups do not look alike
        return matplotlib.colormaps["tab20"]((2 * i) % 20 + (2 * i) // 20)
    return matplotlib.colormaps["hsv"](i / n)


def draw_rank_grid(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   etp: int | None = None, order: str = "tp-cp-ep-dp-pp",
                   keys=("tp", "dp", "pp"), path=None):
    """One panel per key of parallel_state.rank_groups: every rank is a box, coloured by its
    group of that key.

    Rows are pipeline stages; inside a row the ranks of that stage in ascending order.
    A box shows the rank (large) and the index of its group (small, "g3"). Each box is
    a Rectangle with gid "<key>:<rank>", so tests can find it. Saves to `path` if given.
    Returns a matplotlib Figure drawn with the Agg backend (no screen needed).
    """
    from matplotlib.patches import Rectangle

    layout = rank_groups(world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
    for key in keys:
        if key not in layout:
            raise KeyError(f"unknown group {key!r}; known: {', '.join(KEYS)}")
    stage_of = {r: s for g in layout["pp"] for s, r in enumerate(g)}
    rows = [[r for r in range(world_size) if stage_of[r] == s] for s in range(pp)]
    ncols = len(rows[0])

    per_row = 1 if ncols > 8 else min(len(keys), 3)  # wide panels go one per row
    shape = (math.ceil(len(keys) / per_row), per_row)
    panel_w, panel_h = 0.62 * ncols + 1.0, 0.62 * pp + 0.6
    fig = _new_figure(figsize=(panel_w * shape[1], panel_h * shape[0] + 0.4), layout="constrained")
    axes = fig.subplots(*shape, squeeze=False).ravel()
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes, keys):
        groups = layout[key]
        group_of = {r: i for i, g in enumerate(groups) for r in g}
        for row, stage in enumerate(rows):
            for col, r in enumerate(stage):
                # a rank outside every group of this key (a middle stage for
                # "embedding") stays grey
                colour = (_colour(group_of[r], len(groups)) if r in group_of
                          else (0.9, 0.9, 0.9, 1.0))
                ax.add_patch(Rectangle((col + 0.05, -row - 0.95), 0.9, 0.9, facecolor=colour,
                                       edgecolor="black", linewidth=0.8, gid=f"{key}:{r}"))
                red, green, blue = colour[:3]
                ink = "black" if 0.3 * red + 0.6 * green + 0.1 * blue > 0.5 else "white"
                ax.text(col + 0.5, -row - 0.45, str(r), ha="center", va="center",
                        fontsize=11, fontweight="bold", color=ink)
                if r in group_of:
                    ax.text(col + 0.5, -row - 0.82, f"g{group_of[r]}", ha="center",
                            va="center", fontsize=6.5, color=ink)
        ax.set_xlim(0, ncols)
        ax.set_ylim(-pp, 0)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([-s - 0.5 for s in range(pp)], [f"stage {s}" for s in range(pp)],
                      fontsize=8)
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(f'"{key}": {len(groups)} groups of {len(groups[0])}', fontsize=10)
    etp_text = "" if etp is None else f" etp={etp}"
    fig.suptitle(f"world={world_size}  tp={tp} cp={cp} pp={pp} ep={ep}{etp_text}  "
                 f"order={order}", fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# --------------------------------------------------------------------- memory per device

def plot_memory_breakdown(reports: dict[str, dict] | dict, path: str | None = None, *,
                          device_memory_gib: float | None = None, title: str | None = None,
                          unit: str = "auto"):
    """A stacked bar chart of params / grads / optimizer / activations.

    reports: one analysis.memory_report, or {label: memory_report} for several bars (e.g. the
      ZeRO stages of chapter 01, or several micro-batch sizes).
    path: save a PNG there. device_memory_gib: draw a dashed line at one device's memory.
    unit: "KiB", "MiB", "GiB", "TiB", or "auto" (the largest unit in which the tallest bar
      is at least 1).
    Returns the matplotlib Figure (Agg canvas).
    """
    if "total" in reports:                         # a single report
        reports = {reports.get("model", "model"): reports}
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    if unit == "auto":
        tallest = max(report["total"] for report in reports.values())
        unit = next((u for u in reversed(units) if tallest >= units[u]), "KiB")
    scale = units[unit]

    parts = ("params", "grads", "optimizer", "activations")
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
    fig = _new_figure(figsize=(3.0 + 1.2 * len(reports), 4.2))
    ax = fig.add_subplot()
    labels = list(reports)
    bottoms = [0.0] * len(labels)
    for part, color in zip(parts, colors):
        heights = [reports[label][part] / scale for label in labels]
        ax.bar(labels, heights, bottom=bottoms, color=color, label=part, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if device_memory_gib is not None:
        line = device_memory_gib * GiB / scale
        ax.axhline(line, color="black", linestyle="--", linewidth=1, label=f"one device ({device_memory_gib:g} GiB)")
    ax.set_ylabel(unit)
    ax.set_title(title or "training memory per device", fontsize="medium")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# --------------------------------------------------------------------- data parallel

def plot_bucket_timeline(timeline: BucketTimeline, path: str | os.PathLike | None = None,
                         title: str | None = None):
    """Draw backward and each bucket's all-reduce (dp.timeline.BucketTimeline) as bars on one
    time axis (milliseconds).

    Row "backward": 0 .. backward_end. Row "sync": finish_grad_sync. One row per bucket, in
    launch order: a bar from launch to completion (hatched where finish_grad_sync waited for
    it). Saves a PNG to `path` if given; returns the matplotlib Figure (Agg canvas).
    """
    events = timeline.buckets
    rows = ["backward", "finish_grad_sync"] + [f"bucket {e.bucket}" for e in events]
    fig = _new_figure(figsize=(7.5, 1.3 + 0.38 * len(rows)), layout="constrained")
    ax = fig.subplots()
    ms = 1e3
    span = max(timeline.sync_end, timeline.backward_end, 1e-9)
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}      # first row on top
    ax.barh(y["backward"], timeline.backward_end * ms, left=0, height=0.6, color="tab:blue",
            label="backward (gradient computation)")
    ax.barh(y["finish_grad_sync"], (timeline.sync_end - timeline.sync_start) * ms,
            left=timeline.sync_start * ms, height=0.6, color="tab:gray", label="finish_grad_sync")
    hatched = False
    for e in events:
        end = e.completed if e.completed is not None else timeline.sync_end
        ax.barh(y[f"bucket {e.bucket}"], max(end - e.launched, 1e-6) * ms, left=e.launched * ms,
                height=0.6, color="tab:orange",
                label="all-reduce (launch .. done)" if e is events[0] else None)
        if e.waited > 0.01 * span and e.wait_start is not None:   # communication the step waited for
            ax.barh(y[f"bucket {e.bucket}"], e.waited * ms, left=e.wait_start * ms, height=0.6,
                    fill=False, hatch="///", edgecolor="black", linewidth=0,
                    label=None if hatched else "waited for in finish_grad_sync")
            hatched = True
    ax.axvline(timeline.backward_end * ms, color="tab:blue", linestyle=":", linewidth=1)
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_xlabel("milliseconds after backward started")
    ax.set_title(title or f"DDP bucket all-reduces ({'overlapped with' if timeline.overlap else 'after'} backward)")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def wait_until(done: Callable[[], bool], timeout: float = 0.5, poll: float = 0.001) -> bool:
    """Poll `done()` every `poll` seconds until it is true or `timeout` seconds have passed;
    return its last value.

    For measurements of what is still alive: gloo's worker thread lets go of a finished
    collective's tensors a moment after wait() returns, so a buffer just released may still
    be referenced for a moment. A real leak survives the timeout and shows. Pass it as
    `FullyShardedDataParallel.memory_profile(settle=wait_until)` for an exact profile.
    """
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def plot_memory_profile(profile: list[MemoryEvent], path: str | os.PathLike | None = None,
                        unsharded_bytes: int | None = None, title: str = "ZeRO-3 parameter memory over one step"):
    """A step chart of the parameter bytes one rank holds at each event of a ZeRO-3 step
    (FullyShardedDataParallel.memory_profile: own shards, and gathered units on top);
    `unsharded_bytes` draws the full parameters as a dashed line. Returns the Figure (Agg
    canvas) and saves it to `path` if given."""
    x = range(len(profile))
    sharded = [e.sharded / 1024 for e in profile]
    total = [(e.sharded + e.gathered) / 1024 for e in profile]
    fig = _new_figure(figsize=(max(6.0, 0.35 * len(profile)), 4))
    ax = fig.add_subplot()
    ax.fill_between(x, 0, sharded, step="post", color="tab:blue", alpha=0.6, label="own shards")
    ax.fill_between(x, sharded, total, step="post", color="tab:orange", alpha=0.6, label="gathered units")
    if unsharded_bytes:
        ax.axhline(unsharded_bytes / 1024, color="k", ls="--", lw=1, label="full parameters (ZeRO-0/1/2)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([e.label for e in profile], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("parameter memory per rank (KiB)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# --------------------------------------------------------------------- pipeline parallel

def plot_timeline(intervals: list[Interval], title: str = "", path=None, unit: str = "time", ax=None):
    """Draw a pipeline schedule (pp.timeline.simulate, or a measured run): one row per rank
    (rank 0 on top), F boxes light, B boxes dark, each labelled with its micro-batch (and
    chunk when there are several); waiting for a receive grey, handing an output to a send
    orange, idle white.
    Draws into `ax` if given, else into a new Figure (Agg canvas; saved to `path` if given);
    returns the Figure."""
    ranks = sorted({i.rank for i in intervals})
    chunks = max(i.chunk for i in intervals) + 1
    colors = {"F": ["#9ecae1", "#c6dbef", "#deebf7"], "B": ["#3182bd", "#6baed6", "#08519c"]}
    if ax is None:
        fig = _new_figure(figsize=(10, 0.55 * len(ranks) + 1.2))
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    for i in intervals:
        color = colors[i.op][i.chunk % 3] if i.op in colors else "#fdae6b" if i.op == "send" else "#d9d9d9"
        y = len(ranks) - 1 - ranks.index(i.rank)
        ax.barh(y, i.end - i.start, left=i.start, height=0.8, color=color, edgecolor="black", linewidth=0.4)
        if i.op in ("F", "B"):
            label = f"{i.microbatch}" + (f".{i.chunk}" if chunks > 1 else "")
            ax.text((i.start + i.end) / 2, y, label, ha="center", va="center", fontsize=7,
                    color="white" if i.op == "B" else "black")
    ax.set_yticks(range(len(ranks)), [f"stage {r}" for r in reversed(ranks)])
    ax.set_xlabel(unit)
    ax.set_title(title)
    if path is not None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    return fig


def plot_losses(losses: list[float], eval_losses: list[tuple[int, float]], path: str | os.PathLike) -> None:
    """The loss curve of a training run (train.write_history): the train loss of every step,
    the validation loss where it was measured; saved as a PNG to `path`."""
    fig = _new_figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, label="train (per step)", lw=1)
    if eval_losses:
        steps, values = zip(*eval_losses)
        ax.plot(steps, values, "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
