"""The tensor-parallel GPT: the baseline model of model/gpt.py with every matrix cut across a
tensor-parallel group, Megatron-LM's layout.

Shape legend as in model/gpt.py, plus tp (the group's size) and Vp (the vocabulary padded to
a multiple of config.make_vocab_size_divisible_by x tp, see tp/layers.py pad_vocab_size).
What rank r of tp holds:

  embedding.word_embeddings.weight      [Vp/tp, h]   VocabParallelEmbedding: ids r Vp/tp ..
  embedding.position_embeddings.weight  [P, h]       replicated (learned positions only)
  decoder.layers.{i}.input_layernorm.*  [h]          replicated
    self_attention.linear_qkv           [(a+2g) d / tp, h]   column-parallel: g/tp whole
                                                     groups [q (a/g heads) | k | v] each
    self_attention.linear_proj          [h, a d / tp]        row-parallel (bias replicated)
  decoder.layers.{i}.pre_mlp_layernorm.* [h]         replicated
    mlp.linear_fc1                      [f/tp, h] or [2f/tp, h] column-parallel (SwiGLU:
                                                     stride 2, this rank's gate rows; up rows)
    mlp.linear_fc2                      [h, f/tp]            row-parallel (bias replicated)
  decoder.final_layernorm.*             [h]          replicated
  output_layer.weight                   [Vp/tp, h]   untied only: column-parallel over vocab

Communication of one forward (all through minimegatron.comm, in the TP group, tag "fwd"):
  embedding       1 all-reduce of [b, s, h]   (each rank looks up only the ids it owns)
  each layer      2 all-reduces of [b, s, h]  (g after linear_proj, g after linear_fc2)
  output layer    nothing (LinearWithGradAllReduce: f is the identity forward)
  loss            3 all-reduces of [b, s]     (vocab_parallel_cross_entropy; no logits gathered)
and of one backward (tag "bwd"): 2 all-reduces of [b, s, h] per layer (f before linear_qkv,
f before linear_fc1) plus 1 for the output layer's input; the embedding and the loss need none.
That is Megatron's "two all-reduces per layer forward, two backward".

Why the replicated parameters need no all-reduce of their gradients: a norm or the position
embedding sees the same input on every rank (the hidden states after a g are identical) and
receives the same output gradient (after an f, or from the replicated residual stream), so
each rank computes the same gradient; their AdamW steps are then identical too.

Every parameter is cut from initial_value(single-device name, full shape): the model starts
from exactly the single-device weights on any tp. `full_parameters` / `full_gradients`
reassemble them under the single-device names and shapes.

Megatron-LM: megatron/core/transformer/attention.py (SelfAttention), megatron/core/transformer/
mlp.py (MLP), megatron/core/models/gpt/gpt_model.py (GPTModel, its output_layer and
compute_language_model_loss). Differences: the layers here are the baseline's [b, s, h]
modules with TP layers dropped in, not Megatron's spec-built modules.

Dropout (tp/random.py): the embedding's and the residual branches' dropout act on replicated
tensors and draw from torch's default generator, which every rank of the group seeds alike:
with the same seed and batch shape their masks are the single-device model's masks. The
attention dropout acts on this rank's heads only and draws inside get_rng_tracker().fork(),
the per-rank stream; so with attention_dropout > 0 the model is a correct one, but no longer
draws the single-device masks. Seed both streams with model_parallel_manual_seed first.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import all_gather, all_reduce, group_rank, group_size
from ..config import ConfigError, ModelConfig
from ..model.attention import causal_attention, sdpa_attention
from ..model.init import initial_value
from ..model.linear import build_norm
from ..model.rope import apply_rotary_pos_emb, rope_cos_sin
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, LinearWithGradAllReduce, RowParallelLinear, VocabParallelEmbedding,
                     pad_vocab_size)
from .random import get_rng_tracker


__all__ = ["reassemble", "clip_tensor_parallel_grad_norm", "tensor_parallel_grad_norm_squared", "replicated_names", "ParallelSelfAttention", "ParallelMLP", "ParallelTransformerLayer",
           "TensorParallelGPTModel", "check_tensor_parallel_config", "full_parameters",
           "full_gradients"]


def check_tensor_parallel_config(config: ModelConfig, tp: int) -> None:
    """ConfigError (a ValueError) naming the field and the numbers when ``config`` cannot be
    split over ``tp`` ranks. Heads: a rank needs whole query heads AND whole key/value groups
    (a query head must find its group's k and v on its own rank); the MLP needs f / tp.
    (The vocabulary need not divide: it is padded, see tp/layers.py pad_vocab_size.)"""
    config.validate()
    for field, value in (("num_attention_heads", config.num_attention_heads),
                         ("num_query_groups", config.query_groups),
                         ("ffn_hidden_size", config.ffn_size)):
        if value % tp:
            raise ConfigError(f"{field}={value} is not divisible by the tensor-parallel size "
                              f"tp={tp}")


def _replicated_norm(config: ModelConfig, name: str) -> nn.Module:
    """A norm holding the full single-device values of ``name`` (every rank the same)."""
    norm = build_norm(config.normalization, config.hidden_size, config.layernorm_epsilon)
    with torch.no_grad():
        for p_name, p in norm.named_parameters():
            p.data = initial_value(f"{name}.{p_name}", tuple(p.shape), config)
    return norm


class ParallelSelfAttention(nn.Module):
    """Pre-normalised x [b, s, h] (same on every rank) -> attention output [b, s, h] (same on
    every rank, before the residual add), heads split over ``group``.

    linear_qkv (column-parallel, f before it) gives this rank g/tp whole groups: a/tp query
    heads and g/tp key/value heads, [b, s, (a+2g) d / tp]. Attention of a head needs nothing
    from any other head, so it runs locally; linear_proj (row-parallel) sums the heads'
    contributions with one all-reduce (g). Forward 1 all-reduce [b, s, h], backward 1.
    """

    def __init__(self, config: ModelConfig, group, layer_number: int):
        super().__init__()
        self.config, tp = config, group_size(group)
        a, g, d, h = config.num_attention_heads, config.query_groups, config.kv_channels, config.hidden_size
        self.num_heads, self.num_groups = a // tp, g // tp          # local: a/tp, g/tp
        prefix = f"decoder.layers.{layer_number}.self_attention"
        # stride 1: the grouped layout is already group-major, so contiguous rows = whole groups
        self.linear_qkv = ColumnParallelLinear(h, (a + 2 * g) * d, group, bias=config.add_bias_linear,
                                               init_name=f"{prefix}.linear_qkv", config=config)
        self.linear_proj = RowParallelLinear(a * d, h, group, bias=config.add_bias_linear,
                                             init_name=f"{prefix}.linear_proj", config=config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        n, m, d = self.num_heads, self.num_groups, self.config.kv_channels   # a/tp, g/tp, d
        heads_per_group = n // m                                            # a/g, as on one device
        mixed = self.linear_qkv(x)                                          # [b, s, (a+2g) d/tp]
        mixed = mixed.view(b, s, m, (heads_per_group + 2) * d)              # [b, s, g/tp, (a/g+2) d]
        q, k, v = mixed.split([heads_per_group * d, d, d], dim=-1)
        q = q.reshape(b, s, n, d).transpose(1, 2)                           # [b, a/tp, s, d]
        k, v = k.transpose(1, 2), v.transpose(1, 2)                         # [b, g/tp, s, d]
        if rope is not None:
            q, k = apply_rotary_pos_emb(q, *rope), apply_rotary_pos_emb(k, *rope)
        if heads_per_group > 1:
            k = k.repeat_interleave(heads_per_group, dim=1)                 # [b, a/tp, s, d]
            v = v.repeat_interleave(heads_per_group, dim=1)
        attend = causal_attention if self.config.attention_backend == "naive" else sdpa_attention
        p = self.config.attention_dropout
        # the probabilities of this rank's heads are a SHARD of the full [b, a, s, s]: their
        # dropout masks must differ across the TP group, so draw them from the per-rank stream
        with get_rng_tracker().fork() if self.training and p > 0 else nullcontext():
            out = attend(q, k, v, dropout_p=p, training=self.training)      # [b, a/tp, s, d]
        out = out.transpose(1, 2).reshape(b, s, n * d)                      # [b, s, a d/tp]
        return self.linear_proj(out)                                        # [b, s, h], g


class ParallelMLP(nn.Module):
    """x [b, s, h] (same on every rank) -> [b, s, h] (same on every rank).

    linear_fc1 column-parallel: this rank's f/tp inner features (SwiGLU: stride 2, so the
    local [2f/tp] output is [gate slice; up slice] and chunk(2) pairs each gate with its up:
    the activation is elementwise, so it runs on the shard). linear_fc2 row-parallel, one
    all-reduce (g). Forward 1 all-reduce [b, s, h], backward 1 (f before fc1).
    """

    def __init__(self, config: ModelConfig, group, layer_number: int):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        h, f = config.hidden_size, config.ffn_size
        prefix = f"decoder.layers.{layer_number}.mlp"
        self.linear_fc1 = ColumnParallelLinear(h, 2 * f if self.swiglu else f, group,
                                               bias=config.add_bias_linear, init_name=f"{prefix}.linear_fc1",
                                               config=config, stride=2 if self.swiglu else 1)
        self.linear_fc2 = RowParallelLinear(f, h, group, bias=config.add_bias_linear,
                                            init_name=f"{prefix}.linear_fc2", config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)                           # [b, s, f/tp] or [b, s, 2f/tp]
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)                # [b, s, f/tp] each
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)                        # [b, s, h], g


class ParallelTransformerLayer(nn.Module):
    """Pre-norm block, as TransformerLayer: x + attn(norm(x)), then x + mlp(norm(x)).
    [b, s, h] -> [b, s, h], identical on every rank; norms replicated."""

    def __init__(self, config: ModelConfig, group, layer_number: int):
        super().__init__()
        prefix = f"decoder.layers.{layer_number}"
        self.dropout = config.hidden_dropout
        self.input_layernorm = _replicated_norm(config, f"{prefix}.input_layernorm")
        self.self_attention = ParallelSelfAttention(config, group, layer_number)
        self.pre_mlp_layernorm = _replicated_norm(config, f"{prefix}.pre_mlp_layernorm")
        self.mlp = ParallelMLP(config, group, layer_number)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        # hidden dropout acts on REPLICATED [b, s, h] tensors (after the g all-reduces): the
        # default stream, seeded alike on the whole TP group, so every rank draws one mask
        attn = self.self_attention(self.input_layernorm(x), rope)            # [b, s, h]
        x = x + F.dropout(attn, self.dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))                            # [b, s, h]
        return x + F.dropout(mlp, self.dropout, self.training)


class TensorParallelGPTModel(nn.Module):
    """GPTModel split over the tensor-parallel ``group`` (every rank of it builds one), or one
    pipeline stage of it (pre_process, post_process, layer_numbers as GPTModel's, chapter 03).

    forward(tokens=None, position_ids=None, labels=None, hidden_states=None):
      tokens [b, s] int64 (first stage) or hidden_states [b, s, h] (later stages), the same on
      every rank of the group; position_ids [b, s] or [s] (default 0..s-1); on the last stage,
      per-token losses [b, s] (same on every rank, dtype as GPTModel's) when labels [b, s] are
      given, else this rank's logits shard [b, s, Vp/tp] (ids [r Vp/tp, (r+1) Vp/tp); columns
      >= V are padding, not real ids); on other stages the hidden states [b, s, h].
    Raises ConfigError before building anything if config does not split over tp.
    """

    def __init__(self, config: ModelConfig, group, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None):
        super().__init__()
        self.tp = group_size(group)
        check_tensor_parallel_config(config, self.tp)
        self.config, self.group = config, group
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(range(config.num_layers)) if layer_numbers is None else list(layer_numbers)
        h, V = config.hidden_size, config.vocab_size
        self.padded_vocab_size = pad_vocab_size(V, self.tp, config.make_vocab_size_divisible_by)

        self.embedding = None
        if pre_process:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding(
                V, h, group, init_name="embedding.word_embeddings", config=config,
                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by)
            self.embedding.position_embeddings = None
            if config.position_embedding_type == "learned_absolute":
                self.embedding.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
                self.embedding.position_embeddings.weight.data = initial_value(
                    "embedding.position_embeddings.weight", (config.max_position_embeddings, h), config)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict(
            {str(i): ParallelTransformerLayer(config, group, i) for i in self.layer_numbers})
        self.decoder.final_layernorm = _replicated_norm(config, "decoder.final_layernorm") if post_process else None

        self.output_layer = None
        if post_process and (config.untie_embeddings_and_output_weights or not pre_process):
            # its own [V, h] matrix, padded with zero rows like the embedding and cut by rows
            # (vocabulary ranges). The padding rows get zero gradient (the loss masks their
            # logits) and, being zero, AdamW's decoupled weight decay keeps them zero. Tied, on
            # a last pipeline stage without the embedding: a copy that starts equal to it.
            self.output_layer = ColumnParallelLinear(h, self.padded_vocab_size, group, bias=False,
                                                     config=config)
            name = ("output_layer.weight" if config.untie_embeddings_and_output_weights
                    else "embedding.word_embeddings.weight")
            full = initial_value(name, (V, h), config)
            self.output_layer.load_full(torch.cat([full, full.new_zeros(self.padded_vocab_size - V, h)]))

    def output_weight(self) -> torch.Tensor:
        """[Vp/tp, h]: this rank's vocabulary rows of the matrix that makes the logits."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, tokens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        first = tokens if tokens is not None else hidden_states
        s = first.shape[1]
        if s > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {s} > max_position_embeddings={cfg.max_position_embeddings}")
        if position_ids is None:
            position_ids = torch.arange(s, device=first.device)

        if self.pre_process:
            x = self.embedding.word_embeddings(tokens)                      # [b, s, h], g
            if self.embedding.position_embeddings is not None:
                x = x + self.embedding.position_embeddings(position_ids)    # replicated, local
            x = F.dropout(x, cfg.hidden_dropout, self.training)             # replicated: shared stream
        else:
            x = hidden_states                                               # [b, s, h] from the previous stage
        rope = None
        if cfg.position_embedding_type == "rope":
            rope = rope_cos_sin(position_ids, cfg.kv_channels, cfg.rotary_base, dtype=x.dtype)

        for layer in self.decoder.layers.values():
            x = layer(x, rope)                                              # [b, s, h]
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)                                 # [b, s, h]

        # the output layer is column-parallel over the vocabulary: f (identity now; the
        # backward all-reduces dx, since every vocabulary shard's logits depend on all of x)
        logits = LinearWithGradAllReduce.apply(x, self.output_weight(), None, self.group)  # [b, s, Vp/tp]
        if labels is None:
            return logits
        # 3 all-reduces of [b, s]; the logits never leave their rank
        return vocab_parallel_cross_entropy(logits, labels, self.group, vocab_size=cfg.vocab_size)

    # ---- the single-device view -----------------------------------------------------
    def shard_layout(self) -> dict[str, tuple[str, str, int]]:
        """local name -> (single-device name, how it is cut, stride), how ∈
        {"replicated", "rows", "cols", "vocab"}; "vocab" = rows of the padded table."""
        layout = {}
        for name, module in self.named_modules():
            for p_name, _ in module.named_parameters(recurse=False):
                full = f"{name}.{p_name}"
                if isinstance(module, VocabParallelEmbedding) or module is self.output_layer:
                    layout[full] = (full, "vocab", 1)
                elif isinstance(module, ColumnParallelLinear):
                    layout[full] = (full, "rows", module.stride)
                elif isinstance(module, RowParallelLinear) and p_name == "weight":
                    layout[full] = (full, "cols", 1)
                else:                                    # norms, positions, row-parallel bias
                    layout[full] = (full, "replicated", 1)
        return layout


def reassemble(model: TensorParallelGPTModel, tensors: dict[str, torch.Tensor],
                tag: str) -> dict[str, torch.Tensor]:
    """Gather each shard across the TP group (one all-gather per split tensor, through the
    ledger with ``tag``) into the single-device full tensor; replicated ones are copied."""
    tp, out = model.tp, {}
    for name, (full_name, how, stride) in model.shard_layout().items():
        t = tensors[name].detach()
        if how == "replicated":
            out[full_name] = t.clone()
            continue
        gathered = all_gather(t, model.group, dim=1 if how == "cols" else 0, tag=tag)
        if how == "vocab":
            gathered = gathered[: model.config.vocab_size]            # drop the padding rows
        elif stride > 1:
            # rank-major [r0: b0 b1 | r1: b0 b1 ...] -> block-major [b0: r0 r1 | b1: r0 r1]
            per_rank = [chunk.chunk(stride) for chunk in gathered.chunk(tp)]
            gathered = torch.cat([torch.cat([pr[k] for pr in per_rank]) for k in range(stride)])
        out[full_name] = gathered.contiguous()
    return out


def _same_group(model: TensorParallelGPTModel, group) -> None:
    if group is not None and group is not model.group:
        raise ValueError("reassemble over the group the model was split over (model.group)")


def full_parameters(model: TensorParallelGPTModel, group=None) -> dict[str, torch.Tensor]:
    """{single-device name: full tensor}, as GPTModel(config).named_parameters() would give.
    Communication: one all-gather (tag "full") per split parameter; collective: every rank
    of the group must call it. ``group``, if given, must be the model's own group."""
    _same_group(model, group)
    return reassemble(model, dict(model.named_parameters()), "full")


def full_gradients(model: TensorParallelGPTModel, group=None) -> dict[str, torch.Tensor]:
    """{single-device name: full gradient}, the gradients GPTModel would hold after the same
    backward. Replicated parameters' gradients are taken from this rank (they are identical
    on every rank of the group, see the module docstring). Collective, as full_parameters."""
    _same_group(model, group)
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}
    return reassemble(model, grads, "full")


def tensor_parallel_grad_norm_squared(grads: list[tuple[str, torch.Tensor]], replicated: set[str],
                                      group) -> torch.Tensor:
    """The squared global norm of the gradients of a model split over the TP ``group``.

    grads: (parameter name, gradient) pairs, the gradients this rank holds: the shards of the
    split parameters and full copies of the replicated ones (any dtype; float64 is safest).
    replicated: the names whose gradient is the SAME full tensor on every rank of the group
    (norms, position embeddings, row-parallel biases: shard_layout's "replicated").
    Returns a tensor of shape [1] in the gradients' dtype, the same on every rank: the sum of
    squares of every element of the single-device model's gradient, each counted ONCE.
    Communication: one comm.all_reduce (sum) of that one element over ``group``, tag
    "grad-norm". (Under ZeRO the gradients are also split over the data-parallel group;
    the caller adds that all-reduce: sums commute.)

    A first version trained without an error, and its loss went down:

        squares = torch.zeros(1, dtype=grads[0][1].dtype)
        for name, g in grads:
            squares += g.pow(2).sum()
        all_reduce(squares, group, op="sum", tag="grad-norm")
        return squares

    Checked against the single-device run with clipping active (clip_grad=1.0), it showed:
      * with clipping off, losses, gradients and parameters all matched;
      * with clipping on, the updated parameters drifted from the single-device ones, and
        the printed gradient norm was LARGER than the single-device norm, by more at tp 4
        than at tp 2.
    Find the bug, and write a body that meets the spec.
    """
    # BEGIN EXERCISE 2.4: spot the bug in the tensor-parallel gradient norm | hint: every rank holds a full copy of each replicated gradient; how many times does the all-reduce count it?
    count_replicated = group_rank(group) == 0      # one rank speaks for the replicas
    squares = torch.zeros(1, dtype=grads[0][1].dtype)
    for name, g in grads:
        if count_replicated or name not in replicated:
            squares += g.pow(2).sum()
    all_reduce(squares, group, op="sum", tag="grad-norm")
    return squares
    # END EXERCISE


def replicated_names(model: "TensorParallelGPTModel") -> set[str]:
    """The local parameter names that every rank of the TP group holds in full."""
    return {n for n, (_, how, _) in model.shard_layout().items() if how == "replicated"}


def clip_tensor_parallel_grad_norm(model: "TensorParallelGPTModel", max_norm: float) -> torch.Tensor:
    """The global gradient norm of a tensor-parallel model, clipped in place as clip_grad_norm_.

    norm^2 = tensor_parallel_grad_norm_squared: each rank's split gradients' squares, plus
    the replicated gradients' squares counted ONCE, summed with one all-reduce of one number
    over the TP group. Megatron: get_grad_norm_fp32 in megatron/core/optimizer/clip_grads.py
    over the grads that pass param_is_not_tensor_parallel_duplicate
    (megatron/core/tensor_parallel/layers.py).
    """
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    norm = tensor_parallel_grad_norm_squared(grads, replicated_names(model), model.group).sqrt()[0]
    if max_norm > 0:                                 # as torch.nn.utils.clip_grad_norm_
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, g in grads:
            g.mul_(coef)
    return norm
