"""Tokens per second of data-parallel training on this CPU: naive DP, bucketed DDP, ZeRO-1.

    python benchmarks/bench_ddp.py                         # 1, 2 and 4 ranks; naive, ddp, zero1
    python benchmarks/bench_ddp.py --ranks 2 --variants ddp ddp-no-overlap
    python benchmarks/bench_ddp.py --smoke                 # tiny sizes, one short window (~20 s)

One training step is what `python -m minimegatron.train` runs on every rank,
`minimegatron.train.train_step`, unchanged: forward and backward of this rank's micro-batch
(through the data-parallel wrapper), `finish_grad_sync`, global-norm clipping, AdamW,
zero_grad. The variants are the wrappers of chapter 01, the ones `minimegatron.dp.apply_data_parallel`
builds for a TrainConfig (built directly here, so that a one-rank world runs them too:
apply_data_parallel leaves a model on one rank unwrapped):

  naive           NaiveDataParallel: after backward, one blocking all-reduce per parameter
  ddp             DistributedDataParallel: flat buckets of --bucket-size elements, each
                  bucket's all-reduce launched asynchronously during backward (overlap)
  ddp-no-overlap  the same buckets, all-reduced one after the other after backward
  zero1           ZeRO-1 (the optimizer over its shards): reduce-scatter, AdamW on this rank's shard,
                  all-gather of the updated parameters
  zero1-overlap   the same with --overlap-grad-reduce --overlap-param-gather (chapter 07): each
                  bucket's reduce-scatter launched from the backward, the all-gathers waited
                  module by module in the next forward
  zero2, zero2-overlap   ZeRO-2 (the gradients sharded too), without and with the overlaps

Each world size runs in its own `minimegatron.launch.spawn` world (gloo, one intra-op thread
per rank). In a world, every variant is built from the same initial weights; after --warmup
untimed steps each, the variants take turns, window by window (--repeats windows of --steps
steps), so that a busy moment of the machine hits all of them. A window's time is the
slowest rank's (the ranks wait for each other in every collective anyway). Reported per
variant: tokens/s of the best, median and worst window (global tokens: ranks x b x s per
step), and the share of the step spent *blocked on communication*: time inside
`finish_grad_sync` (naive: every all-reduce; ddp: waiting for buckets still in flight;
zero1: the reduce-scatters) plus, for ZeRO, the parameter all-gather after the step (with the
overlaps: the waits for the buckets still in flight, and the forward pre-hooks' waits for the
all-gathers).
For ddp, also how many buckets were launched before backward ended (the DDP timeline).

On a machine shared with other work, other processes only make a window slower: the best
window is the closest estimate of the uncontended speed (Python's timeit convention). More
ranks than cores oversubscribe the CPU: with 4 ranks on 2 cores each rank gets about half a
core, and gloo's communication threads compete with the computation for the same cores.

A measurement, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dp import DistributedDataParallel, NaiveDataParallel, ZeroDataParallel
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.optim import NormGroup, Optimizer
from minimegatron.parallel_state import Layout
from minimegatron.train import train_step
from machine import cpu_model, load_average  # benchmarks/machine.py

VARIANTS = ("naive", "ddp", "ddp-no-overlap", "zero1", "zero1-overlap", "zero2", "zero2-overlap")


@dataclass
class DdpResults:
    """The table main printed, a row per world size and variant: {ranks, variant, best, median,
    worst (tokens/s), ms_best, speedup (over 1 rank's best; None without a 1-rank run), comm
    (the median share blocked on communication), overlap (buckets launched in the backward)}."""
    exit_code: int = 0
    rows: list = field(default_factory=list)


def model_config(args: dict) -> ModelConfig:
    return ModelConfig.llama(hidden_size=args["hidden"], num_layers=args["layers"],
                             num_attention_heads=args["heads"], num_query_groups=args["query_groups"],
                             max_position_embeddings=args["seq"], params_dtype="float32").validate()


def build_variant(variant: str, args: dict, group):
    """(wrapper, optimizer) of one variant over `group`, from the book's initial weights."""
    model = GPTModel(model_config(args))
    bucket = args["bucket_size"]                                    # elements
    cfg = TrainConfig(seq_length=args["seq"], micro_batch_size=args["batch"], lr=1e-4, min_lr=0.0,
                      lr_warmup_iters=0, clip_grad=1.0, progress=False)
    if variant == "naive":
        wrapper = NaiveDataParallel(model, group)
    elif variant in ("ddp", "ddp-no-overlap"):
        wrapper = DistributedDataParallel(model, group, bucket_size_bytes=bucket * 4, overlap=variant == "ddp")
    elif variant.startswith("zero"):
        overlap = variant.endswith("-overlap")                      # --overlap-grad-reduce --overlap-param-gather
        wrapper = ZeroDataParallel(model, group, stage=int(variant[4]), bucket_size=bucket,
                                   overlap_grad_reduce=overlap, overlap_param_gather=overlap)
        return wrapper, Optimizer([wrapper], cfg, [NormGroup(groups=(group,))])   # the shards' norm over dp
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    return wrapper, Optimizer([wrapper], cfg)


class Timed:
    """Adds up the seconds spent in some methods of an object (bound on the instance)."""

    def __init__(self, obj, names: list[str]):
        self.seconds = 0.0
        for name in names:
            if hasattr(obj, name):
                setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, method):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def bench_rank(variants: list[str], args: dict) -> dict:
    """Spawn target: build every variant, warm up, then time interleaved windows."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(world=world, rank=rank, dp=world, dp_rank=rank, dp_group=group)
    g = torch.Generator().manual_seed(1000 + rank)          # each rank its own slice of data
    x = torch.randint(0, 257, (args["batch"], args["seq"] + 1), generator=g)
    batch = {"tokens": x[:, :-1], "labels": x[:, 1:]}

    runners = {}
    for v in variants:
        wrapper, optimizer = build_variant(v, args, group)
        comm = Timed(wrapper, ["finish_grad_sync", "after_optimizer_step", "_wait_for_params"])
        runners[v] = (wrapper, optimizer, comm)

    def step(v: str) -> None:
        wrapper, optimizer, _ = runners[v]
        train_step([wrapper], optimizer, [batch], layout, 1e-4)

    for v in variants:
        for _ in range(args["warmup"]):
            step(v)
    out = {v: {"windows": [], "comm": [], "launched_in_backward": [], "buckets": None} for v in variants}
    for _ in range(args["repeats"]):
        for v in variants:
            wrapper, _, comm = runners[v]
            dist.barrier()                                   # start the window together
            comm.seconds = 0.0
            start = time.perf_counter()
            for _ in range(args["steps"]):
                step(v)
                timeline = getattr(wrapper, "timeline", None)
                if timeline is not None and world > 1:
                    out[v]["launched_in_backward"].append(len(timeline.launched_during_backward()))
            elapsed = time.perf_counter() - start
            out[v]["windows"].append(elapsed)
            out[v]["comm"].append(comm.seconds / elapsed)
    for v in variants:
        wrapper = runners[v][0]
        out[v]["buckets"] = len(getattr(wrapper, "buckets", []) or []) or None
    out["params"] = sum(p.numel() for p in GPTModel(model_config(args)).parameters())
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["naive", "ddp", "zero1"])
    p.add_argument("--hidden", type=int, default=256, help="h (default 256)")
    p.add_argument("--layers", type=int, default=4, help="L (default 4)")
    p.add_argument("--heads", type=int, default=8, help="a (default 8)")
    p.add_argument("--query-groups", type=int, default=2, help="g (default 2)")
    p.add_argument("--seq", type=int, default=128, help="s (default 128)")
    p.add_argument("--batch", type=int, default=4, help="b, sequences per rank per step (default 4)")
    p.add_argument("--bucket-size", type=int, default=500_000,
                   help="DDP / ZeRO-1 bucket size in elements (default 500,000: several buckets; "
                        "Megatron's default, 40M, would make this model one bucket)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant (default 1)")
    p.add_argument("--steps", type=int, default=2, help="steps per timed window (default 2)")
    p.add_argument("--repeats", type=int, default=4, help="timed windows per variant (default 4)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one short window: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.query_groups = 32, 2, 4, 2
        args.seq, args.batch, args.bucket_size = 16, 2, 2000
        args.warmup, args.steps, args.repeats, args.ranks = 1, 1, 1, [1, 2]
    return args


def main(argv: list[str] | None = None) -> DdpResults:
    args = parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    cfg = model_config(vars(args))
    print(f"command: {cmd}")
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, "
          f"python {platform.python_version()}, CPU: {cpu_model()}, {os.cpu_count()} cores")
    print(f"model: LLaMA style h={cfg.hidden_size} L={cfg.num_layers} a={cfg.num_attention_heads} "
          f"g={cfg.query_groups} f={cfg.ffn_size} V={cfg.vocab_size}, float32; s={args.seq}, "
          f"b={args.batch} per rank; bucket {args.bucket_size:,} elements; 1 thread per rank")
    print(f"timing: {args.warmup} warm-up steps per variant, then {args.repeats} interleaved windows of "
          f"{args.steps} steps; a window's time is its slowest rank's")
    rows, single = [], {}
    for n in args.ranks:
        load_before = load_average()
        t0 = time.perf_counter()
        per_rank = spawn(bench_rank, n, args.variants, vars(args), timeout=600)
        wall = time.perf_counter() - t0
        params = per_rank[0]["params"]
        oversubscribed = " (more ranks than cores: oversubscribed)" if n > (os.cpu_count() or 1) else ""
        print(f"\n== {n} rank(s){oversubscribed}: {params:,} parameters, "
              f"{n * args.batch * args.seq:,} tokens per step; world ran {wall:.1f} s; "
              f"load average {load_before} -> {load_average()}")
        print(f"   {'variant':<15}{'tokens/s best':>14}{'median':>9}{'worst':>9}{'ms/step best':>13}"
              f"{'vs 1 rank':>10}{'comm wait':>11}{'  buckets launched in backward'}")
        tokens = n * args.batch * args.seq * args.steps
        for v in args.variants:
            windows = [max(r[v]["windows"][i] for r in per_rank) for i in range(args.repeats)]
            best, med, worst = min(windows), statistics.median(windows), max(windows)
            comm = statistics.median(c for r in per_rank for c in r[v]["comm"])
            if n == 1:
                single[v] = tokens / best
            speedup = (tokens / best) / single[v] if v in single else float("nan")
            launched = per_rank[0][v]["launched_in_backward"]
            buckets = per_rank[0][v]["buckets"]
            overlap = (f"  {min(launched)}-{max(launched)} of {buckets}" if launched and buckets else "")
            row = dict(ranks=n, variant=v, best=tokens / best, median=tokens / med, worst=tokens / worst,
                       ms_best=1000 * best / args.steps, speedup=speedup, comm=comm, overlap=overlap.strip())
            rows.append(row)
            vs1 = f"{speedup:>9.2f}x" if v in single else f"{'-':>10}"
            print(f"   {v:<15}{row['best']:>14,.0f}{row['median']:>9,.0f}{row['worst']:>9,.0f}"
                  f"{row['ms_best']:>13.1f}{vs1}{100 * comm:>10.0f}%{overlap}")
    print("\nmarkdown:")
    print("| ranks | variant | tokens/s best | median | worst | ms/step (best) | vs 1 rank (best) "
          "| blocked on comm (median) | buckets launched in backward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs1 = "-" if r["speedup"] != r["speedup"] else f"{r['speedup']:.2f}×"     # nan: no 1-rank run
        print(f"| {r['ranks']} | {r['variant']} | {r['best']:,.0f} | {r['median']:,.0f} | {r['worst']:,.0f} | "
              f"{r['ms_best']:.1f} | {vs1} | {100 * r['comm']:.0f}% | {r['overlap'] or '-'} |")
    return DdpResults(rows=[{**r, "speedup": None if r["speedup"] != r["speedup"] else r["speedup"]} for r in rows])


if __name__ == "__main__":
    sys.exit(main().exit_code)
