"""Chapter 01 demo: data parallelism, from the naive all-reduce to ZeRO-3, proven on N ranks.

    torchrun --standalone --nproc_per_node=4 chapters/01_dp/demo.py --zero 1
    torchrun --standalone --nproc_per_node=4 chapters/01_dp/demo.py --zero 0 --ddp naive
    torchrun --standalone --nproc_per_node=2 chapters/01_dp/demo.py --zero all --micro-batches 4
    python chapters/01_dp/demo.py                   # no torchrun: spawns --ranks ranks (2) itself
    python chapters/01_dp/demo.py --quick --zero all            # every variant, a few seconds
    python chapters/01_dp/demo.py --quick --break-averaging     # the classic bug: MISMATCH

Every rank builds the same tiny model from (seed, parameter name), wraps it for the chosen
variant with `minimegatron.dp.build_data_parallel` (what `python -m minimegatron.train
--zero-stage` does), and trains `--steps` AdamW steps on its slice of a fixed global batch:
`--micro-batches` M micro-batches of `--micro-batch-size` b sequences per rank, the first M-1
inside `no_sync()`. Then rank 0 (or the parent, without torchrun) prints, per variant:

  [1/3] equivalence: the losses, the first step's gradients (reassembled to full
        single-device tensors) and the final parameters against `testing.single_device_run`
        on the same global batch, with the largest differences and the tolerance; and whether
        every rank ends with bit-identical parameters;
  [2/3] communication: the ledger of each phase of a step (each micro-batch, the optimizer
        step), by collective, against the chapter's formula (every rank and step checked);
  [3/3] memory per rank: parameter, gradient and AdamW-state bytes measured on the tensors,
        against the ZeRO paper's formula `analysis.training_memory(config, zero_stage, dp)`,
        with the padding of the shards.

The last line starts with MATCH (exit status 0) or MISMATCH (exit status 1); under torchrun
every rank exits with rank 0's verdict.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from minimegatron.analysis import count_parameters
from minimegatron.demos import ch01, verdict_under_torchrun

VARIANTS = {"0": None, "1": ["zero1"], "2": ["zero2"], "3": ["zero3"], "all": ["naive", "ddp", "zero1", "zero2", "zero3"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="chapters/01_dp/demo.py",
        description="Chapter 01: train a tiny model data-parallel (naive, bucketed DDP, ZeRO-1/2/3) and "
                    "check it against the single-device run, the communication formulas and the "
                    "memory formulas.",
        epilog="Ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).")
    parser.add_argument("--zero", choices=list(VARIANTS), default="all",
                        help="ZeRO stage: 0 (replicated; see --ddp), 1, 2, 3, or all (naive, bucketed, "
                             "1, 2 and 3 in one world; the default)")
    parser.add_argument("--ddp", choices=["naive", "bucketed"], default="bucketed",
                        help="with --zero 0: one all-reduce per parameter after backward (naive) or "
                             "per bucket during backward (bucketed, the default)")
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="M micro-batches per step and rank; the first M-1 run inside no_sync() (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="b sequences per micro-batch (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps (default 3, or 2 with --quick)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="float64 (tight tolerances, the default) or float32 (AdamW eps 1e-5)")
    parser.add_argument("--style", choices=["llama", "gpt2"], default="llama", help="model style (default llama)")
    parser.add_argument("--bucket-size", type=int, default=8192,
                        help="elements per bucket for DDP and ZeRO-1/2 (default 8192: several buckets; "
                             "Megatron's default of 40M would make one)")
    parser.add_argument("--ranks", type=int, default=2,
                        help="without torchrun: how many ranks to spawn (default 2); torchrun sets its own")
    parser.add_argument("--quick", action="store_true",
                        help="h=32, sequences of 16, 2 steps: a few seconds (what the tests run)")
    parser.add_argument("--break-averaging", action="store_true",
                        help="the classic bug, on purpose: sum the gradients over ranks instead of "
                             "averaging them (no 1/dp); the check must say MISMATCH")
    args = parser.parse_args(argv)
    for name in ("micro_batches", "micro_batch_size", "ranks", "bucket_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")
    return args


def build_jobs(args: argparse.Namespace, dp: int) -> list[tuple[int, ch01.Variant]]:
    """The (dp, Variant) list every rank runs: the same on every rank."""
    sizes = {} if args.quick else dict(hidden_size=64, num_layers=3, max_position_embeddings=32)
    model = ch01.tiny_model(args.style, args.dtype, **sizes)
    kinds = VARIANTS[args.zero] or ["naive" if args.ddp == "naive" else "ddp"]
    steps = args.steps or (2 if args.quick else 3)
    return [(dp, ch01.make_variant(kind, model, micro_batches=args.micro_batches, steps=steps,
                                   micro_batch_size=args.micro_batch_size, bucket_size=args.bucket_size,
                                   break_averaging=args.break_averaging)) for kind in kinds]


def report(args, jobs, per_rank_results, how: str, seconds: float) -> int:
    """Check every variant, print the reports and the verdict; return the exit status."""
    dp, first = jobs[0][0], jobs[0][1]
    cfg, t = first.model, first.train
    n = count_parameters(cfg)["total"]
    print(f"Chapter 01: data parallelism on {dp} rank(s) ({how}), {len(jobs)} variant(s) trained in {seconds:.1f} s")
    print(f"model: {args.style}, h={cfg.hidden_size} L={cfg.num_layers}, {n:,} parameters, {cfg.params_dtype}"
          + (f" (AdamW eps {t.adam_eps:g})" if cfg.params_dtype == "float32" else "")
          + f"; global batch {t.micro_batch_size} x {t.grad_accum_steps} x {dp} = "
            f"{t.micro_batch_size * t.grad_accum_steps * dp} sequences of {t.seq_length} tokens per step")
    if dp == 1:
        print("note: one rank is the single-device run with extra steps; nothing is communicated")
    reports = ch01.check_variants(jobs, per_rank_results)
    for r in reports:
        print()
        print(r)
        if r.timeline is not None:
            print(f"      bucket timeline of the last step, rank 0 (buckets launched during backward: "
                  f"{r.timeline.launched_during_backward()}):")
            print("      " + r.timeline.table().replace("\n", "\n      "))
    print()
    line = ch01.summary_line(reports)
    print(line)
    return 0 if line.startswith("MATCH") else 1


def main_torchrun(args) -> int:
    from minimegatron.launch import init_from_torchrun

    rank, world = init_from_torchrun()
    jobs = build_jobs(args, world)
    start = time.perf_counter()
    return verdict_under_torchrun(ch01.run_variants(jobs),
                                  lambda per_rank: report(args, jobs, per_rank, "torchrun", time.perf_counter() - start))


def main_spawn(args) -> int:
    from minimegatron.launch import spawn

    jobs = build_jobs(args, args.ranks)
    start = time.perf_counter()
    results = spawn(ch01.run_variants, args.ranks, jobs, timeout=600)
    return report(args, jobs, results, "spawned by this script; torchrun works too", time.perf_counter() - start)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    return main_torchrun(args) if "RANK" in os.environ else main_spawn(args)


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main())
