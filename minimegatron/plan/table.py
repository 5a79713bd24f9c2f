"""The planner's printout: a header stating every assumption, the ranked layouts, and the
rejected ones counted by reason with one example each.

    print(format_plan(result, model_name, model_cfg, cluster, note, top=10))
"""

from __future__ import annotations

from ..analysis import count_parameters
from ..config import ModelConfig
from .cluster import Cluster, GiB
from .megatron_formulas import megatron_flops, megatron_theoretical_memory
from .search import USABLE_MEMORY, SearchResult
from .step_time import COMPUTE_EFFICIENCY

__all__ = ["format_plan"]

GB = 1e9


def _header(result: SearchResult, name: str, model_cfg: ModelConfig, cluster: Cluster, note: str) -> list[str]:
    s = result.settings
    counts = count_parameters(model_cfg)
    gpus, seq, gbs = s["gpus"], s["seq_length"], s["global_batch_size"]
    nodes = max(1, gpus // cluster.gpus_per_node)
    flops = megatron_flops(model_cfg, gbs, seq)["total"]
    lines = [f"minimegatron.plan: {name} ({counts['total'] / 1e9:.2f}B parameters, {counts['active'] / 1e9:.2f}B "
             f"active per token) on {gpus} x {cluster.name} ({nodes} node(s) of {cluster.gpus_per_node}; "
             f"{cluster.memory_bytes / GiB:.0f} GiB, {cluster.peak_flops / 1e12:.0f} TFLOP/s bf16 dense, "
             f"{cluster.intra_node_bandwidth / GB:.0f} GB/s in a node, {cluster.inter_node_bandwidth / GB:.0f} GB/s "
             f"across, per GPU and direction)",
             f"batch: {gbs} sequences of {seq} tokens = {gbs * seq / 1e6:.2f}M tokens per step; Megatron's "
             f"num_floating_point_operations: {flops:.3g} FLOPs per step (vocabulary padded for tp = 1)"]
    if note:
        lines.append(f"note: {note}")
    lines += [
        "assumptions (minimegatron/plan/step_time.py, search.py):",
        "  bf16 mixed precision, Adam: 2 + 4 + 12 = 18 bytes per parameter before ZeRO; sequence parallelism with "
        "tp > 1; cp by ring (p2p); experts by all-to-all",
        f"  memory: the book's analysis (rank_parameters, activation_memory; MoE layers estimated), fullest of the "
        f"first and last stage, against {USABLE_MEMORY:.0%} of the GPU",
        "  'Megatron': its report_theoretical_memory for the same layout, to compare (no cp term; SP + selective "
        "recompute: compute_activation_memory, anything else: compute_activation_memory_without_sp, +5%)",
        "  layouts the book can run (parallelize.validate_layout): layers split evenly over pp x v, 1F1B or "
        "interleaved, ZeRO-3 without pp, SP or recompute",
        f"  time: compute at {COMPUTE_EFFICIENCY:.0%} of peak (+ recomputed forwards); tp/ep/pp messages exposed; "
        f"cp ring hidden behind attention; gradient reduction hidden behind one micro-batch; ring algorithms, "
        f"bandwidth only",
        "  bubble = (pp - 1) / (v m) of compute; PFLOP = the step's FLOPs on all GPUs, recomputed forwards included "
        "(MFU counts Megatron's, without them); GB/step = bytes a rank hands to each dimension's collectives",
        f"searched {result.considered} layouts in {result.seconds:.1f} s: {len(result.plans) + result.unranked} fit"
        + (f" ({result.unranked} of them not estimated: compute and bubble alone are slower than the "
           f"best {result.settings['keep']})" if result.unranked else ""),
    ]
    return lines


def _table(result: SearchResult, model_cfg: ModelConfig, top: int) -> list[str]:
    head = (f"{'#':>3}  {'tp':>2} {'cp':>2} {'pp':>3} {'v':>1} {'ep':>3} {'etp':>3} {'dp':>5} {'zero':>4} "
            f"{'recompute':>9} {'mbs':>3} {'m':>5} | {'GiB/GPU':>7} {'states':>6} {'acts':>6} {'Megatron':>8} | "
            f"{'bubble':>6} {'PFLOP':>6} | {'GB/step:':>8} {'tp':>6} {'cp':>6} {'ep':>6} {'pp':>6} {'dp':>6} | {'step s':>7} "
            f"{'tok/s/GPU':>9} {'MFU':>5}")
    lines = [head, "-" * len(head)]
    gpus = result.settings["gpus"]
    for i, plan in enumerate(result.plans[:top], 1):
        L, mem, est = plan.layout, plan.memory, plan.estimate
        megatron = megatron_theoretical_memory(model_cfg, plan.train_cfg, gpus)["total"]
        b = est["comm_bytes"]
        lines.append(
            f"{i:>3}  {L.tp:>2} {L.cp:>2} {L.pp:>3} {L.vp:>1} {L.ep:>3} {L.etp:>3} {L.dp:>5} {L.zero:>4} "
            f"{L.recompute:>9} {L.mbs:>3} {L.m:>5} | {mem['total'] / GiB:>7.1f} "
            f"{(mem['total'] - mem['activations']) / GiB:>6.1f} {mem['activations'] / GiB:>6.1f} "
            f"{megatron / GiB:>8.1f} | {est['bubble']:>6.1%} {est['hardware_flops'] / 1e15:>6.0f} | {'':>8} {b['tp'] / GB:>6.2f} {b['cp'] / GB:>6.2f} "
            f"{(b['ep'] + b['etp']) / GB:>6.2f} {b['pp'] / GB:>6.2f} "
            f"{(b['dp'] + b['expert-dp'] + b['embedding']) / GB:>6.2f} | {est['step_time']:>7.3f} "
            f"{est['tokens_per_second_per_gpu']:>9.0f} {est['mfu']:>5.1%}")
    return lines


def _rejections(result: SearchResult) -> list[str]:
    total = sum(result.rejected.values())
    lines = [f"rejected: {total} layouts, by the first check each fails (numbers replaced by #), one example each:"]
    for pattern, count in result.rejected.most_common():
        layout, message = result.examples[pattern]
        lines.append(f"  {count:>7}  {message}")
        lines.append(f"           e.g. {layout}")
    return lines


def format_plan(result: SearchResult, name: str, model_cfg: ModelConfig, cluster: Cluster, note: str = "",
                top: int = 10) -> str:
    """The whole printout (see the module docstring)."""
    lines = _header(result, name, model_cfg, cluster, note) + [""]
    if result.plans:
        lines += [f"top {min(top, len(result.plans))} by estimated step time:"] + _table(result, model_cfg, top)
    else:
        lines.append("NO layout fits: see the reasons below")
    return "\n".join(lines + [""] + _rejections(result))
