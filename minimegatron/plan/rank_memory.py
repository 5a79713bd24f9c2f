"""The bytes one rank of a 5D layout holds at its peak: parameters, gradients, optimizer state
and activations, from the book's own accounting (minimegatron.analysis), stage by stage.

    rank_memory(model_cfg, train_cfg, world, pp_rank)  -> {"params", "grads", "optimizer",
                                                           "zero3_gathered", "zero3_pending", "activations",
                                                           "total", ...}

n: the rank's dense (and expert) parameter elements (analysis.rank_parameters); p, g, K bytes
per parameter (analysis.adam_bytes_per_parameter; bf16: 2, 4, 12); D = dp x cp ("dp-cp"),
D_e = world / (etp ep pp) for the experts:

  params      p n                 ZeRO-3: p ceil(n / D)
  grads       g n                 ZeRO-2, 3: g ceil(n / D)
  optimizer   K n                 ZeRO-1, 2, 3: K ceil(n / D)
  zero3_pending                   ZeRO-3, m > 1: g D ceil(n / D) (dp/fsdp.py's full-size buffer)
  zero3_gathered                  ZeRO-3: one unit gathered whole, p n_d / (the rank's layers)
With tp = pp = cp = 1 these are analysis.training_memory's numbers.

Activations: analysis.activation_memory per layer for b sequences of s / cp tokens, on a tp
rank with SP when tp > 1, under the layout's recompute (MoE layers: `moe_mlp_bytes`'s estimate;
ring attention: `_ring_attention_change`), held for as many micro-batch-chunks as the schedule
keeps in flight (pp.peak_in_flight); the first stage adds the embedding's tensors per
micro-batch in flight, the last the final norm's, output layer's and loss's once."""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from ..analysis import activation_memory, adam_bytes_per_parameter, rank_parameters
from ..analysis.activations import INDEX_BYTES
from ..analysis.memory import zero_held
from ..config import ModelConfig, TrainConfig
from ..pp import peak_in_flight, schedule, stage_layers

__all__ = ["rank_memory", "rank_states", "layer_activation_bytes", "moe_mlp_bytes", "pipeline_kind"]

_FIRST = ("tokens", "position_ids", "embedding_dropout_mask", "rope_tables")   # outside the layers, stage 0
_LAST = ("final_norm", "output_input", "log_softmax", "labels")               # and on the last stage


def pipeline_kind(cfg: TrainConfig) -> str:
    """The schedule a layout runs: "interleaved" with v > 1 chunks per rank, else "1f1b"."""
    return "interleaved" if cfg.num_virtual_stages_per_pipeline_rank > 1 else "1f1b"


@lru_cache(maxsize=4096)
def _in_flight(kind: str, pp: int, pp_rank: int, m: int, v: int) -> int:
    """pp.peak_in_flight of the schedule, simulated over at most 3 pp micro-batches (the warm-up is
    full by then), so a large global batch plans as fast as a small one."""
    if kind in ("1f1b", "interleaved"):
        m = min(m, 3 * pp)
    return peak_in_flight(schedule(kind, pp, pp_rank, m, v))


def moe_mlp_bytes(model_cfg: ModelConfig, cfg: TrainConfig) -> int:
    """Estimated bytes an MoE layer's MLP part saves for one micro-batch, balanced routing (not
    measured; not called under full recompute). T = b s / cp, T_r = T / tp routed, R = T_r k rows,
    e model bytes, c = 4:

      router       input T_r h e, scores T_r E c, chosen experts T_r k 8
      experts      fc1 input etp R h e, activation R f_e e (GELU) or 3 R f_e e (SwiGLU), fc2 input R f_e e
      combine      expert outputs R h e and their probabilities R c
      shared       fc1 input T_r h e, activation (1 or 3) T f_s / tp e, fc2 input T f_s / tp e"""
    h, e, c = model_cfg.hidden_size, model_cfg.dtype.itemsize, 4
    tp, etp = cfg.tensor_model_parallel_size, cfg.etp
    T = cfg.micro_batch_size * cfg.seq_length // cfg.context_parallel_size
    T_r = T // tp if cfg.sequence_parallel else T
    k, E, fe = model_cfg.moe_router_topk, model_cfg.num_experts, model_cfg.moe_ffn_size
    R = T_r * k
    act = 3 if model_cfg.activation == "swiglu" else 1
    fs = model_cfg.moe_shared_expert_intermediate_size or 0
    return (T_r * h * e + T_r * E * c + T_r * k * INDEX_BYTES
            + etp * R * h * e + act * R * fe * e + R * fe * e
            + R * h * e + R * c
            + ((T_r * h * e + act * T * fs // tp * e + T * fs // tp * e) if fs else 0))


def _ring_attention_change(model_cfg: ModelConfig, cfg: TrainConfig, layer: dict[str, int]) -> int:
    """Bytes a layer saves under ring attention minus the single-device attention of its s / cp tokens:
    the ring keeps its query, output [b, a, s/cp, d], log-sum-exp and stacked K, V [2, b, g, s/cp, d];
    one device kept the qkv output, rotated q and k, and the log-sum-exp (checked by
    chapters/08_capstone/plan_vs_measured.py). Applied to "p2p" without recompute only."""
    tp = cfg.tensor_model_parallel_size
    b, s = cfg.micro_batch_size, cfg.seq_length // cfg.context_parallel_size
    a, g, d, e = (model_cfg.num_attention_heads // tp, model_cfg.query_groups // tp, model_cfg.kv_channels,
                  model_cfg.dtype.itemsize)
    query = layer["query"] if layer["query"] else layer["qkv_output"]
    kept = query + b * a * s * d * e + layer["softmax_logsumexp"] + 2 * b * g * s * d * e
    return kept - (layer["qkv_output"] + layer["query"] + layer["key"] + layer["value"] + layer["softmax_logsumexp"])


def layer_activation_bytes(model_cfg: ModelConfig, cfg: TrainConfig) -> dict[str, int]:
    """{"dense": one dense layer, "moe": one MoE layer, "first": the first stage's tensors
    outside the layers, "last": the last stage's}, bytes for ONE micro-batch on one rank."""
    dense_twin = dataclasses.replace(model_cfg, num_experts=None)
    granularity = cfg.recompute_granularity
    full = dict(recompute_method="uniform", recompute_num_layers=1) if granularity == "full" else {}
    acts = activation_memory(dense_twin, cfg.micro_batch_size, cfg.seq_length // cfg.context_parallel_size,
                             model_cfg.dtype, dropout_mask_itemsize=1, recompute_granularity=granularity,
                             recompute_modules=cfg.recompute_modules, tp=cfg.tensor_model_parallel_size,
                             sequence_parallel=cfg.sequence_parallel, **full)
    dense = acts["layers"] // model_cfg.num_layers
    if cfg.context_parallel_size > 1 and cfg.cp_comm_type == "p2p" and granularity is None:
        dense += _ring_attention_change(model_cfg, cfg, acts["per_layer"])
    moe = dense
    if model_cfg.num_experts is not None and granularity != "full":
        layer = acts["per_layer"]
        moe = dense - layer["fc1_input"] - layer["activation"] - layer["fc2_input"] + moe_mlp_bytes(model_cfg, cfg)
    outside = acts["outside_layers"]
    return {"dense": dense, "moe": moe, "first": sum(outside[k] for k in _FIRST),
            "last": sum(outside[k] for k in _LAST)}


@lru_cache(maxsize=64)
def _bytes_per_parameter(dtype, master_weights: bool, grad_dtype) -> dict:
    return adam_bytes_per_parameter(dtype, master_weights=master_weights, grad_dtype=grad_dtype)


def _sharded(n: int, shards: int, zero: int, m: int, bytes_per: dict) -> dict[str, int]:
    """Bytes of n parameters' state on a rank whose ZeRO stage shards it over `shards` ranks."""
    out = {kind: bytes_per[kind] * elements for kind, elements in zero_held(n, shards, zero).items()}
    out["zero3_pending"] = bytes_per["grads"] * math.ceil(n / shards) * shards if zero == 3 and m > 1 else 0
    return out


def rank_states(model_cfg: ModelConfig, cfg: TrainConfig, world: int, pp_rank: int,
                parameters: dict | None = None) -> dict:
    """{"params", "grads", "optimizer", "zero3_gathered", "zero3_pending"} bytes of a rank of stage
    pp_rank, and "parameters" (analysis.rank_parameters'; pass them if known)."""
    tp, pp, v = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                 cfg.num_virtual_stages_per_pipeline_rank)
    m, zero = cfg.grad_accum_steps, cfg.zero_stage
    counts = rank_parameters(model_cfg, cfg, pp_rank) if parameters is None else parameters
    bytes_per = _bytes_per_parameter(model_cfg.dtype, cfg.bf16 or cfg.fp16, cfg.main_grads_dtype)
    dense = _sharded(counts["dense"], world // (tp * pp), zero, m, bytes_per)
    experts = _sharded(counts["experts"], world // (cfg.etp * cfg.expert_model_parallel_size * pp), zero, m,
                       bytes_per)
    out = {key: dense[key] + experts[key] for key in dense}
    layers_here = model_cfg.num_layers // (pp * v) * v
    # ZeRO-3 gathers a unit whole while it runs: about one layer's share of the rank's dense elements
    out["zero3_gathered"] = bytes_per["params"] * (counts["dense"] // layers_here) if zero == 3 else 0
    out["parameters"] = counts
    return out


def rank_memory(model_cfg: ModelConfig, cfg: TrainConfig, world: int, pp_rank: int, *,
                parameters: dict | None = None, per_microbatch: dict | None = None) -> dict:
    """Bytes a rank of stage pp_rank holds at its peak (module docstring): {"params", "grads",
    "optimizer", "zero3_gathered", "zero3_pending", "activations", "total", "parameters" ({"dense",
    "experts"}), "in_flight"}. `parameters` and `per_microbatch` may be passed when known."""
    pp, v = cfg.pipeline_model_parallel_size, cfg.num_virtual_stages_per_pipeline_rank
    out = rank_states(model_cfg, cfg, world, pp_rank, parameters)
    counts = out.pop("parameters")
    layers = [i for chunk in range(v) for i in stage_layers(model_cfg.num_layers, pp, pp_rank, v, chunk)]
    n_moe = sum(model_cfg.is_moe_layer(i) for i in layers)
    per_mb = layer_activation_bytes(model_cfg, cfg) if per_microbatch is None else per_microbatch
    in_flight = _in_flight(pipeline_kind(cfg), pp, pp_rank, cfg.grad_accum_steps, v)
    chunk = ((len(layers) - n_moe) * per_mb["dense"] + n_moe * per_mb["moe"]) / v
    activations = chunk * in_flight
    if pp_rank == 0:
        activations += per_mb["first"] * math.ceil(in_flight / v)
    if pp_rank == pp - 1:
        activations += per_mb["last"]
    out["activations"] = int(activations)
    out["total"] = sum(out.values())
    out["parameters"], out["in_flight"] = counts, in_flight
    return out
