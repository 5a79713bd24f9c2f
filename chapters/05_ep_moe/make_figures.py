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

import torch

from booktools.demo import import_chapter
from minimegatron.viz import draw_rank_grid, plot_dispatcher_volumes, plot_moe_load_balance

ch05 = import_chapter("05")        # chapters/05_ep_moe/demo.py: the formulas and the runs

OUT = Path(__file__).resolve().parent / "figures"
T, H, E, K, BF16 = 4096, 4096, 64, 2, 2
EP_SIZES = (2, 4, 8, 16, 32, 64)


def fail(message: str) -> None:
    print(f"MISMATCH: {message}", file=sys.stderr)
    sys.exit(1)


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
    plot_dispatcher_volumes(rows, OUT / "dispatchers.png",
                            title=f"received per rank, MoE layer, micro-batch (T={T}, h={H}, E={E}, top-{K}, bf16)")

    results = ch05.load_balance(steps=60)
    print("\n".join(ch05.load_balance_lines(results)))
    plot_moe_load_balance(results, OUT / "load_balance.png",
                          title="a tiny GPT-MoE (8 experts, top-2) trained 60 steps on chapters 00-02's text, one device")
    print(f"wrote {', '.join(p.name for p in sorted(OUT.glob('*.png')))} in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
