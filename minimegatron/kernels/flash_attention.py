"""FlashAttention-2 (Dao 2023) in Triton: causal attention that never stores the [s, s] scores,
forward and backward, with grouped-query attention (k, v never repeated in memory). Chapter 07.

    out = flash_attention(q, k, v)          q [b, a, s, d], k and v [b, g, s, d] -> [b, a, s, d]
    out = flash_attention(q, k, v, document_ids=ids)      packed documents, ids [b, s]

Forward, one program per (BLOCK_M queries, batch x head), over key blocks of BLOCK_N with the
online softmax: per row the running max m, sum l and output acc move to

    m' = max(m, rowmax S)        l' = l e^(m - m') + rowsum e^(S - m')
    acc' = acc e^(m - m') + e^(S - m') v

(`online_softmax_step`, exercise 7.3); out = acc / l. Saved for the backward: q, k, v, out and
lse = m + log l [b, a, s] float32. Backward, D = rowsum(dout * out), P = exp(S - lse): one
kernel per key block (dv = P^T dout, dk = dS^T q / sqrt(d), dS = P (dout v^T - D)), one per
query block (dq = dS k / sqrt(d)); no atomics; GQA's dk, dv summed over a/g heads afterwards.

Computed in float32 (16-bit inputs upcast before the launch, results cast back); on a CPU in
Triton's interpreter (minimegatron/triton_mode.py). d a power of 2 (>= 16 on a GPU). No dropout.
Packed documents: `document_tile_bounds` gives each query block's first key and each key
block's last query (flash-attn's cu_seqlens), so empty tiles are skipped; `attention_tiles`
counts the visited tiles.
Megatron-LM: Transformer Engine's fused attention or flash-attn (TEDotProductAttention)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["flash_attention", "online_softmax_step", "document_tile_bounds", "attention_tiles"]


def online_softmax_step(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                        v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block of the online softmax, in PyTorch (what each loop step of _flash_forward
    computes): running max m [r], running sum l [r] of exp(score - m), running output acc [r, d]
    of r query rows, and this block's scores [r, n] (-inf where masked) and values v [n, d] ->
    the new (m, l, acc). After the last block, acc / l is softmax(all scores) v and m + log l
    the rows' log-sum-exp. Rows whose scores are all -inf so far keep m = -inf, l = 0, acc = 0."""
    # BEGIN EXERCISE 7.3: the online-softmax merge inside a FlashAttention tile | hint: a row's new maximum may be larger than its old one: what factor brings the old sum and the old output to the new maximum, and what if both maxima are still minus infinity?
    m_new = torch.maximum(m, scores.max(dim=-1).values)                      # [r]
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # all masked so far: exp(-inf) = 0
    p = torch.exp(scores - safe[:, None])                                    # [r, n]
    alpha = torch.exp(m - safe)                                              # [r], rescales the old terms
    return m_new, l * alpha + p.sum(dim=-1), acc * alpha[:, None] + p @ v
    # END EXERCISE


@triton.jit
def _flash_forward(Q, K, V, O, LSE, DOC, KEY_START, sm_scale, seq, heads, group_size,
                   sqb, sqh, sqs, skb, skh, sks, sob, soh, sos,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group_size                                                   # this head's key/value head
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)                         # [M] query positions
    cols = tl.arange(0, BLOCK_N)                                           # [N]
    dims = tl.arange(0, D)                                                 # [D]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=rows[:, None] < seq, other=0.0)
    row_doc = tl.load(DOC + b * seq + rows, mask=rows < seq, other=-1)      # [M] their documents
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base, v_base = K + b * skb + kv * skh, V + b * skb + kv * skh
    begin = tl.load(KEY_START + b * tl.num_programs(0) + block)            # no key before the first row's document
    end = tl.minimum((block + 1) * BLOCK_M, seq)                           # causal: no key after the last row
    for start in range(begin, end, BLOCK_N):
        keys = start + cols                                                # [N] key positions
        k = tl.load(k_base + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)   # [N, D]
        v = tl.load(v_base + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)   # [N, D]
        key_doc = tl.load(DOC + b * seq + keys, mask=keys < seq, other=-2)                              # [N]
        s = tl.dot(q, tl.trans(k)) * sm_scale                                                            # [M, N]
        keep = (keys[None, :] <= rows[:, None]) & (keys[None, :] < seq) & (key_doc[None, :] == row_doc[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)                # a row that has seen nothing yet
        p = tl.exp(s - safe[:, None])
        alpha = tl.exp(m - safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    l = tl.where(rows < seq, l, 1.0)                                       # rows past the end: saw nothing, not stored
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :], acc / l[:, None], mask=rows[:, None] < seq)
    tl.store(LSE + bh * seq + rows, m + tl.log(l), mask=rows < seq)


@triton.jit
def _flash_backward_kv(Q, K, V, DO, LSE, DELTA, DK, DV, DOC, QUERY_END, sm_scale, seq, heads, group_size,
                       sqb, sqh, sqs, skb, skh, sks, sdb, sdh, sds,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group_size
    keys = block * BLOCK_N + tl.arange(0, BLOCK_N)                         # [N]
    dims = tl.arange(0, D)
    k = tl.load(K + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
    v = tl.load(V + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
    key_doc = tl.load(DOC + b * seq + keys, mask=keys < seq, other=-2)     # [N]
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    first = (block * BLOCK_N) // BLOCK_M * BLOCK_M                         # causal: no query before the block
    last = tl.load(QUERY_END + b * tl.num_programs(0) + block)             # no query after the last key's document
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)                               # [M]
        in_seq = rows < seq
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_seq[:, None], other=0.0)
        do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_seq[:, None], other=0.0)
        lse = tl.load(LSE + bh * seq + rows, mask=in_seq, other=0.0)
        delta = tl.load(DELTA + bh * seq + rows, mask=in_seq, other=0.0)
        row_doc = tl.load(DOC + b * seq + rows, mask=in_seq, other=-1)
        s = tl.dot(q, tl.trans(k)) * sm_scale                                                        # [M, N]
        keep = ((keys[None, :] <= rows[:, None]) & in_seq[:, None] & (keys[None, :] < seq)
                & (key_doc[None, :] == row_doc[:, None]))
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)                                            # [M, N]
        dv += tl.dot(tl.trans(p), do)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dk += tl.dot(tl.trans(ds), q) * sm_scale
    tl.store(DK + b * sdb + h * sdh + keys[:, None] * sds + dims[None, :], dk, mask=keys[:, None] < seq)
    tl.store(DV + b * sdb + h * sdh + keys[:, None] * sds + dims[None, :], dv, mask=keys[:, None] < seq)


@triton.jit
def _flash_backward_q(Q, K, V, DO, LSE, DELTA, DQ, DOC, KEY_START, sm_scale, seq, heads, group_size,
                      sqb, sqh, sqs, skb, skh, sks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group_size
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    in_seq = rows < seq
    dims = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_seq[:, None], other=0.0)
    do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_seq[:, None], other=0.0)
    lse = tl.load(LSE + bh * seq + rows, mask=in_seq, other=0.0)
    delta = tl.load(DELTA + bh * seq + rows, mask=in_seq, other=0.0)
    row_doc = tl.load(DOC + b * seq + rows, mask=in_seq, other=-1)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    begin = tl.load(KEY_START + b * tl.num_programs(0) + block)
    end = tl.minimum((block + 1) * BLOCK_M, seq)
    for start in range(begin, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
        v = tl.load(V + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
        key_doc = tl.load(DOC + b * seq + keys, mask=keys < seq, other=-2)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        keep = ((keys[None, :] <= rows[:, None]) & in_seq[:, None] & (keys[None, :] < seq)
                & (key_doc[None, :] == row_doc[:, None]))
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds, k) * sm_scale
    tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], dq, mask=in_seq[:, None])


def document_tile_bounds(document_ids: torch.Tensor | None, b: int, s: int, block_m: int, block_n: int,
                         device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loop bounds for document_ids [b, s] (None: one document per row) -> (ids [b, s] int32,
    key_start [b, cdiv(s, block_m)] int32: each query block's first key, its first row's document
    start rounded down to block_n; query_end [b, cdiv(s, block_n)] int32: one past the last query
    row each key block reads). ValueError if ids decrease along s."""
    if document_ids is None:
        ids = torch.zeros(b, s, dtype=torch.int32, device=device)
    else:
        if tuple(document_ids.shape) != (b, s):
            raise ValueError(f"document_ids must be [b, s] = [{b}, {s}], got {list(document_ids.shape)}")
        if s > 1 and (document_ids[:, 1:] < document_ids[:, :-1]).any():
            raise ValueError("document_ids must not decrease along the sequence (each document one contiguous run)")
        ids = document_ids.to(torch.int32).contiguous()
    positions = torch.arange(s, device=ids.device).expand(b, s)                     # [b, s]
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = torch.where(first, positions, 0).cummax(-1).values                     # [b, s] its document's start
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    ends = torch.where(last, positions + 1, s).flip(-1).cummin(-1).values.flip(-1)  # [b, s] its document's end
    query_rows = torch.arange(0, s, block_m, device=ids.device)                      # first row of each query block
    key_lasts = (torch.arange(0, s, block_n, device=ids.device) + block_n).clamp(max=s) - 1
    key_start = (starts[:, query_rows] // block_n * block_n).to(torch.int32).contiguous()
    query_end = ends[:, key_lasts].to(torch.int32).contiguous()
    return ids, key_start, query_end


def attention_tiles(document_ids: torch.Tensor | None, b: int, s: int, block_m: int = 16, block_n: int = 16) -> int:
    """[block_m, block_n] score tiles the forward computes per head over b sequences of s tokens,
    with or without packed documents (document_tile_bounds'; no kernel runs)."""
    _, key_start, _ = document_tile_bounds(document_ids, b, s, block_m, block_n)
    ends = (torch.arange(0, s, block_m) + block_m).clamp(max=s)                      # [cdiv(s, block_m)]
    return int((-(-(ends - key_start) // block_n)).sum())


class FlashAttention(torch.autograd.Function):
    """flash_attention as an autograd op; saves q, k, v, out, lse [b, a, s] float32, and with
    packed documents the ids and tile bounds (int32)."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, block_m: int, block_n: int):
        b, a, s, d = q.shape
        g = k.shape[1]
        ctx.dtype = q.dtype
        q, k, v = (t.float().contiguous() for t in (q, k, v))                           # the kernels' float32
        ids, key_start, query_end = document_tile_bounds(document_ids, b, s, block_m, block_n, q.device)
        out = torch.empty_like(q)
        lse = torch.empty(b, a, s, dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(s, block_m), b * a)
        _flash_forward[grid](q, k, v, out, lse, ids, key_start, 1.0 / math.sqrt(d), s, a, a // g,
                             *q.stride()[:3], *k.stride()[:3], *out.stride()[:3], BLOCK_M=block_m, BLOCK_N=block_n, D=d)
        ctx.save_for_backward(q, k, v, out, lse, *((ids, key_start, query_end) if document_ids is not None else ()))
        ctx.blocks = (block_m, block_n)
        return out.to(ctx.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *bounds = ctx.saved_tensors
        block_m, block_n = ctx.blocks
        b, a, s, d = q.shape
        ids, key_start, query_end = bounds or document_tile_bounds(None, b, s, block_m, block_n, q.device)
        g = k.shape[1]
        dout = dout.float().contiguous()
        delta = (dout * out).sum(-1).contiguous()                                         # [b, a, s]
        dk_heads = torch.empty(b, a, s, d, dtype=torch.float32, device=q.device)         # per query head
        dv_heads = torch.empty_like(dk_heads)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        scale = 1.0 / math.sqrt(d)
        _flash_backward_kv[(triton.cdiv(s, block_n), b * a)](
            q, k, v, dout, lse, delta, dk_heads, dv_heads, ids, query_end, scale, s, a, a // g,
            *q.stride()[:3], *k.stride()[:3], *dk_heads.stride()[:3], BLOCK_M=block_m, BLOCK_N=block_n, D=d)
        _flash_backward_q[(triton.cdiv(s, block_m), b * a)](
            q, k, v, dout, lse, delta, dq, ids, key_start, scale, s, a, a // g,
            *q.stride()[:3], *k.stride()[:3], BLOCK_M=block_m, BLOCK_N=block_n, D=d)
        dk = dk_heads.view(b, g, a // g, s, d).sum(2)                                     # [b, g, s, d]
        dv = dv_heads.view(b, g, a // g, s, d).sum(2)
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    training: bool = False, block_m: int = 16, block_n: int = 16,
                    document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v: q [b, a, s, d], k, v [b, g, s, d] (g divides a, d a power
    of 2) -> [b, a, s, d]; document_ids [b, s] (non-decreasing) keeps each query in its document.
    The signature of SelfAttention.core_attention's backends; no dropout."""
    if dropout_p and training:
        raise ValueError("flash_attention (Triton) has no dropout: use attention_dropout 0 with --kernels triton")
    d = q.shape[-1]
    if d & (d - 1) or (q.is_cuda and d < 16):
        raise ValueError(f"flash_attention needs a head size that is a power of 2 (at least 16 on a GPU), got {d}")
    return FlashAttention.apply(q, k, v, document_ids, block_m, block_n)
