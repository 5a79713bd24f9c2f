"""Vocab-parallel cross-entropy: the loss over a vocabulary split across ranks, without ever
gathering the logits.

Each rank holds z [b, s, Vp/tp], the logits of ids [start, start + Vp/tp) of the padded
vocabulary. loss = log sum_j exp(z_j - m) - (z_t - m), every piece a reduction over the
vocabulary, so three all-reduces of [b, s] finish it:

    1. m       = all-reduce MAX  of the local row max
    2. z_t - m = all-reduce SUM  of (z_t - m) on the rank owning t, 0 elsewhere
    3. S       = all-reduce SUM  of the local sum_j exp(z_j - m)

Bytes: 3 b s e_loss (e_loss = 4 for 16-bit logits, computed in float32). Backward: softmax_j -
[j == t] from the local softmax columns, no communication. Padding columns (ids >= vocab_size)
are set to -inf: zero probability and gradient, so every layout has exactly V ids (Megatron
does not mask them).

Megatron-LM: megatron/core/tensor_parallel/cross_entropy.py (VocabParallelCrossEntropy)."""

from __future__ import annotations

import torch

from ..comm import all_reduce, group_rank, group_size
from ..model.linear import compute_dtype

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_loss"]


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                        group) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of the vocab-parallel cross-entropy: per-token losses and softmax shard.

    logits z [b, s, n]: this rank's columns, the ids [vocab_start, vocab_start + n) of a
    vocabulary split over ``group`` (padding columns already -inf: zero probability).
    labels [b, s] int64: global target ids, the same on every rank; each belongs to exactly
    one rank's range.
    Returns (loss [b, s], the same on every rank: log sum_j exp(z_j) - z_target over the
    whole vocabulary; softmax [b, s, n]: this rank's columns of the full softmax, for the
    backward), in the logits' dtype.
    Communication: exactly three comm.all_reduce calls of [b, s] numbers over ``group``, tag
    "fwd", in this order: op "max" (the row maximum m), "sum" (the target's shifted logit
    z_t - m, contributed by the rank that owns t, 0 elsewhere), "sum" (sum_j exp(z_j - m)).
    Never gather the logits. all_reduce works in place: reduce a tensor of your own
    (contiguous), not a view of the logits.
    """
    # BEGIN EXERCISE 2.3: vocab-parallel cross-entropy | hint: write the loss with a per-token shift m that keeps exp in range; which [b, s] quantities does each rank hold only a piece of, and which reduction joins each? (Megatron: _VocabParallelCrossEntropy.forward)
    n = logits.shape[-1]
    # 1. the global max of each token's logits
    logits_max = logits.amax(dim=-1)                                   # [b, s]
    all_reduce(logits_max, group, op="max", tag="fwd")
    shifted = logits - logits_max.unsqueeze(-1)                        # [b, s, n]

    # 2. the target's shifted logit, contributed by the one rank that owns the target
    outside = (labels < vocab_start) | (labels >= vocab_start + n)     # [b, s]
    local_labels = (labels - vocab_start).masked_fill(outside, 0)
    target_logit = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
    target_logit = target_logit.masked_fill(outside, 0.0).contiguous()  # [b, s]
    all_reduce(target_logit, group, op="sum", tag="fwd")

    # 3. the sum of exponentials over the whole vocabulary
    exp = shifted.exp()                                                # [b, s, n]
    sum_exp = exp.sum(dim=-1)                                          # [b, s]
    all_reduce(sum_exp, group, op="sum", tag="fwd")

    loss = sum_exp.log() - target_logit                                # [b, s]
    softmax = exp.div_(sum_exp.unsqueeze(-1))                          # [b, s, n]
    # END EXERCISE
    return loss, softmax


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits_shard, labels, group, vocab_size):
        tp, rank = group_size(group), group_rank(group)
        per_rank = logits_shard.shape[-1]
        start = rank * per_rank
        padded = per_rank * tp
        if vocab_size is None:
            vocab_size = padded
        if not 0 < vocab_size <= padded:
            # (with Megatron's padding to a multiple of 128 x tp a small vocabulary can leave
            # the last ranks with padding only: their columns are all -inf, which is fine)
            raise ValueError(f"vocab_size={vocab_size} does not fit logits of {per_rank} ids "
                             f"per rank x tp={tp} = {padded}")
        if labels.numel() and (labels.min() < 0 or labels.max() >= vocab_size):
            raise ValueError(f"labels must be in [0, {vocab_size}), got [{int(labels.min())}, {int(labels.max())}]")

        # float32 for 16-bit logits, as the single-device loss (language_model_loss) does
        z = logits_shard.to(compute_dtype(logits_shard))
        n_real = max(0, vocab_size - start)              # real ids on this rank (all, some, none)
        if n_real < per_rank:
            z = z.clone()                                # never write into the caller's logits
            z[..., n_real:] = float("-inf")              # padding: zero probability

        loss, softmax = vocab_parallel_loss(z, labels, start, group)       # [b, s], [b, s, Vp/tp]
        outside = (labels < start) | (labels >= start + per_rank)          # [b, s]
        local_labels = (labels - start).masked_fill(outside, 0)
        ctx.save_for_backward(softmax, local_labels, outside)
        ctx.logits_dtype = logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax          # [b, s, Vp/tp]: written in place, as Megatron does (the forward's
                                # softmax is needed only here; a second backward would raise)
        # minus the one-hot of the target, only on the rank that owns it
        owned = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -owned)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, group,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy of logits split by vocabulary over ``group``.

    logits_shard [b, s, Vp/tp] (ids [r Vp/tp, (r+1) Vp/tp)); labels [b, s] int64, global ids in
    [0, vocab_size), the same on every rank; vocab_size V <= Vp (default Vp), ids >= V get zero
    probability. Returns losses [b, s], the same on every rank, float32 for 16-bit logits else the
    logits' dtype: F.cross_entropy over the V real columns. Communication: forward three
    all-reduces of [b, s] (max, sum, sum), tag "fwd"; backward none."""
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, group, vocab_size)


class VocabParallelCrossEntropy(torch.nn.Module):
    """The loss module of a tensor-parallel GPTModel (in place of LanguageModelLoss):
    forward(logits_shard, labels) = vocab_parallel_cross_entropy(logits_shard, labels, group, vocab_size)."""

    def __init__(self, group, vocab_size: int):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size

    def forward(self, logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, labels, self.group, vocab_size=self.vocab_size)
