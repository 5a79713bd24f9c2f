"""How long one optimizer step of a layout should take on a cluster: compute at an assumed
efficiency, plus the communication that is not hidden, stretched by the pipeline bubble.

    step_estimate(model_cfg, train_cfg, world, cluster) -> {"step_time", "mfu", "flops", "comm", ...}

The model (its constants are assumptions, printed above the planner's table):

  FLOPs      megatron_formulas.megatron_flops of the global batch, plus recomputed forwards
             (full: (mlp + attention + core) / 3; selective: core / 3), spread evenly over ranks
  compute    at COMPUTE_EFFICIENCY of peak
  bytes      per dimension, in the ledger's convention: analysis.step_communication for tp,
             cp, ep, etp, pp and the tied embedding (MoE messages at balanced routing), and
             the gradients: ZeRO-0 all-reduce; ZeRO-1, 2 reduce-scatter + all-gather of bf16
             shards; ZeRO-3 all-gathers per micro-batch + one reduce-scatter
  time       ring algorithms over n: all-reduce 2 (n - 1) / n x bytes, reduce-scatter and
             all-to-all (n - 1) / n x the input, all-gather (n - 1) x the shard, a send its
             bytes; NVLink inside a node, the network across (cluster.py); no latency term
  overlap    tp, ep, etp, pp: exposed; cp's ring behind the core attention; dp, expert-dp
             behind one micro-batch's compute (ZeRO-3: each micro-batch's); tied embedding exposed

  step time  = (m + (p - 1) / v) t_mb + exposed gradient communication + embedding all-reduce,
             t_mb the slower of the first and last stages' micro-batch
  MFU        = model FLOPs / (step time x GPUs x peak)"""

from __future__ import annotations

from collections import Counter

from ..analysis import count_parameters, rank_parameters, step_communication
from ..analysis.communication import gradient_element_size
from ..config import ModelConfig, TrainConfig
from ..pp import bubble_fraction, stage_layers
from .cluster import Cluster
from .megatron_formulas import megatron_flops
from ..tp.layers import pad_vocab_size
from .rank_memory import pipeline_kind

__all__ = ["COMPUTE_EFFICIENCY", "step_estimate", "compute_bound", "stage_messages", "wire_bytes", "group_shapes"]

# The share of the peak FLOP/s the GEMMs of a step reach when nothing waits for the network.
# End-to-end, well-tuned Megatron-style runs report 38-43% MFU for Llama 3 405B on 16K H100s
# (Dubey et al. 2024, Table 4), communication and bubble included: 50% before those losses.
COMPUTE_EFFICIENCY = 0.5

DIMENSIONS = ("tp", "cp", "ep", "etp", "pp", "dp", "expert-dp", "embedding")


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank puts on its link for one call over a group of n (ring algorithms)."""
    if n <= 1 or op == "recv":
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n * nbytes, "reduce_scatter": (n - 1) / n * nbytes,
            "all_to_all": (n - 1) / n * nbytes, "all_gather": (n - 1) * nbytes, "send": nbytes}[op]


def group_shapes(cfg: TrainConfig, world: int) -> dict[str, tuple[int, int]]:
    """{dimension: (stride, size)} of a rank's groups in parallel_state's order tp-cp-ep-dp-pp (experts:
    etp-ep-expert_dp-pp); the tied embedding's placed like the pipeline's."""
    tp, cp, pp = cfg.tensor_model_parallel_size, cfg.context_parallel_size, cfg.pipeline_model_parallel_size
    ep, etp = cfg.expert_model_parallel_size, cfg.etp
    return {"tp": (1, tp), "cp": (tp, cp), "dp": (tp, world // (tp * pp)), "pp": (world // pp, pp),
            "embedding": (world // pp, pp), "etp": (1, etp), "ep": (etp, ep),
            "expert-dp": (etp * ep, world // (etp * ep * pp))}


def _moe_balanced(model_cfg: ModelConfig, cfg: TrainConfig, counters: dict, moe_layers: int) -> None:
    """Add the dispatcher's routing-dependent messages at balanced routing to counters["ep"] and
    ["etp"]: R = T_r k rows per MoE layer and micro-batch (T_r = b s / cp / tp) each way, combine
    as large as dispatch; with etp > 1 the received rows all-gathered and outputs reduce-scattered
    over etp (and again in the backward)."""
    ep = counters.get("ep")
    if ep:
        added = Counter()
        for (op, tag, nbytes), calls in ep.items():
            if tag.endswith("moe-dispatch"):                      # "moe-dispatch", "recompute moe-dispatch"
                added[(op, tag.replace("dispatch", "combine"), nbytes)] += calls
            if tag == "moe-combine-bwd":
                added[(op, "moe-dispatch-bwd", nbytes)] += calls
        ep.update(added)
    if cfg.etp > 1 and moe_layers:
        tokens = cfg.micro_batch_size * cfg.seq_length // cfg.context_parallel_size // cfg.tensor_model_parallel_size
        rows = tokens * model_cfg.moe_router_topk * model_cfg.hidden_size * model_cfg.dtype.itemsize
        calls = moe_layers * cfg.grad_accum_steps
        etp = counters.setdefault("etp", Counter())
        for tag in ("moe-etp", "moe-etp-bwd"):
            etp[("all_gather", tag, rows)] += calls
            etp[("reduce_scatter", tag, cfg.etp * rows)] += calls


def _gradient_messages(model_cfg: ModelConfig, cfg: TrainConfig, world: int, counts: dict) -> dict[str, Counter]:
    """{"dp": ..., "expert-dp": ...}: the step's gradient and ZeRO parameter messages, for a rank
    holding `counts` (analysis.rank_parameters')."""
    g, p = gradient_element_size(model_cfg, cfg), model_cfg.dtype.itemsize
    shapes = group_shapes(cfg, world)
    out = {}
    for dim, n in (("dp", counts["dense"]), ("expert-dp", counts["experts"])):
        shards = shapes[dim][1]
        if n == 0 or shards == 1:
            continue
        shard = -(-n // shards)
        if cfg.zero_stage == 0:
            out[dim] = Counter({("all_reduce", "grads", n * g): 1})
        elif cfg.zero_stage in (1, 2):
            out[dim] = Counter({("reduce_scatter", "grads", n * g): 1, ("all_gather", "params", shard * p): 1})
        else:                                   # ZeRO-3 (dp/fsdp.py, no pipeline): per unit and micro-batch
            out[dim] = _zero3_messages(model_cfg, cfg, n, shards, g, p)
    return out


def _zero3_messages(model_cfg: ModelConfig, cfg: TrainConfig, n: int, shards: int, g: int, p: int) -> Counter:
    """ZeRO-3's messages of one step (dp/fsdp.py's units): every unit's shard all-gathered for its
    forward and its backward per micro-batch (not the embedding's backward; tied embeddings reuse
    the embedding unit), gradients reduce-scattered once. Padding lumped over the total (up to
    dp - 1 elements a unit apart)."""
    m, h = cfg.grad_accum_steps, model_cfg.hidden_size
    embedding = (pad_vocab_size(model_cfg.vocab_size, cfg.tensor_model_parallel_size,
                                model_cfg.make_vocab_size_divisible_by) * h // cfg.tensor_model_parallel_size
                 + count_parameters(model_cfg)["position_embedding"])
    tied = not model_cfg.untie_embeddings_and_output_weights
    shard, embedding_shard = -(-(n - embedding) // shards), -(-embedding // shards)
    return Counter({("reduce_scatter", "grads", n * g): 1,
                    ("all_gather", "params", shard * p): 2 * m,                         # the other units
                    ("all_gather", "params", embedding_shard * p): (1 + 2 * tied) * m}) + \
        Counter({("reduce_scatter", "grads", embedding_shard * shards * g): int(tied)})


def stage_messages(model_cfg: ModelConfig, cfg: TrainConfig, world: int, pp_rank: int,
                   counts: dict | None = None) -> dict[str, Counter]:
    """{dimension: Counter({(op, tag, bytes): calls})}: one optimizer step's messages on a rank of
    stage pp_rank, in the ledger's convention (comparable with run_report.records_by_dimension)."""
    counters = step_communication(model_cfg, cfg, world, pp_rank)
    if any(c is None for c in counters.values()):
        raise ValueError(f"step_communication does not compute {[d for d, c in counters.items() if c is None]} "
                         f"for this layout")
    pp, v = cfg.pipeline_model_parallel_size, cfg.num_virtual_stages_per_pipeline_rank
    moe_layers = sum(model_cfg.is_moe_layer(i) for chunk in range(v)
                     for i in stage_layers(model_cfg.num_layers, pp, pp_rank, v, chunk))
    _moe_balanced(model_cfg, cfg, counters, moe_layers)
    counts = rank_parameters(model_cfg, cfg, pp_rank) if counts is None else counts
    counters.update(_gradient_messages(model_cfg, cfg, world, counts))
    return counters


def _stage_times(model_cfg: ModelConfig, cfg: TrainConfig, world: int, cluster: Cluster, pp_rank: int,
                 counts: dict, compute_mb: float, core_mb: float) -> tuple[float, dict, dict]:
    """(step time, {dimension: ledger bytes}, {dimension: seconds on the wire}) for stage pp_rank."""
    counters = stage_messages(model_cfg, cfg, world, pp_rank, counts)
    shapes = group_shapes(cfg, world)
    nbytes, seconds = {}, {}
    for dim, counter in counters.items():
        stride, size = shapes.get(dim, (1, 1))
        bandwidth = cluster.group_bandwidth(stride, size)
        nbytes[dim] = sum(n * calls for (_, _, n), calls in counter.items())
        members = 2 if dim in ("pp", "embedding") else size        # p2p pairs; the first and last stage
        seconds[dim] = sum(wire_bytes(op, n, members) * calls
                           for (op, _, n), calls in counter.items()) / bandwidth
    m = cfg.grad_accum_steps
    per_mb = sum(seconds.get(d, 0.0) for d in ("tp", "ep", "etp", "pp")) / m
    per_mb += max(0.0, seconds.get("cp", 0.0) / m - core_mb)
    t_mb = compute_mb + per_mb
    exposed = seconds.get("embedding", 0.0)
    for dim in ("dp", "expert-dp"):
        if dim not in counters:
            continue
        if cfg.zero_stage == 3:
            gathers = sum(wire_bytes(op, n, shapes[dim][1]) * c for (op, _, n), c in counters[dim].items()
                          if op == "all_gather") / cluster.group_bandwidth(*shapes[dim])
            exposed += m * max(0.0, gathers / m - compute_mb) + max(0.0, seconds[dim] - gathers - compute_mb)
        else:
            exposed += max(0.0, seconds[dim] - compute_mb)
    pp, v = cfg.pipeline_model_parallel_size, cfg.num_virtual_stages_per_pipeline_rank
    return (m + (pp - 1) / v) * t_mb + exposed, nbytes, seconds


def _compute(model_cfg: ModelConfig, cfg: TrainConfig, world: int, cluster: Cluster,
             flops: dict | None) -> tuple[float, float, float, dict]:
    """(hardware FLOPs of the step, seconds of one micro-batch's compute on a rank, of its core
    attention, Megatron's FLOPs with "tokens" of the global batch)."""
    tp, pp, m = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.grad_accum_steps
    batch = cfg.micro_batch_size * m * world // (tp * pp * cfg.context_parallel_size)
    flops = dict(megatron_flops(model_cfg, batch, cfg.seq_length, tp) if flops is None else flops,
                 tokens=batch * cfg.seq_length)
    again = {"full": (flops["mlp"] + flops["attention"] + flops["core"]) / 3,
             "selective": flops["core"] / 3 if "core_attn" in cfg.recompute_modules else 0.0}.get(
                 cfg.recompute_granularity, 0.0)
    hardware = flops["total"] + again
    rate = cluster.peak_flops * COMPUTE_EFFICIENCY
    return hardware, hardware / world / m / rate, flops["core"] / world / m / rate, flops


def compute_bound(model_cfg: ModelConfig, cfg: TrainConfig, world: int, cluster: Cluster,
                  flops: dict | None = None) -> float:
    """The step time if no byte were exposed, (m + (p - 1) / v) x one micro-batch's compute: a
    lower bound of step_estimate's "step_time" (the search skips layouts it already rules out)."""
    _, compute_mb, _, _ = _compute(model_cfg, cfg, world, cluster, flops)
    return (cfg.grad_accum_steps + (cfg.pipeline_model_parallel_size - 1)
            / cfg.num_virtual_stages_per_pipeline_rank) * compute_mb


def step_estimate(model_cfg: ModelConfig, cfg: TrainConfig, world: int, cluster: Cluster, *,
                  parameters: dict | None = None, flops: dict | None = None) -> dict:
    """The step of a layout on `cluster` (module docstring): {"model_flops", "hardware_flops",
    "bubble" ((p - 1) / (v m)), "compute_per_microbatch", "comm_bytes" and "comm_seconds"
    ({dimension: per step, slowest stage}), "step_time", "tokens_per_second_per_gpu", "mfu"}.
    `parameters` and `flops` may be passed when known."""
    pp, m, v = cfg.pipeline_model_parallel_size, cfg.grad_accum_steps, cfg.num_virtual_stages_per_pipeline_rank
    hardware, compute_mb, core_mb, flops = _compute(model_cfg, cfg, world, cluster, flops)
    stages = {0, pp - 1}
    parameters = parameters or {r: rank_parameters(model_cfg, cfg, r) for r in stages}
    results = [_stage_times(model_cfg, cfg, world, cluster, r, parameters[r], compute_mb, core_mb)
               for r in sorted(stages)]
    step, _, _ = max(results, key=lambda r: r[0])
    comm_bytes = {d: max(r[1].get(d, 0) for r in results) for d in DIMENSIONS}
    comm_seconds = {d: max(r[2].get(d, 0.0) for r in results) for d in DIMENSIONS}
    return {"model_flops": flops["total"], "hardware_flops": hardware,
            "bubble": bubble_fraction(pipeline_kind(cfg), pp, m, v)["bubble_over_ideal"],
            "compute_per_microbatch": compute_mb, "comm_bytes": comm_bytes, "comm_seconds": comm_seconds,
            "step_time": step, "tokens_per_second_per_gpu": flops["tokens"] / step / world,
            "mfu": flops["total"] / (step * world * cluster.peak_flops)}
