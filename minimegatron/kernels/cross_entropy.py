"""The output layer and the cross-entropy fused and chunked over tokens (chapter 07): the
[tokens, vocabulary] logits are never held whole.

    losses = linear_cross_entropy(x, weight, labels, chunk=1024)    x [T, h], weight [V, h] -> [T]

Unfused, the output layer writes logits [T, V] and the loss keeps its log-softmax [T, V] for the
backward: at T = 8 x 4096 tokens and Llama-3's V = 128,256 that is 16.8 GB in float32, more than
the rest of a layer's activations. Here each chunk of `chunk` tokens computes its logits
x_c W^T [chunk, V], turns them into its losses and one log-sum-exp per token, and drops them: the
forward keeps x, W, the labels and lse [T]. The backward walks the chunks again, computes each
chunk's logits once more and its gradient

    dlogits = g (softmax(logits) - onehot(label)),   softmax = exp(logits - lse)

(g the incoming gradient of each token's loss), then dx_c = dlogits W and dW += dlogits^T x_c
(exercise 7.5 writes dlogits). Memory: [chunk, V] at a time instead of [T, V]; compute: the
logits twice (Liger-Kernel's fused linear cross-entropy computes the gradients already in the
forward, which assumes the loss is a plain mean; here the per-token gradient g may carry a loss
mask).

Each chunk's row-wise work (the log-sum-exp over V in blocks, then the gradient in place) is a
Triton program, `_cross_entropy_rows`; the matmuls are PyTorch's. On a CPU it runs in Triton's
interpreter, like the other kernels (float32; 16-bit inputs are upcast).

Megatron-LM computes the loss in `megatron/core/tensor_parallel/cross_entropy.py`
(VocabParallelCrossEntropy, on logits it does materialise) and has a fused variant in
`megatron/core/fusions/fused_cross_entropy.py`; Liger-Kernel's FusedLinearCrossEntropy is the
chunked idea this follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["linear_cross_entropy", "cross_entropy_grad"]


def cross_entropy_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                       grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the per-token losses lse - logits[label] with respect to the logits:
    logits [c, V] (float32), labels [c], lse [c] (each row's log-sum-exp), grad [c] (the
    incoming gradient of each token's loss) -> dlogits [c, V] = grad (softmax - onehot)."""
    # BEGIN EXERCISE 7.5: the chunked cross-entropy's gradient | hint: the loss is the log of the sum of exponentials minus one logit; what is the derivative of each part, and where does each token's own incoming gradient go?
    probs = torch.exp(logits - lse[:, None])                                  # [c, V] softmax
    probs[torch.arange(len(labels), device=labels.device), labels] -= 1.0
    return probs * grad[:, None]
    # END EXERCISE


@triton.jit
def _cross_entropy_rows(LOGITS, LABELS, LOSS, LSE, vocab, BLOCK_V: tl.constexpr):
    """One program per row: the row's log-sum-exp over the vocabulary in blocks (a running max
    and sum, the online softmax), its loss lse - logit[label]."""
    row = tl.program_id(0)
    m = float("-inf")
    total = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(LOGITS + row * vocab + cols, mask=cols < vocab, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(total)
    label = tl.load(LABELS + row)
    tl.store(LSE + row, lse)
    tl.store(LOSS + row, lse - tl.load(LOGITS + row * vocab + label))


def _chunk_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses [c], lse [c]) of float32 logits [c, V] through the Triton rows."""
    c, vocab = logits.shape
    losses = torch.empty(c, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    _cross_entropy_rows[(c,)](logits, labels, losses, lse, vocab, BLOCK_V=min(1024, triton.next_power_of_2(vocab)))
    return losses, lse


class LinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy as an autograd op; saves x, weight, labels and lse [T]."""

    @staticmethod
    def forward(ctx, x, weight, labels, chunk: int):
        ctx.dtypes = (x.dtype, weight.dtype)
        x32, w32 = x.float(), weight.float()
        losses, lse = torch.empty(len(x), dtype=torch.float32, device=x.device), torch.empty(len(x), device=x.device)
        for start in range(0, len(x), chunk):
            piece = slice(start, start + chunk)
            logits = (x32[piece] @ w32.t()).contiguous()                          # [chunk, V], dropped after
            losses[piece], lse[piece] = _chunk_losses(logits, labels[piece].contiguous())
        ctx.save_for_backward(x32, w32, labels, lse)
        ctx.chunk = chunk
        return losses

    @staticmethod
    def backward(ctx, grad):
        x32, w32, labels, lse = ctx.saved_tensors
        grad = grad.float()
        dx, dw = torch.empty_like(x32), torch.zeros_like(w32)
        for start in range(0, len(x32), ctx.chunk):
            piece = slice(start, start + ctx.chunk)
            logits = x32[piece] @ w32.t()                                         # [chunk, V] again
            dlogits = cross_entropy_grad(logits, labels[piece], lse[piece], grad[piece])
            dx[piece] = dlogits @ w32                                             # [chunk, h]
            dw += dlogits.t() @ x32[piece]                                        # [V, h]
        return dx.to(ctx.dtypes[0]), dw.to(ctx.dtypes[1]), None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int = 1024) -> torch.Tensor:
    """Per-token cross-entropy of the logits x W^T without holding them: x [T, h], weight [V, h],
    labels [T] -> losses [T] float32, equal to F.cross_entropy(x @ W^T, labels, reduction="none")
    up to float32 summation order, and its gradients to x and W."""
    return LinearCrossEntropy.apply(x, weight, labels, chunk)
