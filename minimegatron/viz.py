"""The figures the package itself draws, and what every chapter's figures share.

    draw_rank_grid   the 5D rank layout: one panel per group key    (parallel_state; chapters 00-05)
    plot_losses      a training run's loss curve                    (train.write_history)
    plot_run_summary the loss, the rank grid and the bytes per dimension (run_report, make demo)
    new_figure, finish_figure, colour   the common frame of every figure of the book

A chapter's own figures live in chapters/NN_*/make_figures.py, drawn from the records the
algorithms keep (dp.timeline, pp.timeline, ...). Every function builds a matplotlib Figure on
its own Agg canvas (no pyplot: a notebook's backend is left alone), saves it to `path` if given,
and returns it.
"""

from __future__ import annotations

import math
import os

from .parallel_state import KEYS, rank_groups

__all__ = ["new_figure", "finish_figure", "colour", "draw_rank_grid", "plot_losses", "plot_run_summary"]


def new_figure(**kwargs):
    """A matplotlib Figure with its own Agg canvas (pyplot and its backend untouched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


# --------------------------------------------------------------------- the rank layout

def finish_figure(fig, path, title: str = "", dpi: int = 100):
    """Title, layout, save to `path` if given; returns the Figure."""
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=dpi)
    return fig


def colour(i: int, n: int):
    """The colour of item i of n: tab10, tab20 (dark shades first), or a hue wheel."""
    import matplotlib

    if n <= 10:
        return matplotlib.colormaps["tab10"](i)
    if n <= 20:  # dark shades first, so neighbouring groups do not look alike
        return matplotlib.colormaps["tab20"]((2 * i) % 20 + (2 * i) // 20)
    return matplotlib.colormaps["hsv"](i / n)


def draw_rank_grid(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   etp: int | None = None, order: str = "tp-cp-ep-dp-pp",
                   keys=("tp", "dp", "pp"), path=None):
    """One panel per key of parallel_state.rank_groups: a box per rank (rows: pipeline stages, ranks
    ascending), coloured by its group of that key, showing the rank and its group's index ("g3");
    each a Rectangle with gid "<key>:<rank>". Saves to `path` if given; returns the Agg Figure."""
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
    fig = new_figure(figsize=(panel_w * shape[1], panel_h * shape[0] + 0.4), layout="constrained")
    axes = fig.subplots(*shape, squeeze=False).ravel()
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes, keys):
        _rank_panel(ax, layout[key], rows, key)
    etp_text = "" if etp is None else f" etp={etp}"
    fig.suptitle(f"world={world_size}  tp={tp} cp={cp} pp={pp} ep={ep}{etp_text}  order={order}", fontsize=10)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _rank_panel(ax, groups: list[list[int]], rows: list[list[int]], key: str) -> None:
    """One panel of draw_rank_grid: `rows` (the ranks of each pipeline stage) as boxes coloured
    by their group of `groups`, labelled with the rank and "g<group index>"."""
    from matplotlib.patches import Rectangle

    group_of = {r: i for i, g in enumerate(groups) for r in g}
    for row, stage in enumerate(rows):
        for col, r in enumerate(stage):
            # a rank outside every group of this key (a middle stage for "embedding") stays grey
            fill = colour(group_of[r], len(groups)) if r in group_of else (0.9, 0.9, 0.9, 1.0)
            ax.add_patch(Rectangle((col + 0.05, -row - 0.95), 0.9, 0.9, facecolor=fill, edgecolor="black",
                                   linewidth=0.8, gid=f"{key}:{r}"))
            red, green, blue = fill[:3]
            ink = "black" if 0.3 * red + 0.6 * green + 0.1 * blue > 0.5 else "white"
            ax.text(col + 0.5, -row - 0.45, str(r), ha="center", va="center", fontsize=11, fontweight="bold", color=ink)
            if r in group_of:
                ax.text(col + 0.5, -row - 0.82, f"g{group_of[r]}", ha="center", va="center", fontsize=6.5, color=ink)
    pp = len(rows)
    ax.set(xlim=(0, len(rows[0])), ylim=(-pp, 0), aspect="equal", xticks=[])
    ax.set_yticks([-s - 0.5 for s in range(pp)], [f"stage {s}" for s in range(pp)], fontsize=8)
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    ax.set_title(f'"{key}": {len(groups)} groups of {len(groups[0])}', fontsize=10)


# --------------------------------------------------------------------- the training loop

def plot_losses(losses: list[float], eval_losses: list[tuple[int, float]], path: str | os.PathLike) -> None:
    """The loss curve of a training run (train.write_history): the train loss of every step,
    the validation loss where it was measured; saved as a PNG to `path`."""
    fig = new_figure(figsize=(6, 3.5))
    _loss_panel(fig.add_subplot(), losses, eval_losses)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _loss_panel(ax, losses: list[float], eval_losses: list[tuple[int, float]]):
    """The train loss of every step and the validation loss where it was measured, on `ax`."""
    ax.plot(range(1, len(losses) + 1), losses, label="train (per step)", lw=1)
    if eval_losses:
        steps, values = zip(*eval_losses)
        ax.plot(steps, values, "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_run_summary(losses: list[float], eval_losses: list[tuple[int, float]], world_size: int,
                     sizes: dict[str, int], bytes_per_dimension: dict[str, int], path=None):
    """The training entry's one picture (run_report.py, `make demo`): the loss curve, the rank
    grid coloured by tensor-parallel group (rows: pipeline stages), and the bytes one step hands
    to the collectives of each dimension (the busiest rank's). `sizes`: tp, pp, cp, ep, etp."""
    fig = new_figure(figsize=(14, 4))
    grid = fig.add_gridspec(1, 3, width_ratios=[1.2, 1.3, 1.1])
    _loss_panel(fig.add_subplot(grid[0]), losses, eval_losses).set_title("loss", fontsize=10)
    layout = rank_groups(world_size, **sizes)
    stage_of = {r: s for g in layout["pp"] for s, r in enumerate(g)}
    rows = [[r for r in range(world_size) if stage_of[r] == s] for s in range(sizes["pp"])]
    _rank_panel(fig.add_subplot(grid[1]), layout["tp"], rows, "tp")
    ax = fig.add_subplot(grid[2])
    names = list(bytes_per_dimension)
    ax.barh(names[::-1], [bytes_per_dimension[n] / 2**20 for n in names[::-1]],
            color=[colour(i, len(names)) for i in range(len(names))][::-1])
    ax.set_xlabel("MiB handed to collectives in one step")
    ax.set_title("communication per dimension", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    tp, cp, pp = (sizes.get(k, 1) for k in ("tp", "cp", "pp"))
    shown = dict(tp=tp, cp=cp, dp=world_size // (tp * cp * pp), pp=pp, ep=sizes.get("ep", 1))
    return finish_figure(fig, path, title=f"{world_size} ranks: " + " x ".join(
        f"{k} {v}" for k, v in shown.items() if v > 1))
