"""The models the planner knows by name: published shapes, and the book's own presets.

    config, note = planner_model("llama3-70b")     # ModelConfig (bf16), and what is approximate

Shapes from each model's paper or released config (cited beside it), the book's presets from
arguments.PRESETS, GPT-2/3 and Llama-2 from analysis.REAL_MODELS. Real models pad their
vocabulary as Megatron does (128 x tp). DeepSeek-V3's dense first 3 layers are a
PatternedMoEConfig; its multi-latent attention is approximated by multi-head attention with
a = 128, d = h / a (attention FLOPs underestimated) and its MTP module left out: the note
printed above the planner's table says so."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..analysis import REAL_MODELS, real_model_config
from ..arguments import PRESETS
from ..config import ConfigError, ModelConfig, opt

__all__ = ["planner_model", "model_names"]


@dataclass
class PatternedMoEConfig(ModelConfig):
    """A ModelConfig whose MoE layers are listed (Megatron's list form of --moe-layer-freq):
    moe_layer_pattern[i] = 1 when layer i holds experts. For the planner's formulas (they ask
    `is_moe_layer`); the book's model is not built from it."""

    moe_layer_pattern: tuple[int, ...] | None = opt(None, "moe", "1 for each layer that holds experts")

    def is_moe_layer(self, layer_number: int) -> bool:
        if self.moe_layer_pattern is None:
            return super().is_moe_layer(layer_number)
        return self.num_experts is not None and self.moe_layer_pattern[layer_number] == 1

    def validate(self) -> "PatternedMoEConfig":
        super().validate()
        pattern = self.moe_layer_pattern
        if pattern is not None and (len(pattern) != self.num_layers or set(pattern) - {0, 1}):
            raise ConfigError(f"moe_layer_pattern has {len(pattern)} entries of {sorted(set(pattern))}; it needs "
                              f"num_layers={self.num_layers} entries, each 0 or 1")
        return self


_LLAMA3 = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", add_bias_linear=False,
               untie_embeddings_and_output_weights=True, rotary_base=500000.0, vocab_size=128256,
               max_position_embeddings=131072, make_vocab_size_divisible_by=128, params_dtype="bfloat16")

# name -> (constructor, fields, default sequence length, note printed above the plan)
MODELS: dict[str, tuple[type, dict, int, str]] = {
    # Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 (layers, model
    # dimension, FFN dimension, attention heads, key/value heads, vocabulary 128,000 -> the
    # released tokenizer's 128256; RoPE base 500,000); untied embeddings and the 131072-token
    # context of Llama 3.1 as in the released config.json files (meta-llama/Llama-3.1-*B).
    "llama3-8b": (ModelConfig, dict(_LLAMA3, num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                                    num_attention_heads=32, num_query_groups=8), 8192, ""),
    "llama3-70b": (ModelConfig, dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                                     num_attention_heads=64, num_query_groups=8), 8192, ""),
    "llama3-405b": (ModelConfig, dict(_LLAMA3, num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                                      num_attention_heads=128, num_query_groups=8), 8192, ""),
    # Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts", Table 1 (dim 4096, n_layers 32,
    # head_dim 128, hidden_dim 14336, n_heads 32, n_kv_heads 8, context_len 32768, vocab_size
    # 32000, num_experts 8, top_k_experts 2); untied embeddings, RoPE base 1e6 and the router's
    # auxiliary-loss coefficient 0.02 from the released config.json (mistralai/Mixtral-8x7B-v0.1).
    "mixtral-8x7b": (ModelConfig, dict(_LLAMA3, rotary_base=1e6, vocab_size=32000, max_position_embeddings=32768,
                                       num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                                       num_attention_heads=32, num_query_groups=8, num_experts=8, moe_router_topk=2,
                                       moe_aux_loss_coeff=0.02), 4096, ""),
    # DeepSeek-V3: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Section 4.2 (61 layers,
    # hidden 7168, 128 heads, all layers MoE but the first three, 1 shared and 256 routed experts
    # of intermediate size 2048, 8 activated per token, sigmoid scores with a bias for the
    # choice; 4K pre-training sequences); dense intermediate size 18432 and vocabulary 129280
    # from the released config.json (deepseek-ai/DeepSeek-V3). See the module docstring for MLA.
    "deepseek-v3": (PatternedMoEConfig, dict(
        _LLAMA3, vocab_size=129280, rotary_base=10000.0, max_position_embeddings=163840, num_layers=61,
        hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, num_query_groups=128, num_experts=256,
        moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_layer_pattern=(0,) * 3 + (1,) * 58), 4096,
        "APPROXIMATE: DeepSeek-V3's multi-latent attention is described as multi-head attention (128 heads of "
        "56 = h/128; ~10% more attention weights, fewer attention FLOPs) and its MTP module is left out; "
        "its first 3 dense layers are kept (moe_layer_pattern)."),
}


def model_names() -> list[str]:
    """Every name planner_model accepts: the published models, analysis.REAL_MODELS, and the
    book's presets."""
    return [*MODELS, *REAL_MODELS, *PRESETS]


def planner_model(name: str) -> tuple[ModelConfig, int, str]:
    """(config in bf16, a typical training sequence length, a note: "" or what is approximate)
    for a named model. ConfigError naming the known names for any other."""
    if name in MODELS:
        cls, fields, seq, note = MODELS[name]
        return cls(**fields).validate(), seq, note
    if name in REAL_MODELS:
        config, seq = real_model_config(name)
        return dataclasses.replace(config, make_vocab_size_divisible_by=128).validate(), seq, ""
    if name in PRESETS:
        model_over, train_over = PRESETS[name]
        config = ModelConfig.llama(**model_over, params_dtype="bfloat16")
        return config.validate(), train_over["seq_length"], f"the book's preset {name!r} (LLaMA style), in bf16"
    raise ConfigError(f"model={name!r} is not one of {', '.join(model_names())}")
