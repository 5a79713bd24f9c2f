"""How many parameters a model has, component by component (shapes as in model/gpt.py, P
max_position_embeddings):

  word embedding        V h
  position embedding    P h                          learned_absolute only
  per layer:
    linear_qkv          (a + 2g) d h  + (a + 2g) d   weight + bias (if add_bias_linear)
    linear_proj         h a d         + h
    linear_fc1          f h  + f  (GELU), 2f h + 2f (SwiGLU)
    linear_fc2          h f  + h
    2 norms             2 * 2h (LayerNorm), 2 * h (RMSNorm)
  final norm            2h or h
  output layer          V h                          untied only

A GPT-2 style layer (g = a, f = 4h, biases, LayerNorm) has 12h^2 + 13h."""

from __future__ import annotations

from ..config import ModelConfig


def count_parameters(config: ModelConfig) -> dict:
    """Parameter elements of the single-device `GPTModel(config)`, by component:

      "embedding" V h; "position_embedding" P h (0 with RoPE); "per_layer" {"qkv_weight",
      "qkv_bias", "proj_weight", "proj_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias",
      "norms", "total"} (biases 0 without add_bias_linear); "layers" L x per_layer; "final_norm";
      "output_layer" (0 when tied); "total" = sum(p.numel() for p in model.parameters());
      "non_embedding" total minus the embeddings and an untied output layer (Kaplan et al.'s N);
      "moe" None, or for a GPT-MoE {"layers", "router" E h, "expert", "shared", "per_moe_layer"};
      "active" the parameters one token uses (k of the E experts)."""
    config.validate()
    h, a, g, d, f = (config.hidden_size, config.num_attention_heads, config.query_groups,
                     config.kv_channels, config.ffn_size)
    V, L = config.vocab_size, config.num_layers
    bias = config.add_bias_linear
    fc1_out = 2 * f if config.activation == "swiglu" else f
    norm = 2 * h if config.normalization == "LayerNorm" else h

    per_layer = {
        "qkv_weight": (a + 2 * g) * d * h,
        "qkv_bias": (a + 2 * g) * d if bias else 0,
        "proj_weight": h * a * d,
        "proj_bias": h if bias else 0,
        "fc1_weight": fc1_out * h,
        "fc1_bias": fc1_out if bias else 0,
        "fc2_weight": h * f,
        "fc2_bias": h if bias else 0,
        "norms": 2 * norm,                       # input_layernorm + pre_mlp_layernorm
    }
    per_layer["total"] = sum(per_layer.values())

    counts = {
        "embedding": V * h,
        "position_embedding": (config.max_position_embeddings * h
                               if config.position_embedding_type == "learned_absolute" else 0),
        "per_layer": per_layer,
        "layers": L * per_layer["total"],
        "final_norm": norm,
        "output_layer": V * h if config.untie_embeddings_and_output_weights else 0,
    }
    counts["moe"] = None
    inactive = 0
    if config.num_experts is not None:
        def mlp(width):
            inner = 2 * width if config.activation == "swiglu" else width
            return inner * h + (inner if bias else 0) + h * width + (h if bias else 0)
        shared = config.moe_shared_expert_intermediate_size
        moe = {"layers": sum(config.is_moe_layer(i) for i in range(L)), "router": config.num_experts * h,
               "expert": mlp(config.moe_ffn_size), "shared": mlp(shared) if shared else 0}
        moe["per_moe_layer"] = moe["router"] + config.num_experts * moe["expert"] + moe["shared"]
        counts["layers"] += moe["layers"] * (moe["per_moe_layer"] - mlp(f))          # in place of a dense MLP
        counts["moe"] = moe
        inactive = moe["layers"] * (config.num_experts - config.moe_router_topk) * moe["expert"]
    counts["total"] = (counts["embedding"] + counts["position_embedding"] + counts["layers"]
                       + counts["final_norm"] + counts["output_layer"])
    counts["active"] = counts["total"] - inactive
    counts["non_embedding"] = (counts["total"] - counts["embedding"]
                               - counts["position_embedding"] - counts["output_layer"])
    return counts


def tensor_parallel_parameters(config: ModelConfig, tp: int) -> dict:
    """Parameter elements ONE rank of a tensor-parallel group of `tp` holds (chapter 02's layout):

      "split"       what is cut tp ways, per rank: qkv, proj, fc1, fc2 weights and the qkv, fc1
                    biases / tp, vocabulary matrices as Vp/tp rows (Vp = V padded to
                    make_vocab_size_divisible_by * tp)
      "padding"     of "split", the padded vocabulary rows: (Vp - V) h / tp per matrix
      "replicated"  norms, position embedding, linear_proj's and linear_fc2's biases
      "per_rank"    split + replicated
      "total"       count_parameters(config)["total"]
    ConfigError naming the numbers when the layout cannot exist (12 heads over tp = 8)."""
    from ..tp import check_tensor_parallel_config, pad_vocab_size
    check_tensor_parallel_config(config, tp)                # ConfigError for a layout that cannot exist
    c = count_parameters(config)
    layer = c["per_layer"]
    h, V = config.hidden_size, config.vocab_size
    Vp = pad_vocab_size(V, tp, config.make_vocab_size_divisible_by)
    vocab_matrices = 1 + (1 if config.untie_embeddings_and_output_weights else 0)
    split_per_layer = (layer["qkv_weight"] + layer["qkv_bias"] + layer["proj_weight"]
                       + layer["fc1_weight"] + layer["fc1_bias"] + layer["fc2_weight"])
    replicated_per_layer = layer["proj_bias"] + layer["fc2_bias"] + layer["norms"]
    split = config.num_layers * split_per_layer // tp + vocab_matrices * Vp * h // tp
    replicated = (config.num_layers * replicated_per_layer + c["final_norm"] + c["position_embedding"])
    return {"split": split, "padding": vocab_matrices * (Vp - V) * h // tp, "replicated": replicated,
            "per_rank": split + replicated, "total": c["total"]}


__all__ = ["count_parameters", "tensor_parallel_parameters"]
