"""How much arithmetic one training step costs: exact matmul FLOPs, and the published rules.

Shapes as in model/gpt.py (b micro-batch, s sequence, h hidden, V vocabulary, a query heads,
g key/value heads, d = h / a, f MLP inner size, L layers). A matmul [m, k] @ [k, n] is 2 m k n
FLOPs; its backward is exactly 2x (dX and dW, every operand of our model needs a gradient).
Elementwise work (norms, softmax, activations, RoPE) is not counted, as in
torch.utils.flop_counter.FlopCounterMode. Chapter 00, section 3.4 derives the rules."""

from __future__ import annotations

from ..config import ModelConfig
from .params import count_parameters


def flops_per_token_6n(config: ModelConfig, *, include_embedding: bool = False) -> int:
    """Kaplan et al. 2020's C ~= 6 N training FLOPs per token (2N forward + 4N backward), N the
    non-embedding parameters (count_parameters(...)["non_embedding"]), or every parameter with
    `include_embedding=True`. Leaves out attention's q k^T and probs @ v (4 h s per token and layer
    forward) and the logits (2 V h); `training_flops` counts them."""
    counts = count_parameters(config)
    n = counts["total"] if include_embedding else counts["non_embedding"]
    return 6 * (n - (counts["total"] - counts["active"]))   # a GPT-MoE: the experts a token uses


def training_flops(config: ModelConfig, batch: int, seq: int) -> dict:
    """Exact matmul FLOPs of one forward and backward pass of OUR model on a [b, s] batch.

    Forward components, each summed over the L layers:
      "qkv"                    2 b s h (a + 2g) d
      "attention_scores"       2 b a s s d     (all s^2 entries: the naive mask comes after)
      "attention_over_values"  2 b a s s d     (keys and values repeated to a heads under GQA)
      "proj"                   2 b s (a d) h
      "fc1"                    2 b s h f (SwiGLU: 2 b s h 2f)     "fc2"  2 b s f h   (dense layers)
      MoE layers: "router" 2 b s h E; "experts_fc1"/"_fc2" over b s k rows of width f_e;
      "shared_fc1"/"_fc2" over b s rows
      "logits"                 2 b s h V       (once)
    Returns {"forward": {component: FLOPs, ..., "total"}, "backward": {2x each}, "total"}.
    For g = a, f = 4h the total equals narayanan2021_flops_per_iteration(recompute=False)."""
    config.validate()
    h, a, g, d, f = (config.hidden_size, config.num_attention_heads, config.query_groups,
                     config.kv_channels, config.ffn_size)
    V, L, b, s = config.vocab_size, config.num_layers, batch, seq
    fc1_width = lambda width: 2 * width if config.activation == "swiglu" else width   # noqa: E731
    moe_layers = sum(config.is_moe_layer(i) for i in range(L))
    dense_layers = L - moe_layers

    forward = {
        "qkv": L * 2 * b * s * h * (a + 2 * g) * d,
        "attention_scores": L * 2 * b * a * s * s * d,
        "attention_over_values": L * 2 * b * a * s * s * d,
        "proj": L * 2 * b * s * (a * d) * h,
        "fc1": dense_layers * 2 * b * s * h * fc1_width(f),
        "fc2": dense_layers * 2 * b * s * f * h,
        "logits": 2 * b * s * h * V,
    }
    if moe_layers:
        # a GPT-MoE layer (chapter 05): the router [b s, h] @ [h, E]; each token's k experts
        # (b s k rows through an expert's fc1 and fc2, none dropped); the shared expert on every token
        k, fe, shared = config.moe_router_topk, config.moe_ffn_size, config.moe_shared_expert_intermediate_size or 0
        forward.update({
            "router": moe_layers * 2 * b * s * h * config.num_experts,
            "experts_fc1": moe_layers * 2 * b * s * k * h * fc1_width(fe),
            "experts_fc2": moe_layers * 2 * b * s * k * fe * h,
            "shared_fc1": moe_layers * 2 * b * s * h * fc1_width(shared),
            "shared_fc2": moe_layers * 2 * b * s * shared * h,
        })
    forward["total"] = sum(forward.values())
    backward = {name: 2 * flops for name, flops in forward.items()}
    return {"forward": forward, "backward": backward, "total": forward["total"] + backward["total"]}


def megatron_mlp_flops(config: ModelConfig, tokens: int) -> int:
    """The MLP term of Megatron's num_floating_point_operations for `tokens` tokens of one step:
    3 * 2 * tokens * h * (F f L_dense + F_e k f L_moe + F_s f L_moe), f = 3 with SwiGLU else 2, F/F_e/F_s
    the dense, expert and shared-expert widths, L_moe the layers with i % moe_layer_freq == 0; no
    router term. Megatron: megatron/training/training.py, transformer_flops."""
    f = 3 if config.activation == "swiglu" else 2
    L = config.num_layers
    L_moe = sum(config.is_moe_layer(i) for i in range(L))
    F, h = config.ffn_size, config.hidden_size
    if config.num_experts is None:
        return 3 * 2 * tokens * h * F * f * L
    Fe, Fs, k = config.moe_ffn_size, config.moe_shared_expert_intermediate_size or 0, config.moe_router_topk
    return 3 * 2 * tokens * h * (F * f * (L - L_moe) + Fe * k * f * L_moe + Fs * f * L_moe)


def narayanan2021_flops_per_iteration(config: ModelConfig, batch: int, seq: int, *, recompute: bool = True) -> int:
    """Narayanan et al. 2021's FLOPs per iteration (SC'21, Section 5.1), B the batch in sequences:
    96 B s L h^2 (1 + s / (6h) + V / (16 L h)) with full recomputation, 72 B s L h^2 (1 + s / (6h) +
    V / (12 L h)) with `recompute=False` (the same derivation, three passes). Assumes g = a and
    f = 4h whatever `config` says; V is config.vocab_size. Not Megatron's num_floating_point_operations
    (chapter 00, section 3.4 says how they differ)."""
    B, s, L, h, V = batch, seq, config.num_layers, config.hidden_size, config.vocab_size
    passes = 4 if recompute else 3
    return passes * (24 * B * s * L * h * h + 4 * B * s * s * L * h) + 6 * B * s * h * V


__all__ = ["flops_per_token_6n", "training_flops", "megatron_mlp_flops", "narayanan2021_flops_per_iteration"]
