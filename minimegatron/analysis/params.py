"""How many parameters a model has, component by component.

Shape legend (the one of model/gpt.py):
  b micro-batch size     s sequence length     h hidden size        V vocabulary size
  a query heads          g key/value heads     d head size (h / a)  f MLP inner size
  L layers               P max_position_embeddings

The count is read off the parameter shapes listed in gpt.py's docstring, one line per
tensor:

  word embedding        V h
  position embedding    P h                          learned_absolute only (RoPE has none)
  per layer:
    linear_qkv          (a + 2g) d h  + (a + 2g) d   weight + bias (bias if add_bias_linear)
    linear_proj         h a d         + h
    linear_fc1          f h  + f                     GELU
                        2f h + 2f                    SwiGLU (gate and up stacked)
    linear_fc2          h f  + h
    2 norms             2 * 2h                       LayerNorm (weight and bias)
                        2 * h                        RMSNorm (weight only)
  final norm            2h or h
  output layer          V h                          only when the embeddings are untied

For GPT-2 style layers (g = a, f = 4h, biases, LayerNorm) a layer has 12h^2 + 13h
parameters, the count every paper quotes: 4h^2 + 4h for attention, 8h^2 + 5h for the MLP,
4h for the two LayerNorms.
"""

from __future__ import annotations

from ..config import ModelConfig


def count_parameters(config: ModelConfig) -> dict:
    """The parameter count of the single-device `GPTModel(config)`, by component.

    Returns a dict (all values are numbers of elements, not bytes):

      "embedding"            V h
      "position_embedding"   P h (0 with RoPE)
      "per_layer"            a dict for ONE transformer layer:
                               "qkv_weight" (a+2g) d h, "qkv_bias" (a+2g) d,
                               "proj_weight" h a d,     "proj_bias" h,
                               "fc1_weight" f h or 2f h, "fc1_bias" f or 2f,
                               "fc2_weight" h f,        "fc2_bias" h,
                               "norms" 4h (LayerNorm) or 2h (RMSNorm), "total"
                             (biases are 0 without add_bias_linear)
      "layers"               L * per_layer["total"]
      "final_norm"           2h or h
      "output_layer"         V h when untied, else 0 (the embedding matrix is reused)
      "total"                the sum: what `sum(p.numel() for p in model.parameters())` gives
      "non_embedding"        total - embedding - position_embedding - output_layer
      "moe"                  None for a dense model; for a GPT-MoE (num_experts set, chapter 05)
                             {"layers": the number of MoE layers, "router" E h, "expert" one
                             expert's MLP (width moe_ffn_size), "shared" the shared expert's,
                             "per_moe_layer" what an MoE layer holds in place of the MLP}; "layers"
                             and "total" then count E experts in each MoE layer
      "active"               the parameters one token uses: total with only k of the E experts
                             of each MoE layer (= total for a dense model)

    "non_embedding" is Kaplan et al. 2020's N ("Scaling Laws for Neural Language Models",
    Section 2.1): "the number of model parameters, excluding all vocabulary and positional
    embeddings". We also leave out an untied output layer, the "de-embedding" that Kaplan
    lists next to the embedding, so N is the same tied or untied.
    """
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
        dense_mlp = (per_layer["fc1_weight"] + per_layer["fc1_bias"] + per_layer["fc2_weight"]
                     + per_layer["fc2_bias"])
        shared = config.moe_shared_expert_intermediate_size
        moe = {"layers": sum(config.is_moe_layer(i) for i in range(L)), "router": config.num_experts * h,
               "expert": mlp(config.moe_ffn_size), "shared": mlp(shared) if shared else 0}
        moe["per_moe_layer"] = moe["router"] + config.num_experts * moe["expert"] + moe["shared"]
        counts["layers"] += moe["layers"] * (moe["per_moe_layer"] - dense_mlp)
        counts["moe"] = moe
        inactive = moe["layers"] * (config.num_experts - config.moe_router_topk) * moe["expert"]
    counts["total"] = (counts["embedding"] + counts["position_embedding"] + counts["layers"]
                       + counts["final_norm"] + counts["output_layer"])
    counts["active"] = counts["total"] - inactive
    counts["non_embedding"] = (counts["total"] - counts["embedding"]
                               - counts["position_embedding"] - counts["output_layer"])
    return counts


def tensor_parallel_parameters(config: ModelConfig, tp: int) -> dict:
    """Parameters ONE rank of a tensor-parallel group of `tp` holds (chapter 02's layout, which
    is Megatron's), from count_parameters' components. Numbers of elements:

      "split"       what is cut tp ways, per rank: (qkv + proj weight + fc1 + fc2 weight) / tp
                    per layer, the qkv and fc1 biases / tp, and the vocabulary matrices
                    (embedding, untied output layer) as Vp/tp rows of h, Vp = V padded to a
                    multiple of config.make_vocab_size_divisible_by * tp
      "padding"     of "split", the rows of the padded vocabulary: (Vp - V) h / tp per matrix
      "replicated"  what every rank holds in full: the norms, the position embedding, the
                    row-parallel biases (linear_proj's and linear_fc2's h each, per layer)
      "per_rank"    split + replicated
      "total"       count_parameters(config)["total"] (the single-device model)

    So per_rank = (total - replicated) / tp + replicated + padding: as tp grows, the rank's
    share tends to the replicated part, which is O(L h), not zero. ConfigError (naming the
    numbers) when the layout cannot exist, e.g. 12 heads over tp = 8.
    """
    from ..tp import check_tensor_parallel_config           # heads, KV groups, ffn by tp
    check_tensor_parallel_config(config, tp)                # ConfigError for a layout that cannot exist
    c = count_parameters(config)
    layer = c["per_layer"]
    h, V = config.hidden_size, config.vocab_size
    multiple = config.make_vocab_size_divisible_by * tp
    Vp = -(-V // multiple) * multiple
    vocab_matrices = 1 + (1 if config.untie_embeddings_and_output_weights else 0)
    split_per_layer = (layer["qkv_weight"] + layer["qkv_bias"] + layer["proj_weight"]
                       + layer["fc1_weight"] + layer["fc1_bias"] + layer["fc2_weight"])
    replicated_per_layer = layer["proj_bias"] + layer["fc2_bias"] + layer["norms"]
    split = config.num_layers * split_per_layer // tp + vocab_matrices * Vp * h // tp
    replicated = (config.num_layers * replicated_per_layer + c["final_norm"] + c["position_embedding"])
    return {"split": split, "padding": vocab_matrices * (Vp - V) * h // tp, "replicated": replicated,
            "per_rank": split + replicated, "total": c["total"]}


__all__ = ["count_parameters", "tensor_parallel_parameters"]
