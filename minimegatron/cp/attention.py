"""Context parallelism as a transformation of the one model: `apply_context_parallel`.

Shapes as in model/attention.py; a and g are this rank's query and key/value heads (a / tp,
g / tp under tensor parallelism); a cp rank holds s / cp tokens, two chunks of c = s / (2 cp)
(cp/layout.py). Every module but attention treats them as a shorter sequence (RoPE reads the
positions the batch carries). `ContextParallelAttention` gets the other keys and values in one
of Megatron's four `cp_comm_type`s:

  "p2p"        ring attention (cp/ring.py): K/V blocks go round the ring, cp - 1 hops.
  "all_gather" all-gather K, V [b, g, s/cp, d] -> [b, g, s, d]; backward gathers again (tag
               "regather") and reduce-scatters dK, dV.
  "a2a"        DeepSpeed-Ulysses: all-to-all q, k, v to head-sharded [b, a/cp, s, d], attend,
               all-to-all back. a and g divisible by cp.
  "a2a+p2p"    all-to-all inside groups of A consecutive ranks, ring across the P groups
               (hierarchical_context_parallel_sizes = [A, P], A P = cp).

All four use the blockwise core of cp/blocks.py and skip causally hidden blocks. Dense
gradients are averaged over the "dp-cp" group by the data-parallel wrapper.
Megatron-LM: TEDotProductAttention (megatron/core/extensions/transformer_engine.py) into
Transformer Engine's context_parallel.py (AttnFuncWithCPAndKVP2P, ...KVAllGather, ...QKVOA2A)."""

from __future__ import annotations

import torch
from torch import nn

from ..comm import all_gather, all_to_all_region, group_rank, group_size, reduce_scatter
from ..config import ConfigError
from .layout import cp_chunk_ids
from .ring import attend_blocks, attend_blocks_backward, ring_attention

__all__ = ["CP_COMM_TYPES", "ContextParallelAttention", "apply_context_parallel", "check_context_parallel_config",
           "hierarchical_sizes"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
SEQ, HEADS = 2, 1                      # dims of q, k, v [b, heads, s, d]


def hierarchical_sizes(cp: int, comm_type: str, given: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """(all-to-all size, ring size) of "a2a+p2p": `given`, or all-to-all groups of 2 (the
    book's default; Megatron asks for --hierarchical-context-parallel-sizes). None for the
    other comm types or cp = 1."""
    if comm_type != "a2a+p2p" or cp == 1:
        return None
    return tuple(given) if given else (2, cp // 2)


def check_context_parallel_config(num_heads: int, num_groups: int, cp: int, comm_type: str,
                                  hierarchical: tuple[int, int] | None = None, attention_dropout: float = 0.0) -> None:
    """ConfigError naming the field and the numbers when attention cannot run over `cp` ranks
    with `comm_type`: heads (a and g of one tensor-parallel rank) not divisible by the
    all-to-all size, hierarchical sizes whose product is not cp, attention dropout."""
    if comm_type not in CP_COMM_TYPES:
        raise ConfigError(f"cp_comm_type={comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")
    if cp == 1:
        return
    if attention_dropout:
        raise ConfigError(f"attention_dropout={attention_dropout} with context_parallel_size={cp}: dropout on "
                          f"attention probabilities is not implemented for context parallelism here; set it to 0")
    sizes = hierarchical_sizes(cp, comm_type, hierarchical)
    a2a = {"a2a": cp, "a2a+p2p": sizes[0] if sizes else None}.get(comm_type)
    if comm_type == "a2a+p2p":
        if len(sizes) != 2 or sizes[0] * sizes[1] != cp or min(sizes) < 1:
            raise ConfigError(f"hierarchical_context_parallel_sizes={list(sizes)}: expected [all-to-all size, ring "
                              f"size] whose product is context_parallel_size={cp}")
    if a2a:
        for field, value in (("num_attention_heads per tensor-parallel rank", num_heads),
                             ("num_query_groups per tensor-parallel rank", num_groups)):
            if value % a2a:
                raise ConfigError(f"{field} = {value} is not divisible by the all-to-all size {a2a} of "
                                  f"cp_comm_type={comm_type!r}: each rank runs whole heads (and key/value groups) "
                                  f"after the all-to-all; use cp_comm_type 'p2p' or 'all_gather'")


class _AllGatherAttention(torch.autograd.Function):
    """cp_comm_type "all_gather": forward all-gather K, V (tag "fwd") and attend; keep this
    rank's own K, V only; backward gather them again (tag "regather"), compute dQ and the full
    dK, dV, reduce-scatter dK, dV (tag "bwd") so each rank gets the sum for its own tokens."""

    @staticmethod
    def forward(ctx, q, k, v, group, q_ids, all_ids, backend, document_ids=None):
        k_all = all_gather(k.contiguous(), group, dim=SEQ, tag="fwd")             # [b, g, s, d]
        v_all = all_gather(v.contiguous(), group, dim=SEQ, tag="fwd")
        partial = attend_blocks(q, k_all, v_all, q_ids, all_ids, backend, [None] * len(q_ids), document_ids)
        out = torch.cat([o for o, _ in partial], dim=SEQ)                          # [b, a, s/cp, d]
        lse = torch.cat([l for _, l in partial], dim=SEQ)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.q_ids, ctx.all_ids, ctx.backend, ctx.document_ids = group, q_ids, all_ids, backend, document_ids
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        k_all = all_gather(k, ctx.group, dim=SEQ, tag="regather")
        v_all = all_gather(v, ctx.group, dim=SEQ, tag="regather")
        dq, dkv = torch.zeros_like(q), torch.zeros(2, *k_all.shape, dtype=k.dtype, device=k.device)
        attend_blocks_backward(dout, q, k_all, v_all, out, lse, ctx.q_ids, ctx.all_ids, ctx.backend, dq, dkv,
                               ctx.document_ids)
        dk = reduce_scatter(dkv[0], ctx.group, dim=SEQ, tag="bwd")                # [b, g, s/cp, d]
        dv = reduce_scatter(dkv[1], ctx.group, dim=SEQ, tag="bwd")
        return dq, dk, dv, None, None, None, None, None


class ContextParallelAttention:
    """Core attention under context parallelism: q [b, a, s/cp, d], k, v [b, g, s/cp, d] of this
    rank's chunks (`chunk_ids_per_rank[cp_rank]`) -> out [b, a, s/cp, d], the single-device output
    of those tokens. cp_group; for "a2a+p2p" also a2a_group (consecutive ranks) and p2p_group (the ring).

    Per call and rank, kv = bytes of this rank's k (or v), q of its q; tags "fwd", "bwd", "regather":
      p2p         forward cp - 1 ring hops of 2 kv; backward cp - 1 of 4 kv
      all_gather  forward 2 all-gathers of kv; backward 2 all-gathers of kv ("regather") and
                  2 reduce-scatters of cp kv
      a2a         4 all-to-alls forward (2 q + 2 kv) and 4 backward
      a2a+p2p     a2a's in the A ranks, then p2p's ring over P = cp / A
    document_ids [b, s], the WHOLE sequence's, mask every block pair (ring.same_document); same
    messages. Not an nn.Module: the state dict is unchanged."""

    def __init__(self, cp_group, comm_type: str, chunk_ids_per_rank: list[list[int]], backend: str = "sdpa",
                 a2a_group=None, p2p_group=None):
        self.cp_group, self.comm_type, self.backend = cp_group, comm_type, backend
        self.chunk_ids_per_rank = chunk_ids_per_rank
        self.a2a_group, self.p2p_group = a2a_group, p2p_group

    def __call__(self, q, k, v, dropout_p: float = 0.0, training: bool = False, document_ids=None):
        ids, me = self.chunk_ids_per_rank, group_rank(self.cp_group)
        every = [i for r in ids for i in r]                                                     # cp rank order
        if self.comm_type == "p2p":
            return ring_attention(q, k, v, self.cp_group, ids[me], ids, self.backend, document_ids)   # [b, a, s/cp, d]
        if self.comm_type == "all_gather":
            return _AllGatherAttention.apply(q, k, v, self.cp_group, ids[me], every, self.backend,
                                             document_ids)                                      # [b, a, s/cp, d]
        if self.comm_type == "a2a":
            return self._ulysses(q, k, v, self.cp_group, None, every, [every], document_ids)
        # "a2a+p2p": the all-to-all inside my sub-group, then a ring across sub-groups
        n_a2a, ring = group_size(self.a2a_group), group_size(self.p2p_group)
        members = [ids[j * n_a2a:(j + 1) * n_a2a] for j in range(ring)]                       # sub-group j's ranks
        per_ring_rank = [[i for r in m for i in r] for m in members]
        mine = per_ring_rank[group_rank(self.p2p_group)]
        return self._ulysses(q, k, v, self.a2a_group, self.p2p_group, mine, per_ring_rank, document_ids)

    def _ulysses(self, q, k, v, a2a_group, ring_group, q_ids, kv_ids_per_rank, document_ids=None):
        # sequence-sharded -> head-sharded: scatter heads, gather the sub-group's tokens
        q = all_to_all_region(q, a2a_group, scatter_dim=HEADS, gather_dim=SEQ)                 # [b, a/n, n s/cp, d]
        k = all_to_all_region(k, a2a_group, scatter_dim=HEADS, gather_dim=SEQ)                 # [b, g/n, n s/cp, d]
        v = all_to_all_region(v, a2a_group, scatter_dim=HEADS, gather_dim=SEQ)
        out = ring_attention(q, k, v, ring_group, q_ids, kv_ids_per_rank, self.backend,
                             document_ids)                                                      # [b, a/n, n s/cp, d]
        return all_to_all_region(out, a2a_group, scatter_dim=SEQ, gather_dim=HEADS)              # [b, a, s/cp, d]


def apply_context_parallel(model: nn.Module, cp_group, comm_type: str = "p2p", load_balance: bool = True,
                           a2a_group=None, p2p_group=None) -> nn.Module:
    """Give every attention layer of `model` (after tensor parallelism) a ContextParallelAttention
    over `cp_group`; returns the model; no-op for one rank. The batch must be this rank's
    (get_batch_on_this_cp_rank with the same `load_balance`). ConfigError before any change when
    the heads do not divide."""
    cp, cfg = group_size(cp_group), model.config
    if cp == 1:
        return model
    for layer in model.decoder.layers.values():
        attention = layer.self_attention
        heads, groups = attention.local_heads()
        sizes = (group_size(a2a_group), group_size(p2p_group)) if comm_type == "a2a+p2p" else None
        check_context_parallel_config(heads, groups, cp, comm_type, sizes, cfg.attention_dropout)
        ids = [cp_chunk_ids(cp, r, load_balance) for r in range(cp)]
        attention.core_attention = ContextParallelAttention(cp_group, comm_type, ids, cfg.attention_backend,
                                                            a2a_group, p2p_group)
    return model
