"""The figures of chapter 02 and the tables the chapter quotes.

    python chapters/02_tp/make_figures.py          # about 30 s on 2 cores; writes figures/*.png

Three diagrams, drawn from the shapes (no run):
  column_row_split.png   Y = X A cut two ways: A's columns (column-parallel, no communication)
                         and A's rows (row-parallel, partial sums and one all-reduce)
  tp_layer.png           one transformer layer on 2 TP ranks: what is split, what is
                         replicated, and where Megatron's copy and reduce operators sit
                         (the 2019 paper's f and g; the book keeps f and g for sizes)
  tp_dp_grid.png         16 ranks on 2 nodes of 8, tp=4 x dp=4: the TP and DP groups of
                         parallel_state.rank_groups (tp fastest), and the same world with
                         tp slowest, where every TP group straddles the two nodes

One spawned gloo world of 4 ranks (minimegatron.launch.spawn), tiny GPT-2 style (tied,
learned positions, biases, GELU) and LLaMA style (untied, RoPE, GQA, SwiGLU, no biases)
models, float32, V = 257 (divisible by neither 2 nor 4). It prints
  * the ledger of one forward and one backward of the GPTModel cut by
    tp.apply_tensor_parallel at tp=2 (groups [0, 1], [2, 3]) and tp=4 (the world), next to
    the chapter's formula; it stops with an error if they differ on any rank;
  * every collective of one training step of TP=2 x DP=2 (the training loop's own pieces:
    resume.initialize_layout, parallelize.build_model and build_optimizer, train.train_step:
    bucketed DDP over the DP group, the global norm's one all-reduce over the TP group);
  * each rank's parameter count (split and replicated) next to the formula, and the
    activation bytes autograd saves per rank at tp = 1, 2, 4 (saved-tensor hooks);
and draws
  tp_memory.png          parameters per rank vs tp, split vs replicated, for GPT-2 small
                         (the formula, which the tiny models check against real shards), and
                         the model state (16 bytes per parameter) of LLaMA-2 7B and 70B
                         shapes per rank vs one 80 GiB GPU

The ledger and the byte counts do not change from run to run. RUNS and measure() at the end
are what `make numbers CH=02` (booktools/measured.py) reruns and records in measured.json: the
numbers the chapter's README and notebook quote, checked against the text by
tests/test_measured.py.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt  # noqa: E402
import torch.distributed as dist  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

from booktools.demo import import_chapter  # noqa: E402
from minimegatron import parallel_state  # noqa: E402
from minimegatron.analysis import (GiB, count_parameters, measure_saved_activation_bytes,  # noqa: E402
                                   real_model_config, tensor_parallel_parameters)
from minimegatron.comm import CommRecord, record_communication, ring_traffic  # noqa: E402
from minimegatron.config import ModelConfig, TrainConfig  # noqa: E402
from minimegatron.launch import spawn  # noqa: E402
from minimegatron.model import GPTModel  # noqa: E402
from minimegatron.parallelize import build_model, build_optimizer, unwrap  # noqa: E402
from minimegatron.placement import placement_of  # noqa: E402
from minimegatron.testing import make_batches  # noqa: E402
from minimegatron.tp import apply_tensor_parallel, pad_vocab_size, vocab_range  # noqa: E402
from minimegatron.resume import initialize_layout  # noqa: E402
from minimegatron.train import train_step  # noqa: E402

OUT = Path(__file__).resolve().parent / "figures"

# ---------------------------------------------------------------------------------------
# the tiny models of the runs (float32; V = 257 is divisible by neither 2 nor 4)
# ---------------------------------------------------------------------------------------
TINY = dict(vocab_size=257, hidden_size=32, num_layers=2, max_position_embeddings=16,
            params_dtype="float32")
STYLES = {
    "gpt2": lambda: ModelConfig.gpt2(num_attention_heads=4, **TINY),
    # 8 query heads in 4 KV groups: GQA that still splits over tp = 4
    "llama": lambda: ModelConfig.llama(num_attention_heads=8, num_query_groups=4, **TINY),
}
B, S = 2, 16                     # micro-batch of the ledger runs
ACT_B, ACT_S = 4, 16             # micro-batch of the activation measurement
E = 4                            # bytes per float32 element


# ---------------------------------------------------------------------------------------
# the chapter's formulas, from the shapes alone
# ---------------------------------------------------------------------------------------
def tp_parameter_counts(cfg: ModelConfig, tp: int) -> dict:
    """analysis.tensor_parallel_parameters (elements ONE rank holds: split, replicated,
    per_rank, padding) plus the padded vocabulary Vp it assumes."""
    return {**tensor_parallel_parameters(cfg, tp),
            "Vp": pad_vocab_size(cfg.vocab_size, tp, cfg.make_vocab_size_divisible_by)}


def tp_ledger_formula(cfg: ModelConfig, b: int, s: int, e: int) -> dict[str, list[int]]:
    """Bytes of each all-reduce of one forward and one backward, in the TP group.

    forward : 1 (embedding) + 2 per layer (after linear_proj, after linear_fc2) of [b, s, h],
              then 3 of [b, s] (the loss: max, target logit, sum of exponentials)
    backward: 2 per layer (before linear_qkv, before linear_fc1) + 1 (the output layer's
              input) of [b, s, h]; the embedding and the loss need none
    """
    bsh, bs, L = b * s * cfg.hidden_size * e, b * s * e, cfg.num_layers
    return {"fwd": [bsh] * (1 + 2 * L) + [bs] * 3, "bwd": [bsh] * (2 * L + 1)}


# ---------------------------------------------------------------------------------------
# the runs (rank functions: spawn imports them from this file)
# ---------------------------------------------------------------------------------------
def _records(ledger) -> list[tuple]:
    return [(r.op, r.tag, r.nbytes, r.group_size, tuple(r.shape)) for r in ledger]


def tp_rank() -> dict:
    """On each of 4 ranks: one forward + backward at tp = 2 and 4, per style; then one
    training step of TP=2 x DP=2."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]       # every rank makes every group
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    out = {"ledger": {}, "params": {}, "acts": {}}
    for tp, group in groups.items():
        for style, make in STYLES.items():
            cfg = make()
            model = apply_tensor_parallel(GPTModel(cfg), group)
            batch = make_batches(cfg, 1, B, S, seed=0)[0]
            with record_communication() as fwd:
                losses = model(batch["tokens"], labels=batch["labels"])
            with record_communication() as bwd:
                losses.mean().backward()
            # Megatron's attribute marks what apply_tensor_parallel split; the rest is replicated
            split = sum(p.numel() for p in model.parameters() if placement_of(p).tensor_model_parallel)
            out["ledger"][(tp, style)] = {"fwd": _records(fwd), "bwd": _records(bwd),
                                          "loss": losses.detach().mean().item()}
            out["params"][(tp, style)] = (split, sum(p.numel() for p in model.parameters()) - split)
            act = make_batches(cfg, 1, ACT_B, ACT_S, seed=1)[0]
            out["acts"][(tp, style)] = measure_saved_activation_bytes(model, act["tokens"], act["labels"])

    # one training step of TP=2 x DP=2, built and run as the training loop does
    cfg = STYLES["llama"]()
    train_cfg = TrainConfig(seq_length=S, micro_batch_size=B, lr=1e-3, lr_warmup_iters=0, train_iters=1,
                            clip_grad=1.0, tensor_model_parallel_size=2, progress=False)
    layout = initialize_layout(train_cfg)                             # tp [0, 1], [2, 3]; dp [0, 2], [1, 3]
    chunks = build_model(cfg, train_cfg, layout)                      # GPTModel -> TP -> DDP
    optimizer = build_optimizer(chunks, train_cfg, layout)            # its norm sums over the TP group
    batch = make_batches(cfg, 1, 2 * B, S, seed=2)[0]                  # the global batch
    mine = {k: v[layout.dp_rank * B:(layout.dp_rank + 1) * B] for k, v in batch.items()}
    with record_communication() as step:
        train_step(chunks, optimizer, [mine], layout, train_cfg.lr)
    out["step"] = [(r.op, r.tag, r.nbytes, r.group_ranks) for r in step]
    out["step_groups"] = {"tp": parallel_state.get_group_ranks("tp"), "dp": parallel_state.get_group_ranks("dp")}
    out["step_params"] = sum(p.numel() for p in unwrap(chunks[0]).parameters())
    parallel_state.destroy_model_parallel()
    return out


# ---------------------------------------------------------------------------------------
# diagrams
# ---------------------------------------------------------------------------------------
RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
REPL = "#BBBBBB"


def _block(ax, x, y, w, h, color, text="", fontsize=8, alpha=0.85, ink="black", **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", lw=0.8, alpha=alpha, **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=ink)


def _arrow(ax, x0, y0, x1, y1, color="black", lw=1.0, style="-|>", ls="-"):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=9,
                                 color=color, lw=lw, linestyle=ls, shrinkA=0, shrinkB=0))


def plot_column_row_split() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.0))
    for ax in (left, right):
        ax.set_xlim(0, 12)
        ax.set_ylim(0, 5.6)
        ax.axis("off")

    # ---- column-parallel: A [h, f] = [A_1 | A_2]; Y_r = X A_r ------------------------------
    ax = left
    ax.set_title("column-parallel (linear_qkv, linear_fc1, output layer)\n"
                 "A = [A$_1$ | A$_2$] split by columns: Y$_r$ = X A$_r$, no communication forward",
                 fontsize=9)
    _block(ax, 0.3, 2.0, 1.6, 3.2, REPL, "X\n[bs, h]\nsame on\nevery rank", 8)
    ax.text(2.2, 3.6, "×", fontsize=14, ha="center", va="center")
    _block(ax, 2.6, 2.0, 1.3, 3.2, RANK_COLORS[0], "A$_1$\n[h, f/tp]", 8)
    _block(ax, 3.9, 2.0, 1.3, 3.2, RANK_COLORS[1], "A$_2$\n[h, f/tp]", 8)
    ax.text(5.6, 3.6, "=", fontsize=14, ha="center", va="center")
    _block(ax, 6.0, 2.0, 1.3, 3.2, RANK_COLORS[0], "Y$_1$ = XA$_1$\n[bs, f/tp]", 7.5)
    _block(ax, 7.3, 2.0, 1.3, 3.2, RANK_COLORS[1], "Y$_2$ = XA$_2$\n[bs, f/tp]", 7.5)
    ax.text(10.3, 4.6, "each rank keeps\nits slice of Y's\nlast dimension:\nan elementwise\nGELU can run\non it directly",
            fontsize=8, ha="center", va="center")
    ax.text(6.0, 1.2, "backward: dX = dY$_1$ A$_1^T$ + dY$_2$ A$_2^T$  (a sum over ranks: one all-reduce)\n"
                      "dA$_r$ = X$^T$ dY$_r$ is local: exactly rank r's columns of dA",
            fontsize=8, ha="center", va="center")
    ax.text(6.0, 0.3, "stored as W = A$^T$ [out, in]: rank r holds ROWS of W, [f/tp, h]",
            fontsize=8, ha="center", va="center", style="italic")

    # ---- row-parallel: A [f, h] = [A_1; A_2]; Z = X_1 A_1 + X_2 A_2 ----------------------
    ax = right
    ax.set_title("row-parallel (linear_proj, linear_fc2)\n"
                 "A = [A$_1$; A$_2$] split by rows: Z = X$_1$A$_1$ + X$_2$A$_2$, one all-reduce forward",
                 fontsize=9)
    _block(ax, 0.2, 2.0, 1.1, 3.2, RANK_COLORS[0], "X$_1$\n[bs,\nf/tp]", 8)
    _block(ax, 1.3, 2.0, 1.1, 3.2, RANK_COLORS[1], "X$_2$\n[bs,\nf/tp]", 8)
    ax.text(2.75, 3.6, "×", fontsize=14, ha="center", va="center")
    _block(ax, 3.1, 3.6, 1.6, 1.6, RANK_COLORS[0], "A$_1$ [f/tp, h]", 7.5)
    _block(ax, 3.1, 2.0, 1.6, 1.6, RANK_COLORS[1], "A$_2$ [f/tp, h]", 7.5)
    ax.text(5.1, 3.6, "→", fontsize=14, ha="center", va="center")
    _block(ax, 5.5, 4.0, 1.5, 1.2, RANK_COLORS[0], "X$_1$A$_1$ [bs, h]\npartial", 7)
    _block(ax, 5.5, 2.0, 1.5, 1.2, RANK_COLORS[1], "X$_2$A$_2$ [bs, h]\npartial", 7)
    _arrow(ax, 7.05, 4.6, 8.15, 3.75)
    _arrow(ax, 7.05, 2.6, 8.15, 3.45)
    ax.text(7.7, 3.6, "all-reduce\n(sum)", fontsize=7.5, ha="center", va="center",
            bbox=dict(boxstyle="round", fc="white", ec="black", lw=0.6))
    _block(ax, 8.3, 3.0, 1.5, 1.2, REPL, "Z [bs, h]\nsame on\nevery rank", 7)
    ax.text(10.1, 3.6, "+ b", fontsize=10, ha="left", va="center")
    ax.text(10.9, 2.6, "bias once,\nAFTER the\nall-reduce", fontsize=7.5, ha="center", va="center")
    ax.text(6.0, 1.2, "backward: each rank gets the full dZ (identity); dX$_r$ = dZ A$_r^T$ and\n"
                      "dA$_r$ = X$_r^T$ dZ are local; the bias gradient is the same on every rank",
            fontsize=8, ha="center", va="center")
    ax.text(6.0, 0.3, "stored as W = A$^T$ [out, in]: rank r holds COLUMNS of W, [h, f/tp]",
            fontsize=8, ha="center", va="center", style="italic")
    fig.suptitle("Splitting Y = X A over tp = 2 ranks (colour = the rank that holds the block; grey = on every rank)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "column_row_split.png", dpi=100)
    plt.close(fig)


def plot_tp_layer() -> None:
    fig, ax = plt.subplots(figsize=(14, 5.2))
    ax.set_xlim(0, 28.4)
    ax.set_ylim(0, 10)
    ax.axis("off")
    mid, up, dn = 5.0, 7.0, 3.0           # y of the replicated lane and of the two rank lanes

    def op(x, y, w, text, color, h=1.3, fs=7.0):
        _block(ax, x, y - h / 2, w, h, color, text, fs)

    def fg(x, name, fwd, bwd, side):
        ax.add_patch(FancyBboxPatch((x - 0.45, mid - 0.45), 0.9, 0.9, boxstyle="circle,pad=0.05",
                                    fc="#FFE9A8", ec="black", lw=1.0))
        ax.text(x, mid, name, ha="center", va="center", fontsize=7.5 if len(name) <= 4 else 6.3, fontweight="bold")
        dx = -0.2 if side == "left" else -0.3               # "right": under the circle, clear of the residual
        ax.text(x + dx, mid - 0.7, f"fwd: {fwd}\nbwd: {bwd}", ha="right" if side == "left" else "left",
                va="top", fontsize=6.5)

    def residual(x0, x1, y_box_bottom):
        ax.plot([x0, x0, x1], [mid, 1.15, 1.15], color="#555555", lw=1.0, ls=":")
        _arrow(ax, x1, 1.15, x1, y_box_bottom, color="#555555", ls=":")

    # input and first norm (replicated)
    ax.text(0.45, mid + 0.35, "x [b, s, h]", fontsize=7, ha="center", va="bottom")
    _arrow(ax, 0.1, mid, 1.0, mid)
    op(1.0, mid, 1.6, "input_\nlayernorm", REPL)
    _arrow(ax, 2.6, mid, 3.15, mid)
    fg(3.6, "copy", "identity", "all-reduce dx", "left")
    for lane, y in ((0, up), (1, dn)):                       # attention, one lane per rank
        c = RANK_COLORS[lane]
        _arrow(ax, 4.05, mid, 4.6, y)
        op(4.6, y, 2.2, "linear_qkv (col)\nW [(a+2g)d/tp, h]", c)
        _arrow(ax, 6.8, y, 7.1, y)
        op(7.1, y, 2.7, f"rank {lane}'s attention\n[b, a/tp, s, d],\ng/tp whole KV groups", c, h=1.5)
        _arrow(ax, 9.8, y, 10.1, y)
        op(10.1, y, 2.2, "linear_proj (row)\nW [h, ad/tp]", c)
        _arrow(ax, 12.3, y, 12.85, mid)
    fg(13.3, "reduce", "all-reduce", "identity", "right")
    _arrow(ax, 13.75, mid, 14.2, mid)
    op(14.2, mid, 1.1, "+ bias\n+ x", REPL)
    residual(0.45, 15.1, mid - 0.65)
    _arrow(ax, 15.3, mid, 15.7, mid)
    op(15.7, mid, 1.6, "pre_mlp_\nlayernorm", REPL)
    _arrow(ax, 17.3, mid, 17.85, mid)
    fg(18.3, "copy", "identity", "all-reduce dx", "left")
    for lane, y in ((0, up), (1, dn)):                       # MLP
        c = RANK_COLORS[lane]
        _arrow(ax, 18.75, mid, 19.3, y)
        op(19.3, y, 2.0, "linear_fc1 (col)\nW [f/tp, h]", c)
        _arrow(ax, 21.3, y, 21.6, y)
        op(21.6, y, 1.2, "GELU\n[b,s,f/tp]", c)
        _arrow(ax, 22.8, y, 23.1, y)
        op(23.1, y, 2.0, "linear_fc2 (row)\nW [h, f/tp]", c)
        _arrow(ax, 25.1, y, 25.55, mid)
    fg(26.0, "reduce", "all-reduce", "identity", "right")
    _arrow(ax, 26.45, mid, 26.9, mid)
    op(26.9, mid, 1.1, "+ bias\n+ x", REPL)
    residual(15.45, 27.8, mid - 0.65)

    ax.text(8.45, 9.3, "split region: each rank holds a/tp query heads and g/tp whole KV groups;\n"
                       "attention runs locally, no communication", ha="center", fontsize=8)
    ax.text(22.2, 9.3, "split region: each rank holds f/tp of the MLP's inner features\n"
                       "(SwiGLU: its f/tp gate rows and the matching f/tp up rows, stride 2)",
            ha="center", fontsize=8)
    for x0, x1 in ((4.3, 12.6), (19.0, 25.4)):
        ax.add_patch(Rectangle((x0, 1.6), x1 - x0, 6.9, fill=False, ls="--", lw=0.8, ec="grey"))
    ax.text(15.8, 7.6, "between the sub-layers the residual\nstream [b, s, h] is whole and identical\n"
                       "on every rank (dropout on it must\ndraw the same mask everywhere)",
            fontsize=7, ha="center", va="center")
    ax.text(14.2, 0.75, "dotted: the residual connections (replicated, no communication)", fontsize=7, ha="center")
    ax.text(0.1, 0.1, "grey = replicated on every TP rank (norms, row-parallel biases, the residual stream);  "
                      "blue / orange = rank 0 / rank 1.   Per layer: 2 all-reduces of [b, s, h] forward "
                      "(reduce, reduce), 2 backward (copy, copy).\n"
                      "Sizes: f = MLP inner size, g = key/value heads (as in chapter 00); "
                      "copy and reduce are the paper's f and g operators.", fontsize=8)
    ax.set_title("One transformer layer under tensor parallelism (tp = 2): Megatron's copy and reduce operators",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "tp_layer.png", dpi=100)
    plt.close(fig)


def plot_tp_dp_grid() -> dict:
    """16 ranks = 2 nodes x 8 GPUs, tp = 4, dp = 4; groups from rank_groups for two orders."""
    world, tp, per_node = 16, 4, 8
    orders = [("tp-cp-ep-dp-pp", "Megatron's default order: tp fastest (rank = tp_rank + 4 dp_rank)"),
              ("dp-cp-ep-tp-pp", "tp slowest (rank = dp_rank + 4 tp_rank): the wrong way round")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    summary = {}
    for ax, (order, title) in zip(axes, orders):
        groups = parallel_state.rank_groups(world, tp=tp, order=order)
        summary[order] = {"tp": groups["tp"], "dp": groups["dp"]}
        tp_of = {r: i for i, g in enumerate(groups["tp"]) for r in g}
        # lay the ranks out as the machine has them: node n holds ranks 8n .. 8n+7, in 2 rows of 4
        pos = {r: ((r % per_node) % 4, 3 - (r // per_node) * 2 - (r % per_node) // 4) for r in range(world)}
        cross = sum(len({r // per_node for r in g}) > 1 for g in groups["tp"])
        for r, (x, y) in pos.items():
            _block(ax, x * 1.4 + 0.2, y * 1.25 + 0.2, 1.1, 0.95, RANK_COLORS[tp_of[r]], "", alpha=0.75)
            ax.text(x * 1.4 + 0.75, y * 1.25 + 0.77, str(r), ha="center", va="center", fontsize=11,
                    fontweight="bold")
            ax.text(x * 1.4 + 0.75, y * 1.25 + 0.42, f"TP g{tp_of[r]}", ha="center", va="center", fontsize=6.5)
        for n in range(2):
            ax.add_patch(Rectangle((0.05, (1 - n) * 2.5 + 0.08), 5.65, 2.45, fill=False, lw=1.6, ec="black"))
            ax.text(5.85, (1 - n) * 2.5 + 1.3, f"node {n}\n8 GPUs\nNVLink", fontsize=8, va="center")
        # dp group of rank 0: a line through its members
        dp0 = next(g for g in groups["dp"] if 0 in g)
        xs = [pos[r][0] * 1.4 + 0.75 for r in dp0]
        ys = [pos[r][1] * 1.25 + 0.2 + 0.95 / 2 for r in dp0]
        ax.plot(xs, ys, "k:", lw=1.5, marker="o", ms=3)
        ax.set_xlim(0, 7.2)
        ax.set_ylim(0, 5.3)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{title}\nTP groups (colour): {groups['tp'][:2]} ...;  DP group of rank 0 "
                     f"(dotted): {dp0}\nTP groups crossing the node boundary: {cross} of {len(groups['tp'])}",
                     fontsize=8.5)
    fig.suptitle("16 ranks, tp = 4, dp = 4, on 2 nodes of 8 GPUs (groups from parallel_state.rank_groups)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(OUT / "tp_dp_grid.png", dpi=100)
    plt.close(fig)
    return summary


def plot_tp_memory(gpt2_small: dict[int, dict], big: dict[str, dict[int, dict]]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    tps = sorted(gpt2_small)
    x = list(range(len(tps)))
    split = [gpt2_small[t]["split"] * 2 / 2**20 for t in tps]          # bf16: 2 bytes
    repl = [gpt2_small[t]["replicated"] * 2 / 2**20 for t in tps]
    left.bar(x, split, color="#4C72B0", width=0.6, label="split: QKV, proj, fc1, fc2 weights (+ column biases),\n"
                                                         "word embedding = output layer (tied)")
    left.bar(x, repl, bottom=split, color="#C44E52", width=0.6,
             label="replicated: position embedding, norms,\nrow-parallel biases")
    for i, t in enumerate(tps):
        total = split[i] + repl[i]
        left.text(i, total + 4, f"{total:.0f} MiB\n({repl[i] / total:.1%} replicated)", ha="center", fontsize=7.5)
    left.set_xticks(x, [f"tp = {t}" for t in tps])
    left.set_ylabel("MiB of bf16 parameters per rank")
    left.set_ylim(0, max(s + r for s, r in zip(split, repl)) * 1.25)
    left.set_title("GPT-2 small shapes (124M parameters): parameter bytes per rank\n"
                   "= 2 (split / tp + replicated); the formula is checked on real shards", fontsize=9)
    left.legend(fontsize=7, loc="upper right")

    width = 0.38
    colors = {"llama2-7b": "#55A868", "llama2-70b": "#8172B2"}
    big_tps = sorted(next(iter(big.values())))
    x = list(range(len(big_tps)))
    for k, (name, rows) in enumerate(big.items()):
        vals = [rows[t]["per_rank"] * 16 / GiB for t in big_tps]
        xs = [i + (k - 0.5) * width for i in x]
        right.bar(xs, vals, width=width, color=colors[name], label=f"{name} shapes, 16 bytes/param")
        for xi, v in zip(xs, vals):
            right.text(xi, v * 1.08, f"{v:.0f}", ha="center", fontsize=7)
    right.axhline(80, color="black", ls="--", lw=1)
    right.text(len(big_tps) - 0.5, 86, "one 80 GiB GPU", ha="right", fontsize=8)
    right.set_yscale("log")
    right.set_xticks(x, [f"tp = {t}" for t in big_tps])
    right.set_ylabel("GiB per rank (log scale)")
    right.set_title("Model state per rank (bf16 weights + grads, fp32 master + Adam m, v)\n"
                    "vs tp; activations not included", fontsize=9)
    right.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(OUT / "tp_memory.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# the numbers the chapter quotes (booktools/measured.py: `make numbers CH=02` reruns RUNS,
# records measure()'s values in measured.json; the text's <!--m:key--> and <!--run:id-->
# markers are checked against it)
# ---------------------------------------------------------------------------------------
RUNS = {
    "figures": "python chapters/02_tp/make_figures.py",                                   # §4, §5, §8
    "demo": "torchrun --standalone --nproc_per_node=4 chapters/02_tp/demo.py --tp 2 --dp 2",  # §4's printout
}
MiB = 2**20


def _same_for_both_styles(ledger: dict, tp: int, direction: str) -> dict[str, int]:
    """The text gives one row for "GPT-2 and LLaMA": refuse to record it if they differ."""
    gpt2, llama = (ledger[f"tp{tp} {style} {direction}"] for style in STYLES)
    if gpt2 != llama:
        raise ValueError(f"tp={tp} {direction}: GPT-2 {gpt2} and LLaMA {llama} differ; "
                         "the text's table says they agree")
    return gpt2


def _ring_factor(tp: int) -> float:
    """Bytes one rank sends in a ring all-reduce over tp ranks, per byte handed in."""
    return ring_traffic(CommRecord("all_reduce", tuple(range(tp)), MiB, None, ())) / MiB


def _flops_per_byte(h: int, tp: int, e: int = 2) -> float:
    """A GPT-2 style layer's forward FLOPs per token over the bytes one rank sends for it (§4):
    24 h^2 / tp FLOPs against two ring all-reduces of h e bytes, 6h / ((tp - 1) e)."""
    return (24 * h * h / tp) / (2 * 2 * (tp - 1) / tp * h * e)


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    """Every number the chapter's README and notebook markdown quote that the code measures or
    computes, by marker key: the figures run's results (FiguresResults), or computed with the
    same functions (the notebook's own cells included)."""
    fig, v = results["figures"], {}

    # §3.3 padding a vocabulary (pad_vocab_size, vocab_range); README Q4, notebook §4, §7, Q3
    v |= {"vp_tp2": pad_vocab_size(257, 2), "vp_tp4": pad_vocab_size(257, 4),
          "vp_gpt2_tp1_megatron": pad_vocab_size(50257, 1, 128), "vp_gpt2_tp8_megatron": pad_vocab_size(50257, 8, 128),
          "vp_tp4_megatron": pad_vocab_size(257, 4, 128),
          "padding_ranks_first_id": vocab_range(pad_vocab_size(257, 4, 128), 2, 4)[0],
          "padding_ranks_last_id": vocab_range(pad_vocab_size(257, 4, 128), 3, 4)[1] - 1,
          "tp4_rank3_first_id": vocab_range(pad_vocab_size(257, 4), 3, 4)[0],
          "tp4_rank3_last_id": vocab_range(pad_vocab_size(257, 4), 3, 4)[1] - 1}
    vp8 = pad_vocab_size(50257, 8, 128)
    v |= {"vp_gpt2_tp8_rows_per_rank": vocab_range(vp8, 0, 8)[1], "vp_gpt2_tp8_padding_rows": vp8 - 50257}

    # §4 the ledger of one forward + backward of the tiny models, vs the formula
    for tp in (2, 4):
        fwd, bwd = (_same_for_both_styles(fig["ledger"], tp, d) for d in ("fwd", "bwd"))
        v |= {f"ledger_tp{tp}_fwd_calls": fwd["calls"], f"ledger_tp{tp}_fwd_bytes": fwd["bytes"],
              f"ledger_tp{tp}_bwd_calls": bwd["calls"], f"ledger_tp{tp}_bwd_bytes": bwd["bytes"],
              f"ledger_tp{tp}_ring_bytes": fwd["ring"] + bwd["ring"]}
    v["ledger_ring_tp4_over_tp2"] = v["ledger_tp4_ring_bytes"] / v["ledger_tp2_ring_bytes"]
    v["ledger_formula_bytes"] = sum(sum(x) for x in tp_ledger_formula(STYLES["gpt2"](), B, S, E).values())
    for style in STYLES:                    # the text: one loss, on one device and at tp = 2 and 4
        one, tp2, tp4 = (fig["losses"][style][k] for k in ("one device", "tp2", "tp4"))
        if not one == tp2 == tp4:
            raise ValueError(f"{style}: mean losses {one}, {tp2}, {tp4} differ; the text says they are the same")
        v[f"loss_{style}"] = one
    for tp in (2, 4, 8):                    # a ring all-reduce's bytes sent per byte handed in
        v[f"ring_factor_tp{tp}"] = _ring_factor(tp)
    for name, h, tps in (("gpt2_small", 768, (4, 6)), ("gpt3", 12288, (4, 8))):   # §4, notebook §6's printout
        v |= {f"flops_per_byte_{name}_tp{tp}": _flops_per_byte(h, tp) for tp in tps}

    # §4 at real size: GPT-2 small, b = 1, s = 1024, bf16
    real = fig["real"]
    v |= {"real_fwd_calls": real["fwd_calls"], "real_bwd_calls": real["bwd_calls"],
          "real_handed_mib": real["handed_mib"],
          **{f"real_ring_tp{tp}_mib": real[f"ring_tp{tp}_mib"] for tp in (2, 4, 6)}}
    gpt2_small, _ = real_model_config("gpt2-small")
    v["gpt2_small_grad_mib"] = count_parameters(gpt2_small)["total"] * 2 / MiB

    # §5 parameters per rank, measured on every rank of the 4-rank world
    for style in STYLES:
        v[f"params_{style}_one_device"] = fig["params"][f"{style} tp1"]["per_rank"]
        for tp in (2, 4):
            row = fig["params"][f"{style} tp{tp}"]
            v |= {f"params_{style}_tp{tp}_{k}": n for k, n in row.items() if k != "Vp"}
    v["params_gpt2_tp2_both_ranks"] = 2 * v["params_gpt2_tp2_per_rank"]
    v["params_gpt2_tp2_padding_both_ranks"] = 2 * tensor_parallel_parameters(STYLES["gpt2"](), 2)["padding"]

    # Figure 3: GPT-2 small's shapes per rank (bf16), LLaMA-2 7B and 70B model state per rank
    small = fig["gpt2_small"]
    v |= {"gpt2_small_params": small["tp1"]["per_rank"], "gpt2_small_replicated": small["tp1"]["replicated"]}
    for tp in (1, 2, 3, 4, 6):
        v |= {f"gpt2_small_tp{tp}_mib": small[f"tp{tp}"]["mib"],
              f"gpt2_small_tp{tp}_replicated_pct": small[f"tp{tp}"]["replicated_pct"]}
    v["gpt2_small_position_table"] = count_parameters(gpt2_small)["position_embedding"]
    for name in ("llama2-7b", "llama2-70b"):
        for tp in (1, 2, 4, 8):
            v[f"{name.replace('-', '_')}_tp{tp}_gib"] = fig["state_gib"][name][f"tp{tp}"]

    # §5 activations saved per rank (b = 4, s = 16, float32), the same on every rank
    if fig["activations_differ"]:
        raise ValueError("the activation bytes differ between ranks; the text says they are the same on every rank")
    for style in STYLES:
        one = v[f"acts_{style}_tp1"] = fig["activations"][style]["tp1"]
        for tp in (2, 4):
            v[f"acts_{style}_tp{tp}"] = fig["activations"][style][f"tp{tp}"]
            v[f"acts_{style}_tp{tp}_ratio"] = v[f"acts_{style}_tp{tp}"] / one

    # §8 one training step of TP 2 x DP 2 (rank 0)
    for tag in ("fwd", "bwd", "grads", "grad-norm"):
        row = next(r for r in fig["step"] if r["op"] == "all_reduce" and r["tag"] == tag)
        v |= {f"step_{tag.replace('-', '_')}_{k}": row[k] for k in ("calls", "bytes")}
    v["step_params"] = fig["step_params"]

    # notebook §7, §8: the tiny LLaMA model of the notebook's runs (demo.tiny_model: h = 32, L = 2)
    demo = import_chapter("02")
    v["tiny_llama_replicated"] = tensor_parallel_parameters(demo.tiny_model("llama"), 2)["replicated"]
    shares = [100 * c["replicated"] / c["per_rank"]                  # notebook §7: tp = 1 ... 12
              for c in (tensor_parallel_parameters(gpt2_small, k) for k in (1, 12))]
    v |= {"gpt2_small_tp1_share_pct": shares[0], "gpt2_small_tp12_share_pct": shares[1]}

    # the questions (README §13, notebook's end): GPT-3's layer, and the buggy norm
    gpt3_allreduce = 1 * 2048 * 12288 * 2                           # [b, s, h] in bf16
    v |= {"q_gpt3_allreduce_mib": gpt3_allreduce / MiB, "q_gpt3_layer_fwd_mib": 2 * gpt3_allreduce / MiB,
          "q_gpt3_ring_mib": 2 * gpt3_allreduce * _ring_factor(8) / MiB}
    big = ModelConfig.llama(hidden_size=4096, num_attention_heads=32, num_query_groups=8)
    v["q_qkv_rows_tp8"] = (32 + 2 * 8) * big.kv_channels // 8
    wrong = math.sqrt(1 + (4 - 1) * 0.01)
    v |= {"q_wrong_norm": wrong, "q_smaller_update_pct": 100 * (1 - 1 / wrong)}
    return {key: float(value) if isinstance(value, float) and not value.is_integer() else int(value)
            for key, value in v.items()}


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def fmt(n: float) -> str:
    return f"{n:,.0f}"


@dataclass
class FiguresResults:
    """The numbers main printed (rank 0's where ranks agree), keyed as printed; floats rounded
    to the digits printed."""
    exit_code: int = 0
    ledger: dict = field(default_factory=dict)       # "tp2 gpt2 fwd": {calls, bytes, formula, ring}
    losses: dict = field(default_factory=dict)       # style: {"one device", "tp2", "tp4"}
    step: list = field(default_factory=list)         # one TP=2 x DP=2 step: {op, ranks, tag, calls, bytes}
    step_params: int = 0
    params: dict = field(default_factory=dict)       # "gpt2 tp2": {Vp, split, replicated, per_rank}
    activations: dict = field(default_factory=dict)  # style: {"tp1": bytes, ...} (the largest over ranks)
    activations_differ: bool = False
    gpt2_small: dict = field(default_factory=dict)   # "tp1": {Vp, split, replicated, per_rank, mib, replicated_pct}
    state_gib: dict = field(default_factory=dict)    # "llama2-7b": {"tp1": GiB of model state per rank, ...}
    real: dict = field(default_factory=dict)         # GPT-2 small's all-reduces per micro-batch


def main(argv=None) -> FiguresResults:
    found = FiguresResults()
    plt.switch_backend("Agg")       # a script: no screen (importing this file leaves the backend alone)
    OUT.mkdir(parents=True, exist_ok=True)
    plot_column_row_split()
    plot_tp_layer()
    grid = plot_tp_dp_grid()
    print("== rank_groups(16, tp=4): the first TP and DP groups")
    for order, groups in grid.items():
        print(f"  order {order}: tp {groups['tp'][:2]} ...  dp {groups['dp'][:2]} ...")

    per_rank = spawn(tp_rank, 4, timeout=300)

    # ---- 1. the ledger of one forward + backward vs the formula -------------------------
    print(f"\n== one forward + backward of the TP model (apply_tensor_parallel), b={B} s={S}, float32 "
          "(every rank; bytes handed to the collectives)")
    print(f"{'tp':>3} {'style':<6}{'dir':<5}{'all-reduces':>12}{'bytes':>9}{'formula':>9}"
          f"{'ring bytes/rank':>17}   shapes")
    for (tp, style) in per_rank[0]["ledger"]:
        cfg = STYLES[style]()
        expected = tp_ledger_formula(cfg, B, S, E)
        for direction in ("fwd", "bwd"):
            for r, result in enumerate(per_rank):
                recs = result["ledger"][(tp, style)][direction]
                got = sorted(nb for op, tag, nb, n, _ in recs if op == "all_reduce" and tag == direction and n == tp)
                if len(recs) != len(got) or got != sorted(expected[direction]):
                    print(f"MISMATCH rank {r} tp={tp} {style} {direction}: {recs}\n expected {expected[direction]}",
                          file=sys.stderr)
                    return FiguresResults(1)
            recs = per_rank[0]["ledger"][(tp, style)][direction]
            ring = round(sum(2 * (tp - 1) / tp * x[2] for x in recs))     # a ring all-reduce
            row = found.ledger[f"tp{tp} {style} {direction}"] = {
                "calls": len(recs), "bytes": sum(x[2] for x in recs), "formula": sum(expected[direction]), "ring": ring}
            shapes = {}
            for *_, shape in recs:
                shapes[shape] = shapes.get(shape, 0) + 1
            print(f"{tp:>3} {style:<6}{direction:<5}{row['calls']:>12}{fmt(row['bytes']):>9}"
                  f"{fmt(row['formula']):>9}{fmt(ring):>17}   "
                  + ", ".join(f"{c} x {list(s)}" for s, c in shapes.items()))
    print("ledger == formula on every rank, for tp = 2 and 4, both styles")
    losses = {k: v["loss"] for k, v in per_rank[0]["ledger"].items()}
    for style, make in STYLES.items():
        cfg = make()
        batch = make_batches(cfg, 1, B, S, seed=0)[0]
        ref = GPTModel(cfg)(batch["tokens"], labels=batch["labels"]).detach().mean().item()
        loss = found.losses[style] = {"one device": round(ref, 7), "tp2": round(losses[(2, style)], 7),
                                      "tp4": round(losses[(4, style)], 7)}
        print(f"  {style}: mean loss one device {loss['one device']:.7f}; tp=2 {loss['tp2']:.7f}; "
              f"tp=4 {loss['tp4']:.7f}")

    # ---- 2. one TP=2 x DP=2 training step ---------------------------------------------------
    r0 = per_rank[0]
    print(f"\n== one training step, TP=2 x DP=2 (LLaMA style, b={B} per DP rank, s={S}); rank 0's "
          f"groups: tp {r0['step_groups']['tp']}, dp {r0['step_groups']['dp']}")
    rows: dict[tuple, list] = {}
    for op, tag, nbytes, ranks in r0["step"]:
        row = rows.setdefault((op, tag, ranks), [0, 0])
        row[0] += 1
        row[1] += nbytes
    for (op, tag, ranks), (calls, nbytes) in rows.items():
        found.step.append({"op": op, "ranks": list(ranks), "tag": tag, "calls": calls, "bytes": nbytes})
        print(f"  {op:<11}{str(list(ranks)):<9}{tag:<10}{calls:>3} calls {fmt(nbytes):>9} bytes")
    found.step_params = r0["step_params"]
    print(f"  this rank's parameters: {fmt(r0['step_params'])} elements = "
          f"{fmt(r0['step_params'] * E)} bytes (the DP all-reduce)")
    for r, res in enumerate(per_rank):
        grads = [nb for op, tag, nb, ranks in res["step"] if tag == "grads"]
        assert grads == [res["step_params"] * E], (r, grads)
        norm = [(nb, list(ranks)) for op, tag, nb, ranks in res["step"] if tag == "grad-norm"]
        assert norm == [(E, res["step_groups"]["tp"])], (r, norm)    # one number, TP group only

    # ---- 3. parameters per rank: real shards vs the formula ---------------------------------
    print("\n== parameters per rank (elements): measured on every rank vs tp_parameter_counts")
    print(f"{'style':<7}{'tp':>3}{'Vp':>5}{'split/tp':>10}{'replicated':>11}{'per rank':>10}{'formula':>10}"
          f"{'one device':>11}")
    for style, make in STYLES.items():
        cfg = make()
        found.params[f"{style} tp1"] = {"per_rank": count_parameters(cfg)["total"]}
        print(f"{style:<7}{1:>3}{cfg.vocab_size:>5}{'':>10}{'':>11}{'':>10}{'':>10}"
              f"{fmt(found.params[f'{style} tp1']['per_rank']):>11}")
        for tp in (2, 4):
            f = tp_parameter_counts(cfg, tp)
            for r, res in enumerate(per_rank):
                split, repl = res["params"][(tp, style)]
                if (split, repl) != (f["split"], f["replicated"]):
                    print(f"MISMATCH rank {r} {style} tp={tp}: {(split, repl)} vs formula "
                          f"{(f['split'], f['replicated'])}", file=sys.stderr)
                    return FiguresResults(1)
            split, repl = per_rank[0]["params"][(tp, style)]
            found.params[f"{style} tp{tp}"] = {"Vp": f["Vp"], "split": split, "replicated": repl,
                                               "per_rank": split + repl}
            print(f"{style:<7}{tp:>3}{f['Vp']:>5}{fmt(split):>10}{fmt(repl):>11}{fmt(split + repl):>10}"
                  f"{fmt(f['per_rank']):>10}")
    print("parameters == formula on every rank")

    # ---- 4. activations saved per rank ------------------------------------------------------
    print(f"\n== activation bytes saved for backward per rank (b={ACT_B}, s={ACT_S}, float32; "
          "saved-tensor hooks)")
    for style, make in STYLES.items():
        cfg = make()
        act = make_batches(cfg, 1, ACT_B, ACT_S, seed=1)[0]
        one = measure_saved_activation_bytes(GPTModel(cfg), act["tokens"], act["labels"])
        found.activations[style] = {"tp1": one}
        cells = [f"tp=1 {fmt(one)}"]
        for tp in (2, 4):
            vals = {res["acts"][(tp, style)] for res in per_rank}
            v = found.activations[style][f"tp{tp}"] = max(vals)
            found.activations_differ |= len(vals) > 1
            cells.append(f"tp={tp} {fmt(v)} ({v / one:.2f} x){'' if len(vals) == 1 else ' (ranks differ)'}")
        print(f"  {style:<6}" + ";  ".join(cells))

    # ---- 5. real-size models, from the formula ---------------------------------------------
    gpt2_small_cfg, _ = real_model_config("gpt2-small")
    tps = (1, 2, 3, 4, 6)           # the divisors of its 12 heads up to 6 (tp = 8 cannot split them)
    gpt2_small = {t: tp_parameter_counts(gpt2_small_cfg, t) for t in tps}
    print("\n== GPT-2 small shapes (h 768, L 12, a 12, V 50257, P 1024, tied), parameters per rank")
    print(f"{'tp':>3}{'Vp':>7}{'split/tp':>13}{'replicated':>12}{'per rank':>13}{'bf16 MiB':>10}{'repl. share':>12}")
    for t in tps:
        f = gpt2_small[t]
        row = found.gpt2_small[f"tp{t}"] = {**{k: f[k] for k in ("Vp", "split", "replicated", "per_rank")},
                                            "mib": round(f["per_rank"] * 2 / 2**20, 1),
                                            "replicated_pct": round(f["replicated"] / f["per_rank"] * 100, 2)}
        print(f"{t:>3}{f['Vp']:>7}{fmt(f['split']):>13}{fmt(f['replicated']):>12}{fmt(f['per_rank']):>13}"
              f"{row['mib']:>10.1f}{row['replicated_pct']:>11.2f}%")
    f = gpt2_small[1]
    print(f"  (tp=1 count {fmt(f['per_rank'])} = count_parameters {fmt(f['total'])})")
    megatron = dataclasses.replace(gpt2_small_cfg, make_vocab_size_divisible_by=128)
    print("  with Megatron's default --make-vocab-size-divisible-by 128: "
          + ", ".join(f"tp={t} Vp={tp_parameter_counts(megatron, t)['Vp']} "
                      f"({fmt(tp_parameter_counts(megatron, t)['padding'])} padding elements per rank)" for t in tps))
    big, big_tps = {}, (1, 2, 4, 8)
    for name in ("llama2-7b", "llama2-70b"):
        cfg, _ = real_model_config(name)
        big[name] = {t: tp_parameter_counts(cfg, t) for t in big_tps}
        gib = found.state_gib[name] = {f"tp{t}": round(big[name][t]["per_rank"] * 16 / GiB, 1) for t in big_tps}
        print(f"  {name}: model state (16 bytes/param) per rank: "
              + ", ".join(f"tp={t} {gib[f'tp{t}']:.1f} GiB" for t in big_tps)
              + f"; replicated {fmt(big[name][1]['replicated'])} params")
    plot_tp_memory(gpt2_small, big)

    # ---- 6. the communication formula at real size ------------------------------------------
    print("\n== TP all-reduces per micro-batch, GPT-2 small shapes, b=1, s=1024, bf16 (e=2)")
    cfg = gpt2_small_cfg
    form = tp_ledger_formula(cfg, 1, 1024, 2)
    handed = sum(form["fwd"]) + sum(form["bwd"])
    found.real = {"fwd_calls": len(form["fwd"]), "bwd_calls": len(form["bwd"]), "handed_mib": round(handed / 2**20, 1)}
    for t in (2, 4, 6):
        ring = found.real[f"ring_tp{t}_mib"] = round(2 * (t - 1) / t * handed / 2**20, 1)
        print(f"  tp={t}: {len(form['fwd'])} + {len(form['bwd'])} all-reduces, {found.real['handed_mib']:.1f} MiB "
              f"handed in, ring {ring:.1f} MiB sent per rank")

    for path in sorted(OUT.glob("*.png")):
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB")
    return found


if __name__ == "__main__":
    sys.exit(main().exit_code)
