"""The baseline: one decoder-only transformer, GPT-2 style or LLaMA style.

Shape legend (used in every shape comment of the book):
  b micro-batch size     s sequence length     h hidden size        V vocabulary size
  a query heads          g key/value heads     d head size (h / a)  f MLP inner size
  L layers               tp, cp, pp, dp, ep    the parallel sizes (later chapters)
  c one context-parallel chunk, s / (2 cp) tokens (chapter 04: a cp rank holds two, s / cp)

Activations are [b, s, h] (Megatron-LM: [s, b, h]). Names follow Megatron-core's GPTModel:

  embedding.word_embeddings.weight                 [V, h]
  embedding.position_embeddings.weight             [P, h]     learned positions only
  decoder.layers.{i}.input_layernorm.{weight,bias}
  decoder.layers.{i}.self_attention.linear_qkv     [(a+2g) d, h]
  decoder.layers.{i}.self_attention.linear_proj    [h, a d]
  decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}
  decoder.layers.{i}.mlp.linear_fc1                [f, h] (GELU) or [2f, h] (SwiGLU: gate; up)
  decoder.layers.{i}.mlp.linear_fc2                [h, f]
  decoder.final_layernorm.{weight,bias}
  output_layer.weight                              [V, h]     untied, or a pipeline's last stage

A pipeline stage builds part of the model (`pre_process`, `post_process`, a range of global
layer numbers); layer i keeps its name `decoder.layers.{i}` on every layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..config import ModelConfig
from ..placement import name_placements, set_placement
from .attention import SelfAttention
from .init import init_parameters
from .linear import Linear, build_norm, compute_dtype
from .mlp import MLP
from .finalize import register_grad_finalizer
from .moe import MoELayer, moe_layers, update_expert_bias
from .rope import rope_cos_sin


def dropout(x: torch.Tensor, p: float, training: bool, rng=None) -> torch.Tensor:
    """F.dropout, drawing inside `rng()` (a context-manager factory) when one is given: the
    per-rank stream of tp/random.py, for activations split over ranks (sequence parallel)."""
    if rng is None or not training or p == 0:
        return F.dropout(x, p, training)
    with rng():
        return F.dropout(x, p, training)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). [b, s, h] -> [b, s, h]
    ([b, s/tp, h] under sequence parallelism). dropout_rng: as SelfAttention's, for the residual
    branches (None: torch's default generator)."""

    def __init__(self, config: ModelConfig, layer_number: int = 0):
        super().__init__()
        self.dropout = config.hidden_dropout
        self.dropout_rng = None
        self.input_layernorm = build_norm(config.normalization, config.hidden_size, config.layernorm_epsilon)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = build_norm(config.normalization, config.hidden_size, config.layernorm_epsilon)
        # a mixture of experts in every moe_layer_freq-th layer of a GPT-MoE (chapter 05)
        self.mlp = MoELayer(config) if config.is_moe_layer(layer_number) else MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), rope, document_ids)   # [b, s, h]
        x = x + dropout(attn, self.dropout, self.training, self.dropout_rng)
        mlp = self.mlp(self.pre_mlp_layernorm(x))                          # [b, s, h]
        return x + dropout(mlp, self.dropout, self.training, self.dropout_rng)


class TransformerBlock(nn.Module):
    """The decoder: this stage's layers keyed by global number, and on the last stage the final norm
    (which GPTModel applies). forward(x, rope, document_ids=None): x [b, s, h] -> [b, s, h];
    document_ids [b, s] keeps attention within packed documents. Chapter 07's full recompute
    replaces forward (Megatron: TransformerBlock._checkpointed_forward)."""

    def __init__(self, config: ModelConfig, layer_numbers: list[int], post_process: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i) for i in layer_numbers})
        self.final_layernorm = (build_norm(config.normalization, config.hidden_size, config.layernorm_epsilon)
                                if post_process else None)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x, rope, document_ids)                                # [b, s, h]
        return x


class Embedding(nn.Module):
    """tokens [b, s] (+ positions) -> [b, s, h]. Sequence-parallel hooks (set by
    tp.apply_tensor_parallel): `scatter_to_sequence_parallel` ([b, s, h] -> [b, s/tp, h], after the
    positions; None: nothing) and `dropout_rng`. Megatron: LanguageModelEmbedding."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dropout = config.hidden_dropout
        self.dropout_rng = None
        self.scatter_to_sequence_parallel = None
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                    if config.position_embedding_type == "learned_absolute" else None)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)                                   # [b, s, h] ([b, s/tp, h]: SP with RoPE)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)                 # [b, s, h]
        if self.scatter_to_sequence_parallel is not None:
            x = self.scatter_to_sequence_parallel(x)                       # [b, s/tp, h]
        return dropout(x, self.dropout, self.training, self.dropout_rng)


class GPTModel(nn.Module):
    """The decoder-only language model, or one pipeline stage of it (the book's only model).

    config: validated here; pre_process: owns the embedding; post_process: owns the final norm,
    output layer and loss; layer_numbers: the global layers run (default all L).
    forward(tokens, position_ids=None, labels=None, hidden_states=None, document_ids=None):
      tokens [b, s] int64 (first stage) or hidden_states [b, s, h]; position_ids [b, s] or [s]
      (default 0..s-1; pass them under cp, packed documents, or SP-cut hidden states);
      document_ids [b, s] to every stage. Returns, on the last stage, losses [b, s] (float32, or
      float64 for a float64 model) with labels, else logits [b, s, V]; elsewhere [b, s, h].
    Parallelisms transform it in place (parallelize.build_model)."""

    def __init__(self, config: ModelConfig, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None):
        super().__init__()
        self.config = config.validate()
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(range(config.num_layers)) if layer_numbers is None else list(layer_numbers)

        self.embedding = Embedding(config) if pre_process else None
        self.decoder = TransformerBlock(config, self.layer_numbers, post_process)
        # The output layer. Tied on the stage that holds the embedding: no weight of its own,
        # forward reads the word embedding. Tied on a pipeline's last stage without the
        # embedding: its own copy, marked `shared` in its placement record (Megatron's name): it
        # starts equal to the embedding, its gradient is summed with the embedding's
        # (finalize_model_grads), and the gradient norm counts it once (optim.grads_for_norm).
        self.output_layer, self.loss = None, None
        if post_process:
            tied = not config.untie_embeddings_and_output_weights
            self.output_layer = Linear(config.hidden_size, config.vocab_size, bias=False,
                                       skip_weight_param_allocation=tied and pre_process)
            self.loss = LanguageModelLoss()

        init_parameters(self, config)
        self.to(config.dtype)
        name_placements(self)                    # every parameter's record: its name and shape
        if not config.untie_embeddings_and_output_weights and pre_process != post_process:
            # a tied embedding cut between pipeline stages: a copy on each (Megatron's marks)
            copy = self.output_layer.weight if post_process else self.embedding.word_embeddings.weight
            set_placement(copy, shared_embedding=True,
                          copy_of="embedding.word_embeddings.weight" if post_process else None)
        if moe_layers(self):                     # chapter 05's routers: the expert-bias update
            register_grad_finalizer(self, "expert-bias", update_expert_bias)

    def output_weight(self) -> torch.Tensor:
        """[V, h] (or this rank's [Vp/tp, h]): the matrix that turns hidden states into logits."""
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, tokens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        s = (tokens if tokens is not None else hidden_states).shape[1]
        if position_ids is None:                 # (given positions are not checked: no host sync)
            if s > cfg.max_position_embeddings:
                raise ValueError(f"sequence length {s} > max_position_embeddings={cfg.max_position_embeddings}")
            position_ids = torch.arange(s, device=(tokens if tokens is not None else hidden_states).device)

        # [b, s, h]: embedded tokens on the first stage, else the previous stage's output
        x = self.embedding(tokens, position_ids) if self.pre_process else hidden_states
        rope = (rope_cos_sin(position_ids, cfg.kv_channels, cfg.rotary_base, dtype=x.dtype)   # [s, d] x2
                if cfg.position_embedding_type == "rope" else None)

        x = self.decoder(x, rope, document_ids)                             # [b, s, h]
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)                                 # [b, s, h]
        return self.output_and_loss(x, labels)                              # [b, s] or [b, s, V]

    def output_and_loss(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """x [b, s, h] (after the final norm) -> losses [b, s] with labels [b, s], else logits [b, s, V].
        The seam chapter 07's fused linear cross-entropy replaces (kernels.apply_kernels)."""
        logits = self.output_layer(x, weight=self.output_weight())          # [b, s, V]
        if labels is None:
            return logits
        return self.loss(logits, labels)                                    # [b, s]


class LanguageModelLoss(nn.Module):
    """Per-token cross-entropy, logits [b, s, V] and labels [b, s] -> losses [b, s]
    (tensor parallelism swaps it for tp.VocabParallelCrossEntropy)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return language_model_loss(logits, labels)


class CrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy z [N, V], t [N] -> losses [N], F.cross_entropy(reduction="none")'s values.

    forward saves log_probs = log_softmax(z) [N, V]; backward writes (softmax(z) - onehot(t)) *
    dloss in place in it (no new [N, V] tensor), so it runs once: a second backward raises.
    Megatron: tensor_parallel/cross_entropy.py, calculate_gradients (the same in-place gradient)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)                        # [N, V]
        ctx.save_for_backward(log_probs, labels)
        return -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)       # [N]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        log_probs, labels = ctx.saved_tensors
        grad = log_probs.exp_()                                              # [N, V] softmax
        minus_one = torch.full_like(labels, -1, dtype=grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, labels.unsqueeze(-1), minus_one)               # - onehot(t)
        return grad.mul_(grad_loss.unsqueeze(-1)), None                      # [N, V]


def mean_loss(losses: torch.Tensor, loss_mask: torch.Tensor | None = None,
              loss_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A micro-batch's loss from per-token losses [b, s]: their mean, or with loss_mask [b, s]
    (--eod-mask-loss) sum(losses x mask) / sum(mask) (0 when all masked; Megatron's loss_func).
    loss_tokens: the kept tokens of the WHOLE micro-batch over cp (from get_batch_on_this_cp_rank),
    used as the denominator so the cp ranks' average is the micro-batch's mean."""
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.to(losses.dtype)
    count = mask.sum() if loss_tokens is None else loss_tokens.to(losses.dtype)
    return (losses * mask).sum() / count.clamp(min=1)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy: logits [b, s, V], labels [b, s] -> losses [b, s], in float32 for
    16-bit logits (as Megatron), else the logits' dtype; equal to F.cross_entropy(reduction="none")."""
    b, s, v = logits.shape
    logits = logits.to(compute_dtype(logits))
    return CrossEntropy.apply(logits.reshape(b * s, v), labels.reshape(b * s)).view(b, s)
