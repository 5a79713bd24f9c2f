"""FlashAttention-2 (Dao 2023) in Triton: causal attention that never stores the [s, s] scores,
forward and backward, with grouped-query attention (k, v shared by a/g query heads, never
repeated in memory). Chapter 07.

    out = flash_attention(q, k, v)          q [b, a, s, d], k and v [b, g, s, d] -> [b, a, s, d]

Forward, one program per (block of BLOCK_M queries, batch x head): the queries' rows of
softmax(q k^T / sqrt(d)) v, computed over key blocks of BLOCK_N with the online softmax. The
program keeps, per query row, the running maximum m, the running sum l of exp(score - m) and the
running output acc; a new block of scores S moves them to

    m' = max(m, rowmax S)        l' = l e^(m - m') + rowsum e^(S - m')
    acc' = acc e^(m - m') + e^(S - m') v

(exercise 7.3 writes this merge in PyTorch: `online_softmax_step`), and at the end out = acc / l.
Causal: a query block reads only the key blocks at or before it, and masks the diagonal block.
Starting at key 0, every row meets a finite score in its first block, so unlike the general
merge of exercise 7.3 the kernel never sees a row whose maximum is still -inf. For the backward
it keeps its inputs q, k, v, its output, and one float32 log-sum-exp per row, lse = m + log l
(4 b a s bytes), where the written-out attention keeps the b a s^2 probabilities and more.

Backward, with D = rowsum(dout * out) (one pass in PyTorch): the probabilities come back from
the scores and lse, P = exp(S - lse), so nothing [s, s] was kept. Two kernels, each summing in
its own program (no atomics): one per key block, which loops over the query blocks at or after
it for dv = P^T dout and dk = dS^T q / sqrt(d), dS = P (dout v^T - D); one per query block for
dq = dS k / sqrt(d). Under GQA each query head's dk, dv are written apart and summed over the
a/g heads of a group afterwards (two float32 [b, a, s, d] buffers; a fused kernel would
accumulate them in place).

The kernels compute in float32: 16-bit inputs are upcast before the launch and the results
cast back (a production kernel reads them in 16 bits and accumulates in float32; Triton's
interpreter gets 16-bit arithmetic wrong, so the book keeps one path). On a CPU the kernels run
in that interpreter (minimegatron/triton_mode.py sets TRITON_INTERPRET=1 there): exact in float32,
hundreds of times slower than PyTorch, so the tests keep s and d small. d must be a power of
2, and on a GPU at least 16 (Triton's tl.dot); both are refused by name. No dropout.

Reference: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (2023), Algorithms 1 and 2. Megatron-LM reaches the same algorithm through
Transformer Engine's fused attention or the flash-attn package (megatron/core/extensions/
transformer_engine.py, TEDotProductAttention).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["flash_attention", "online_softmax_step"]


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
def _flash_forward(Q, K, V, O, LSE, sm_scale, seq, heads, group_size,
                   sqb, sqh, sqs, skb, skh, sks, sob, soh, sos,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group_size                                                   # this head's key/value head
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)                         # [M] query positions
    cols = tl.arange(0, BLOCK_N)                                           # [N]
    dims = tl.arange(0, D)                                                 # [D]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=rows[:, None] < seq, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base, v_base = K + b * skb + kv * skh, V + b * skb + kv * skh
    end = tl.minimum((block + 1) * BLOCK_M, seq)                           # causal: no key after the last row
    for start in range(0, end, BLOCK_N):
        keys = start + cols                                                # [N] key positions
        k = tl.load(k_base + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)   # [N, D]
        v = tl.load(v_base + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)   # [N, D]
        s = tl.dot(q, tl.trans(k)) * sm_scale                                                            # [M, N]
        s = tl.where((keys[None, :] <= rows[:, None]) & (keys[None, :] < seq), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :], acc / l[:, None], mask=rows[:, None] < seq)
    tl.store(LSE + bh * seq + rows, m + tl.log(l), mask=rows < seq)


@triton.jit
def _flash_backward_kv(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, seq, heads, group_size,
                       sqb, sqh, sqs, skb, skh, sks, sdb, sdh, sds,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group_size
    keys = block * BLOCK_N + tl.arange(0, BLOCK_N)                         # [N]
    dims = tl.arange(0, D)
    k = tl.load(K + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
    v = tl.load(V + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    first = (block * BLOCK_N) // BLOCK_M * BLOCK_M                         # causal: no query before the block
    for start in range(first, seq, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)                               # [M]
        in_seq = rows < seq
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_seq[:, None], other=0.0)
        do = tl.load(DO + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=in_seq[:, None], other=0.0)
        lse = tl.load(LSE + bh * seq + rows, mask=in_seq, other=0.0)
        delta = tl.load(DELTA + bh * seq + rows, mask=in_seq, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale                                                        # [M, N]
        keep = (keys[None, :] <= rows[:, None]) & in_seq[:, None] & (keys[None, :] < seq)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)                                            # [M, N]
        dv += tl.dot(tl.trans(p), do)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dk += tl.dot(tl.trans(ds), q) * sm_scale
    tl.store(DK + b * sdb + h * sdh + keys[:, None] * sds + dims[None, :], dk, mask=keys[:, None] < seq)
    tl.store(DV + b * sdb + h * sdh + keys[:, None] * sds + dims[None, :], dv, mask=keys[:, None] < seq)


@triton.jit
def _flash_backward_q(Q, K, V, DO, LSE, DELTA, DQ, sm_scale, seq, heads, group_size,
                      sqb, sqh, sqs, skb, skh, sks,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
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
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum((block + 1) * BLOCK_M, seq)
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
        v = tl.load(V + b * skb + kv * skh + keys[:, None] * sks + dims[None, :], mask=keys[:, None] < seq, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        keep = (keys[None, :] <= rows[:, None]) & in_seq[:, None] & (keys[None, :] < seq)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds, k) * sm_scale
    tl.store(DQ + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], dq, mask=in_seq[:, None])


class FlashAttention(torch.autograd.Function):
    """flash_attention as an autograd op; saves q, k, v, out and lse [b, a, s] (float32)."""

    @staticmethod
    def forward(ctx, q, k, v, block_m: int, block_n: int):
        b, a, s, d = q.shape
        g = k.shape[1]
        ctx.dtype = q.dtype
        q, k, v = (t.float().contiguous() for t in (q, k, v))                           # the kernels' float32
        out = torch.empty_like(q)
        lse = torch.empty(b, a, s, dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(s, block_m), b * a)
        _flash_forward[grid](q, k, v, out, lse, 1.0 / math.sqrt(d), s, a, a // g,
                             *q.stride()[:3], *k.stride()[:3], *out.stride()[:3],
                             BLOCK_M=block_m, BLOCK_N=block_n, D=d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks = (block_m, block_n)
        return out.to(ctx.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        block_m, block_n = ctx.blocks
        b, a, s, d = q.shape
        g = k.shape[1]
        dout = dout.float().contiguous()
        delta = (dout * out).sum(-1).contiguous()                                         # [b, a, s]
        dk_heads = torch.empty(b, a, s, d, dtype=torch.float32, device=q.device)         # per query head
        dv_heads = torch.empty_like(dk_heads)
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        scale = 1.0 / math.sqrt(d)
        _flash_backward_kv[(triton.cdiv(s, block_n), b * a)](
            q, k, v, dout, lse, delta, dk_heads, dv_heads, scale, s, a, a // g,
            *q.stride()[:3], *k.stride()[:3], *dk_heads.stride()[:3], BLOCK_M=block_m, BLOCK_N=block_n, D=d)
        _flash_backward_q[(triton.cdiv(s, block_m), b * a)](
            q, k, v, dout, lse, delta, dq, scale, s, a, a // g,
            *q.stride()[:3], *k.stride()[:3], BLOCK_M=block_m, BLOCK_N=block_n, D=d)
        dk = dk_heads.view(b, g, a // g, s, d).sum(2)                                     # [b, g, s, d]
        dv = dv_heads.view(b, g, a // g, s, d).sum(2)
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    training: bool = False, block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v: q [b, a, s, d], k and v [b, g, s, d] (a a multiple of
    g; d a power of 2) -> [b, a, s, d], through the Triton kernels above. The signature of the
    book's attention backends (model/attention.py); dropout is not supported."""
    if dropout_p and training:
        raise ValueError("flash_attention (Triton) has no dropout: use attention_dropout 0 with --kernels triton")
    d = q.shape[-1]
    if d & (d - 1) or (q.is_cuda and d < 16):
        raise ValueError(f"flash_attention needs a head size that is a power of 2 (at least 16 on a GPU), got {d}")
    return FlashAttention.apply(q, k, v, block_m, block_n)
