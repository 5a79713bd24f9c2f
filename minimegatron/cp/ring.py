"""Ring attention (cp_comm_type "p2p"): the keys and values travel, the queries stay.

Shapes as in cp/blocks.py; n the ring's size, c one chunk's length (s / (2 cp) under zig-zag,
cp/layout.py). Step t on ring rank r: start sending the K/V block it holds to r + 1 and
receiving from r - 1, attend its queries to the block it holds (from r - t), merge into the
running (out, lse), wait. Query chunk i against key chunk j: full when i > j, causal when
i == j, skipped when i < j (under zig-zag, Transformer Engine's three cases, equal work per
rank and step).

Backward: the ring the other way, starting from the block the forward held last, passing each
block with its running dK, dV to r - 1; after n - 1 hops they are home. dQ stays local.

Per attention call and rank, kv = bytes of K (or V) [b, g, s/cp, d]; one message per hop,
via comm.batch_isend_irecv (tags "fwd", "bwd"):
    forward   n - 1 sends (and receives) of 2 kv        (K, V)
    backward  n - 1 sends (and receives) of 4 kv        (K, V, dK, dV)
Memory: own q, k, v, out, lse and one extra block (2 kv). With n = 1 it is blockwise attention
on one rank (how the all-gather and all-to-all variants call it).
Megatron-LM / TE: AttnFuncWithCPAndKVP2P (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py)."""

from __future__ import annotations

import torch

from ..comm import P2POp, batch_isend_irecv, group_rank, group_ranks, group_size
from .blocks import attention_block_backward, attention_block_forward, merge_attention

__all__ = ["ring_attention", "block_pairs"]


def block_pairs(q_ids: list[int], kv_ids: list[int]) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, causal) for every pair that is not fully masked."""
    return [(i, j, qi == kj) for i, qi in enumerate(q_ids) for j, kj in enumerate(kv_ids) if qi >= kj]


def _chunk(t: torch.Tensor, slot: int, c: int) -> torch.Tensor:
    return t.narrow(2, slot * c, c)                                  # [b, heads, c, d]


def same_document(document_ids: torch.Tensor | None, q_chunk: int, kv_chunk: int, c: int) -> torch.Tensor | None:
    """[b, c, c]: which keys of chunk kv_chunk are in each query's document of chunk q_chunk
    (document_ids [b, s], the whole sequence's: every rank holds it), or None (no documents)."""
    if document_ids is None:
        return None
    rows = document_ids.narrow(1, q_chunk * c, c)                    # [b, c]
    cols = document_ids.narrow(1, kv_chunk * c, c)
    return rows.unsqueeze(-1) == cols.unsqueeze(-2)


def attend_blocks(q, k, v, q_ids, kv_ids, backend, partial, document_ids=None):
    """Merge into `partial` (one (out, lse) or None per query chunk) the attention of q's
    chunks over the key chunks kv_ids held in k, v (document_ids [b, s]: packed documents)."""
    c = q.shape[2] // len(q_ids)
    for i, j, causal in block_pairs(q_ids, kv_ids):
        out, lse = attention_block_forward(_chunk(q, i, c), _chunk(k, j, c), _chunk(v, j, c), causal, backend,
                                           same_document(document_ids, q_ids[i], kv_ids[j], c))
        partial[i] = (out, lse) if partial[i] is None else merge_attention(*partial[i], out, lse)
    return partial


def attend_blocks_backward(dout, q, k, v, out, lse, q_ids, kv_ids, backend, dq, dkv, document_ids=None):
    """Add to dq (this rank's queries) and dkv [2, b, g, sk, d] (the block held) the
    gradients of the pairs computed in the forward."""
    c = q.shape[2] // len(q_ids)
    for i, j, causal in block_pairs(q_ids, kv_ids):
        dq_i, dk_j, dv_j = attention_block_backward(
            _chunk(dout, i, c), _chunk(q, i, c), _chunk(k, j, c), _chunk(v, j, c),
            _chunk(out, i, c), lse.narrow(2, i * c, c), causal, backend,
            same_document(document_ids, q_ids[i], kv_ids[j], c))
        _chunk(dq, i, c).add_(dq_i)
        _chunk(dkv[0], j, c).add_(dk_j)
        _chunk(dkv[1], j, c).add_(dv_j)


def _ring_shift(t: torch.Tensor, group, tag: str, step: int = 1) -> tuple[torch.Tensor, list]:
    """Start sending t to ring rank me + step and receiving from me - step into a new buffer
    (step 1: forward round the ring, -1: backward); returns (buffer, handles). Wait on the
    handles before reading the buffer."""
    ranks, me = group_ranks(group), group_rank(group)
    incoming = torch.empty_like(t)
    handles = batch_isend_irecv([P2POp("send", t, ranks[(me + step) % len(ranks)], group),
                                 P2POp("recv", incoming, ranks[(me - step) % len(ranks)], group)], tag=tag)
    return incoming, handles


def _wait(handles):
    for h in handles:
        h.wait()


def _ring(group) -> tuple[int, int]:
    """(ring size, this rank's index); group None: no ring (local blockwise attention)."""
    return (1, 0) if group is None else (group_size(group), group_rank(group))


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, q_ids, kv_ids_per_rank, backend, document_ids=None):
        n, me = _ring(group)
        kv = torch.stack([k, v])                                     # [2, b, g, sk, d]: one message
        partial = [None] * len(q_ids)
        for step in range(n):
            if step < n - 1:
                incoming, handles = _ring_shift(kv, group, "fwd")    # overlaps with the attention below
            partial = attend_blocks(q, kv[0], kv[1], q_ids, kv_ids_per_rank[(me - step) % n], backend, partial,
                                    document_ids)
            if step < n - 1:
                _wait(handles)
                kv = incoming
        out = torch.cat([o for o, _ in partial], dim=2)              # [b, a, sq, d]
        lse = torch.cat([l for _, l in partial], dim=2)              # [b, a, sq]
        ctx.save_for_backward(q, out, lse, kv)                       # kv: the last block held (rank me + 1's)
        ctx.group, ctx.q_ids, ctx.kv_ids_per_rank, ctx.backend = group, q_ids, kv_ids_per_rank, backend
        ctx.document_ids = document_ids
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, kv = ctx.saved_tensors
        group, q_ids, kv_ids_per_rank, backend = ctx.group, ctx.q_ids, ctx.kv_ids_per_rank, ctx.backend
        n, me = _ring(group)
        dq = torch.zeros_like(q)
        kv_dkv = torch.cat([kv, torch.zeros_like(kv)])               # [4, b, g, sk, d]: K, V, dK, dV
        for step in range(n):                                        # step t: rank me + 1 + t's block
            attend_blocks_backward(dout, q, kv_dkv[0], kv_dkv[1], out, lse, q_ids,
                                   kv_ids_per_rank[(me + 1 + step) % n], backend, dq, kv_dkv[2:], ctx.document_ids)
            if step < n - 1:                                         # the block and its gradient move on
                kv_dkv, handles = _ring_shift(kv_dkv, group, "bwd", step=-1)
                _wait(handles)
        return dq, kv_dkv[2], kv_dkv[3], None, None, None, None, None   # the last block held is my own


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, q_ids: list[int],
                   kv_ids_per_rank: list[list[int]], backend: str = "sdpa",
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of every rank of the ring `group`.

    q [b, a, sq, d], k, v [b, g, sk, d]: this rank's chunks `q_ids` concatenated;
    kv_ids_per_rank[r]: the chunks ring rank r's k, v hold (group None or of one: the one local
    list). Returns out [b, a, sq, d], rows q_ids of single-device causal attention. document_ids
    [b, s] (the whole sequence's): attention within documents. Differentiable; communication as
    in the module docstring."""
    return _RingAttention.apply(q, k, v, group, list(q_ids), [list(x) for x in kv_ids_per_rank], backend, document_ids)
