"""The output layer and the cross-entropy fused and chunked over tokens (chapter 07): the
[tokens, vocabulary] logits are never held whole.

    losses = linear_cross_entropy(x, weight, labels, chunk=1024)    x [T, h], weight [V, h] -> [T]

Each chunk of `chunk` tokens computes its logits x_c W^T [chunk, V], its losses and one
log-sum-exp per token, and drops them: the forward keeps x, W, the labels and lse [T]. The
backward recomputes each chunk's logits and

    dlogits = g (softmax(logits) - onehot(label)),   softmax = exp(logits - lse)

(g each token's incoming gradient, which may carry a loss mask; exercise 7.5), then
dx_c = dlogits W and dW += dlogits^T x_c. Memory [chunk, V] instead of [T, V]; the logits
computed twice. The row-wise work is a Triton program (`_cross_entropy_rows`, float32), the
matmuls PyTorch's.
Megatron-LM: megatron/core/fusions/fused_cross_entropy.py; the chunking follows Liger-Kernel's
FusedLinearCrossEntropy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..comm import ALONE, all_gather, all_reduce, group_rank, group_size, reduce_scatter
from ..model.linear import compute_dtype
from ..tp.layers import SEQUENCE_DIM

__all__ = ["linear_cross_entropy", "cross_entropy_grad"]


def cross_entropy_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                       grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the per-token losses lse - logits[label] with respect to the logits:
    logits [c, n] (float32 or float64), labels [c], lse [c] (each row's log-sum-exp over the
    whole vocabulary), grad [c] (the incoming gradient of each token's loss; 0 for a token the
    loss mask drops) -> dlogits [c, n] = grad[:, None] (softmax - onehot), a new tensor in the
    logits' dtype (logits are left as they are). Under TP the n columns are this rank's share of
    the vocabulary and labels are local (label - this rank's first id): a label outside [0, n)
    is another rank's, and its one-hot is not in these columns."""
    # BEGIN EXERCISE 7.5: the chunked cross-entropy's gradient | hint: the loss is the log of the sum of exponentials minus one logit; what is the derivative of each part, which rows own their label's column, and where does each token's own incoming gradient go?
    probs = torch.exp(logits - lse[:, None])                                  # [c, n] softmax
    owned = (labels >= 0) & (labels < logits.shape[1])                        # [c]
    rows = torch.arange(len(labels), device=labels.device)
    probs[rows[owned], labels[owned]] -= 1.0
    return probs * grad[:, None]
    # END EXERCISE


@triton.jit
def _cross_entropy_rows(LOGITS, LABELS, LSE, TARGET, vocab, BLOCK_V: tl.constexpr):
    """One program per row of logits [rows, vocab]: the row's log-sum-exp over blocks (online
    softmax) and its label's logit (0 when the label is another rank's)."""
    row = tl.program_id(0)
    m = float("-inf")
    total = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + row * vocab + cols, mask=cols < vocab, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    tl.store(LSE + row, m + tl.log(total))
    label = tl.load(LABELS + row)
    owned = (label >= 0) & (label < vocab)
    target = tl.load(LOGITS + row * vocab + tl.where(owned, label, 0))
    tl.store(TARGET + row, tl.where(owned, target, 0.0))


def _chunk_rows(logits: torch.Tensor, local_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [c], target [c]) of logits [c, n] through the Triton rows; local_labels [c] index
    the n columns, or fall outside them (target 0)."""
    c, n = logits.shape
    lse, target = logits.new_empty(c), logits.new_empty(c)
    _cross_entropy_rows[(c,)](logits, local_labels, lse, target, n, BLOCK_V=min(1024, triton.next_power_of_2(n)))
    return lse, target


def _columns(weight: torch.Tensor, group, vocab_size: int | None) -> tuple[int, int]:
    """(start, n_real): this rank's first vocabulary id and how many of its rows are real (the rest is
    tp.pad_vocab_size's padding)."""
    per_rank = weight.shape[0]
    start = group_rank(group) * per_rank
    vocab = per_rank * group_size(group) if vocab_size is None else vocab_size
    return start, max(0, min(per_rank, vocab - start))


class LinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy as an autograd op; saves x (this rank's tokens), weight, labels and
    lse [T]."""

    @staticmethod
    def forward(ctx, x, weight, labels, group, vocab_size, sequence_parallel, chunk):
        dtype = compute_dtype(x)                                    # float32 for 16-bit, else its own
        saved_x = x
        ctx.group, ctx.vocab_size, ctx.sequence_parallel, ctx.chunk = group, vocab_size, sequence_parallel, chunk
        if sequence_parallel:                                       # [b, s/tp, h] -> [b, s, h]
            x = all_gather(x.contiguous(), group, dim=SEQUENCE_DIM, tag="fwd")
        start, n_real = _columns(weight, group, vocab_size)
        flat, w = x.reshape(-1, x.shape[-1]).to(dtype), weight[:n_real].to(dtype)       # [T, h], [n, h]
        local_labels = labels.reshape(-1) - start                                        # [T]
        lse = torch.full((len(flat),), float("-inf"), dtype=dtype, device=x.device)
        target = torch.zeros_like(lse)
        for piece in _chunks(len(flat), chunk if n_real else 0):
            logits = (flat[piece] @ w.t()).contiguous()                                  # [chunk, n], dropped after
            lse[piece], target[piece] = _chunk_rows(logits, local_labels[piece].contiguous())
        if group_size(group) > 1:
            # the three all-reduces of tp/cross_entropy.py, over [T] numbers: the ranks' largest
            # log-sum-exp, the target's logit (its owner's, 0 elsewhere), the sum of the ranks'
            # exp(lse_r - m); then lse = m + log(sum)
            m = lse.clone()
            all_reduce(m, group, op="max", tag="fwd")
            all_reduce(target, group, op="sum", tag="fwd")
            total = torch.exp(lse - m)
            all_reduce(total, group, op="sum", tag="fwd")
            lse = m + total.log()
        ctx.save_for_backward(saved_x, weight, labels, lse)
        return (lse - target).view(labels.shape)                                         # [b, s]

    @staticmethod
    def backward(ctx, grad):
        x, weight, labels, lse = ctx.saved_tensors
        group, chunk = ctx.group, ctx.chunk
        total_x = (all_gather(x.contiguous(), group, dim=SEQUENCE_DIM, tag="regather")   # [b, s, h]
                   if ctx.sequence_parallel else x)                 # (only the shard was kept)
        dtype = lse.dtype
        start, n_real = _columns(weight, group, ctx.vocab_size)
        flat, w = total_x.reshape(-1, total_x.shape[-1]).to(dtype), weight[:n_real].to(dtype)
        local_labels, grad = labels.reshape(-1) - start, grad.reshape(-1).to(dtype)
        dx, dw = torch.zeros_like(flat), torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        for piece in _chunks(len(flat), chunk if n_real else 0):
            logits = flat[piece] @ w.t()                                                 # [chunk, n] again
            dlogits = cross_entropy_grad(logits, local_labels[piece], lse[piece], grad[piece])
            dx[piece] = dlogits @ w                                                      # [chunk, h], partial under TP
            dw[:n_real] += dlogits.t() @ flat[piece]                                     # [n, h]
        dx = dx.view(total_x.shape).to(x.dtype)
        if ctx.sequence_parallel:                                   # summed over tp, each rank its tokens
            dx = reduce_scatter(dx, group, dim=SEQUENCE_DIM, tag="bwd")                  # [b, s/tp, h]
        elif group_size(group) > 1:
            all_reduce(dx, group, op="sum", tag="bwd")
        return dx, dw.to(weight.dtype), None, None, None, None, None


def _chunks(tokens: int, chunk: int):
    return [slice(start, start + chunk) for start in range(0, tokens, chunk)] if chunk else []


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 1024,
                         group=ALONE, vocab_size: int | None = None, sequence_parallel: bool = False) -> torch.Tensor:
    """Per-token cross-entropy of the logits x W^T without holding them.

    One device (group ALONE): x [T, h] or [b, s, h], weight [V, h], labels of x's leading shape ->
    losses of that shape, F.cross_entropy(x @ W^T, labels, reduction="none") up to summation order.
    Vocabulary-parallel (``group`` of tp): weight [Vp/tp, h] this rank's rows, vocab_size V <= Vp
    (padding ids get zero probability); x [b, s, h] on every rank, or [b, s/tp, h] with
    sequence_parallel; labels [b, s] global ids; losses [b, s] on every rank. The same result and
    messages as a ColumnParallelLinear output layer + tp/cross_entropy.py: forward (SP: all-gather
    of x, "fwd") three all-reduces of [T] (max, sum, sum; "fwd"); backward (SP: all-gather again,
    "regather") dx all-reduced ("bwd"), or reduce-scattered along s under SP.
    Computed in float32 for 16-bit inputs (else their dtype); losses in it."""
    if group_size(group) == 1 and not sequence_parallel and vocab_size is None:
        vocab_size = weight.shape[0]
    return LinearCrossEntropy.apply(x, weight, labels, group, vocab_size, sequence_parallel, chunk)
