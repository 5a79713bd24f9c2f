"""Every figure of the book, in one place: the algorithms keep their records, this draws them.

    draw_rank_grid         the 5D rank layout: one panel per group key    (parallel_state)
    plot_memory_breakdown  params / grads / optimizer / activations bars  (analysis.report)
    plot_bucket_timeline   DDP: backward and each bucket's all-reduce     (dp.timeline.BucketTimeline)
    plot_memory_profile    ZeRO-3: parameter bytes at every gather/free   (dp.fsdp.MemoryEvent)
    plot_timeline          a pipeline schedule, one row per stage         (pp.timeline.Interval)
    plot_cp_load_balance   causal attention work per cp rank, contiguous vs zig-zag   (cp.causal_work_per_rank)
    plot_cp_comm_types     the four cp_comm_types' bytes and steps as cp grows       (chapter 04's formulas)
    plot_sp_cp_activations activation bytes per rank against 1/(tp cp) and Korthikanti's formulas
    draw_sequence_parallel_regions   SP's regions and their collectives, a diagram

Every function builds a matplotlib Figure on its own Agg canvas (no pyplot, no backend switch:
a notebook's backend is left alone), saves it to `path` if given, and returns it.
This module sits late in the import order: chapters, notebooks, tests and benchmarks import
it; no algorithm module does.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from .analysis.report import GiB
from .parallel_state import KEYS, rank_groups

if TYPE_CHECKING:                  # the records drawn here (only their fields are read)
    from .dp.fsdp import MemoryEvent
    from .dp.timeline import BucketTimeline
    from .pp.timeline import Interval

__all__ = ["draw_rank_grid", "plot_memory_breakdown", "plot_bucket_timeline", "plot_memory_profile",
           "plot_timeline", "plot_losses", "plot_cp_load_balance", "plot_cp_comm_types",
           "plot_sp_cp_activations", "draw_sequence_parallel_regions", "plot_moe_load_balance",
           "plot_dispatcher_volumes"]


def _new_figure(**kwargs):
    """A matplotlib Figure with its own Agg canvas (pyplot and its backend untouched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


# --------------------------------------------------------------------- the rank layout

def _finish(fig, path, title: str = "", dpi: int = 100):
    """Title, layout, save to `path` if given; returns the Figure."""
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=dpi)
    return fig


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


# --------------------------------------------------------------------- sequence and context parallel

def plot_cp_load_balance(work: dict[int, dict[str, list[int]]], path: str | os.PathLike | None = None,
                         title: str = ""):
    """Causal attention work per context-parallel rank (cp.causal_work_per_rank): one panel per
    cp size, a pair of bars per rank (contiguous split, zig-zag split), each in units of the
    mean over the ranks, with the mean (1) dashed. work: {cp: {"contiguous": [W_0, ...],
    "zig-zag": [W_0, ...]}}. Returns the Figure (saved to `path` if given)."""
    sizes = sorted(work)
    fig = _new_figure(figsize=(3.6 * len(sizes) + 0.6, 3.4))
    axes = fig.subplots(1, len(sizes), sharey=True, squeeze=False)[0]
    colors = {"contiguous": "#C44E52", "zig-zag": "#4C72B0"}
    for ax, cp in zip(axes, sizes):
        width = 0.4
        for i, (name, per_rank) in enumerate(work[cp].items()):
            mean = sum(per_rank) / len(per_rank)
            xs = [r + (i - 0.5) * width for r in range(cp)]
            ax.bar(xs, [w / mean for w in per_rank], width=width, color=colors.get(name, _colour(i, 2)),
                   label=f"{name} (max/mean {max(per_rank) / mean:.3f})")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(cp), [str(r) for r in range(cp)])
        ax.set_xlabel("cp rank")
        ax.set_title(f"cp = {cp}", fontsize="medium")
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("unmasked scores / mean")
    return _finish(fig, path, title)


def plot_cp_comm_types(rows: dict[str, dict[int, dict[str, float]]], path: str | os.PathLike | None = None,
                       unit: str = "bytes", title: str = ""):
    """The context-parallel communication types side by side as cp grows: three panels, bytes
    sent per rank and layer in the forward, the same in the backward, and the number of
    communication steps (forward + backward). rows: {comm_type: {cp: {"fwd": bytes, "bwd":
    bytes, "steps": n}}}; `unit` labels the byte axes. Returns the Figure."""
    fig = _new_figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 3)
    markers = "osD^v"
    for i, (name, by_cp) in enumerate(rows.items()):
        cps = sorted(by_cp)
        for ax, key in zip(axes, ("fwd", "bwd", "steps")):
            ax.plot(cps, [by_cp[c][key] for c in cps], marker=markers[i % len(markers)], color=_colour(i, len(rows)),
                    label=name)
    for ax, label in zip(axes, (f"forward: sent per rank and layer ({unit})",
                                f"backward: sent per rank and layer ({unit})",
                                "communication steps per layer (fwd + bwd)")):
        ax.set_title(label, fontsize="medium")
        ax.set_xlabel("cp")
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({c for by_cp in rows.values() for c in by_cp}))
    axes[0].legend(fontsize=8)
    return _finish(fig, path, title)


def plot_sp_cp_activations(tp_panel: dict, cp_panel: dict, path: str | os.PathLike | None = None):
    """Activation bytes per rank, measured, against the ideal cut and the paper's formulas.

    tp_panel: {"tp": [t, ...], "measured_tp": [...], "measured_sp": [...] (bytes per rank /
      single-device bytes), "korthikanti_tp": [...], "korthikanti_sp": [...] (the same
      ratios from the formulas), "label": str}.
    cp_panel: {"cp": [c, ...], "measured": [bytes per rank], "single": bytes on one device,
      "label": str}.
    Left: fractions of the single device against tp, with 1/tp dashed; right: MiB per rank
    against cp, with single / cp dashed. Returns the Figure."""
    fig = _new_figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    t = tp_panel["tp"]
    left.plot(t, [1 / x for x in t], "k--", linewidth=0.8, label="1 / tp")
    left.plot(t, tp_panel["korthikanti_tp"], "-", color="#C44E52", alpha=0.6, label="Korthikanti TP formula")
    left.plot(t, tp_panel["korthikanti_sp"], "-", color="#4C72B0", alpha=0.6, label="Korthikanti TP+SP formula")
    left.plot(t, tp_panel["measured_tp"], "o", color="#C44E52", label="measured, TP")
    left.plot(t, tp_panel["measured_sp"], "s", color="#4C72B0", label="measured, TP + SP")
    left.set_xticks(t)
    left.set_xlabel("tp")
    left.set_ylabel("saved activations per rank / one device")
    left.set_ylim(0, 1.05)
    left.set_title(tp_panel.get("label", ""), fontsize="medium")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    c, mib = cp_panel["cp"], 2 ** 20
    right.plot(c, [cp_panel["single"] / x / mib for x in c], "k--", linewidth=0.8, label="one device / cp")
    right.plot(c, [m / mib for m in cp_panel["measured"]], "o-", color="#55A868", label="measured per rank")
    right.set_xticks(c)
    right.set_xlabel("cp")
    right.set_ylabel("saved activations per rank (MiB)")
    right.set_ylim(0, None)
    right.set_title(cp_panel.get("label", ""), fontsize="medium")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    return _finish(fig, path)


def draw_sequence_parallel_regions(path: str | os.PathLike | None = None):
    """A diagram of one transformer layer under sequence parallelism (Korthikanti et al. 2022;
    tp/layers.py): the sequence-parallel regions ([b, s/tp, h], this rank's tokens: norms,
    dropout, residual adds) and the tensor-parallel regions ([b, s, .../tp], all tokens, this
    rank's heads or MLP columns), with the collective at each boundary (forward, and in
    brackets backward). Returns the Figure (saved to `path` if given)."""
    import matplotlib.patches as patches

    fig = _new_figure(figsize=(14, 3.6))
    ax = fig.add_subplot()
    ax.set_xlim(0, 14)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    sp_colour, tp_colour = "#dbe9f6", "#fde0c5"
    # (x, width, label, region)
    boxes = [(0.1, 1.5, "LayerNorm\ninput_layernorm", "sp"),
             (2.6, 2.4, "linear_qkv (column)\ncore attention\n(a/tp heads)", "tp"),
             (5.2, 1.3, "linear_proj\n(row)", "tp"), (7.3, 1.9, "+ bias, dropout,\nresidual;\npre_mlp_layernorm", "sp"),
             (10.2, 1.9, "linear_fc1 (column)\nactivation", "tp"), (12.3, 1.3, "linear_fc2\n(row)", "tp")]
    for x, w, label, region in boxes:
        ax.add_patch(patches.FancyBboxPatch((x, 1.2), w, 1.2, boxstyle="round,pad=0.05",
                                            facecolor=sp_colour if region == "sp" else tp_colour, edgecolor="black"))
        ax.text(x + w / 2, 1.8, label, ha="center", va="center", fontsize=8)
    arrows = [(1.65, 2.55, "all-gather\n(bwd: reduce-scatter;\nre-gather of the shard)"),
              (5.0, 5.15, ""), (6.55, 7.25, "reduce-scatter\n(bwd: all-gather)"),
              (9.25, 10.15, "all-gather\n(bwd: reduce-scatter;\nre-gather of the shard)"),
              (12.15, 12.25, ""), (13.65, 13.95, "")]
    for x0, x1, label in arrows:
        ax.annotate("", xy=(x1, 1.8), xytext=(x0, 1.8), arrowprops=dict(arrowstyle="->", lw=1.2))
        if label:
            ax.text((x0 + x1) / 2, 0.8, label, ha="center", va="center", fontsize=7.5, color="#7f2704")
    ax.text(13.8, 0.8, "reduce-scatter\n(bwd: all-gather)", ha="center", va="center", fontsize=7.5, color="#7f2704")
    handles = [patches.Patch(facecolor=sp_colour, edgecolor="black",
                             label="sequence-parallel region: [b, s/tp, h], this rank's tokens, whole in h"),
               patches.Patch(facecolor=tp_colour, edgecolor="black",
                             label="tensor-parallel region: all s tokens, a/tp heads or f/tp MLP columns")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1.02), ncol=2, fontsize=8, frameon=False)
    return _finish(fig, path)


def plot_moe_load_balance(results: dict[str, dict], path: str | os.PathLike | None = None, title: str = ""):
    """Three panels of a mixture's load balance (chapter 05's demo, load_balance): the largest
    expert's tokens over the mean after each training step, per balancing setting; the share of
    the routed pairs each expert got after the last step (layer 0); the fraction of routed pairs
    a capacity factor drops. results: {setting: {"imbalance": [...], "final": [...],
    "dropped": {factor: fraction}}}. Returns the Figure (saved to `path` if given)."""
    fig = _new_figure(figsize=(13.5, 3.6))
    ax_steps, ax_final, ax_drop = fig.subplots(1, 3)
    n = len(results)
    for i, (name, r) in enumerate(results.items()):
        colour = _colour(i, max(n, 3))
        ax_steps.plot(range(1, len(r["imbalance"]) + 1), r["imbalance"], color=colour, label=name)
        experts = len(r["final"])
        width = 0.8 / n
        ax_final.bar([e + (i - (n - 1) / 2) * width for e in range(experts)], r["final"], width=width,
                     color=colour, label=name)
        factors = sorted(r["dropped"])
        ax_drop.plot(factors, [r["dropped"][f] for f in factors], marker="o", color=colour, label=name)
    ax_steps.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax_steps.set(xlabel="training step", ylabel="max / mean tokens per expert",
                 title="imbalance (held-out batch, worst layer)")
    experts = len(next(iter(results.values()))["final"])
    ax_final.axhline(1 / experts, color="black", linestyle="--", linewidth=0.8)
    ax_final.set(xlabel="expert", ylabel="share of routed pairs", title="after the last step (layer 0)")
    ax_final.set_xticks(range(experts))
    ax_drop.set(xlabel="capacity factor", ylabel="routed pairs dropped", title="dropped at capacity")
    ax_drop.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax_steps.legend(fontsize=7)
    return _finish(fig, path, title)


def plot_dispatcher_volumes(rows: dict[str, dict[int, float]], path: str | os.PathLike | None = None,
                            title: str = ""):
    """Bytes one rank receives per MoE layer and micro-batch against the expert-parallel size,
    one line per dispatcher (rows: {dispatcher: {ep: bytes}}), log-scaled x. Returns the Figure."""
    fig = _new_figure(figsize=(5.4, 3.6))
    ax = fig.subplots()
    for i, (name, by_ep) in enumerate(rows.items()):
        sizes = sorted(by_ep)
        ax.plot(sizes, [by_ep[ep] / 2**20 for ep in sizes], marker="o", color=_colour(i, 3), label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(ep) for ep in sizes])
    ax.set(xlabel="expert-parallel size ep", ylabel="MiB received per rank")
    ax.legend(fontsize=8)
    return _finish(fig, path, title)
