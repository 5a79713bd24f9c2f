"""How much arithmetic one training step costs: exact matmul FLOPs, and the famous rules.

Shape legend (the one of model/gpt.py):
  b micro-batch size     s sequence length     h hidden size        V vocabulary size
  a query heads          g key/value heads     d head size (h / a)  f MLP inner size
  L layers

One multiply-add is 2 FLOPs, so a matmul [m, k] @ [k, n] costs 2 m k n FLOPs. Everything
else a transformer does (norms, softmax, GELU, residual adds, RoPE) is O(b s h) or
O(b a s^2) elementwise work, small next to the matmuls, and not counted here, as in every
paper below and in `torch.utils.flop_counter.FlopCounterMode`.

Backward = 2 x forward, for every matmul: Y = X W needs dX = dY W^T (one matmul the size of
the forward one) and dW = X^T dY (another). Every matmul of our model has both operands
requiring a gradient (even the first layer's: its input is a norm output, which depends on
the norm's weight), so the factor is exactly 2.
"""

from __future__ import annotations

from ..config import ModelConfig
from .params import count_parameters


def flops_per_token_6n(config: ModelConfig, *, include_embedding: bool = False) -> int:
    """The 6N rule: training FLOPs per token ~= 6 N.

        C ~= 6 N   per token   (2N forward + 4N backward)

    Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Section 2.1 (eq. 2.2 and
    Table 1): C_forward ~= 2N + 2 n_layer n_ctx d_attn, and backward is twice the forward.
    Kaplan's N is the NON-embedding parameter count (`count_parameters(...)["non_embedding"]`),
    which is the default here; `include_embedding=True` uses every parameter instead (what
    many later papers do, e.g. for Chinchilla-style compute budgets).

    What the rule leaves out, and what `training_flops` counts exactly:
      - attention's own matmuls, q k^T and probs @ v: 4 a d s = 4 h s FLOPs per token and
        layer in the forward pass (not parameters, so not in N); small while s << 6h;
      - the logits matmul h -> V: 2 V h per token forward (excluded with N non-embedding);
      - the embedding lookup, which is a gather and costs no multiply at all (so counting
        the embedding in N over-counts).
    Norm and bias parameters are in N but do not multiply a whole matrix; negligible.
    """
    counts = count_parameters(config)
    n = counts["total"] if include_embedding else counts["non_embedding"]
    return 6 * (n - (counts["total"] - counts["active"]))   # a GPT-MoE: the experts a token uses


def training_flops(config: ModelConfig, batch: int, seq: int) -> dict:
    """Exact matmul FLOPs of one forward and backward pass of OUR model on a [b, s] batch.

    Forward, per layer (the matmuls of attention.py and gpt.py, in order):

      "qkv"                     2 b s h (a + 2g) d      x W_qkv^T        [b s, h] @ [h, (a+2g) d]
      "attention_scores"        2 b a s s d             q @ k^T          [b a, s, d] @ [b a, d, s]
      "attention_over_values"   2 b a s s d             probs @ v        [b a, s, s] @ [b a, s, d]
      "proj"                    2 b s (a d) h           out W_proj^T     [b s, a d] @ [a d, h]
      "fc1"                     2 b s h f   (GELU)      x W_fc1^T        [b s, h] @ [h, f]
                                2 b s h 2f  (SwiGLU: gate and up in one matmul)
      "fc2"                     2 b s f h               y W_fc2^T        [b s, f] @ [f, h]

    (fc1 and fc2 over the dense layers only); in each MoE layer of a GPT-MoE instead

      "router"                  2 b s h E               x W_r^T          [b s, h] @ [h, E]
      "experts_fc1"/"_fc2"      fc1 and fc2 of width f_e over b s k rows (each token's k experts)
      "shared_fc1"/"_fc2"       fc1 and fc2 of the shared expert's width over b s rows

    and once per model

      "logits"                  2 b s h V               x W_out^T        [b s, h] @ [h, V]

    Each layer component in the returned dicts is summed over the L layers. Two things to
    notice:
      - with grouped-query attention the q/k/v projection shrinks (g < a), but attention
        itself does not: keys and values are repeated to a heads before the two matmuls;
      - our naive attention computes the full s x s score matrix and masks the upper
        triangle afterwards, so it pays for all s^2 entries; a causal kernel
        (FlashAttention) skips about half of them.

    Returns {"forward": {component: FLOPs, ..., "total"}, "backward": {... 2x each ...},
    "total": forward + backward}.

    Compare with Narayanan et al. 2021 (`narayanan2021_flops_per_iteration`, the paper's formula): for a GPT-2 style
    config (g = a, f = 4h) the forward is 24 b s L h^2 + 4 b s^2 L h + 2 b s h V, so our
    forward + backward equals their count without recomputation, 72 b s L h^2 (1 + s/6h +
    V/12Lh), exactly; their 96 (... V/16Lh) adds one more forward for full recomputation.
    """
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
    return {"forward": forward, "backward": backward,
            "total": forward["total"] + backward["total"]}


def megatron_mlp_flops(config: ModelConfig, tokens: int) -> int:
    """The MLP term of Megatron-LM's `num_floating_point_operations` (megatron/training/
    training.py, transformer_flops; checked 2026-11-24 at commit d98e8a6), written as Megatron
    writes it, for `tokens` tokens of one training step (forward + both backward matmuls):

        3 * 2 * tokens * h * (F f L_dense + F_e k f L_moe + F_s f L_moe)

    f = 3 with SwiGLU (fc1 of 2F plus fc2 of F), else 2; F the dense MLP width, F_e an expert's,
    F_s the shared expert's (0 without one), L_moe the layers with i % moe_layer_freq == 0. The
    router's h x E matmul is not in it (training_flops counts it, "router")."""
    f = 3 if config.activation == "swiglu" else 2
    L = config.num_layers
    L_moe = sum(config.is_moe_layer(i) for i in range(L))
    F, h = config.ffn_size, config.hidden_size
    if config.num_experts is None:
        return 3 * 2 * tokens * h * F * f * L
    Fe, Fs, k = config.moe_ffn_size, config.moe_shared_expert_intermediate_size or 0, config.moe_router_topk
    return 3 * 2 * tokens * h * (F * f * (L - L_moe) + Fe * k * f * L_moe + Fs * f * L_moe)


def narayanan2021_flops_per_iteration(config: ModelConfig, batch: int, seq: int, *,
                                 recompute: bool = True) -> int:
    """Narayanan et al. 2021's FLOPs per iteration, for a GPT-2 style model: the paper's
    formula, not a port of Megatron-LM's code (see the last paragraph for how they differ).

    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
    (SC'21), Section 5.1 (derivation in its appendix), with B the batch in sequences:

        F = 96 B s L h^2 (1 + s / (6h) + V / (16 L h))       with full activation recomputation

    Derivation: a layer's forward costs 24 B s h^2 (QKV 6, proj 2, MLP 16) + 4 B s^2 h
    (scores and attention over values); forward + recomputed forward + backward (2x) = 4
    forward passes, hence 96 B s L h^2 + 16 B s^2 L h; the logits cost 2 B s h V forward and
    are not recomputed: 3 x, hence 6 B s h V. With `recompute=False` there are 3 passes:

        F = 72 B s L h^2 (1 + s / (6h) + V / (12 L h))

    the same derivation with three passes (the paper states only the 96 form), and what
    `training_flops(...)["total"]` gives for g = a, f = 4h. The formula ignores GQA and
    SwiGLU (it assumes 3h for q, k, v and 4h for the MLP), whatever `config` says, and V is
    `config.vocab_size` as given.

    Megatron-LM's own throughput log, `num_floating_point_operations` in
    megatron/training/training.py (checked 2026-11-24), is a different function: three
    passes (recomputation is not counted), GQA, SwiGLU and MoE accounted for, the causal half
    of the attention scores, and the logits counted with the PADDED vocabulary
    (`args.padded_vocab_size`, a multiple of 128 x tp by default; chapter 02, section 3.3),
    so its figure differs from this one.
    """
    B, s, L, h, V = batch, seq, config.num_layers, config.hidden_size, config.vocab_size
    passes = 4 if recompute else 3
    return passes * (24 * B * s * L * h * h + 4 * B * s * s * L * h) + 6 * B * s * h * V


__all__ = ["flops_per_token_6n", "training_flops", "megatron_mlp_flops", "narayanan2021_flops_per_iteration"]
