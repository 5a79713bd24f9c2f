"""Tensor parallelism as a transformation of the one model: `apply_tensor_parallel`.

Shape legend as in model/gpt.py, plus tp (the group's size) and Vp (the vocabulary padded to
a multiple of config.make_vocab_size_divisible_by x tp, see layers.pad_vocab_size).
`apply_tensor_parallel(model, tp_group)` takes a GPTModel (or one pipeline stage of it) that
holds the single-device weights and swaps, in place, each module of the plan for its
parallel form, keeping this rank's slice of the weights it already holds:

  embedding.word_embeddings       -> VocabParallelEmbedding   [Vp/tp, h] rows (vocab ids)
  decoder.layers.{i}
    self_attention.linear_qkv     -> ColumnParallelLinear     [(a+2g) d / tp, h]: g/tp whole
                                                              groups [q (a/g heads) | k | v]
    self_attention.linear_proj    -> RowParallelLinear        [h, a d / tp] (bias replicated)
    mlp.linear_fc1                -> ColumnParallelLinear     [f/tp, h], SwiGLU [2f/tp, h] with
                                                              stride 2: [gate slice; up slice]
    mlp.linear_fc2                -> RowParallelLinear        [h, f/tp] (bias replicated)
  output_layer                    -> ColumnParallelLinear     [Vp/tp, h] (tied: reads the
                                                              embedding's rows)
  loss                            -> VocabParallelCrossEntropy
  norms, position embeddings      unchanged: replicated

Nothing else changes: SelfAttention reads its head count from linear_qkv (a/tp heads), the MLP
chunks its [gate; up] shard the same way, and every module keeps its name, so a state dict of
a rank reads like the single-device one with smaller tensors. Each shard is cut from the full
initial value, so any tp starts from exactly the single-device weights.

Communication of one forward (all through minimegatron.comm, in the TP group, tag "fwd"):
  embedding       1 all-reduce of [b, s, h]   (each rank looks up only the ids it owns)
  each layer      2 all-reduces of [b, s, h]  (after linear_proj and after linear_fc2)
  output layer    nothing (its input's gradient is all-reduced in backward)
  loss            3 all-reduces of [b, s]     (vocab_parallel_cross_entropy; no logits gathered)
and of one backward (tag "bwd"): 2 all-reduces of [b, s, h] per layer (before linear_qkv and
before linear_fc1) plus 1 for the output layer's input; the embedding and the loss need none.
That is Megatron's "two all-reduces per layer forward, two backward".

The replicated parameters (norms, position embedding) get identical gradients on every rank
and need no all-reduce (chapter 02, section 2.4). Dropout (tp/random.py): replicated tensors
draw from the default generator, seeded alike; the attention dropout acts on this rank's
heads only, so SelfAttention.dropout_rng is the per-rank tracker stream.

Sequence parallelism (chapter 04, `sequence_parallel=True`): the same cut, and the regions
TP leaves replicated (the norms, the dropouts, the residual adds: [b, s, h] on every rank) are
cut along the sequence instead, [b, s/tp, h] per rank (Korthikanti et al. 2022):

  embedding       reduce-scatter along s instead of the all-reduce (with learned positions:
                  the all-reduce, the positions added, then this rank's s/tp rows kept)
  linear_qkv, linear_fc1, output_layer   all-gather the input along s (backward: reduce-scatter)
  linear_proj, linear_fc2                reduce-scatter the output along s (backward: all-gather)
  norms, row-parallel biases             marked `sequence_parallel`: each rank's gradient sums
                                         over its own tokens only, so finalize_model_grads
                                         all-reduces them over TP (allreduce_sequence_parallel_grads)
  dropout in the split regions           the per-rank tracker stream (each rank's tokens differ)

Each column-parallel layer also all-gathers its saved input shard again in the backward (tag
"regather").

Megatron-LM: megatron/core/models/gpt/gpt_layer_specs.py (the parallel layers chosen by a spec
when the model is built; here swapped in afterwards).
"""

from __future__ import annotations

import torch
from torch import nn

from functools import partial

from ..comm import all_reduce, group_size, scatter_to_sequence_parallel_region
from ..config import ConfigError, ModelConfig
from ..dp import grad_of
from ..model.finalize import register_grad_finalizer
from ..placement import name_placements, placement_of, set_placement
from .cross_entropy import VocabParallelCrossEntropy
from .layers import (SEQUENCE_DIM, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, pad_rows,
                     pad_vocab_size)
from .random import get_rng_tracker

__all__ = ["TENSOR_PARALLEL_PLAN", "apply_tensor_parallel", "check_tensor_parallel_config",
           "allreduce_sequence_parallel_grads"]

# Inside every transformer layer: which linear is cut by its output rows ("column") and which
# by its input columns ("row"). A column-parallel layer followed by a row-parallel one needs
# one all-reduce forward and one backward, and nothing is gathered in between. An MLP of
# another kind brings its own plan for the "mlp." entries (MoELayer.tensor_parallel_plan,
# chapter 05), where "replicated" marks a module that sees this rank's s/tp tokens under SP.
TENSOR_PARALLEL_PLAN = {
    "self_attention.linear_qkv": "column",
    "self_attention.linear_proj": "row",
    "mlp.linear_fc1": "column",
    "mlp.linear_fc2": "row",
}


def check_tensor_parallel_config(config: ModelConfig, tp: int) -> None:
    """ConfigError (a ValueError) naming the field and the numbers when ``config`` cannot be
    split over ``tp`` ranks. Heads: a rank needs whole query heads AND whole key/value groups
    (a query head must find its group's k and v on its own rank; Megatron can also split a
    key/value group over ranks, the book does not); the MLP needs f / tp.
    (The vocabulary need not divide: it is padded, see layers.pad_vocab_size.)"""
    config.validate()
    for field, value in (("num_attention_heads", config.num_attention_heads),
                         ("num_query_groups", config.query_groups),
                         ("ffn_hidden_size", config.ffn_size),
                         ("moe_shared_expert_intermediate_size",
                          (config.moe_shared_expert_intermediate_size or 0) if config.num_experts else 0)):
        if value % tp:
            raise ConfigError(f"{field}={value} is not divisible by the tensor-parallel size tp={tp}")


def _parallel_linear(full: nn.Module, style: str, tp_group, stride: int = 1,
                     sequence_parallel: bool = False) -> nn.Module:
    """The column- or row-parallel form of the Linear `full`, holding this rank's slice of it."""
    out_features, in_features = full.weight.shape
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    kwargs = {"stride": stride} if style == "column" else {}
    layer = cls(in_features, out_features, tp_group, bias=full.bias is not None,
                params_dtype=full.weight.dtype, sequence_parallel=sequence_parallel, **kwargs).to(full.weight.device)
    layer.load_full(full.weight, full.bias)
    layer.gemm = full.gemm                                # its matrix products go with it
    return layer


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, tp_group, sequence_parallel: bool = False,
                          overlap_sp_backward: bool = False) -> nn.Module:
    """Cut `model` (a GPTModel or pipeline stage holding single-device weights) over the
    tensor-parallel group `tp_group`, in place (see the module docstring); returns it.
    With `sequence_parallel`, also cut the regions between the linear layers along the
    sequence (chapter 04): the model then takes and returns this rank's s/tp tokens between
    pipeline stages, and its `sequence_parallel` parameters need
    allreduce_sequence_parallel_grads after the backward (registered as the model's
    "sequence-parallel" gradient hook, model/finalize.py). `overlap_sp_backward` (chapter 07):
    the column-parallel layers' backward hides its all-gather and reduce-scatter behind its
    GEMMs (tp/overlap.py), with the same results.
    A no-op when the group has one rank. ConfigError before anything changes when the
    model does not split over the group's size."""
    tp, cfg = group_size(tp_group), model.config
    if tp == 1:
        return model
    check_tensor_parallel_config(cfg, tp)
    Vp = pad_vocab_size(cfg.vocab_size, tp, cfg.make_vocab_size_divisible_by)
    per_rank_rng = get_rng_tracker().fork
    sp = sequence_parallel

    if model.embedding is not None:
        table = model.embedding.word_embeddings.weight                       # [V, h]
        learned_positions = model.embedding.position_embeddings is not None
        embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group,
                                           cfg.make_vocab_size_divisible_by, params_dtype=table.dtype,
                                           reduce_scatter_embeddings=sp and not learned_positions).to(table.device)
        embedding.load_full(table)
        set_placement(embedding.weight, shared_embedding=placement_of(table).shared_embedding)
        model.embedding.word_embeddings = embedding
        if sp:
            if learned_positions:       # positions are added to the full [b, s, h], then it is cut
                model.embedding.scatter_to_sequence_parallel = partial(
                    scatter_to_sequence_parallel_region, group=tp_group, dim=SEQUENCE_DIM)
            model.embedding.dropout_rng = per_rank_rng
    for layer in model.decoder.layers.values():
        for path, style in _plan_of(layer).items():
            if style == "replicated":                                    # e.g. an MoE router
                if sp:
                    _mark_sequence_parallel(layer.get_submodule(path))
                continue
            parent, name = layer.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
            stride = 2 if name == "linear_fc1" and cfg.activation == "swiglu" else 1   # [gate; up]
            setattr(parent, name, _parallel_linear(getattr(parent, name), style, tp_group, stride, sp))
        layer.self_attention.dropout_rng = per_rank_rng                  # this rank's heads only
        if sp:
            layer.dropout_rng = per_rank_rng                             # this rank's tokens only
            _mark_sequence_parallel(layer.input_layernorm, layer.pre_mlp_layernorm)
    if model.post_process:
        if sp:
            _mark_sequence_parallel(model.decoder.final_layernorm)
        full = model.output_layer.weight                                     # [V, h] or None (tied)
        output_layer = ColumnParallelLinear(cfg.hidden_size, Vp, tp_group, bias=False,
                                            params_dtype=cfg.dtype, skip_weight_param_allocation=full is None,
                                            unpadded_size=cfg.vocab_size, sequence_parallel=sp,
                                            ).to(model.decoder.final_layernorm.weight.device)
        if full is not None:
            output_layer.load_full(pad_rows(full, Vp))
            set_placement(output_layer.weight, copy_of=placement_of(full).copy_of,     # a pipeline's
                          shared_embedding=placement_of(full).shared_embedding)     # tied copy
        model.output_layer = output_layer
        model.loss = VocabParallelCrossEntropy(tp_group, cfg.vocab_size)
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear) and sp:
            module.overlap_backward = overlap_sp_backward
    name_placements(model)                                 # the new parameters' single-device names
    if sp:      # the norms' gradients, after each step (looked up when called: a grader may swap it)
        register_grad_finalizer(model, "sequence-parallel", lambda chunks: allreduce_sequence_parallel_grads(chunks, tp_group))
    return model


def _plan_of(layer: nn.Module) -> dict[str, str]:
    """TENSOR_PARALLEL_PLAN for this layer, its "mlp." entries replaced by the MLP's own
    `tensor_parallel_plan` when it has one (chapter 05's MoELayer)."""
    mlp_plan = getattr(layer.mlp, "tensor_parallel_plan", None)
    if mlp_plan is None:
        return TENSOR_PARALLEL_PLAN
    plan = {k: v for k, v in TENSOR_PARALLEL_PLAN.items() if not k.startswith("mlp.")}
    return plan | {f"mlp.{path}": style for path, style in mlp_plan.items()}


def _mark_sequence_parallel(*norms: nn.Module) -> None:
    for norm in norms:
        for p in norm.parameters():
            set_placement(p, sequence_parallel=True)         # Megatron's attribute, in the record


def allreduce_sequence_parallel_grads(models: list[nn.Module], tp_group) -> None:
    """Sum over `tp_group` the gradients of every parameter marked `sequence_parallel` (the
    norms and row-parallel biases under sequence parallelism): such a parameter is replicated,
    but each rank applied it to its own s/tp tokens, so its gradient holds only those tokens'
    share. One all-reduce of all of them, flattened (tag "sp-grads"); nothing without sequence
    parallelism. Megatron-LM: _allreduce_non_tensor_model_parallel_grads in
    megatron/core/distributed/finalize_model_grads.py (also one coalesced all-reduce).

    models: this rank's model chunks (bare, or in a data-parallel wrapper after its sync: the
    gradient is then where the wrapper holds it, dp.grad_of, e.g. a float32 main_grad beside
    bf16 parameters, chapter 06). In place: afterwards every marked gradient is the
    single-device gradient, the same on every rank of the group. Parameters without a
    gradient are left out; a group of one rank communicates nothing."""
    # BEGIN EXERCISE 4.4: spot the bug in the norm-gradient all-reduce | hint: each rank's copy of a norm weight saw only its own s/tp tokens: what does the single-device gradient do with the shares? And which parameters are marked sequence_parallel?
    grads = [grad_of(m, p) for m in models for p in m.parameters()
             if placement_of(p).sequence_parallel and grad_of(m, p) is not None]
    if not grads or group_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])                  # one message, not one per norm
    all_reduce(flat, tp_group, op="sum", tag="sp-grads")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    # END EXERCISE
