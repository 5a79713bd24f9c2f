"""The figures of chapter 01, from real multi-rank runs, and the tables the chapter quotes.

    python chapters/01_dp/make_figures.py          # about 30 s on 2 cores; writes figures/*.png
    python chapters/01_dp/make_figures.py --out /tmp/figs      # somewhere else

Two spawned gloo worlds (minimegatron.launch.spawn), each step the training loop's
(`train.train_step`, the chapter demo's with its forward and backward written out):

  2 ranks   the benchmark's model (LLaMA style, h=256, L=4, 2.9M parameters, s=128, b=4 per
            rank) under DistributedDataParallel, buckets of 500,000 elements, 2 warm-up and 7
            recorded steps with overlap, the same without; each figure shows the step of median
            length (the script prints min / median / max of all 7):
              ddp_timeline.png             backward and each bucket's all-reduce (overlapped)
              ddp_timeline_no_overlap.png  the same buckets, all-reduced after backward
  4 ranks   the tests' tiny LLaMA (h=32, L=2, 39,648 parameters, float32), one training step
            (b=2 per rank, s=16) with each variant of the chapter: naive DP, DDP (one bucket,
            Megatron's default size; and buckets of 4,000 elements), ZeRO-1, ZeRO-2 (also with
            buckets of 4,000 elements), ZeRO-3 (M=1 and M=2 micro-batches), run and judged by
            the chapter's demo (chapters/01_dp/demo.py: run_variants, expected_ledger,
            expected_memory). It prints
              * the communication ledger of the step next to the chapter's formula (and stops
                with an error if they differ), with the ring-algorithm bytes each rank sends;
              * the bytes each rank holds for parameters, gradients and optimizer state,
                measured on the real tensors (and stops unless they equal the layout's), next
                to analysis.memory.training_memory;
            and draws
              zero_memory.png              those bytes per ZeRO stage, and the same formula
                                           for a 7B model on 64 ranks (bf16 + fp32 master)
              zero3_memory_profile.png     ZeRO-3's parameter bytes at every gather and free
                                           of one step (FullyShardedDataParallel.memory_profile)

Timings in the timeline figures change from run to run (a shared 2-core machine); the
ledger and the memory bytes do not.

`make numbers CH=01` (python -m booktools.measured record 01) runs this script as the chapter's
one recorded run (RUNS), keeps its printout in measured.json with what measure() reads off it
and computes, and rewrites the numbers the README and the notebook's markdown quote.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import os
import torch
import torch.distributed as dist

from minimegatron.analysis import (GiB, adam_bytes_per_parameter, count_parameters, real_model_config,
                                   training_memory)
from minimegatron.comm import CommRecord, ring_traffic
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dp import DistributedDataParallel, shard_range
from minimegatron.dp.fsdp import MemoryEvent
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.optim import Optimizer
from minimegatron.parallel_state import Layout
from booktools.demo import import_chapter
from booktools.measured import RoundOff, claim
from minimegatron.testing import TOLERANCES, make_batches
from minimegatron.train import train_step
from minimegatron.dp.timeline import BucketTimeline
from minimegatron.viz import new_figure

ch01 = import_chapter("01")      # the chapter's experiment: variants, runs, formulas

OUT = Path(__file__).resolve().parent / "figures"

# ---------------------------------------------------------------------------------------
# the runs
# ---------------------------------------------------------------------------------------
TIMELINE_MODEL = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2,
                      max_position_embeddings=128, params_dtype="float32")
TIMELINE_B, TIMELINE_S, TIMELINE_BUCKET = 4, 128, 500_000          # bucket in elements
TIMELINE_STEPS = 7                    # recorded steps per mode; the figure shows the median one

TINY_B, TINY_S, SMALL_BUCKET = 2, 16, 4_000                         # SMALL_BUCKET in elements
VARIANTS = ["naive", "ddp", "ddp-4k", "zero1", "zero2", "zero2-4k", "zero3", "zero3-M2"]


def timeline_rank() -> dict:
    """DDP with overlap, then without: the timelines of TIMELINE_STEPS steps of each (spawn
    target: the new processes import it from this file)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(world=world, rank=rank, dp=world, dp_rank=rank, dp_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, 257, (TIMELINE_B, TIMELINE_S + 1), generator=g)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:]}
    cfg = TrainConfig(seq_length=TIMELINE_S, micro_batch_size=TIMELINE_B, lr=1e-4, progress=False)
    out = {}
    for overlap in (True, False):
        model = GPTModel(ModelConfig.llama(**TIMELINE_MODEL))
        ddp = DistributedDataParallel(model, layout.dp_group, bucket_size_bytes=4 * TIMELINE_BUCKET, overlap=overlap)
        opt = Optimizer([ddp], cfg)
        recorded = []
        for step in range(2 + TIMELINE_STEPS):   # the first 2 warm up the allocator and AdamW
            train_step([ddp], opt, [batch], layout, 1e-4)
            if step >= 2:
                recorded.append(ddp.timeline)
        out[overlap] = {"timelines": recorded, "buckets": [b.names for b in ddp.buckets]}
    return out


def tiny_variant(name: str):
    """One step of `name` (VARIANTS) on the tiny LLaMA in float32, as a chapter-demo Variant:
    "-4k" buckets of SMALL_BUCKET elements (else Megatron's default for DDP, one bucket per
    weight-decay group for ZeRO), "-M2" two micro-batches."""
    kind = name.split("-")[0]
    return ch01.make_variant(kind, ch01.tiny_model("llama", "float32"), name=name, steps=1,
                             micro_batches=2 if name.endswith("-M2") else 1, micro_batch_size=TINY_B,
                             seq_length=TINY_S, bucket_size=SMALL_BUCKET if name.endswith("-4k") else None,
                             clip_grad=1.0)


def step_ledger(record: dict) -> list[tuple[str, int, str]]:
    """The (op, bytes, tag) of every collective of the record's first step, all phases."""
    return [call for phase in record["ledger"][0] for call in phase]


def ring_bytes(calls, dp: int) -> float:
    """Bytes one rank sends for these calls with ring algorithms (comm.ring_traffic)."""
    return sum(ring_traffic(CommRecord(op, tuple(range(dp)), nbytes, None, ())) for op, nbytes, _ in calls)


def summarize(rows) -> dict[tuple[str, str], list[int]]:
    """{(op, tag): [calls, bytes]}."""
    out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for op, nbytes, tag, *_ in rows:
        out[(op, tag)][0] += 1
        out[(op, tag)][1] += nbytes
    return dict(out)


# ---------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------
COLORS = {"params": "#4C72B0", "grads": "#55A868", "optimizer": "#C44E52", "master": "#8172B2"}


def plot_zero_memory(measured: dict[int, dict], formula: dict[int, dict], n_tiny: int, dp: int, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seven_b, _ = real_model_config("llama2-7b")
    big = {s: training_memory(seven_b, master_weights=True, zero_stage=s, dp=64) for s in range(4)}
    n_big = big[0]["num_parameters"]

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    x = list(range(4))
    labels = ["stage 0\n(DDP)", "stage 1\n(optimizer)", "stage 2\n(+ grads)", "stage 3\n(+ params)"]

    bottom = [0.0] * 4
    for kind, name in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "Adam m + v")):
        vals = [measured[s][kind] / 1024 for s in x]
        left.bar(x, vals, bottom=bottom, color=COLORS[kind], width=0.6, label=f"{name} (measured)")
        bottom = [b + v for b, v in zip(bottom, vals)]
    left.plot(x, [formula[s]["total"] / 1024 for s in x], "kD", ms=6, label="training_memory (formula)")
    for i, total in enumerate(bottom):
        left.text(i, total + 12, f"{total:,.0f}", ha="center", fontsize=8)
    left.set_xticks(x, labels, fontsize=8)
    left.set_ylabel("KiB per rank")
    left.set_ylim(0, max(bottom) * 1.15)
    left.set_title(f"tiny LLaMA, {n_tiny:,} params, fp32 AdamW, dp={dp}:\nmeasured bytes per rank "
                   "(rank 0) and the ZeRO formula", fontsize=9)
    left.legend(fontsize=7, loc="upper right")

    bottom = [0.0] * 4
    for kind, name in (("params", "bf16 parameters"), ("grads", "bf16 gradients"),
                       ("master_weights", "fp32 master"), ("adam", "Adam m + v (fp32)")):
        vals = [(big[s]["exp_avg"] + big[s]["exp_avg_sq"] if kind == "adam" else big[s][kind]) / GiB for s in x]
        color = {"params": COLORS["params"], "grads": COLORS["grads"], "master_weights": COLORS["master"],
                 "adam": COLORS["optimizer"]}[kind]
        right.bar(x, vals, bottom=bottom, color=color, width=0.6, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        right.text(i, total + 1.5, f"{total:,.1f} GiB", ha="center", fontsize=8)
    right.axhline(80, color="black", ls="--", lw=1)
    right.text(3.45, 82, "one 80 GiB GPU", ha="right", fontsize=8)
    right.set_xticks(x, labels, fontsize=8)
    right.set_ylabel("GiB per rank")
    right.set_ylim(0, max(bottom) * 1.15)
    right.set_title(f"LLaMA-2-7B shapes, {n_big / 1e9:.2f}B params, dp=64: 2+2+12 bytes/param\n"
                    "(formula; activations not included)", fontsize=9)
    right.legend(fontsize=7, loc="upper right")
    fig.suptitle("Model state per data-parallel rank, ZeRO stages 0-3", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "zero_memory.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def fmt(n: float) -> str:
    return f"{n:,.0f}"


# ---------------------------------------------------------------------------------------
# the figures (drawn from the records the code keeps; the notebook and the tests draw them too)
# ---------------------------------------------------------------------------------------
def plot_bucket_timeline(timeline: BucketTimeline, path: str | os.PathLike | None = None,
                         title: str | None = None, collective: str = "all-reduce"):
    """Draw backward and each bucket's all-reduce (dp.timeline.BucketTimeline) as bars on one
    time axis (milliseconds).

    Row "backward": 0 .. backward_end. Row "sync": finish_grad_sync. One row per bucket, in
    launch order: a bar from launch to completion (hatched where finish_grad_sync waited for
    it). `collective`: what each bucket runs (ZeRO's: "reduce-scatter"). Saves a PNG to `path`
    if given; returns the matplotlib Figure (Agg canvas).
    """
    events = timeline.buckets
    rows = ["backward", "finish_grad_sync"] + [f"bucket {e.bucket}" for e in events]
    fig = new_figure(figsize=(7.5, 1.3 + 0.38 * len(rows)), layout="constrained")
    ax = fig.subplots()
    ms = 1e3
    span = max(timeline.sync_end, timeline.backward_end, 1e-9)
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}      # first row on top
    ax.barh(y["backward"], timeline.backward_end * ms, left=0, height=0.6, color="tab:blue",
            label="backward (gradient computation)")
    ax.barh(y["finish_grad_sync"], (timeline.sync_end - timeline.sync_start) * ms,
            left=timeline.sync_start * ms, height=0.6, color="tab:gray", label="finish_grad_sync")
    hatched = False
    done = "done" if collective == "all-reduce" else "seen done"   # gloo's reduce-scatter: at the wait
    for e in events:
        end = e.completed if e.completed is not None else timeline.sync_end
        ax.barh(y[f"bucket {e.bucket}"], max(end - e.launched, 1e-6) * ms, left=e.launched * ms,
                height=0.6, color="tab:orange",
                label=f"{collective} (launch .. {done})" if e is events[0] else None)
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
    fig = new_figure(figsize=(max(6.0, 0.35 * len(profile)), 4))
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


# ---------------------------------------------------------------------------------------
# the numbers the chapter quotes (booktools/measured.py: `make numbers CH=01` reruns RUNS,
# records the printout and measure()'s values in measured.json, and checks the text's
# <!--m:key--> markers against them)
# ---------------------------------------------------------------------------------------
RUNS = {"figures": "python chapters/01_dp/make_figures.py"}
# The printout's lines that hold times (the bucket timelines' rows, the PNGs' sizes): a fresh run
# is compared with the record by their words only (tests/test_measured.py).
MACHINE_DEPENDENT = r"^\s+\d+\s+[\d,]+\s+[\d,]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$|\d KB$|launched during backward"

YEAR = 365.25 * 24 * 3600
def adamw_amplification(eps: float = 1e-8) -> dict:
    """Section 9, bug 7, measured in one process: the tiny LLaMA in float32, one batch of 4
    sequences (the float32 ZeRO-1 case of tests/test_dp_zero.py at dp = 4, seed 0). The
    whole batch's gradient against the mean of its 4 one-sequence slices (what averaging over 4
    ranks computes): at the element where AdamW's first update g / (|g| + eps) differs most,
    the gradient, the two gradients' difference, and the update's difference (a fraction of lr)."""
    cfg = ch01.tiny_model("llama", "float32")
    batch = make_batches(cfg, steps=1, batch_size=4, seq_length=16, seed=0)[0]

    params = dict(GPTModel(cfg).named_parameters())               # the same initial values as each model

    def gradients(rows: slice) -> dict[str, torch.Tensor]:
        model = GPTModel(cfg)
        model(batch["tokens"][rows], labels=batch["labels"][rows]).mean().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    whole, slices = gradients(slice(0, 4)), [gradients(slice(r, r + 1)) for r in range(4)]
    worst = {"update_diff": -1.0}
    for name, g in whole.items():
        mean = sum(s[name] / 4 for s in slices)                   # pre-scaled, then summed
        diff = (g / (g.abs() + eps) - mean / (mean.abs() + eps)).abs().flatten()
        i = int(diff.argmax())
        if diff[i] > worst["update_diff"]:
            worst = {"name": name, "grad": g.flatten()[i].item(), "update_diff": diff[i].item(),
                     "param": params[name].flatten()[i].item(),
                     "grad_diff": (g.flatten()[i] - mean.flatten()[i]).abs().item()}
    return worst


def measure(outputs: dict[str, list[str]], results: dict[str, dict | None]) -> dict[str, float]:
    """Every number chapter 01's README and notebook markdown quote that the code measures or
    computes, by marker key: the figures run's results (FiguresResults), or computed here with
    the same functions. Raises if a claim the text makes in words ("the same on every rank",
    "ZeRO-1 and ZeRO-2 send the same") no longer holds."""
    fig, v = results["figures"], {}
    cfg = ch01.tiny_model("llama", "float32")
    model, e, dp = GPTModel(cfg), 4, 4
    N = count_parameters(cfg)["total"]

    # the chapter's opening: chapter 00 section 5's GPT-3 175B, recomputed
    gpt3, _ = real_model_config("gpt3-175b")
    n3 = count_parameters(gpt3)["total"]
    v |= {"gpt3_years_a100_peak": 6 * n3 * 300e9 / 312e12 / YEAR, "gpt3_state_gpus_needed": -(-16 * n3 // (80 * GiB))}

    # 2. naive DP and the price of an all-reduce
    timeline_cfg = ModelConfig.llama(**TIMELINE_MODEL)
    seven_b, _ = real_model_config("llama2-7b")
    n7 = count_parameters(seven_b)["total"]
    ring64 = [ring_traffic(CommRecord("all_reduce", tuple(range(64)), n7 * b, None, ())) for b in (2, 4)]
    v |= {"tiny_params": N, "tiny_tensors": len(list(model.parameters())),
          "bench_tensors": len(list(GPTModel(timeline_cfg).parameters())), "tiny_grad_bytes": N * e,
          "tiny_ring_allreduce": ring_traffic(CommRecord("all_reduce", tuple(range(dp)), N * e, None, ())),
          "seven_b_params_b": n7 / 1e9, "seven_b_allreduce_bf16_gb": ring64[0] / 1e9,
          "seven_b_allreduce_fp32_gb": ring64[1] / 1e9}

    # Figure 1: the DDP timeline (times in ms: this run's, on this machine)
    v["timeline_params_m"] = count_parameters(timeline_cfg)["total"] / 1e6
    for overlap, prefix in ((True, "timeline"), (False, "timeline_no_overlap")):
        t = fig["timelines"]["overlap" if overlap else "no overlap"]
        v |= {f"{prefix}_{k}_ms": t[k] for k in ("step_min", "step_median", "step_max", "blocked",
                                                  "blocked_median", "backward", "step")}
        v |= {f"{prefix}_buckets": t["buckets"], f"{prefix}_launched_in_backward": t["launched_in_backward"]}
        if overlap:
            v |= {f"timeline_launch_{i}_ms": ms for i, ms in enumerate(t["launched"][:-1])}
            v["timeline_last_bucket"] = t["last_bucket"]

    # 5.1 and Figure 2: ZeRO's stages for LLaMA-2-7B's shapes on 64 ranks (bf16 + fp32 master)
    for s in range(4):
        v[f"zero_7b_stage{s}_gib"] = training_memory(seven_b, master_weights=True, zero_stage=s, dp=64)["total"] / GiB

    # 5.3 and 6: ZeRO-1/2's buckets and ZeRO-3's units of the tiny LLaMA; padding at dp = 3
    matrices, norms = ch01.zero_bucket_numels(model, None)
    units = ch01.zero3_unit_numels(model)
    S, S_norm = shard_range(matrices, 3, 0)[1], shard_range(norms, 3, 0)[1]
    v |= {"zero_matrix_bucket": matrices, "zero_norm_bucket": norms, "zero_dp3_S": S, "zero_dp3_norm_S": S_norm,
          "zero_dp3_padded": 3 * S, "zero_dp3_rank2_real": matrices - 2 * S,
          "zero3_unit_embedding": units["embedding"], "zero3_unit_layer": units["decoder.layers.0"],
          "zero3_unit_head": units["head"]}
    zero1_dp3 = ch01.make_variant("zero1", cfg, steps=1, micro_batch_size=TINY_B, seq_length=TINY_S,
                                 bucket_size=None)                      # one bucket per group
    layout = [ch01.expected_memory(zero1_dp3, 3, r) for r in range(3)]
    formula = training_memory(cfg, zero_stage=1, dp=3)
    if layout[0]["optimizer"] != layout[1]["optimizer"]:
        raise ValueError(f"section 6 says ranks 0 and 1 hold the same optimizer state at dp = 3: {layout}")
    v |= {"dp3_param_bytes": layout[0]["params"], "dp3_param_formula": formula["params"],
          "dp3_opt_rank0": layout[0]["optimizer"], "dp3_opt_rank1": layout[1]["optimizer"],
          "dp3_opt_rank2": layout[2]["optimizer"], "dp3_opt_formula": formula["optimizer"]}

    # 5.4: ZeRO-2's full gradients held during backward
    v |= {"zero2_grad_peak": fig["grad_peak"]["zero2"], "zero2_4k_grad_peak": fig["grad_peak"]["zero2-4k"]}

    # Figure 3: ZeRO-3's parameter bytes over one step, rank 0 ("fwd gather decoder.layers.0", ...)
    profile = fig["zero3_profile"]
    gathered = {label.split()[2]: g for label, _, g in profile if label.split()[1] == "gather"}
    peak = max(own + g for _, own, g in profile)
    own = {own for _, own, _ in profile}
    if len(own) != 1:
        raise ValueError(f"Figure 3's caption says rank 0's own shards are constant; the run printed {own}")
    v |= {"zero3_own_shards": own.pop(), "zero3_layer_gathered": gathered["decoder.layers.0"],
          "zero3_embedding_gathered": gathered["embedding"], "zero3_head_gathered": gathered["head"],
          "zero3_peak": peak, "zero3_peak_pct": 100 * peak / (N * e), "tiny_param_bytes": N * e}

    # 6: the ledger of one step, rank 0 (the printout), and ZeRO-3 against DP
    ledger, ring = fig["ledger"], fig["ring"]
    for variant, rows in ledger.items():
        for op_tag, (calls, nbytes) in rows.items():
            key = f"ledger_{variant}_{op_tag}".replace("-", "_").replace(" ", "_")
            v |= {f"{key}_calls": calls, f"{key}_bytes": nbytes}
    v |= {f"ring_{variant}".replace("-", "_"): sent for variant, sent in ring.items()}
    if ledger["zero1"] != ledger["zero2"]:
        raise ValueError("section 6's table has one row for ZeRO-1 and ZeRO-2; their ledgers now differ")
    v |= {"zero3_over_dp": ring["zero3"] / ring["ddp"], "embedding_share_pct": 100 * units["embedding"] / N,
          "embedding_share": units["embedding"] / N}

    # 6: bytes per rank, measured (the printout) and training_memory
    for s in range(4):
        memory = fig["memory"][f"stage{s}"]
        for kind in ("params", "grads", "optimizer"):
            low, high, _ = memory[kind]
            if low != high:
                raise ValueError(f"section 6 says the memory is the same on every rank; stage {s} {kind}: {low}..{high}")
            v[f"mem_stage{s}_{kind}"] = low
        v |= {f"mem_stage{s}_total": memory["total"][0], f"mem_stage{s}_formula": memory["total"][1]}

    # 9, bug 7: AdamW's amplification of a rounding difference, float32
    # (round-off: which element differs most, and by how much, is the kernels' summation order's)
    worst = adamw_amplification()
    lr, tol = TrainConfig().lr, TOLERANCES[torch.float32]
    v |= {"eps_grad": RoundOff(abs(worst["grad"])), "eps_grad_diff": RoundOff(worst["grad_diff"]),
          "eps_update_pct": RoundOff(100 * worst["update_diff"]), "eps_param_diff": RoundOff(lr * worst["update_diff"])}
    claim(abs(worst["grad"]) < 1e-8 and v["eps_param_diff"] > tol.atol + tol.rtol * abs(worst["param"]),
          "a gradient below eps moves its parameter beyond the float32 parameter tolerance")

    # the notebook's own cells: ZeRO-3 / DDP per micro-batch (3N - Vh) / 2N, its section 10
    # table at dp = 8 and its answers to Q1 and Q7
    def zero3_ratio(config: ModelConfig) -> float:
        c = count_parameters(config)
        return (3 * c["total"] - c["embedding"]) / (2 * c["total"])

    v |= {"nb_zero3_ratio_tiny": zero3_ratio(cfg), "nb_zero3_ratio_7b": zero3_ratio(seven_b),
          "nb_norm_ring_bytes": ring_traffic(CommRecord("all_reduce", tuple(range(4)), 8, None, ()))}
    for s in range(4):
        v[f"nb_7b_dp8_stage{s}_gb"] = training_memory(seven_b, param_dtype="bfloat16", master_weights=True,
                                                      zero_stage=s, dp=8)["total"] / 1e9
    per = adam_bytes_per_parameter("bfloat16", master_weights=True)
    p, g, K, psi = per["params"], per["grads"], per["optimizer"], 7e9
    for s, bytes_per in enumerate([p + g + K, p + g + K / 64, p + (g + K) / 64, (p + g + K) / 64]):
        v[f"nb_q1_stage{s}_gb"] = bytes_per * psi / 1e9
    lo, hi = shard_range(8224, 3, 2)
    v |= {"nb_q7_S": hi - lo, "nb_q7_padded": hi, "nb_q7_padding": hi - 8224}
    return {key: value if isinstance(value, RoundOff) else float(value) if isinstance(value, float) else int(value)
            for key, value in v.items()}


@dataclass
class FiguresResults:
    """The numbers main printed, as printed (milliseconds to the printed decimals): each DDP
    timeline ("overlap", "no overlap"), rank 0's ledger per variant ({"op tag": [calls, bytes]})
    and its ring bytes, the bytes per rank per ZeRO stage ({kind: [min, max, formula]}, "total":
    [measured, formula]), ZeRO-2's full-gradient peaks, ZeRO-3's profile ([label, own, gathered])."""
    exit_code: int = 0
    timelines: dict = field(default_factory=dict)
    ledger: dict = field(default_factory=dict)
    ring: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    grad_peak: dict = field(default_factory=dict)
    zero3_profile: list = field(default_factory=list)


def main(argv=None) -> FiguresResults:
    found = FiguresResults()
    parser = argparse.ArgumentParser(description="Chapter 01's figures and tables, from real multi-rank runs.")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write the figures (default {OUT})")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)

    # ---- 1. the DDP timeline, 2 ranks -------------------------------------------------
    timelines = spawn(timeline_rank, 2, timeout=300)
    for overlap, name in ((True, "ddp_timeline.png"), (False, "ddp_timeline_no_overlap.png")):
        recorded = timelines[0][overlap]["timelines"]
        by_length = sorted(recorded, key=lambda t: t.sync_end)
        tl = by_length[len(by_length) // 2]         # the step of median length, not the best one
        blocked = sorted(1e3 * (t.sync_end - t.sync_start) for t in recorded)
        totals = sorted(1e3 * t.sync_end for t in recorded)
        t = found.timelines["overlap" if overlap else "no overlap"] = {
            "step_min": round(totals[0], 0), "step_median": round(totals[len(totals) // 2], 0),
            "step_max": round(totals[-1], 0), "blocked_median": round(blocked[len(blocked) // 2], 1),
            "blocked": round(1e3 * (tl.sync_end - tl.sync_start), 1), "step": round(1e3 * tl.sync_end, 1),
            "backward": round(1e3 * tl.backward_end, 1), "buckets": len(tl.buckets),
            "launched_in_backward": len(tl.launched_during_backward()), "last_bucket": tl.buckets[-1].numel,
            "launched": [round(1e3 * e.launched, 2) for e in tl.buckets if e.launched is not None]}
        print(f"\n[rank 0, 2 ranks, {'overlap' if overlap else 'no overlap'}] "
              f"{len(timelines[0][overlap]['buckets'])} buckets; first: {timelines[0][overlap]['buckets'][0]}")
        print(f"{len(recorded)} steps: backward + finish_grad_sync {t['step_min']:.0f} / {t['step_median']:.0f} / "
              f"{t['step_max']:.0f} ms (min / median / max); blocked in finish_grad_sync "
              f"{blocked[0]:.1f} / {t['blocked_median']:.1f} / {blocked[-1]:.1f} ms; the median step:")
        print(tl.table())
        print(f"blocked in finish_grad_sync: {t['blocked']:.1f} ms of {t['step']:.1f} ms (backward {t['backward']:.1f} "
              f"ms); launched during backward: {t['launched_in_backward']} of {t['buckets']}")
        title = (f"DDP on 2 ranks, {len(tl.buckets)} buckets of >= {TIMELINE_BUCKET // 1000}k elements: "
                 + ("overlapped" if overlap else "after backward"))
        plot_bucket_timeline(tl, out / name, title=title)

    # ---- 2. one step of every variant, 4 ranks ----------------------------------------
    dp = 4
    variants = {name: tiny_variant(name) for name in VARIANTS}
    per_rank = spawn(ch01.run_variants, dp, [(dp, v) for v in variants.values()], timeout=300)
    cfg = ch01.tiny_model("llama", "float32")
    model = GPTModel(cfg)
    e = 4
    N = sum(p.numel() for p in model.parameters())
    print(f"\n== tiny LLaMA ({N:,} parameters, {len(list(model.parameters()))} tensors, float32), "
          f"dp={dp}, one step, b={TINY_B} s={TINY_S} per rank; ledger of rank 0 (bytes handed in)")
    print(f"{'variant':<10}{'op':<16}{'tag':<11}{'calls':>6}{'bytes':>10}{'formula':>10}")
    for name, v in variants.items():
        expected = [call for phase in ch01.expected_ledger(v, dp) for call in phase]
        for r, result in enumerate(per_rank):
            got = step_ledger(result[name])
            if sorted(got) != sorted(expected):
                print(f"MISMATCH rank {r} {name}:\n got {sorted(got)}\n expected {sorted(expected)}", file=sys.stderr)
                return FiguresResults(1)
            layout = ch01.expected_memory(v, dp, r)
            if any(result[name]["memory"][k] != layout[k] for k in layout):
                print(f"MISMATCH rank {r} {name}: memory {result[name]['memory']}, layout {layout}", file=sys.stderr)
                return FiguresResults(1)
        got = step_ledger(per_rank[0][name])
        got_sum, exp_sum = summarize(got), summarize(expected)
        for (op, tag), (calls, nbytes) in got_sum.items():
            found.ledger.setdefault(name, {})[f"{op} {tag}"] = [calls, nbytes]
            print(f"{name:<10}{op:<16}{tag:<11}{calls:>6}{fmt(nbytes):>10}{fmt(exp_sum[(op, tag)][1]):>10}")
        ring = found.ring[name] = round(ring_bytes(got, dp))
        print(f"{'':<10}ring bytes sent per rank: {fmt(ring)} ({ring / (N * e):.3f} x N e)")
    print("ledger == formula on every rank, for every variant")

    print(f"\n== bytes per rank, measured (min..max over ranks) vs training_memory(cfg, zero_stage, dp={dp})")
    measured, formula = {}, {}
    for s, name in enumerate(["ddp", "zero1", "zero2", "zero3"]):
        formula[s] = training_memory(cfg, zero_stage=s, dp=dp)
        measured[s] = {k: per_rank[0][name]["memory"][k] for k in ("params", "grads", "optimizer")}
        memory = found.memory[f"stage{s}"] = {
            kind: [min(r[name]["memory"][kind] for r in per_rank), max(r[name]["memory"][kind] for r in per_rank),
                   formula[s][kind]] for kind in ("params", "grads", "optimizer")}
        memory["total"] = [sum(measured[s].values()), formula[s]["total"]]
        print(f"stage {s} ({name:<5}): "
              + "; ".join(f"{kind} {fmt(memory[kind][0])}..{fmt(memory[kind][1])} ({fmt(memory[kind][2])})"
                          for kind in ("params", "grads", "optimizer"))
              + f"; total {fmt(memory['total'][0])} ({fmt(memory['total'][1])})")
    for name in ("zero2", "zero2-4k"):
        peak = found.grad_peak[name] = max(r[name]["grad_peak"] for r in per_rank)
        buckets = len(ch01.zero_bucket_numels(model, variants[name].train.ddp_bucket_size))
        print(f"{name}: most full-gradient bytes held during backward {fmt(peak)} "
              f"(one full gradient: {fmt(N * e)}; buckets: {buckets})")
    plot_zero_memory(measured, formula, N, dp, out)

    # ---- 3. ZeRO-3's parameter memory over one step -------------------------------------
    events = [MemoryEvent(*x) for x in per_rank[0]["zero3"]["profile"]]
    print("\n== ZeRO-3 parameter bytes on rank 0 over one step (own shards + gathered units)")
    for ev in events:
        found.zero3_profile.append([ev.label, ev.sharded, ev.gathered])
        print(f"  {ev.label:<28}{fmt(ev.sharded):>8} + {fmt(ev.gathered):>7} = {fmt(ev.sharded + ev.gathered):>7}")
    plot_memory_profile(events, out / "zero3_memory_profile.png", unsharded_bytes=N * e,
                        title=f"ZeRO-3, dp={dp}: rank 0's parameter memory, one step")

    for path in sorted(out.glob("*.png")):
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB")
    return found


if __name__ == "__main__":
    sys.exit(main().exit_code)
