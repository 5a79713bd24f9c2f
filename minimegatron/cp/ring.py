"""Ring attention (cp_comm_type "p2p"): the keys and values travel, the queries stay.

Shape legend as in cp/blocks.py; n = the ring's size, c = one chunk's length. Each ring rank
holds the queries, keys and values of its own tokens, a few chunks of c positions each (two
under the zig-zag layout, cp/layout.py). In n steps every rank sees every rank's K and V:

    step t on ring rank r:  start sending the K/V block it holds to rank r + 1 and receiving the
                            next one from rank r - 1 (both asynchronous), attend its queries to
                            the block it holds (it came from rank r - t), merge into the running
                            (out, lse), then wait for the transfer.

Which pairs of chunks to compute is decided by their chunk indices alone (positions grow with
the index): query chunk i against key chunk j is full attention when i > j, the causal
triangle when i == j, and skipped when i < j (every score masked). Under the zig-zag layout
this yields Transformer Engine's three cases: step 0, the rank's own block, with the diagonal
masks; a block from a lower ring rank, every query against the block's first chunk; a block
from a higher ring rank, the rank's second query chunk against the whole block. Every rank
then computes the same number of scores at every step (the point of zig-zag).

The backward runs the ring again. The block a rank holds travels together with the running
sums of its dK and dV; each rank adds the share its queries contribute
(blocks.attention_block_backward, with the final out and lse saved by the forward), and after
the last step one more hop brings each dK/dV home. dQ stays on its rank.

Communication per attention call and rank, with K and V of [b, g, s/cp... ] = kv bytes each
(one message per hop, K and V stacked):
    forward   n - 1 sends (and receives) of 2 kv
    backward  n - 1 sends of 4 kv (K, V, dK, dV) and 1 send of 2 kv (dK, dV home)
All through comm.batch_isend_irecv (ledger tags "fwd" and "bwd").

With n = 1 (no group) this is blockwise attention over chunks on one rank: the all-gather and
all-to-all variants (cp/attention.py) call it that way, with other chunk lists for the keys.
Megatron-LM / Transformer Engine: AttnFuncWithCPAndKVP2P in transformer_engine/pytorch/
attention/dot_product_attention/context_parallel.py (GPU kernels, the same three cases).
"""

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


def _attend(q, k, v, q_ids, kv_ids, backend, partial):
    """Merge into `partial` (one (out, lse) or None per query chunk) the attention of q's
    chunks over the key chunks kv_ids held in k, v."""
    c = q.shape[2] // len(q_ids)
    for i, j, causal in block_pairs(q_ids, kv_ids):
        out, lse = attention_block_forward(_chunk(q, i, c), _chunk(k, j, c), _chunk(v, j, c), causal, backend)
        partial[i] = (out, lse) if partial[i] is None else merge_attention(*partial[i], out, lse)
    return partial


def _attend_backward(dout, q, k, v, out, lse, q_ids, kv_ids, backend, dq, dkv):
    """Add to dq (this rank's queries) and dkv [2, b, g, sk, d] (the block held) the
    gradients of the pairs computed in the forward."""
    c = q.shape[2] // len(q_ids)
    for i, j, causal in block_pairs(q_ids, kv_ids):
        dq_i, dk_j, dv_j = attention_block_backward(
            _chunk(dout, i, c), _chunk(q, i, c), _chunk(k, j, c), _chunk(v, j, c),
            _chunk(out, i, c), lse.narrow(2, i * c, c), causal, backend)
        _chunk(dq, i, c).add_(dq_i)
        _chunk(dkv[0], j, c).add_(dk_j)
        _chunk(dkv[1], j, c).add_(dv_j)


def _ring_shift(t: torch.Tensor, group, tag: str) -> tuple[torch.Tensor, list]:
    """Start sending t to the next ring rank and receiving the previous rank's into a new
    buffer; returns (buffer, handles). Wait on the handles before reading the buffer."""
    ranks, me = group_ranks(group), group_rank(group)
    incoming = torch.empty_like(t)
    handles = batch_isend_irecv([P2POp("send", t, ranks[(me + 1) % len(ranks)], group),
                                 P2POp("recv", incoming, ranks[(me - 1) % len(ranks)], group)], tag=tag)
    return incoming, handles


def _wait(handles):
    for h in handles:
        h.wait()


def _ring(group) -> tuple[int, int]:
    """(ring size, this rank's index); group None: no ring (local blockwise attention)."""
    return (1, 0) if group is None else (group_size(group), group_rank(group))


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, q_ids, kv_ids_per_rank, backend):
        n, me = _ring(group)
        kv = torch.stack([k, v])                                     # [2, b, g, sk, d]: one message
        partial = [None] * len(q_ids)
        for step in range(n):
            if step < n - 1:
                incoming, handles = _ring_shift(kv, group, "fwd")    # overlaps with the attention below
            partial = _attend(q, kv[0], kv[1], q_ids, kv_ids_per_rank[(me - step) % n], backend, partial)
            if step < n - 1:
                _wait(handles)
                kv = incoming
        out = torch.cat([o for o, _ in partial], dim=2)              # [b, a, sq, d]
        lse = torch.cat([l for _, l in partial], dim=2)              # [b, a, sq]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.q_ids, ctx.kv_ids_per_rank, ctx.backend = group, q_ids, kv_ids_per_rank, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, q_ids, kv_ids_per_rank, backend = ctx.group, ctx.q_ids, ctx.kv_ids_per_rank, ctx.backend
        n, me = _ring(group)
        dq = torch.zeros_like(q)
        kv_dkv = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])   # [4, b, g, sk, d]
        for step in range(n):
            _attend_backward(dout, q, kv_dkv[0], kv_dkv[1], out, lse, q_ids, kv_ids_per_rank[(me - step) % n],
                             backend, dq, kv_dkv[2:])
            if step < n - 1:                                         # the block and its gradient move on
                kv_dkv, handles = _ring_shift(kv_dkv, group, "bwd")
                _wait(handles)
            elif n > 1:                                              # one more hop: each dK/dV goes home
                dkv, handles = _ring_shift(kv_dkv[2:].contiguous(), group, "bwd")
                _wait(handles)
                kv_dkv = torch.cat([kv_dkv[:2], dkv])
        return dq, kv_dkv[2], kv_dkv[3], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, q_ids: list[int],
                   kv_ids_per_rank: list[list[int]], backend: str = "sdpa") -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of every rank of the ring `group`.

    q [b, a, sq, d], k and v [b, g, sk, d]: this rank's tokens, the chunks `q_ids` (and the
    same chunks for its k, v) concatenated along the sequence; kv_ids_per_rank[r]: the chunks
    ring rank r's k, v hold (a list per rank of `group`; with group None or of one rank, the
    one list of the local k, v). Returns out [b, a, sq, d], equal to the rows q_ids of
    single-device causal attention over the whole sequence. Differentiable (the ring backward
    above); communication as in the module docstring."""
    return _RingAttention.apply(q, k, v, group, list(q_ids), [list(x) for x in kv_ids_per_rank], backend)
