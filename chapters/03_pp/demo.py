"""Chapter 03 demo: pipeline parallelism (and 3D), proven on tp x pp x dp ranks.

    torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 4 --schedule 1f1b
    torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 4 --schedule gpipe
    torchrun --standalone --nproc_per_node=4 chapters/03_pp/demo.py --pp 2 --schedule interleaved --chunks 2 --dp 2
    torchrun --standalone --nproc_per_node=8 chapters/03_pp/demo.py --tp 2 --pp 2 --dp 2      # 3D
    python chapters/03_pp/demo.py                     # no torchrun: spawns the ranks (pp 4, 1f1b) itself
    python chapters/03_pp/demo.py --quick --pp 2      # a few seconds

Every rank builds its stage(s) of the same tiny model (layers cut from the single-device
initial values, pp.stages), on a grid of tp x dp x pp ranks (Megatron's order: tp fastest,
pp slowest), and trains `--steps` AdamW steps of `--micro-batches` micro-batches each with the
schedule `--schedule` (pp.schedules), exactly as `python -m minimegatron.train
--pipeline-model-parallel-size` does. Rank 0 (or the parent, without torchrun) prints:

  [1/4] equivalence: losses, first-step gradients and final parameters, gathered from the
        stages under single-device names, against `testing.single_device_run`;
  [2/4] the bubble: the textbook idle fraction, the unit-cost simulation of the same
        schedules, and the wall clock of the last real step, per stage;
  [3/4] activations held at once: the peak number of micro-batches in flight on each stage,
        measured, against the schedule's, and the bytes saved for backward at the peak;
  [4/4] the p2p ledger of a step against the formula;

draws the last step's timeline next to the simulated one (--figure, default
runs/ch03_timeline.png), and ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from minimegatron.analysis import count_parameters
from minimegatron.config import ConfigError
from minimegatron.demos import verdict_under_torchrun
from minimegatron.demos import ch03
from minimegatron.pp import KINDS, plot_timeline, simulate


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="chapters/03_pp/demo.py",
        description="Chapter 03: train a tiny model pipeline-parallel (optionally x tensor x data parallel) and "
                    "check it against the single-device run, the bubble formula, the in-flight micro-batches "
                    "and the p2p formula.",
        epilog="Ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size inside each stage (default 1)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel pipelines (default: world / (tp pp) under torchrun, 1 without)")
    parser.add_argument("--schedule", choices=KINDS, default="1f1b", help="default 1f1b")
    parser.add_argument("--chunks", type=int, default=None,
                        help="model chunks per rank for --schedule interleaved (default 2)")
    parser.add_argument("--micro-batches", type=int, default=8, help="m micro-batches per step (default 8)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="b sequences per micro-batch (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps (default 3, or 2 with --quick)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--style", choices=["llama", "gpt2"], default="gpt2",
                        help="model style (default gpt2: tied embeddings, the first and last stage share them)")
    parser.add_argument("--figure", default="runs/ch03_timeline.png", help="where to draw the timelines ('' : none)")
    parser.add_argument("--quick", action="store_true", help="h=32, sequences of 16, 2 steps (what the tests run)")
    args = parser.parse_args(argv)
    if args.chunks is None:
        args.chunks = 2 if args.schedule == "interleaved" else 1
    for name in ("pp", "tp", "chunks", "micro_batches", "micro_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.dp is not None and args.dp < 1:
        parser.error(f"--dp={args.dp} must be at least 1")
    return args


def build_run(args: argparse.Namespace, dp: int) -> ch03.PPRun:
    """The run every rank trains; ConfigError / ValueError naming the numbers if it cannot."""
    layers = args.pp * args.chunks * (1 if args.quick else 2)
    sizes = {} if args.quick else dict(hidden_size=64, max_position_embeddings=32)
    extra = {"num_query_groups": args.tp} if args.style == "llama" else {}
    model = ch03.tiny_model(args.style, args.dtype, num_layers=layers, **sizes, **extra)
    return ch03.make_run(model, pp=args.pp, dp=dp, tp=args.tp, kind=args.schedule, num_chunks=args.chunks,
                         micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                         steps=args.steps or (2 if args.quick else 3))


def draw(run: ch03.PPRun, per_rank: list[dict], path: str) -> None:
    """The last real step's timeline above the unit-cost simulation of the same schedules."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    title = f"{run.kind}, pp={run.pp}, m={run.micro_batches}" + (f", v={run.num_chunks}" if run.num_chunks > 1 else "")
    fig, (real, sim) = plt.subplots(2, 1, figsize=(11, 1.1 * run.pp + 2.5))
    plot_timeline(ch03.measured_timeline(per_rank), f"measured, last step (grey: waiting for a receive): {title}",
                  unit="seconds", ax=real)
    plot_timeline(simulate(run.kind, run.pp, run.micro_batches, run.num_chunks),
                  f"simulated with t_f = 1, t_b = 2: {title}", unit="time units", ax=sim)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args, run: ch03.PPRun, per_rank: list[dict], how: str, seconds: float) -> int:
    cfg = run.model
    print("Chapter 03: pipeline parallelism on " + (f"tp={run.tp} x " if run.tp > 1 else "")
          + f"pp={run.pp} x dp={run.dp} = {run.world} rank(s) ({how}), trained in {seconds:.1f} s")
    print(f"model: {cfg.normalization}/{cfg.activation}, h={cfg.hidden_size} L={cfg.num_layers} "
          f"({cfg.num_layers // (run.pp * run.num_chunks)} per virtual stage), V={cfg.vocab_size}, "
          f"{count_parameters(cfg)['total']:,} parameters, {cfg.params_dtype}"
          + ("" if cfg.untie_embeddings_and_output_weights else ", tied embeddings"))
    print()
    result = ch03.check_run(run, per_rank)
    print(result)
    if args.figure:
        draw(run, per_rank, args.figure)
        print(f"      timelines: {args.figure}")
    print()
    line = ch03.summary_line([result])
    print(line)
    return 0 if line.startswith("MATCH") else 1


def main_torchrun(args) -> int:
    import torch.distributed as dist

    from minimegatron.launch import init_from_torchrun

    rank, world = init_from_torchrun()
    model_parallel = args.tp * args.pp
    if world % model_parallel or (args.dp is not None and model_parallel * args.dp != world):
        if rank == 0:
            print(f"error: world size {world} is not tp x pp x dp = {args.tp} x {args.pp} x {args.dp or '?'}",
                  file=sys.stderr)
        dist.destroy_process_group()
        return 2
    run = build_run(args, world // model_parallel)
    start = time.perf_counter()
    return verdict_under_torchrun(ch03.train_run(run),
                                  lambda per_rank: report(args, run, per_rank, "torchrun", time.perf_counter() - start))


def main_spawn(args) -> int:
    from minimegatron.launch import spawn

    run = build_run(args, 1 if args.dp is None else args.dp)     # errors before any process starts
    start = time.perf_counter()
    per_rank = spawn(ch03.train_run, run.world, run, timeout=600)
    return report(args, run, per_rank, "spawned by this script; torchrun works too", time.perf_counter() - start)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    try:
        return main_torchrun(args) if "RANK" in os.environ else main_spawn(args)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main())
