"""Megatron-LM's own estimates, re-derived in the book's names: the FLOPs its training log
reports and the memory estimate it prints on rank 0 with the first log lines.

  megatron/training/training.py                num_floating_point_operations(args, batch_size)
  megatron/training/theoretical_memory_usage.py compute_weight_and_optimizer_memory(args),
                                               compute_activation_memory(args, num_microbatches),
                                               compute_activation_memory_without_sp(...),
                                               report_theoretical_memory(args, num_microbatches)

B sequences in the global batch, b micro-batch, s sequence, h hidden, a query heads, g key/value
groups, d head size, f / f_e / f_s the dense, expert and shared-expert widths, E experts, k
top-k, L layers (L_moe with experts), Vp the padded vocabulary, t tp, p pp, v virtual stages,
m micro-batches. F = 3 with SwiGLU, else 2. Covers what ModelConfig describes (dense and MoE
layers, tied or untied embeddings, the distributed optimizer); BSHD only (no MLA, MTP, THD).
Written from the formulas; tests/test_plan.py checks them against hand-worked Llama-3 8B and
Mixtral 8x7B numbers and the book's `analysis`."""

from __future__ import annotations

from ..config import ModelConfig, TrainConfig
from ..tp import pad_vocab_size

__all__ = ["megatron_flops", "megatron_weight_and_optimizer_bytes", "megatron_activation_bytes",
           "megatron_theoretical_memory"]


def _layer_counts(config: ModelConfig) -> tuple[int, int]:
    """(L_dense, L_moe): the layers whose MLP is dense, and those with experts."""
    moe = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    return config.num_layers - moe, moe


def megatron_flops(config: ModelConfig, batch: int, seq: int, tp: int = 1) -> dict[str, int]:
    """Megatron's `num_floating_point_operations(args, batch)`: the FLOPs of one step over
    `batch` sequences (B) of `seq` tokens (s), the global batch, forward and backward, without
    recomputation. Returns {"mlp", "attention", "core", "logits", "total"} in FLOPs:

      "mlp"        the MLPs' GEMMs: each dense layer's, and in each MoE layer the k experts a
                   token visits (config.moe_router_topk, each config.moe_ffn_size wide) and the
                   shared expert (config.moe_shared_expert_intermediate_size), F matrices each
                   (3 with SwiGLU: gate, up, down; 2 with GELU)
      "attention"  the q, k, v projections (a heads, g key/value groups of d = kv_channels) and
                   the output projection
      "core"       the scores q k^T and probabilities times v, of which Megatron counts only
                   the lower triangle the causal mask keeps
      "logits"     the output layer, over the vocabulary padded for `tp`
                   (tp.layers.pad_vocab_size: Vp)
      "total"      the sum

    Every GEMM runs three times (forward, weight gradient, data gradient) at 2 FLOPs per
    multiply-add. Not counted (as in Megatron): the router's h x E product, norms, softmax,
    RoPE, the embedding lookup. `tp` only sets Vp. Layers: config.is_moe_layer(i) says which
    hold experts (_layer_counts).

    How it differs from the book's `analysis.training_flops(config, B, s)["total"]`, which
    counts the matmuls our model really runs: that counts all s^2 scores (the masked half too:
    naive attention computes it), the router's 6 B s h E, and the logits over the unpadded V.
    So  megatron = book - core/2 - router + 6 B s h (Vp - V)  (tests/test_plan.py checks it).
    """
    # BEGIN EXERCISE 8.4: Megatron's FLOPs of a step | hint: count multiply-adds per token for each GEMM (the MLP's F matrices, the experts a token visits, q/k/v/o, the output layer over the padded vocabulary), then the scores: which half does the causal mask let Megatron skip?
    config.validate()
    h, a, g, d, L = (config.hidden_size, config.num_attention_heads, config.query_groups,
                     config.kv_channels, config.num_layers)
    F = 3 if config.activation == "swiglu" else 2
    L_dense, L_moe = _layer_counts(config)
    tokens = batch * seq
    mlp_width = config.ffn_size * L_dense                                  # sum of F-less widths
    if config.num_experts is not None:
        mlp_width += (config.moe_ffn_size * config.moe_router_topk
                      + (config.moe_shared_expert_intermediate_size or 0)) * L_moe
    Vp = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
    parts = {
        "mlp": 6 * tokens * h * F * mlp_width,
        "attention": 6 * tokens * L * (h * (a * d + 2 * g * d) + a * d * h),
        "core": 6 * tokens * seq * L * a * d,
        "logits": 6 * tokens * h * Vp,
    }
    parts["total"] = sum(parts.values())
    return parts
    # END EXERCISE


def _parameter_groups(config: ModelConfig, tp: int) -> dict[str, float]:
    """Megatron's split of the whole model's parameter elements: "tp_sharded" (attention, dense MLPs,
    shared experts), "replicated" (norms, routers), "experts" (cut ep x etp ways), "embedding"
    (Vp h). No biases (Megatron assumes none but the router's)."""
    h, a, g, d = config.hidden_size, config.num_attention_heads, config.query_groups, config.kv_channels
    gated = 1.5 if config.activation == "swiglu" else 1.0
    norm = 1 if config.normalization == "RMSNorm" else 2                  # RMSNorm has no bias
    L_dense, L_moe = _layer_counts(config)
    attention = 2 * h * h * (1 + g / a) * (a * d / h)                     # qkv + proj = 2 h a d (1 + g/a)
    dense_mlp = 2 * h * config.ffn_size * gated
    layernorms = 2 * h * norm
    shared = experts = router = 0.0
    if config.num_experts is not None:
        E = config.num_experts
        shared = 2 * h * (config.moe_shared_expert_intermediate_size or 0) * gated
        experts = 2 * h * config.moe_ffn_size * E * gated
        router = h * E + (E if config.add_bias_linear else 0)
    return {"tp_sharded": (attention + dense_mlp) * L_dense + (attention + shared) * L_moe,
            "replicated": layernorms * L_dense + (layernorms + router) * L_moe + norm * h,
            "experts": experts * L_moe,
            "embedding": h * pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)}


def megatron_weight_and_optimizer_bytes(config: ModelConfig, cfg: TrainConfig, world: int) -> float:
    """Megatron's compute_weight_and_optimizer_memory: bytes of parameters, gradients and optimizer
    state on the first pipeline stage (the most loaded), bf16 with fp32 main grads, params and Adam:

        18 bytes per parameter; with the distributed optimizer (zero_stage >= 1) 6 + 12 / dp,
        dp = world / (t p cp), and 6 + 12 / dp_e for routed experts, dp_e = world / (etp ep p)
      dense on the rank   (tp_sharded / p + Vp h) / t + replicated / p  (+ Vp h / t when untied and p = 1)
      experts on the rank experts / (p etp ep)

    Differs from the book's (analysis.rank_parameters x 18): layers and the final norm divided
    evenly over p, no biases, no tied copy on the last stage, optimizer divided by dp without cp,
    every zero_stage >= 1 read as the distributed optimizer."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    groups = _parameter_groups(config, tp)
    dense = (groups["tp_sharded"] / pp + groups["embedding"]) / tp + groups["replicated"] / pp
    if config.untie_embeddings_and_output_weights and pp == 1:
        dense += groups["embedding"] / tp
    experts = groups["experts"] / (pp * cfg.etp * cfg.expert_model_parallel_size)
    dp = world // (tp * pp * cfg.context_parallel_size)
    expert_dp = world // (cfg.etp * cfg.expert_model_parallel_size * pp)

    def bytes_per_parameter(shards: int) -> float:
        return 18 if cfg.zero_stage == 0 else 6 + 12 / shards

    return dense * bytes_per_parameter(dp) + experts * bytes_per_parameter(expert_dp)


def megatron_activation_bytes(config: ModelConfig, cfg: TrainConfig) -> float:
    """Megatron's activation estimate for the first pipeline stage, in bytes.

    SP and recompute_granularity "selective" (compute_activation_memory):

        s b h (18 + 4 f / h) L                       the layers (34 s b h for f = 4h)
      + 8 s b p + s b h p                            embedding input and its dropout, p in flight
      x (1 + (p - 1) / (p v))                        interleaved (v > 1)
      x min(1, m / p)                                1F1B (v = 1, p > 1), m < p
      + 4 s b h (1 + Vp / h)                         p = 1 only: output layer input and the loss
      all / t

    anything else (compute_activation_memory_without_sp):

        s b h (10 + 24 / t) L + 8 s b p + s b h p    then the same two pipeline factors
      + 2 (s b Vp / t + s b h)                       p = 1 only: logits and final norm output
      x 1.05

    Neither divides by cp or counts routed tokens (f is the dense width); the second ignores
    recompute. The planner uses analysis.activation_memory instead."""
    s, b, h = cfg.seq_length, cfg.micro_batch_size, config.hidden_size
    tp, pp, m = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.grad_accum_steps
    v = cfg.num_virtual_stages_per_pipeline_rank
    Vp = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
    with_sp = cfg.sequence_parallel and cfg.recompute_granularity == "selective"
    per_layer = s * b * h * (18 + 4 * config.ffn_size / h) if with_sp else s * b * h * (10 + 24 / tp)
    total = per_layer * config.num_layers + 8 * s * b * pp + s * b * h * pp
    if v > 1:
        total *= 1 + (pp - 1) / (pp * v)
    elif pp > 1:
        total *= min(1, m / pp)
    if with_sp:
        if pp == 1:
            total += s * b * h * 4 * (1 + Vp / h)
        return total / tp
    if pp == 1:
        total += (s * b * Vp / tp + s * b * h) * 2
    return total * 1.05


def megatron_theoretical_memory(config: ModelConfig, cfg: TrainConfig, world: int) -> dict[str, float]:
    """`report_theoretical_memory`'s three numbers, in bytes (Megatron prints MB = 2^20 bytes):
    {"weight_and_optimizer", "activations", "total"}."""
    weights = megatron_weight_and_optimizer_bytes(config, cfg, world)
    activations = megatron_activation_bytes(config, cfg)
    return {"weight_and_optimizer": weights, "activations": activations, "total": weights + activations}
