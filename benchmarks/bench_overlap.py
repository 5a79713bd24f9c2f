"""What chapter 07's two remaining overlaps buy on this CPU: sequence parallelism's backward
collectives behind its GEMMs (--overlap-sp-backward) and the pipeline's receives posted one op
ahead (--overlap-p2p-communication).

    python benchmarks/bench_overlap.py                   # 2 ranks: tp 2 + SP, and pp 2 (1F1B), each both ways
    python benchmarks/bench_overlap.py --smoke           # tiny sizes, one short window (~20 s)

One step is `minimegatron.train.train_step` on the layout the training command builds
(resume.initialize_layout, parallelize.build_model / build_optimizer, a pp.PipelineComm for
the pipeline), the same as `python -m minimegatron.train` with these flags on 2 ranks:

  sp            --tensor-model-parallel-size 2 --sequence-parallel
  sp-overlap    the same with --overlap-sp-backward (tp/overlap.py)
  pp            --pipeline-model-parallel-size 2, 1F1B over --microbatches micro-batches
  pp-overlap    the same with --overlap-p2p-communication (pp/p2p.py's post_recv_ahead)

All four live in one `minimegatron.launch.spawn` world of 2 gloo ranks, 1 intra-op thread
each; after --warmup untimed steps each, the variants take turns window by window (--repeats
windows of --steps steps, a barrier before each), so a busy moment of the machine hits all of
them; a window's time is its slowest rank's, and the best window is reported with the median
and the worst. For the pipeline, also the share of the step each rank spent blocked waiting
for a receive ("recv wait" in the executor's StepRecord), whose shrinking is what posting the
receives early is for.

Why little is expected here: 2 ranks on 2 cores already use both cores for computing, and
gloo's transfer threads run on the same cores, so a collective moved off the critical path
still takes CPU time from the GEMM it overlaps. On a GPU, NCCL's transfers use the network
and copy engines, not the cores that compute.

A measurement, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from minimegatron.launch import spawn
from minimegatron.parallelize import build_model, build_optimizer
from minimegatron.pp import PipelineComm
from minimegatron.resume import initialize_layout
from minimegatron.train import train_step
from machine import cpu_model, load_average  # benchmarks/machine.py

VARIANTS = {"sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
            "sp-overlap": dict(tensor_model_parallel_size=2, sequence_parallel=True, overlap_sp_backward=True),
            "pp": dict(pipeline_model_parallel_size=2),
            "pp-overlap": dict(pipeline_model_parallel_size=2, overlap_p2p_comm=True)}


@dataclass
class OverlapResults:
    """The table main printed, a row per variant: {variant, best, median, worst (tokens/s),
    ms_best, ratio (overlapped / plain, best; None for a plain one), waits (each pipeline rank's
    median share blocked on a receive)}."""
    exit_code: int = 0
    rows: list = field(default_factory=list)


def configs(args: dict) -> tuple[ModelConfig, TrainConfig]:
    model = ModelConfig.llama(hidden_size=args["hidden"], num_layers=args["layers"], num_attention_heads=args["heads"],
                              num_query_groups=args["query_groups"], max_position_embeddings=args["seq"],
                              params_dtype="float32").validate()
    train = TrainConfig(seq_length=args["seq"], micro_batch_size=args["batch"], grad_accum_steps=args["microbatches"],
                        lr=1e-4, min_lr=0.0, lr_warmup_iters=0, progress=False, eval_interval=0)
    return model, train


def bench_rank(args: dict) -> dict:
    """Spawn target: build every variant, warm up, then time interleaved windows."""
    model_cfg, base = configs(args)
    g = torch.Generator().manual_seed(1000)                  # the same data on both ranks (no dp)
    x = torch.randint(0, model_cfg.vocab_size, (args["microbatches"], args["batch"], args["seq"] + 1), generator=g)
    runners = {}
    for name, fields in VARIANTS.items():
        cfg = dataclasses.replace(base, **fields)
        layout = initialize_layout(cfg)
        chunks = build_model(model_cfg, cfg, layout)
        optimizer = build_optimizer(chunks, cfg, layout)
        local_seq = cfg.seq_length // (layout.tp if cfg.sequence_parallel else 1)
        p2p = (PipelineComm(layout.pp_ranks, layout.pp_rank, 1, (cfg.micro_batch_size, local_seq, model_cfg.hidden_size),
                            model_cfg.dtype, overlap_p2p_comm=cfg.overlap_p2p_comm) if layout.pp > 1 else None)
        mbs = [{"tokens": m[:, :-1], "labels": m[:, 1:]} for m in x]    # SP cuts the sequence inside the model
        runners[name] = (chunks, optimizer, layout, p2p, mbs)

    def step(name: str, records: list | None = None) -> None:
        chunks, optimizer, layout, p2p, mbs = runners[name]
        train_step(chunks, optimizer, mbs, layout, 1e-4, p2p, "1f1b", records=records)

    for name in VARIANTS:
        for _ in range(args["warmup"]):
            step(name)
    out = {name: {"windows": [], "recv_wait": []} for name in VARIANTS}
    for _ in range(args["repeats"]):
        for name in VARIANTS:
            records: list = []
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args["steps"]):
                step(name, records if name.startswith("pp") else None)
            elapsed = time.perf_counter() - start
            out[name]["windows"].append(elapsed)
            if records:
                waited = sum(i.end - i.start for rec in records for i in rec.intervals if i.op == "recv wait")
                out[name]["recv_wait"].append(waited / elapsed)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="h (default 256)")
    p.add_argument("--layers", type=int, default=4, help="L (default 4)")
    p.add_argument("--heads", type=int, default=8, help="a (default 8)")
    p.add_argument("--query-groups", type=int, default=2, help="g (default 2)")
    p.add_argument("--seq", type=int, default=256, help="s (default 256)")
    p.add_argument("--batch", type=int, default=2, help="b, sequences per micro-batch (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant (default 1)")
    p.add_argument("--steps", type=int, default=2, help="steps per timed window (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed windows per variant (default 5)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one short window: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.query_groups = 32, 2, 4, 2
        args.seq, args.batch, args.microbatches = 16, 2, 2
        args.warmup, args.steps, args.repeats = 1, 1, 1
    return args


def main(argv: list[str] | None = None) -> OverlapResults:
    args = parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    model_cfg, _ = configs(vars(args))
    print(f"command: {cmd}")
    print(f"date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, "
          f"python {platform.python_version()}, CPU: {cpu_model()}, {os.cpu_count()} cores")
    print(f"model: LLaMA style h={model_cfg.hidden_size} L={model_cfg.num_layers} a={model_cfg.num_attention_heads} "
          f"g={model_cfg.query_groups} f={model_cfg.ffn_size} V={model_cfg.vocab_size}, float32; s={args.seq}, "
          f"b={args.batch}, {args.microbatches} micro-batches a step; 2 ranks, 1 thread each")
    print(f"timing: {args.warmup} warm-up steps per variant, then {args.repeats} interleaved windows of "
          f"{args.steps} steps; a window's time is its slowest rank's")
    load_before = load_average()
    per_rank = spawn(bench_rank, 2, vars(args), timeout=600)
    print(f"load average {load_before} -> {load_average()}")
    tokens = args.microbatches * args.batch * args.seq * args.steps
    best, out = {}, OverlapResults()
    print("\n| variant | tokens/s best | median | worst | ms/step (best) | overlapped / plain (best) "
          "| blocked on a receive (median, per rank) |")
    print("|---|---|---|---|---|---|---|")
    for name in VARIANTS:
        windows = [max(r[name]["windows"][i] for r in per_rank) for i in range(args.repeats)]
        best[name] = tokens / min(windows)
        plain = name.removesuffix("-overlap")
        row = dict(variant=name, best=best[name], median=tokens / statistics.median(windows),
                   worst=tokens / max(windows), ms_best=1000 * min(windows) / args.steps,
                   ratio=best[name] / best[plain] if name != plain else None,
                   waits=[statistics.median(r[name]["recv_wait"]) for r in per_rank if r[name]["recv_wait"]])
        out.rows.append(row)
        ratio = f"{row['ratio']:.3f}×" if row["ratio"] is not None else "-"
        waits = ", ".join(f"{100 * w:.1f}%" for w in row["waits"]) or "-"
        print(f"| {name} | {row['best']:,.0f} | {row['median']:,.0f} | {row['worst']:,.0f} | {row['ms_best']:.1f} | "
              f"{ratio} | {waits} |")
    return out


if __name__ == "__main__":
    sys.exit(main().exit_code)
