"""The figures of chapter 05 and the numbers the chapter quotes.

    python chapters/05_ep_moe/make_figures.py       # about a minute on 2 cores; writes figures/*.png

  expert_grid.png    16 ranks as the 5D demo lays them out (tp 2, cp 2, pp 2, dp 2; experts: etp 2,
                     ep 2, expert-dp 2): which ranks share a dense gradient ("dp-cp"), which an
                     expert's ("expert-dp"), and the ep and pp groups (parallel_state.rank_groups)
  dispatchers.png    bytes one rank receives per MoE layer and micro-batch, all-to-all against
                     all-gather, ep = 2 .. 64, from the demo's dispatcher_volumes (T = 4096 tokens,
                     h = 4096, 64 experts, top-2, bf16), checked against the closed forms
                     2 T k h e (ep - 1)/ep and 2 (ep - 1) T h e + (ep - 1) T E (e + 1)
  load_balance.png   the demo's load_balance: the same tiny GPT-MoE trained 60 steps on the text of
                     chapters 00-02 (bytes; not this chapter's, so editing it does not move the
                     numbers) with no balancing, the auxiliary loss, sigmoid scores, sigmoid scores
                     with the expert bias (measured on one device)
It stops with an error (exit 1) if a number differs from its closed form.
"""

from __future__ import annotations

import sys
from pathlib import Path

import os
import torch

from booktools.demo import import_chapter
from minimegatron.viz import colour, draw_rank_grid, finish_figure, new_figure

ch05 = import_chapter("05")        # chapters/05_ep_moe/demo.py: the formulas and the runs

OUT = Path(__file__).resolve().parent / "figures"
T, H, E, K, BF16 = 4096, 4096, 64, 2, 2
EP_SIZES = (2, 4, 8, 16, 32, 64)


def fail(message: str) -> None:
    print(f"MISMATCH: {message}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------------------
# the figures (drawn from the records the code keeps; the notebook and the tests draw them too)
# ---------------------------------------------------------------------------------------
def plot_moe_load_balance(results: dict[str, dict], path: str | os.PathLike | None = None, title: str = ""):
    """Three panels of a mixture's load balance (chapter 05's demo, load_balance): the largest
    expert's tokens over the mean after each training step, per balancing setting (the worst
    layer); the share of the routed pairs each expert got after the last step, in each setting's
    worst layer then (named in the legend), so that the bars show the collapse the left panel
    shows; the fraction of routed pairs a capacity factor drops. results: {setting:
    {"imbalance": [...], "final": [...], "final_layer": i (optional), "dropped": {factor:
    fraction}}}. Returns the Figure (saved to `path` if given)."""
    fig = new_figure(figsize=(13.5, 3.6))
    ax_steps, ax_final, ax_drop = fig.subplots(1, 3)
    n = len(results)
    for i, (name, r) in enumerate(results.items()):
        line = colour(i, max(n, 3))
        ax_steps.plot(range(1, len(r["imbalance"]) + 1), r["imbalance"], color=line, label=name)
        experts = len(r["final"])
        width = 0.8 / n
        layer = f" (layer {r['final_layer']})" if "final_layer" in r else ""
        ax_final.bar([e + (i - (n - 1) / 2) * width for e in range(experts)], r["final"], width=width,
                     color=line, label=name + layer)
        factors = sorted(r["dropped"])
        ax_drop.plot(factors, [r["dropped"][f] for f in factors], marker="o", color=line, label=name)
    ax_steps.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax_steps.set(xlabel="training step", ylabel="max / mean tokens per expert",
                 title="imbalance (held-out batch, worst layer)")
    experts = len(next(iter(results.values()))["final"])
    ax_final.axhline(1 / experts, color="black", linestyle="--", linewidth=0.8)
    ax_final.set(xlabel="expert", ylabel="share of routed pairs", title="after the last step (worst layer)")
    ax_final.set_xticks(range(experts))
    ax_final.legend(fontsize=7)
    ax_drop.set(xlabel="capacity factor", ylabel="routed pairs dropped", title="dropped at capacity")
    ax_drop.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax_steps.legend(fontsize=7)
    return finish_figure(fig, path, title)


def plot_dispatcher_volumes(rows: dict[str, dict[int, float]], path: str | os.PathLike | None = None,
                            title: str = ""):
    """Bytes one rank receives per MoE layer and micro-batch against the expert-parallel size,
    one line per dispatcher (rows: {dispatcher: {ep: bytes}}), log-scaled x. Returns the Figure."""
    fig = new_figure(figsize=(5.4, 3.6))
    ax = fig.subplots()
    for i, (name, by_ep) in enumerate(rows.items()):
        sizes = sorted(by_ep)
        ax.plot(sizes, [by_ep[ep] / 2**20 for ep in sizes], marker="o", color=colour(i, 3), label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(ep) for ep in sizes])
    ax.set(xlabel="expert-parallel size ep", ylabel="MiB received per rank")
    ax.legend(fontsize=8)
    return finish_figure(fig, path, title)


def main() -> int:
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    draw_rank_grid(16, tp=2, cp=2, pp=2, ep=2, keys=("dp-cp", "expert-dp", "ep", "pp"),
                   path=OUT / "expert_grid.png")

    rows = {"all-to-all": {}, "all-gather": {}}
    for ep in EP_SIZES:
        v = ch05.dispatcher_volumes(T, H, E, K, ep, BF16)
        if v["alltoall"] != 2 * T * K * H * BF16 * (ep - 1) / ep or \
                v["allgather"] != 2 * (ep - 1) * T * H * BF16 + (ep - 1) * T * E * (BF16 + 1):
            fail(f"dispatcher_volumes at ep={ep} differs from the closed forms")
        rows["all-to-all"][ep], rows["all-gather"][ep] = v["alltoall"], v["allgather"]
        print(f"ep={ep:3d}: all-to-all {v['alltoall'] / 2**20:8.1f} MiB, all-gather {v['allgather'] / 2**20:8.1f} MiB "
              f"({v['allgather'] / v['alltoall']:.1f}x)")
    plot_dispatcher_volumes(rows, OUT / "dispatchers.png",    # two lines: one is wider than the figure
                            title=f"received per rank, MoE layer and micro-batch\n"
                                  f"T={T}, h={H}, E={E}, top-{K}, bf16, uniform routing")

    results = ch05.load_balance(steps=60)
    print("\n".join(ch05.load_balance_lines(results)))
    plot_moe_load_balance(results, OUT / "load_balance.png",
                          title="a tiny GPT-MoE (8 experts, top-2) trained 60 steps on chapters 00-02's text, one device")
    print(f"wrote {', '.join(p.name for p in sorted(OUT.glob('*.png')))} in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
