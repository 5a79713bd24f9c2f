"""Chapter 00 demo: the single-device baseline that every later chapter is compared against.

    python chapters/00_single_device/demo.py                 # about 20 s on a laptop CPU
    python chapters/00_single_device/demo.py --quick         # a few seconds (what the tests run)
    torchrun --nproc_per_node=1 chapters/00_single_device/demo.py
    torchrun --nproc_per_node=4 chapters/00_single_device/demo.py --quick

What it does, in order:
  1. init      every rank builds the model from (seed, parameter name) with a different global
               RNG state, and the ranks all-gather fingerprints of their weights: they must be
               bit-identical (one rank: the check runs against a pipeline-stage-like slice);
  2. train     the tiny LLaMA-style model on the embedded corpus (the book's own text), with
               a progress bar; the loss curve goes to <out-dir>/loss.png;
  3. FLOPs     per token: the 6N rule next to the exact matmul count and the count measured by
               torch's FlopCounterMode;
  4. memory    parameters, gradients, Adam's two moments and the activations of one
               micro-batch: the formula of minimegatron.analysis next to bytes counted on the
               model (activations: the tensors autograd saves, seen by saved-tensor hooks);
  5. verdict   gradient accumulation over k micro-batches against one batch k times larger,
               in float64, through the equivalence harness of minimegatron.testing.

The last line starts with MATCH (exit status 0) or MISMATCH (exit status 1). Chapter 00 has
one device; with torchrun --nproc_per_node > 1 the ranks take part in step 1 and rank 0 alone
runs the rest (the parallel chapters give the other ranks work).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from minimegatron.config import TrainConfig
from minimegatron.demos import ch00
from minimegatron.launch import init_from_torchrun
from minimegatron.train import train


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="chapters/00_single_device/demo.py",
        description="Chapter 00: train the single-device baseline, account for its memory and FLOPs, "
                    "and check that gradient accumulation equals one big batch (float64).",
        epilog="Ends with a line starting MATCH (exit 0) or MISMATCH (exit 1).")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny, fast run (smaller model, 15 training steps); what the tests use")
    parser.add_argument("--style", choices=["llama", "gpt2"], default="llama",
                        help="model style (default: llama)")
    parser.add_argument("--train-iters", type=int, default=None,
                        help="training steps (default: 150, or 15 with --quick)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="k, the micro-batches accumulated in the equivalence check (default: 4)")
    parser.add_argument("--out-dir", default="runs/ch00_demo",
                        help="where the loss log and loss.png go (default: runs/ch00_demo)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--forget-loss-scaling", action="store_true",
                        help="break the accumulation on purpose (no 1/k on the micro-batch losses) "
                             "to see the check fail")
    args = parser.parse_args(argv)
    if args.train_iters is not None and args.train_iters < 1:
        parser.error(f"--train-iters={args.train_iters} must be at least 1")
    if args.micro_batches < 1:
        parser.error(f"--micro-batches={args.micro_batches} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = init_from_torchrun()
    make = ch00.tiny_llama if args.style == "llama" else ch00.tiny_gpt2
    sizes = dict(hidden_size=32, max_position_embeddings=32) if args.quick else {}
    config = make(**sizes)
    say = print if rank == 0 else (lambda *a, **k: None)
    failures: list[str] = []

    # 1. layout-independent init, across the ranks of this job -------------------------
    init_cfg = make(**{**sizes, "num_layers": max(world, 2)})
    result = ch00.init_checksum_worker(init_cfg)
    table = result["table"]
    same = bool((table == table[0]).all())
    say(f"[1/5] init: {world} rank(s) built the model from (seed, parameter name), each with another "
        f"global RNG state:\n      {len(result['names'])} parameter tensors "
        f"{'bit-identical on every rank' if same else 'DIFFERENT between ranks'}; rank 0's pipeline-stage "
        f"slice equals the full model: {all(result['stage_matches'])}")
    if not same:
        failures.append("ranks built different initial weights")
    if not all(result["stage_matches"]):
        failures.append("a stage's weights differ from the full model's")
    if world > 1:
        # every rank learns whether some rank's slice failed (one more all-gather)
        from minimegatron import comm
        ok = comm.all_gather(torch.tensor([int(all(result["stage_matches"]))]), group=None)
        if not bool(ok.all()):
            failures.append(f"stage slices differ from the full model on ranks {(ok == 0).nonzero().flatten().tolist()}")
        say(f"      the other {world - 1} rank(s) stop here: chapter 00 trains on one device")
        if rank != 0:
            dist.destroy_process_group()
            return 0

    # 2. train ------------------------------------------------------------------------
    iters = args.train_iters or (15 if args.quick else 150)
    seq, mbs = (32, 4) if args.quick else (64, 8)
    train_cfg = TrainConfig(seq_length=seq, micro_batch_size=mbs, train_iters=iters,
                            lr_warmup_iters=max(1, iters // 10), eval_interval=max(1, iters // 3),
                            eval_iters=2 if args.quick else 4, out_dir=args.out_dir,
                            progress=not args.no_progress)
    from minimegatron.analysis import count_parameters
    counts = count_parameters(config)
    style = "LLaMA" if args.style == "llama" else "GPT-2"
    say(f"[2/5] train: {style} style, h={config.hidden_size} L={config.num_layers} a={config.num_attention_heads} "
        f"g={config.query_groups}, {counts['total']:,} parameters ({counts['non_embedding']:,} non-embedding), "
        f"{iters} steps of {mbs} x {seq} tokens")
    start = time.perf_counter()
    run = train(config, train_cfg)
    val = f", validation {run.eval_losses[-1][1]:.3f}" if run.eval_losses else ""
    say(f"      loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}{val} "
        f"(ln V = {torch.log(torch.tensor(float(config.vocab_size))).item():.3f} is a uniform guess) "
        f"in {time.perf_counter() - start:.1f} s; curve: {os.path.join(args.out_dir, 'loss.png')}")

    # 3 + 4. FLOPs and memory, formula vs measured --------------------------------------
    b, s = (2, 16) if args.quick else (mbs, seq)
    budget = ch00.measure_budget(config, b, s)
    flops = budget.row("FLOPs")
    say(f"[3/5] FLOPs per token (train = forward + backward):\n"
        f"      6N rule   {budget.flops_6n:>12,}   (N = {counts['non_embedding']:,} non-embedding parameters)\n"
        f"      exact     {budget.flops_exact_per_token:>12,.0f}   (every matmul, incl. attention and logits; "
        f"{budget.flops_exact_per_token / budget.flops_6n:.2f} x 6N)\n"
        f"      measured  {flops.measured / (b * s):>12,.0f}   (torch FlopCounterMode)")
    say("[4/5] memory and FLOPs of one training step, formula vs measured:")
    say("      " + str(budget).replace("\n", "\n      "))
    for row in budget.rows:
        if not row.ok:
            failures.append(f"{row.what}: formula {row.formula:,} != measured {row.measured:,}")

    # 5. the verdict ------------------------------------------------------------------
    k = args.micro_batches
    report = ch00.grad_accum_equivalence(torch.float64, config=make(**{**sizes, "max_position_embeddings": 16}),
                                         micro_batches=k, steps=2 if args.quick else 3,
                                         scale_loss=not args.forget_loss_scaling)
    say(f"[5/5] gradient accumulation ({k} micro-batches of 2) vs one batch of {2 * k}, "
        f"{2 if args.quick else 3} AdamW steps, float64:")
    lines = str(report).splitlines()
    say("      " + "\n      ".join(lines[:4] + (lines[4:7] + [f"  ... {len(lines) - 7} more"] if len(lines) > 8 else lines[4:])))
    if not report.ok:
        failures.insert(0, "gradient accumulation differs from one big batch")

    t = report.tolerance
    diffs = (f"max |dloss| {report.max_loss_diff:.1e} (tol {t.loss:.0e}), max |dgrad| {report.max_grad_diff:.1e}, "
             f"max |dparam| {report.max_param_diff:.1e} (rtol {t.rtol:.0e}, atol {t.atol:.0e})")
    if failures:
        say(f"MISMATCH: {'; '.join(failures)}; {diffs}")
        return 1
    say(f"MATCH: {k} accumulated micro-batches equal one batch of {2 * k} on the single device (float64): {diffs}; "
        f"memory and FLOPs formulas equal the measurement")
    return 0


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
