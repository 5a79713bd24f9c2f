"""Chapter 02 demo: tensor parallelism (and TP x DP), proven on tp x dp ranks.

    torchrun --standalone --nproc_per_node=4 chapters/02_tp/demo.py --tp 2 --dp 2
    torchrun --standalone --nproc_per_node=4 chapters/02_tp/demo.py --tp 4
    torchrun --standalone --nproc_per_node=4 chapters/02_tp/demo.py --tp 2 --dp 2 --zero 1
    python chapters/02_tp/demo.py                    # no torchrun: spawns tp x dp ranks (2 x 2) itself
    python chapters/02_tp/demo.py --quick --tp 2 --dp 1 --style gpt2     # a few seconds

Every rank builds its shard of the same tiny model (cut from the single-device initial values),
on a grid of tp x dp ranks (tp fastest, as Megatron lays them out): each tensor-parallel group
of tp ranks holds one copy of the model split by heads, MLP columns and vocabulary rows, and
the dp groups are data-parallel replicas, wrapped by chapter 01's DDP (or ZeRO-1/2 with
--zero). This is the layout `python -m minimegatron.train --tensor-model-parallel-size`
trains. After `--steps` AdamW steps, rank 0 (or the parent, without torchrun) prints:

  [1/3] equivalence: the losses, the first step's gradients and the final parameters, each
        reassembled from the shards under single-device names, against
        `testing.single_device_run` on the same global batch, with the largest differences
        and the tolerance; gradient clipping is active on every step;
  [2/3] communication: the ledger of each phase of a step, by group (TP, DP) and collective,
        against the chapter's formula (every rank and step checked);
  [3/3] parameters per rank: counted on the tensors, against
        `analysis.tensor_parallel_parameters` (what is split, what is replicated).

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
from minimegatron.config import ConfigError
from minimegatron.demos import verdict_under_torchrun
from minimegatron.demos import ch02


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="chapters/02_tp/demo.py",
        description="Chapter 02: train a tiny model tensor-parallel (x data-parallel) and check it against "
                    "the single-device run, the communication formula and the parameter formula.",
        epilog="Ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2; 2 or 4 for this model)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel size (default: world / tp under torchrun, 2 without)")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                        help="chapter 01's DP variant: 0 bucketed DDP (default), 1 or 2 ZeRO")
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="M micro-batches per step and DP rank; the first M-1 run inside no_sync() (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="b sequences per micro-batch (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps (default 3, or 2 with --quick)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="float64 (tight tolerances, the default) or float32 (AdamW eps 1e-5)")
    parser.add_argument("--style", choices=["llama", "gpt2"], default="llama", help="model style (default llama)")
    parser.add_argument("--quick", action="store_true", help="h=32, sequences of 16, 2 steps (what the tests run)")
    args = parser.parse_args(argv)
    for name in ("tp", "micro_batches", "micro_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.dp is not None and args.dp < 1:
        parser.error(f"--dp={args.dp} must be at least 1")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")
    return args


def build_run(args: argparse.Namespace, dp: int) -> ch02.TPRun:
    """The run every rank trains; ConfigError (naming the numbers) for a layout that does not split."""
    sizes = {} if args.quick else dict(hidden_size=64, num_layers=3, max_position_embeddings=32)
    model = ch02.tiny_model(args.style, args.dtype, **sizes)
    return ch02.make_run(model, args.tp, dp, zero_stage=args.zero, micro_batches=args.micro_batches,
                         micro_batch_size=args.micro_batch_size, steps=args.steps or (2 if args.quick else 3))


def report(run: ch02.TPRun, per_rank: list[dict], how: str, seconds: float) -> int:
    """Check the run, print the report and the verdict; return the exit status."""
    cfg = run.model
    print(f"Chapter 02: tensor parallelism on tp={run.tp} x dp={run.dp} = {run.world} rank(s) ({how}), "
          f"trained in {seconds:.1f} s")
    print(f"model: {cfg.normalization}/{cfg.activation}, h={cfg.hidden_size} L={cfg.num_layers} "
          f"a={cfg.num_attention_heads} g={cfg.query_groups} V={cfg.vocab_size}, "
          f"{count_parameters(cfg)['total']:,} parameters, {cfg.params_dtype}"
          + ("" if cfg.untie_embeddings_and_output_weights else ", tied embeddings"))
    print()
    result = ch02.check_run(run, per_rank)
    print(result)
    print()
    line = ch02.summary_line([result])
    print(line)
    return 0 if line.startswith("MATCH") else 1


def main_torchrun(args) -> int:
    import torch.distributed as dist

    from minimegatron.launch import init_from_torchrun

    rank, world = init_from_torchrun()
    if world % args.tp or (args.dp is not None and args.tp * args.dp != world):
        if rank == 0:
            print(f"error: world size {world} is not tp x dp = {args.tp} x {args.dp or '?'}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    run = build_run(args, world // args.tp)
    start = time.perf_counter()
    return verdict_under_torchrun(ch02.train_run(run),
                                  lambda per_rank: report(run, per_rank, "torchrun", time.perf_counter() - start))


def main_spawn(args) -> int:
    from minimegatron.launch import spawn

    run = build_run(args, 2 if args.dp is None else args.dp)     # errors before any process starts
    start = time.perf_counter()
    per_rank = spawn(ch02.train_run, run.world, run, timeout=600)
    return report(run, per_rank, "spawned by this script; torchrun works too", time.perf_counter() - start)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    try:
        return main_torchrun(args) if "RANK" in os.environ else main_spawn(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":      # the guard matters: spawned ranks import this file again
    sys.exit(main())
