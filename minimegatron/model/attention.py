"""Causal self-attention with grouped-query attention (GQA), Megatron-LM's layout.

Shape legend: b batch, s sequence, h hidden, a query heads, g key/value heads (query groups),
d head size (kv_channels), so h = a * d. Each of the g groups has a/g query heads sharing
one key head and one value head; g = a is ordinary multi-head attention, g = 1 multi-query.

The fused QKV projection's output is laid out group by group, as in Megatron-LM:

    [ group 0: q (a/g heads) | k | v ][ group 1: q | k | v ] ...   each head d wide

so a tensor-parallel split of that projection along its output dimension hands each rank
whole groups (it only needs g to be divisible by the TP size) and no rank ever needs a key
or value head that lives on another rank.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .linear import Linear, compute_dtype
from .rope import apply_rotary_pos_emb


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, written out.

    query, key, value: [b, n, s, d] (n heads; keys/values already repeated for GQA).
    Returns [b, n, s, d] in the dtype of `query`.
    Causal: output position i depends only on key/value positions j <= i.
    The softmax runs in float32 when the inputs are bfloat16/float16 (as Megatron does with
    --attention-softmax-in-fp32), otherwise in the input dtype.
    """
    # BEGIN EXERCISE 0.1: causal self-attention | hint: which scores may the query at position i use, and which score value makes a softmax weight exactly 0? The spec's dtype rule concerns the softmax alone (Megatron: DotProductAttention, FusedScaleMaskSoftmax)
    s, d = query.shape[-2], query.shape[-1]
    scores = query @ key.transpose(-2, -1) / math.sqrt(d)                     # [b, n, s, s]
    future = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)  # [s, s], j > i
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.to(compute_dtype(scores)), dim=-1).to(query.dtype)                     # [b, n, s, s]
    probs = F.dropout(probs, p=dropout_p, training=training)
    return probs @ value                                                      # [b, n, s, d]
    # END EXERCISE


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """`causal_attention` through PyTorch's fused kernel (the default backend): query [b, n, s, d];
    key, value [b, n_kv, s, d], n a multiple of n_kv, query head i using key/value head
    i // (n / n_kv), read in place (enable_gqa) instead of copied. Returns [b, n, s, d] in the
    dtype of `query`; dropout only when `training` (mask from torch's default generator)."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=dropout_p if training else 0.0,
                                          enable_gqa=key.shape[1] != query.shape[1])


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, document_ids: torch.Tensor,
                       dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """Causal attention kept inside each document of a packed sequence (chapter 07): query i
    attends to key j when j <= i and both are in the same document. query [b, a, s, d]; key,
    value [b, g, s, d]; document_ids [b, s] (data/gpt_dataset.py document_masks). Returns
    [b, a, s, d]: per document, what attention over that document alone gives. PyTorch's
    fused kernel with a block-diagonal boolean mask [b, 1, s, s]; Megatron's THD format gives
    the same blocks to a variable-length kernel as cu_seqlens, without the padding of a mask."""
    s = query.shape[-2]
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()          # [s, s], j <= i
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)                  # [b, s, s]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=(same & causal).unsqueeze(1),
                                          dropout_p=dropout_p if training else 0.0,
                                          enable_gqa=key.shape[1] != query.shape[1])


def single_device_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa",
                            document_ids: torch.Tensor | None = None, dropout_p: float = 0.0,
                            training: bool = False) -> torch.Tensor:
    """The attention core on one device: q [b, a, s, d], k and v [b, g, s, d] -> [b, a, s, d].
    With document_ids [b, s] (packed documents, chapter 07) `document_attention`, either
    backend; else backend "sdpa" (the default) `sdpa_attention` on the g shared heads, or
    "naive" (the lesson, exercise 0.1, the test oracle) k and v copied to a heads and
    `causal_attention`. All equal to rounding (tests/test_model.py checks it in float64)."""
    if document_ids is not None:                                      # the block-diagonal mask
        return document_attention(q, k, v, document_ids, dropout_p, training)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, dropout_p, training)
    heads_per_group = q.shape[1] // k.shape[1]
    if heads_per_group > 1:                                           # GQA: copy k, v to every head
        k = k.repeat_interleave(heads_per_group, dim=1)               # [b, a, s, d]
        v = v.repeat_interleave(heads_per_group, dim=1)               # [b, a, s, d]
    return causal_attention(q, k, v, dropout_p, training)


class SelfAttention(nn.Module):
    """Pre-normalised input [b, s, h] -> attention output [b, s, h] (before the residual add).

    Parameters (Megatron-core names):
      linear_qkv:  weight [(a + 2g) d, h], grouped layout above; bias if add_bias_linear.
      linear_proj: weight [h, a d]; bias if add_bias_linear.

    The number of heads this module runs is read from its projection: linear_qkv's output
    rows hold whole groups of (a/g + 2) d rows, so a tensor-parallel linear_qkv holding
    [(a + 2g) d / tp, h] makes this module run g/tp groups, a/tp query heads (chapter 02).

    The seams later chapters set (None on one device):
      dropout_rng     a context-manager factory the attention dropout draws inside (None: torch's
                      default generator); tensor parallelism sets the per-rank stream, since this
                      rank's heads are a shard of the full [b, a, s, s] (tp/random.py)
      core_attention  a callable (q [b, a, s, d], k [b, g, s, d], v [b, g, s, d], dropout_p,
                      training[, document_ids]) -> [b, a, s, d] in place of
                      `single_device_attention` (config.attention_backend): context parallelism's
                      attention over the whole sequence (cp/attention.py), the Triton kernel
                      (kernels/), the KV cache (generate.py). q and k arrive with RoPE applied.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        a, g, d, h = config.num_attention_heads, config.query_groups, config.kv_channels, config.hidden_size
        self.linear_qkv = Linear(h, (a + 2 * g) * d, bias=config.add_bias_linear)
        self.linear_proj = Linear(a * d, h, bias=config.add_bias_linear)
        self.dropout_rng = None
        self.core_attention = None

    def local_heads(self) -> tuple[int, int]:
        """(query heads, key/value groups) this module runs: (a, g), or (a/tp, g/tp) once
        tensor parallelism has cut linear_qkv."""
        cfg = self.config
        heads_per_group = cfg.num_attention_heads // cfg.query_groups                  # a/g on any layout
        groups = self.linear_qkv.weight.shape[0] // ((heads_per_group + 2) * cfg.kv_channels)
        return groups * heads_per_group, groups

    def core_attention_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with the causal mask and the attention dropout: q [b, a, s, d],
        k and v [b, g, s, d] -> [b, a, s, d] (a, g: this module's heads); with document_ids [b, s]
        (a packed sequence, chapter 07) inside each document only (document_attention, either
        backend). The part chapter 07's selective recompute ("core_attn") recomputes in the
        backward instead of keeping its [b, a, s, s] probabilities (Megatron:
        Attention._checkpointed_attention_forward)."""
        p = self.config.attention_dropout
        rng = self.dropout_rng() if self.dropout_rng is not None and self.training and p > 0 else nullcontext()
        with rng:
            if self.core_attention is None:                               # one device
                return single_device_attention(q, k, v, self.config.attention_backend, document_ids, p,
                                               self.training)             # [b, a, s, d]
            docs = {} if document_ids is None else {"document_ids": document_ids}
            return self.core_attention(q, k, v, dropout_p=p, training=self.training, **docs)   # [b, a, s, d]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.config
        d = cfg.kv_channels
        heads, groups = self.local_heads()                                # a, g (or a/tp, g/tp)
        heads_per_group = heads // groups

        mixed = self.linear_qkv(x)                                        # [b, s, (a+2g) d]
        b, s = mixed.shape[:2]              # s: the whole sequence also when x is [b, s/tp, h] (SP)
        mixed = mixed.view(b, s, groups, (heads_per_group + 2) * d)       # [b, s, g, (a/g+2) d]
        q, k, v = mixed.split([heads_per_group * d, d, d], dim=-1)
        q = q.reshape(b, s, heads, d).transpose(1, 2)                     # [b, a, s, d]
        k = k.transpose(1, 2)                                             # [b, g, s, d]
        v = v.transpose(1, 2)                                             # [b, g, s, d]

        if rope is not None:
            cos, sin = rope
            q = apply_rotary_pos_emb(q, cos, sin)
            k = apply_rotary_pos_emb(k, cos, sin)

        out = self.core_attention_forward(q, k, v, document_ids)          # [b, a, s, d]
        out = out.transpose(1, 2).reshape(b, s, heads * d)                # [b, s, a d]
        return self.linear_proj(out)                                      # [b, s, h]
