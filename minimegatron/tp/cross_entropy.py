"""Vocab-parallel cross-entropy: the loss over a vocabulary split across ranks, without ever
gathering the logits.

Shape legend as in model/gpt.py; Vp is the padded vocabulary (tp divides it), each rank
holds the logits of its Vp/tp ids: z [b, s, Vp/tp], ids [start, start + Vp/tp).

The loss of one token with target t is  loss = log sum_j exp(z_j) - z_t. Stabilised with
the row maximum m (subtracting a constant changes neither term's difference):

    loss = log sum_j exp(z_j - m) - (z_t - m)

Each of the three pieces is a reduction over the vocabulary, so each rank reduces its own
columns and one all-reduce over the group finishes the job:

    1. m       = all-reduce MAX  of the local max over columns        [b, s]
    2. z_t - m = all-reduce SUM  of (z_t - m) on the rank owning t,    [b, s]
                                 0 on every other rank
    3. S       = all-reduce SUM  of the local sum_j exp(z_j - m)       [b, s]

Three all-reduces of b*s numbers each: bytes = 3 * b * s * e_loss (e_loss = 4 for 16-bit
logits, which the loss computes in float32; else the logits' element size), where the
gathered logits would be b * s * V * e (about V/3 times more; 50k/3 for GPT-2).

Backward. d loss / d z_j = softmax_j - [j == t]. Each rank already holds its columns of the
softmax, exp(z_j - m) / S, and knows whether it owns t: the gradient is local, no
communication. (The all-reduces of the forward are not differentiated through: m cancels
out of the loss, and the other two are reassembled in the closed form above.)

Padding. Columns of ids >= vocab_size (the padding of pad_vocab_size) are set to -inf
before step 1: exp(-inf) = 0, so they hold zero probability, add nothing to S, and get
a zero gradient. Whatever values the padding logits have, the loss and the gradients of the
real columns equal the single-device ones over the V real ids.

Megatron-LM: megatron/core/tensor_parallel/cross_entropy.py (VocabParallelCrossEntropy,
_VocabParallelCrossEntropy). Difference: Megatron does not mask the padding; its padded ids
are ordinary rows of its (padded) embedding, so they carry a little probability, and since
the padded size depends on tp (a multiple of 128 x tp: GPT-2's 50,257 ids become 50,304 at
tp 1 and 51,200 at tp 8) the model differs slightly between layouts. Here the single-device
model has exactly V ids on every layout, so we mask.
"""

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
            raise ValueError(f"labels must be in [0, {vocab_size}), got "
                             f"[{int(labels.min())}, {int(labels.max())}]")

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

    logits_shard [b, s, Vp/tp]: this rank's columns (ids [r Vp/tp, (r+1) Vp/tp)), as a
    ColumnParallelLinear output layer (or the tied VocabParallelEmbedding) produces them.
    labels [b, s] int64, global ids in [0, vocab_size), the same on every rank.
    vocab_size: the real vocabulary V <= Vp; ids >= V are padding and get zero probability.
    Default Vp (no padding).
    Returns losses [b, s], the same on every rank, float32 for 16-bit logits else the
    logits' dtype; equal to F.cross_entropy over the V real columns of the full logits.
    Communication: forward three all-reduces of [b, s] (max, sum, sum), tag "fwd";
    backward none.
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, group, vocab_size)


class VocabParallelCrossEntropy(torch.nn.Module):
    """The loss module of a tensor-parallel GPTModel (tp.apply_tensor_parallel puts it in
    place of model.LanguageModelLoss): forward(logits_shard, labels) =
    vocab_parallel_cross_entropy(logits_shard, labels, group, vocab_size)."""

    def __init__(self, group, vocab_size: int):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size

    def forward(self, logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, labels, self.group, vocab_size=self.vocab_size)
