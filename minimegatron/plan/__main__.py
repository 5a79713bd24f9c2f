"""`python -m minimegatron.plan`: which 5D layouts of a model fit a cluster, and which should be
fastest. Flags use Megatron-LM's spellings where it has them (--tensor-model-parallel-size,
--seq-length, --global-batch-size, --recompute-granularity, ...); each parallel size given pins
that dimension, the others are searched.

    python -m minimegatron.plan --model llama3-70b --cluster h100-sxm --gpus 1024 \\
        --seq-length 8192 --global-batch-size 1024 --top 10

Exit status: 0 with a plan, 1 when no layout fits (the reasons are printed), 2 for bad input
(the message names the flag and the numbers).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field

from ..config import ConfigError
from .cluster import CLUSTERS, GiB
from .megatron_formulas import megatron_flops
from .models import model_names, planner_model
from .search import search
from .table import format_plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minimegatron.plan",
        description="Enumerate the 5D layouts (tp, cp, pp with virtual stages, ep, etp, dp; ZeRO 0-3; recompute; "
                    "micro-batch size) of a model on a cluster; reject each invalid one with its reason; estimate "
                    "memory per GPU, FLOPs, bytes per dimension, bubble, step time and MFU of the others; rank them.",
        epilog=f"models: {', '.join(model_names())}\nclusters: "
               + ", ".join(f"{name} ({c.gpus_per_node} GPUs/node)" for name, c in CLUSTERS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="NAME", help="a named model (list below)")
    parser.add_argument("--cluster", default="h100-sxm", metavar="NAME", help="a named cluster [default: h100-sxm]")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all: whole nodes (or a part of one node)")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence [default: the model's usual one]")
    parser.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--top", type=int, default=10, help="layouts to print [default: 10]")
    pins = parser.add_argument_group("pins (each fixes one dimension; unset: searched)")
    for flag, dest, text in (("--tensor-model-parallel-size", "tp", "tp, within a node"),
                             ("--context-parallel-size", "cp", "cp"),
                             ("--pipeline-model-parallel-size", "pp", "pp"),
                             ("--num-virtual-stages-per-pipeline-rank", "vp", "v, model chunks per rank"),
                             ("--expert-model-parallel-size", "ep", "ep (MoE models)"),
                             ("--expert-tensor-parallel-size", "etp", "etp (MoE models)"),
                             ("--zero-stage", "zero", "0, 1, 2 or 3"),
                             ("--micro-batch-size", "mbs", "sequences per micro-batch")):
        pins.add_argument(flag, dest=dest, type=int, help=text)
    pins.add_argument("--recompute-granularity", "--recompute", dest="recompute",
                      choices=["none", "selective", "full"], help="activation recompute (selective: core_attn)")
    return parser


@dataclass
class PlanResults:              # what the printout says, as numbers rounded as printed
    exit_code: int = 0
    flops: float = 0.0
    searched: int = 0
    fit: int = 0
    top: list[dict] = field(default_factory=list)   # the table's rows: search.Layout's fields, gib, step_s, mfu_pct


def main(argv: list[str] | None = None) -> PlanResults:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cluster not in CLUSTERS:
            raise ConfigError(f"--cluster {args.cluster!r} is not one of {', '.join(CLUSTERS)}")
        for flag, value in (("--gpus", args.gpus), ("--global-batch-size", args.global_batch_size),
                            ("--seq-length", args.seq_length), ("--top", args.top)):
            if value is not None and value < 1:                   # None: --seq-length left to the model
                raise ConfigError(f"{flag} {value} must be at least 1")
        try:
            model_cfg, seq, note = planner_model(args.model)
        except ConfigError as exc:
            raise ConfigError(f"--model: {exc}") from None
        for flag, value in (("--tensor-model-parallel-size", args.tp), ("--context-parallel-size", args.cp),
                            ("--pipeline-model-parallel-size", args.pp), ("--micro-batch-size", args.mbs),
                            ("--num-virtual-stages-per-pipeline-rank", args.vp),
                            ("--expert-model-parallel-size", args.ep), ("--expert-tensor-parallel-size", args.etp)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} {value} must be at least 1")
        if args.zero not in (None, 0, 1, 2, 3):
            raise ConfigError(f"--zero-stage {args.zero} is not 0, 1, 2 or 3")
        cluster = CLUSTERS[args.cluster]
        pins = {k: getattr(args, k) for k in ("tp", "cp", "pp", "vp", "ep", "etp", "zero", "recompute", "mbs")}
        seq_length = seq if args.seq_length is None else args.seq_length
        if seq_length > model_cfg.max_position_embeddings:
            raise ConfigError(f"--seq-length {seq_length} is longer than {args.model}'s max_position_embeddings="
                              f"{model_cfg.max_position_embeddings}")
        result = search(model_cfg, cluster, args.gpus, seq_length, args.global_batch_size,
                        keep=args.top, **pins)
    except ConfigError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return PlanResults(2)
    print(format_plan(result, args.model, model_cfg, cluster, note, args.top))
    flops = megatron_flops(model_cfg, args.global_batch_size, seq_length)["total"]
    top = [{**asdict(p.layout), "gib": round(p.memory["total"] / GiB, 1), "step_s": round(p.estimate["step_time"], 3),
            "mfu_pct": round(100 * p.estimate["mfu"], 1)} for p in result.plans[:args.top]]
    return PlanResults(0 if result.plans else 1, float(f"{flops:.3g}"), result.considered,
                       len(result.plans) + result.unranked, top)


if __name__ == "__main__":
    sys.exit(main().exit_code)
