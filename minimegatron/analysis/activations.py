"""Activation memory: the tensors autograd keeps from the forward pass for the backward pass.

Shapes as in model/gpt.py (b micro-batch, s sequence, h hidden, V vocabulary, a query heads,
g key/value heads, d = h / a, f MLP inner size, L layers); e bytes per element of the model
dtype; c bytes of the norms', softmax's and loss's compute dtype (4 for 16-bit models, else e).

`activation_memory` counts op by op what OUR implementation saves ("naive" and "sdpa"
attention); `measure_saved_activation_bytes` measures it with saved_tensors_hooks (the two agree
to the byte); `korthikanti_activation_memory` is the paper's 16-bit count (chapter 00, 3.3)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ModelConfig
from .memory import as_dtype, bytes_per_element

INDEX_BYTES = 8  # token ids, labels and positions are int64


def attention_operands_share_qkv_output(config: ModelConfig, batch: int, seq: int, tp: int = 1
                                         ) -> tuple[bool, bool, bool]:
    """(q_is_view, k_is_view, v_is_view): does attention save q, k, v as views of the fused QKV
    output [b, s, (a + 2g) d] (which it then keeps once) or as new tensors (b a s d each)?

    New: RoPE's outputs; the query reshape when it merges real groups (g > 1 and a/g > 1); naive
    GQA's repeat_interleave of k and v; and the naive backend's folded [b a, s, d] bmm operands
    unless b = 1, a = 1 or (s = 1 and no GQA). sdpa keeps k and v's g heads (enable_gqa), views
    unless RoPE rotated k. tp: a / tp and g / tp heads decide it."""
    a, g = config.num_attention_heads // tp, config.query_groups // tp
    per_group = a // g
    rope = config.position_embedding_type == "rope"
    q_slice = not rope and (g == 1 or per_group == 1)      # q still points into the QKV output
    k_slice = not rope and per_group == 1
    v_slice = per_group == 1
    if config.attention_backend == "sdpa":                  # k, v of g heads, never repeated
        return q_slice, not rope, True
    folds_freely = batch == 1 or a == 1
    return (q_slice and (folds_freely or (per_group == 1 and seq == 1)),
            k_slice and (folds_freely or seq == 1),
            v_slice and (folds_freely or seq == 1))


def _norm_bytes(config: ModelConfig, b: int, s: int, e: int, c: int) -> int:
    """Bytes one norm saves, its output excluded (the next op saves it): LayerNorm x [b, s, h] and
    mean, rstd [b, s, 1], b s h c + 2 b s c; RMSNorm (model/linear.py) x, rstd and the normalised
    y, 2 b s h c + b s c. 16-bit models add the fp32 copies of weight (and bias), 4h bytes each."""
    h = config.hidden_size
    sixteen_bit = e == 2
    if config.normalization == "LayerNorm":
        return b * s * h * c + 2 * b * s * c + (2 * 4 * h if sixteen_bit else 0)
    return 2 * b * s * h * c + b * s * c + (4 * h if sixteen_bit else 0)


def activation_memory(config: ModelConfig, batch: int, seq: int,
                      dtype: torch.dtype | str | None = None, *, training: bool = True,
                      dropout_mask_itemsize: int | None = None, recompute_granularity: str | None = None,
                      recompute_method: str | None = None, recompute_num_layers: int | None = None,
                      recompute_modules: tuple[str, ...] = ("core_attn",), tp: int = 1,
                      sequence_parallel: bool = False) -> dict:
    """Bytes autograd saves for backward in one forward pass of our GPTModel (with labels).

    dtype: the model's (default config.params_dtype), e bytes. training: dropout runs (with False
    or p = 0 it saves nothing). dropout_mask_itemsize m: e on CPU (the default), 1 for a CUDA bool mask.

    Per layer, component: what is saved, bytes:
      input_norm, pre_mlp_norm     _norm_bytes
      qkv_input                    linear_qkv's input                 b s h e
      qkv_output                   when q, k or v is a view of it     b s (a + 2g) d e
      query / key / value          unless views: b a s d e (sdpa's k, v: b g s d e)
      naive: causal_mask s s (bool); softmax_output b a s s c; attention_dropout_mask b a s s m;
             attention_probs b a s s e (when a new tensor: the dropout output or the 16-bit cast)
      sdpa:  softmax_logsumexp b a s c (its dropout is not modelled)
      proj_input                   linear_proj's input                b s h e
      *_residual_dropout_mask      attention's and the MLP's          b s h m each
      fc1_input                    b s h e
      activation                   GELU's input b s f e; SwiGLU gate, silu(gate), up: 3 b s f e
      fc2_input                    b s f e
    Outside the layers: tokens b s 8, position_ids s 8 (learned positions), embedding_dropout_mask
    b s h m, rope_tables 2 s d e, final_norm, output_input b s h e, log_softmax b s V c, labels b s 8.
    Parameters are excluded; logits are not saved.

    Recompute (chapter 07, TrainConfig's arguments): full keeps b s h e per unit ("uniform":
    ceil(L / recompute_num_layers) units; "block": the first recompute_num_layers layers); selective
    drops what "core_attn" (naive: mask, softmax, dropout mask, probs; sdpa: the log-sum-exp), "mlp"
    (activation and fc2 inputs) and "layernorm" (keeps its input, b s h e) keep inside.
    Tensor parallelism t: heads, groups, f and linear_proj's input are divided by t; with sequence
    parallelism the replicated ones hold s / t tokens. Outside the layers the vocabulary-parallel
    embedding and loss keep local ids and masks (b s 8 + b s) and b s (V / t) c.

    Returns {"per_layer": {component: bytes, ..., "total"}, "layers": the L layers' bytes,
    "outside_layers": {component: bytes, ..., "total"}, "total": layers + outside}."""
    config.validate()
    if config.num_experts is not None:           # the dense formulas would be silently wrong
        raise ValueError(f"activation_memory counts dense layers only; num_experts={config.num_experts}: the "
                         f"mixture-of-experts accounting comes with chapter 05")
    dtype = config.dtype if dtype is None else as_dtype(dtype)
    e = bytes_per_element(dtype)
    c = 4 if e == 2 else e
    m = e if dropout_mask_itemsize is None else dropout_mask_itemsize
    b, s, h, V, L = batch, seq, config.hidden_size, config.vocab_size, config.num_layers
    t = tp
    a, g, d, f = config.num_attention_heads // t, config.query_groups // t, config.kv_channels, config.ffn_size // t
    s_sp = s // t if sequence_parallel else s            # tokens of the norms, dropouts and column inputs
    p_attn = config.attention_dropout if training else 0.0
    p_hidden = config.hidden_dropout if training else 0.0
    naive = config.attention_backend == "naive"
    if not naive and p_attn > 0:
        raise ValueError("activation_memory does not model the sdpa backend with attention_dropout > 0")

    q_view, k_view, v_view = attention_operands_share_qkv_output(config, b, s, t)
    head_tensor = b * a * s * d * e                       # one of q, k, v: [b, a, s, d]
    kv_tensor = head_tensor if naive else b * g * s * d * e   # sdpa: k, v keep their g heads
    scores = b * a * s * s                                # elements of one [b, a, s, s] matrix
    per_layer = {
        "input_norm": _norm_bytes(config, b, s_sp, e, c),
        "qkv_input": b * s_sp * h * e,
        "qkv_output": b * s * (a + 2 * g) * d * e if (q_view or k_view or v_view) else 0,
        "query": 0 if q_view else head_tensor,
        "key": 0 if k_view else kv_tensor,
        "value": 0 if v_view else kv_tensor,
    }
    if naive:
        per_layer.update({
            "causal_mask": s * s,
            "softmax_output": scores * c,
            "attention_dropout_mask": scores * m if p_attn > 0 else 0,
            "attention_probs": scores * e if (p_attn > 0 or e == 2) else 0,
        })
    else:
        per_layer["softmax_logsumexp"] = b * a * s * c
    per_layer.update({
        "proj_input": b * s * a * d * e,
        "attention_residual_dropout_mask": b * s_sp * h * m if p_hidden > 0 else 0,
        "pre_mlp_norm": _norm_bytes(config, b, s_sp, e, c),
        "fc1_input": b * s_sp * h * e,
        "activation": 3 * b * s * f * e if config.activation == "swiglu" else b * s * f * e,
        "fc2_input": b * s * f * e,
        "mlp_residual_dropout_mask": b * s_sp * h * m if p_hidden > 0 else 0,
    })
    if recompute_granularity == "selective":
        if "core_attn" in recompute_modules:
            for name in ("causal_mask", "softmax_output", "attention_dropout_mask", "attention_probs",
                         "softmax_logsumexp"):
                per_layer.pop(name, None)
            # the unit keeps q, k, v as they enter it: g heads of k and v, views of the QKV output
            # where the fused kernel's operands would be (sdpa's rule: the repeat happens inside)
            q_in, k_in, v_in = attention_operands_share_qkv_output(dataclasses.replace(config, attention_backend="sdpa"),
                                                                  b, s, t)
            per_layer.update(qkv_output=b * s * (a + 2 * g) * d * e if (q_in or k_in or v_in) else 0,
                             query=0 if q_in else head_tensor, key=0 if k_in else b * g * s * d * e,
                             value=0 if v_in else b * g * s * d * e)
        if "mlp" in recompute_modules:
            per_layer["activation"] = per_layer["fc2_input"] = 0
        if "layernorm" in recompute_modules:
            per_layer["input_norm"] = per_layer["pre_mlp_norm"] = b * s_sp * h * e
    per_layer["total"] = sum(per_layer.values())

    outside = {
        "tokens": b * s * INDEX_BYTES,
        "position_ids": s * INDEX_BYTES if config.position_embedding_type == "learned_absolute" else 0,
        "embedding_dropout_mask": b * s_sp * h * m if p_hidden > 0 else 0,
        "rope_tables": 2 * s * d * e if config.position_embedding_type == "rope" else 0,
        "final_norm": _norm_bytes(config, b, s_sp, e, c),
        "output_input": b * s_sp * h * e,
        "log_softmax": b * s * V * c,
        "labels": b * s * INDEX_BYTES,
    }
    if t > 1:                     # the vocabulary-parallel embedding and loss (tp/layers.py, tp/cross_entropy.py)
        outside.update(tokens=b * s * INDEX_BYTES + b * s, log_softmax=b * s * (-(-V // t)) * c,
                       labels=b * s * INDEX_BYTES + b * s)
    outside["total"] = sum(outside.values())
    layers = L * per_layer["total"]
    if recompute_granularity == "full":                  # a unit keeps its input [b, s, h] only
        n = recompute_num_layers
        units = -(-L // n) if recompute_method == "uniform" else min(n, L)
        whole = 0 if recompute_method == "uniform" else L - units
        layers = units * b * s_sp * h * e + whole * per_layer["total"]
    return {"per_layer": per_layer, "layers": layers, "outside_layers": outside, "total": layers + outside["total"]}


def korthikanti_activation_memory(config: ModelConfig, batch: int, seq: int, tp: int = 1,
                                  sequence_parallel: bool = False) -> dict:
    """Korthikanti et al. 2022's 16-bit bytes per layer and rank: s b h (34 + 5 a s / h); with tensor
    parallelism t, s b h (10 + 24/t + 5 a s / (h t)); with sequence parallelism too,
    s b h (34/t + 5 a s / (h t)). Returns {"per_layer": ..., "total": L x per_layer} (no embedding,
    final norm or loss).

    What `activation_memory` adds for the same bf16 shapes (tests/test_analysis.py checks each):
    the norms' fp32 inputs (4 bytes, not 2), mean/rstd and weight copies; the fp32 softmax output;
    the causal mask (s^2 bools); CPU dropout masks in the input's dtype (2 bytes, not 1). SwiGLU
    saves 3 b s f e + fc2's input where GELU saves 2 b s f e; GQA's k, v are repeated to a heads."""
    b, s, h, a, t = batch, seq, config.hidden_size, config.num_attention_heads, tp
    if sequence_parallel:
        per_layer = (34 * s * b * h + 5 * a * s * s * b) // t
    else:
        per_layer = 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t
    return {"per_layer": per_layer, "total": config.num_layers * per_layer}


def measure_saved_activation_bytes(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
                                   position_ids: torch.Tensor | None = None) -> int:
    """Bytes autograd saves in model(tokens, position_ids=position_ids, labels=labels): this rank's;
    under tp/sp/cp the forward's collectives run, so every rank of the groups must call it.

    Counts distinct storages seen by saved_tensors_hooks' pack: a view costs its whole storage
    (tokens and labels sliced from one [b, s+1] tensor count as that tensor), a storage saved twice
    counts once, parameters' storages are skipped (a cast parameter is a new storage and counts).
    Runs no backward; the model's mode decides dropout."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved.setdefault(storage.data_ptr(), storage)   # holding it keeps its address unique
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        extra = {} if position_ids is None else {"position_ids": position_ids}
        losses = model(tokens, labels=labels, **extra)
    del losses                                              # frees the graph
    return sum(storage.nbytes() for storage in saved.values())


__all__ = ["activation_memory", "korthikanti_activation_memory", "measure_saved_activation_bytes", "INDEX_BYTES"]
