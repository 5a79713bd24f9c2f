"""Tensor-parallel layers: a weight matrix cut across the ranks of a tensor-parallel group.

Shapes as in model/gpt.py (b batch, s sequence, h hidden, V vocabulary, tp the group size).
A linear layer stores W [out, in] and computes y = x W^T + b:

  ColumnParallelLinear   rank r holds rows r of W: [out/tp, in]; y_r is its slice of y.
                         forward  copy (identity)  -> local matmul
                         backward local matmul grads -> all-reduce dx (LinearWithGradAllReduce)
  RowParallelLinear      rank r holds columns r of W: [out, in/tp]; x_r W_r^T is a partial sum.
                         forward  local matmul -> all-reduce (reduce) -> + bias (once)
                         backward identity: every rank gets the full dy
  VocabParallelEmbedding rank r holds rows [start, end) of the padded table [Vp, h]; looks up
                         the ids it owns, zeros for the others, one all-reduce sums.

Every layer is built with zeros of its shard's shape and set from the full single-device tensor
by ``load_full``: no per-rank random numbers. A split parameter's placement record
(set_tensor_model_parallel_attributes) says how it was cut.

Sequence parallelism (chapter 04, `sequence_parallel=True`): activations between layers are
[b, s/tp, h]; the column layer all-gathers its input along s (backward reduce-scatter of dx, and
a second all-gather of x: LinearWithSequenceParallelGather), the row layer reduce-scatters its
output (backward all-gather), the embedding reduce-scatters (`reduce_scatter_embeddings`).
SEQUENCE_DIM = 1: the book's activations are [b, s, h] (Megatron's [s, b, h], dim 0). Our
linear layers return the output only, not Megatron's (output, bias).

Megatron-LM: megatron/core/tensor_parallel/layers.py, utils.py (VocabUtility)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import (all_gather, all_reduce, gather_from_tensor_model_parallel_region, group_rank, group_size,
                    reduce_from_tensor_model_parallel_region, reduce_scatter, reduce_scatter_to_sequence_parallel_region,
                    scatter_to_tensor_model_parallel_region)
from ..model.linear import GEMM, Gemm
from ..placement import Split, set_placement
from .overlap import sequence_parallel_linear_backward_overlapped

__all__ = ["set_tensor_model_parallel_attributes", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "LinearWithGradAllReduce",
           "LinearWithSequenceParallelGather",
           "column_parallel_linear_backward", "sequence_parallel_linear_backward", "row_parallel_linear_forward",
           "shard_rows", "shard_cols", "divide", "pad_vocab_size", "vocab_range"]


SEQUENCE_DIM = 1                     # activations [b, s, h]: sequence parallelism cuts s

# ======================================================================================
# Cutting shards
# ======================================================================================

def divide(numerator: int, denominator: int, what: str = "size", stride: int = 1) -> int:
    """``numerator / (denominator * stride)``, or ValueError naming the numbers when not whole."""
    if numerator % (denominator * stride):
        blocks = f" in {stride} stacked blocks, each" if stride > 1 else ""
        raise ValueError(f"{what} {numerator}{blocks} is not divisible by the tensor-parallel size {denominator}")
    return numerator // (denominator * stride)


def _shard(full: torch.Tensor, dim: int, group, stride: int) -> torch.Tensor:
    tp, r = group_size(group), group_rank(group)
    divide(full.shape[dim], tp, f"dimension {dim} of size", stride)
    # stride > 1: the full tensor is `stride` blocks stacked along `dim` (e.g. SwiGLU's
    # [gate; up]); each rank keeps its slice of EVERY block, so the local tensor is again
    # [block_0 slice; block_1 slice; ...] and local code can still chunk it the same way.
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[r] for b in blocks], dim=dim).contiguous()


def shard_rows(full: torch.Tensor, group, stride: int = 1) -> torch.Tensor:
    """This rank's rows of ``full`` [n, ...] -> [n/tp, ...] (a contiguous copy, no communication).

    Rank r keeps rows [r n/tp, (r+1) n/tp); with ``stride`` k the rows are k stacked blocks and
    rank r keeps its rows of each, in block order (Megatron: _initialize_affine_weight_cpu's stride)."""
    return _shard(full, 0, group, stride)


def shard_cols(full: torch.Tensor, group, stride: int = 1) -> torch.Tensor:
    """This rank's columns of ``full`` [m, n] -> [m, n/tp] (as shard_rows, along dim 1)."""
    return _shard(full, 1, group, stride)


def pad_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 1) -> int:
    """The smallest multiple of ``make_vocab_size_divisible_by * tp`` >= vocab_size (Megatron's
    ``--make-vocab-size-divisible-by``): 257 -> 258 at tp 2 (divisible_by 1). Padding ids are never tokens."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pad_rows(full: torch.Tensor, padded: int) -> torch.Tensor:
    """``full`` [V, ...] with zero rows appended: [padded, ...] (the vocabulary's padding rows)."""
    return torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])


def vocab_range(padded_vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """[start, end) of the vocabulary ids that rank ``rank`` of ``tp`` owns (Megatron's
    VocabUtility.vocab_range_from_global_vocab_size)."""
    per_rank = divide(padded_vocab_size, tp, "padded vocabulary size")
    return rank * per_rank, (rank + 1) * per_rank


# ======================================================================================
# Linear layers
# ======================================================================================

def column_parallel_linear_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                    has_bias: bool, group, gemm: Gemm = GEMM):
    """Backward of the column-parallel y = x W_r^T + b_r, by hand.

    dy [..., out/tp], x [..., in] (same on every rank), weight W_r [out/tp, in]; gemm: the layer's
    dgrad/wgrad (model/linear.py). Returns (grad_x [..., in], grad_weight [out/tp, in], grad_bias
    [out/tp] or None) in x's and weight's dtypes. grad_x = sum over ``group`` of dy_r W_r: one
    comm.all_reduce of [..., in], tag "bwd", async and overlapped with the wgrad GEMM; grad_weight and
    grad_bias are local, exactly this rank's rows of the single-device gradients.
    Megatron: LinearWithGradAccumulationAndAsyncCommunication.backward."""
    # BEGIN EXERCISE 2.1: the column-parallel linear's backward | hint: each rank's dx uses only its rows of W, so it is a partial sum: which collective completes it, and which gradients can you compute while it travels? (Megatron: LinearWithGradAccumulationAndAsyncCommunication.backward)
    grad_x = gemm.dgrad(grad_output, weight)                             # [..., in], partial
    handle = all_reduce(grad_x, group, op="sum", tag="bwd", async_op=True)   # in place, later full
    grad_weight = gemm.wgrad(grad_output, x)                             # [out/tp, in], local
    grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if has_bias else None   # [out/tp]
    handle.wait()                                                        # grad_x is now the sum
    # END EXERCISE
    return grad_x, grad_weight, grad_bias


class LinearWithGradAllReduce(torch.autograd.Function):
    """y = x W^T + b forward (no communication); backward column_parallel_linear_backward (dx
    all-reduced over ``group``). Equals ``F.linear(copy_to_tensor_model_parallel_region(x, group), W, b)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, gemm=GEMM):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.gemm = group, bias is not None, gemm
        return gemm.fprop(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = column_parallel_linear_backward(
            grad_output, x, weight, ctx.has_bias, ctx.group, ctx.gemm)
        return grad_x, grad_weight, grad_bias, None, None


def sequence_parallel_linear_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                      has_bias: bool, group, gemm: Gemm = GEMM):
    """Backward of the column-parallel linear under sequence parallelism, by hand.

    dy [b, s, out/tp] (the full sequence); x_r [b, s/tp, in], the saved shard (positions
    [r s/tp, (r+1) s/tp) of SEQUENCE_DIM); weight W_r [out/tp, in]; gemm: dgrad/wgrad.
    Returns (grad_x [b, s/tp, in], grad_weight [out/tp, in], grad_bias [out/tp] or None), this
    rank's parts of the single-device gradients. Collectives, exactly two: all_gather of x_r
    along s (tag "regather") for dW = dy^T x, and reduce_scatter of dx = dy W_r [b, s, in] along
    s (tag "bwd")."""
    # BEGIN EXERCISE 4.3: the sequence-parallel column linear's backward | hint: the forward gathered the tokens: dW needs every token's input again, and dx is a partial sum of which each rank keeps only its own tokens. Which two collectives, along which dimension? (Megatron: LinearWithGradAccumulationAndAsyncCommunication.backward)
    total = all_gather(x.contiguous(), group, dim=SEQUENCE_DIM, tag="regather")       # [b, s, in]
    grad_total = gemm.dgrad(grad_output, weight)                                      # [b, s, in], partial
    grad_x = reduce_scatter(grad_total, group, dim=SEQUENCE_DIM, tag="bwd")          # [b, s/tp, in], summed
    grad_weight = gemm.wgrad(grad_output, total)                                      # [out/tp, in]
    grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if has_bias else None   # [out/tp]
    # END EXERCISE
    return grad_x, grad_weight, grad_bias


class LinearWithSequenceParallelGather(torch.autograd.Function):
    """The column-parallel linear under sequence parallelism.

    forward   x_r [b, s/tp, in] -> all-gather along s (tag "fwd", through the GEMM seam: FP8
              bytes under chapter 06) -> y = x W_r^T + b_r [b, s, out/tp]
    backward  sequence_parallel_linear_backward -> dx [b, s/tp, in]
    Saves only x_r (the price: a second all-gather). overlap_backward: tp/overlap.py's backward,
    each collective behind a GEMM (chapter 07).
    Megatron: LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel=True."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, gemm=GEMM, overlap_backward=False):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias, ctx.gemm, ctx.overlap_backward = group, bias is not None, gemm, overlap_backward
        total = gemm.gather_input(x.contiguous(), group, SEQUENCE_DIM, "fwd")          # [b, s, in]
        return gemm.fprop(total, weight, bias)                                          # [b, s, out/tp]

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        backward = (sequence_parallel_linear_backward_overlapped if ctx.overlap_backward
                    else sequence_parallel_linear_backward)
        grad_x, grad_weight, grad_bias = backward(grad_output, x, weight, ctx.has_bias, ctx.group, ctx.gemm)
        return grad_x, grad_weight, grad_bias, None, None, None


def row_parallel_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                group, gemm: Gemm = GEMM) -> torch.Tensor:
    """y = sum over ranks of x_r W_r^T, plus b once.

    x [..., in/tp], weight W_r [out, in/tp], bias [out] (replicated) or None; gemm: the layer's
    products (`gemm.linear` carries the backward). Returns y [..., out], the same on every rank.
    Communication: one all-reduce (sum) of [..., out] via reduce_from_tensor_model_parallel_region
    (identity backward). The bias is added after it (before, it would be summed tp times)."""
    # BEGIN EXERCISE 2.2: the row-parallel linear's forward | hint: each rank's product holds only its columns' share of y: which of the paper's two operators completes it, and how often would a bias added before it be counted? (Megatron: RowParallelLinear.forward)
    partial = gemm.linear(x, weight)                 # [..., out], a partial sum
    y = reduce_from_tensor_model_parallel_region(partial, group)           # g: all-reduce now, identity later
    return y + bias if bias is not None else y
    # END EXERCISE


def set_tensor_model_parallel_attributes(param: nn.Parameter, partition_dim: int, group, stride: int = 1,
                                         unpadded_size: int | None = None) -> None:
    """Record that `param` is this rank's part of a tensor split over `group` along
    `partition_dim`, in `stride` blocks each cut alike (placement.Placement). unpadded_size: the
    single-device size of that dimension when padded (the vocabulary). Read by full-tensor
    gathers, the gradient norm and checkpoints; no record means replicated.
    Megatron: tensor_parallel.layers.set_tensor_model_parallel_attributes."""
    tp, shape = group_size(group), list(param.shape)
    shape[partition_dim] = unpadded_size if unpadded_size is not None else shape[partition_dim] * tp
    set_placement(param, shape=tuple(shape), split=Split(partition_dim, group, tp, group_rank(group), stride))


class _ParallelLinear(nn.Module):
    """Zero parameters of this rank's shapes, set from full single-device tensors by ``load_full``;
    W split along ``partition_dim`` (0: rows, the bias too; 1: columns, the bias replicated)."""

    def __init__(self, in_features: int, out_features: int, group, partition_dim: int, bias: bool, stride: int,
                 params_dtype: torch.dtype | None, sequence_parallel: bool, skip_weight_param_allocation: bool = False):
        super().__init__()
        self.group, self.tp, self.partition_dim = group, group_size(group), partition_dim
        self.in_features, self.out_features, self.stride = in_features, out_features, stride
        self.sequence_parallel = sequence_parallel
        shape = [out_features, in_features]                   # [out/tp, in] or [out, in/tp]
        what = ("ColumnParallelLinear: out_features", "RowParallelLinear: in_features")[partition_dim]
        shape[partition_dim] = divide(shape[partition_dim], self.tp, what, stride) * stride
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = None if skip_weight_param_allocation else nn.Parameter(torch.zeros(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(shape[0], dtype=dtype)) if bias else None
        self.gemm = GEMM                                      # its matrix products (model/linear.py)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> None:
        """Set this rank's shard from the full single-device weight [out, in] (and bias [out])."""
        if self.weight is not None:
            self.weight.copy_(_shard(weight, self.partition_dim, self.group, self.stride))
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias: pass the full bias too")
            self.bias.copy_(shard_rows(bias, self.group, self.stride) if self.partition_dim == 0 else bias)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (output features) split over ``group``.

    weight [out/tp, in] (rows r; with ``stride`` k, rows r of each of k blocks), bias [out/tp].
    x [..., in], the same on every rank (sequence_parallel: [b, s/tp, in]) -> [..., out/tp], or
    [..., out] with gather_output.
    Communication: forward none (all-gather with gather_output); backward all-reduce of dx
    [..., in]. sequence_parallel: forward all-gather of x along s; backward reduce-scatter of dx
    and a second all-gather of x; ``overlap_backward`` overlaps them with the GEMMs (chapter 07).
    Invariant: weight/bias gradients are exactly rows of the single-device gradients."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 gather_output: bool = False, stride: int = 1, params_dtype: torch.dtype | None = None,
                 skip_weight_param_allocation: bool = False, unpadded_size: int | None = None,
                 sequence_parallel: bool = False):
        super().__init__(in_features, out_features, group, 0, bias, stride, params_dtype, sequence_parallel,
                         skip_weight_param_allocation)
        self.overlap_backward = False          # sequence_parallel: tp/overlap.py's backward instead
        self.gather_output = gather_output
        for p in (self.weight, self.bias):
            if p is not None:
                set_tensor_model_parallel_attributes(p, 0, group, stride, unpadded_size)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """weight: use this [out/tp, in] instead of self.weight (a tied output layer)."""
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            y = LinearWithSequenceParallelGather.apply(x, weight, self.bias, self.group, self.gemm,
                                                       self.overlap_backward)                        # [b, s, out/tp]
        else:
            y = LinearWithGradAllReduce.apply(x, weight, self.bias, self.group, self.gemm)        # [..., out/tp]
        if self.gather_output:
            # only for a consumer that needs every feature (rare: it costs an all-gather
            # and every rank then holds the whole activation); stride must be 1 for the
            # gathered features to come out in the single-device order.
            if self.stride != 1:
                raise ValueError("gather_output with stride > 1 would interleave the blocks")
            y = gather_from_tensor_model_parallel_region(y, self.group, dim=-1)  # [..., out]
        return y


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's columns (input features) split over ``group``.

    weight [out, in/tp] (columns r), bias [out] replicated. x [..., in/tp] (or [..., in] with
    input_is_parallel=False, split here) -> y [..., out], the same on every rank
    (sequence_parallel: [b, s/tp, out]).
    Communication: forward all-reduce of y (sequence_parallel: reduce-scatter along s); backward
    none (all-gather of dy along s under sequence_parallel). The bias is added once after the
    reduction; its gradient is identical on every rank, except under sequence_parallel, where it
    is marked `sequence_parallel` and finalize_model_grads all-reduces it."""

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 input_is_parallel: bool = True, params_dtype: torch.dtype | None = None,
                 sequence_parallel: bool = False):
        super().__init__(in_features, out_features, group, 1, bias, 1, params_dtype, sequence_parallel)
        self.input_is_parallel = input_is_parallel
        set_tensor_model_parallel_attributes(self.weight, 1, group)      # the bias is replicated
        if sequence_parallel and self.bias is not None:
            set_placement(self.bias, sequence_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group, dim=-1)  # [..., in/tp]; dx all-gathered later
        if self.sequence_parallel:
            partial = self.gemm.linear(x, self.weight)                                      # [b, s, out], partial
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group, dim=SEQUENCE_DIM)  # [b, s/tp, out]
            return y + self.bias if self.bias is not None else y
        return row_parallel_linear_forward(x, self.weight, self.bias, self.group, self.gemm)


# ======================================================================================
# Embedding
# ======================================================================================

class VocabParallelEmbedding(nn.Module):
    """tokens [b, s] -> [b, s, h], the table's rows split over ``group``.

    Vp = pad_vocab_size(V, tp, make_vocab_size_divisible_by); rank r owns ids vocab_range(Vp, r, tp)
    and holds weight [Vp/tp, h]. Padding rows [V, Vp) are zero and get zero gradient (no token is
    >= V; vocab_parallel_cross_entropy(..., vocab_size=V) masks their logits).
    Communication: forward all-reduce of [b, s, h]; backward none. reduce_scatter_embeddings:
    reduce-scatter along s instead, output [b, s/tp, h], backward all-gather."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group,
                 make_vocab_size_divisible_by: int = 1, params_dtype: torch.dtype | None = None,
                 reduce_scatter_embeddings: bool = False):
        super().__init__()
        self.group = group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        tp, r = group_size(group), group_rank(group)
        self.padded_vocab_size = pad_vocab_size(num_embeddings, tp, make_vocab_size_divisible_by)
        self.vocab_start_index, self.vocab_end_index = vocab_range(self.padded_vocab_size, r, tp)
        self.weight = nn.Parameter(torch.zeros(self.padded_vocab_size // tp, embedding_dim,
                                               dtype=params_dtype or torch.get_default_dtype()))
        set_tensor_model_parallel_attributes(self.weight, 0, group, unpadded_size=num_embeddings)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Set this rank's rows from the full single-device table [V, h]."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"expected the full table [{self.num_embeddings}, "
                             f"{self.embedding_dim}], got {list(weight.shape)}")
        self.weight.copy_(shard_rows(pad_rows(weight, self.padded_vocab_size), self.group))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.num_embeddings):
            # the single-device embedding raises too; here an id in the padding would
            # silently read a zero row, so say it before it becomes a wrong answer
            raise ValueError(f"token ids must be in [0, {self.num_embeddings}), got "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        outside = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
        local_ids = (tokens - self.vocab_start_index).masked_fill(outside, 0)   # [b, s]
        partial = F.embedding(local_ids, self.weight)                          # [b, s, h]
        # ids owned by another rank read row 0 above: zero them, so the sum over ranks
        # holds exactly one (the owner's) row per token, and row 0 gets no stray gradient
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group, dim=SEQUENCE_DIM)   # [b, s/tp, h]
        return reduce_from_tensor_model_parallel_region(partial, self.group)                         # [b, s, h]
