"""Tensor-parallel layers: a weight matrix cut across the ranks of a tensor-parallel group.

Shape legend as in model/gpt.py (b batch, s sequence, h hidden, V vocabulary, f MLP inner
size, tp the tensor-parallel size). A linear layer stores W: [out, in] and computes
y = x W^T + b. It can be cut two ways:

  ColumnParallelLinear   rank r holds rows r of W (its output features): [out/tp, in].
                         y_r = x W_r^T is the r-th slice of y's last dimension.
                         Every rank needs all of x, and x's gradient is a SUM over ranks
                         (each rank's slice of y depends on all of x):
                             forward  f (identity)  -> local matmul
                             backward local matmul grads -> all-reduce dx (copy)
                         (LinearWithGradAllReduce: the matmul and f in one autograd
                         Function, the backward written out by hand)
  RowParallelLinear      rank r holds columns r of W (its input features): [out, in/tp].
                         x_r W_r^T is a PARTIAL SUM of y; the full y is their sum:
                             forward  local matmul -> all-reduce (reduce) -> + bias (once)
                             backward identity (reduce): every rank gets the full dy

A column-parallel layer followed by a row-parallel one (the MLP, attention's QKV then its
output projection) needs one all-reduce forward (reduce) and one backward (copy), and the activation
between them stays split: nothing is gathered.

VocabParallelEmbedding cuts the embedding table [V, h] by rows (vocabulary ranges); each
rank looks up the ids it owns, writes zeros for the others, and one all-reduce (reduce) sums.

Initialisation (the book's rule 3): a layer is built with zeros of its shard's shape and set
from the full single-device tensor with ``load_full`` (apply_tensor_parallel passes the
weights the single-device model was initialised with), so any TP layout starts from exactly
the single-device weights. Nothing here draws random numbers per rank. A split parameter's
placement record says how it was cut (set_tensor_model_parallel_attributes, Megatron's name;
minimegatron/placement.py), which the gradient norm and the gathering of full tensors read.

Sequence parallelism (chapter 04, `sequence_parallel=True`, Megatron's argument): the
activations between layers are cut along the sequence, [b, s/tp, h]. A column-parallel layer
then all-gathers its input along s (backward: reduce-scatter of dx) instead of the copy's
backward all-reduce; a row-parallel layer reduce-scatters its output along s (backward:
all-gather) instead of the reduce's all-reduce; the embedding reduce-scatters
(`reduce_scatter_embeddings`). An all-reduce is a reduce-scatter followed by an all-gather,
so the bytes are the same and the activations in between are tp times smaller; the column
layer's backward adds one all-gather, because it saves only its input's shard
(LinearWithSequenceParallelGather).
SEQUENCE_DIM = 1: the book's activations are [b, s, h] (Megatron's are [s, b, h], dim 0).

Megatron-LM: megatron/core/tensor_parallel/layers.py (ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding, _initialize_affine_weight_cpu) and
megatron/core/tensor_parallel/utils.py (VocabUtility). Difference: Megatron's linear layers
return (output, bias) so a later fused kernel can add the bias; ours return the output only,
like the baseline's Linear, so a TP layer drops into the baseline model in its place.
"""

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
    """``numerator / (denominator * stride)``, or ValueError naming the numbers when it is not a
    whole number (``denominator`` is the tensor-parallel size; ``stride`` blocks are each
    split tp ways, see shard_rows)."""
    if numerator % (denominator * stride):
        blocks = f" in {stride} stacked blocks, each" if stride > 1 else ""
        raise ValueError(f"{what} {numerator}{blocks} is not divisible by the tensor-parallel size "
                         f"{denominator}")
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
    """This rank's rows of ``full`` [n, ...] -> [n/tp, ...] (a copy, contiguous).

    Rank r (its index in ``group``) keeps rows [r n/tp, (r+1) n/tp). With ``stride`` k the
    rows are k stacked blocks and rank r keeps its rows of each block, in block order
    (Megatron's ``stride`` in _initialize_affine_weight_cpu). No communication.
    """
    return _shard(full, 0, group, stride)


def shard_cols(full: torch.Tensor, group, stride: int = 1) -> torch.Tensor:
    """This rank's columns of ``full`` [m, n] -> [m, n/tp] (as shard_rows, along dim 1)."""
    return _shard(full, 1, group, stride)


def pad_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 1) -> int:
    """The smallest multiple of ``make_vocab_size_divisible_by * tp`` that is >= vocab_size.

    Megatron pads the vocabulary the same way (``--make-vocab-size-divisible-by``, 128 by
    default, times tp) so each rank gets an equal, well-aligned slice. 257 with tp 2 -> 258,
    with tp 4 -> 260. The padding ids [vocab_size, padded) are never valid tokens.
    """
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


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
    """The backward of a column-parallel linear y = x W_r^T + b_r, written out by hand.

    grad_output dy [..., out/tp]: the gradient of this rank's output slice.
    x [..., in]: the layer's input, the same on every rank of ``group``.
    weight W_r [out/tp, in]: this rank's rows of the full W.
    gemm: the layer's matrix products (model/linear.py's seam): grad_x = gemm.dgrad(dy, W_r),
    grad_weight = gemm.wgrad(dy, x).
    Returns (grad_x [..., in], grad_weight [out/tp, in], grad_bias [out/tp] or None), in the
    dtypes of x and weight.

    Every rank's output slice depends on ALL of x, so the full gradient of x is the sum over
    the group of dy_r W_r: grad_x is all-reduced (sum) over ``group`` -- the backward half of
    copy operator (the paper's f), one comm.all_reduce of [..., in], tag "bwd", and no other collective.
    grad_weight = dy^T x and grad_bias = the sum of dy over every dimension but the last are
    local: they are exactly this rank's rows of the single-device gradients.
    Order, as Megatron's LinearWithGradAccumulationAndAsyncCommunication: compute grad_x,
    launch its all-reduce asynchronously (async_op=True), compute the weight gradient while
    it travels, then wait: communication overlapped with a matmul.
    """
    # BEGIN EXERCISE 2.1: the column-parallel linear's backward | hint: each rank's dx uses only its rows of W, so it is a partial sum: which collective completes it, and which gradients can you compute while it travels? (Megatron: LinearWithGradAccumulationAndAsyncCommunication.backward)
    grad_x = gemm.dgrad(grad_output, weight)                             # [..., in], partial
    handle = all_reduce(grad_x, group, op="sum", tag="bwd", async_op=True)   # in place, later full
    grad_weight = gemm.wgrad(grad_output, x)                             # [out/tp, in], local
    grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if has_bias else None   # [out/tp]
    handle.wait()                                                        # grad_x is now the sum
    # END EXERCISE
    return grad_x, grad_weight, grad_bias


class LinearWithGradAllReduce(torch.autograd.Function):
    """y = x W^T + b forward (no communication); backward column_parallel_linear_backward,
    whose dx is all-reduced over ``group``. The same as ``F.linear(copy_to_tensor_model_parallel_region(x, group),
    W, b)``, with the backward in view (Megatron fuses it for the overlap)."""

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
    """The backward of the column-parallel linear under sequence parallelism
    (LinearWithSequenceParallelGather in minimegatron/tp/layers.py), written out by hand.

    grad_output dy [b, s, out/tp]: the gradient of this rank's output columns, over the FULL
    sequence (the forward gathered the sequence before the GEMM).
    x (x_r) [b, s/tp, in]: the saved input, only this rank's s/tp tokens (rank r of ``group``
    holds positions [r s/tp, (r+1) s/tp) of dim 1, SEQUENCE_DIM).
    weight W_r [out/tp, in]: this rank's rows of the full W. gemm: the layer's matrix products
    (model/linear.py's seam: dgrad and wgrad).
    Returns (grad_x [b, s/tp, in], grad_weight [out/tp, in], grad_bias [out/tp] or None):
    grad_x the single-device gradient of x restricted to this rank's tokens, grad_weight and
    grad_bias exactly this rank's rows of the single-device gradients.

    dW = dy^T x needs every token's input, so the full x [b, s, in] is all-gathered again
    along s (comm.all_gather(x, group, dim=SEQUENCE_DIM, tag="regather")); db = dy summed
    over b and s. Every rank's output columns depend on all of x, so dx = dy W_r [b, s, in] is
    a partial sum: comm.reduce_scatter(dx, group, dim=SEQUENCE_DIM, tag="bwd") sums it over the
    group and leaves each rank its own s/tp tokens. Exactly these two collectives, one
    all_gather of the [b, s/tp, in] shard and one reduce_scatter of [b, s, in], nothing else.
    """
    # BEGIN EXERCISE 4.3: the sequence-parallel column linear's backward | hint: the forward gathered the tokens: dW needs every token's input again, and dx is a partial sum of which each rank keeps only its own tokens. Which two collectives, along which dimension? (Megatron: LinearWithGradAccumulationAndAsyncCommunication.backward)
    total = all_gather(x.contiguous(), group, dim=SEQUENCE_DIM, tag="regather")       # [b, s, in]
    grad_total = gemm.dgrad(grad_output, weight)                                      # [b, s, in], partial
    grad_x = reduce_scatter(grad_total, group, dim=SEQUENCE_DIM, tag="bwd")          # [b, s/tp, in], summed
    grad_weight = gemm.wgrad(grad_output, total)                                      # [out/tp, in]
    grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if has_bias else None   # [out/tp]
    # END EXERCISE
    return grad_x, grad_weight, grad_bias


class LinearWithSequenceParallelGather(torch.autograd.Function):
    """The column-parallel linear under sequence parallelism, as Megatron-LM writes it
    (LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel=True):

    forward   x_r [b, s/tp, in] -> all-gather along s (tag "fwd"; through the GEMM seam, which
              gathers FP8 bytes under chapter 06's FP8) -> y = x W_r^T + b_r [b, s, out/tp]
    backward  sequence_parallel_linear_backward: all-gather x again (tag "regather"),
              dW = dy^T x, db = sum dy, and dx = dy W_r [b, s, in] reduce-scattered along s
              (tag "bwd") -> [b, s/tp, in]

    Only the shard x_r is saved for the backward, not the gathered x: keeping the gathered
    input would store tp copies of the same activation, which is what sequence parallelism
    exists to avoid (Korthikanti et al. 2022). The price is a second all-gather in backward.
    overlap_backward: the backward of tp/overlap.py instead, the same results with each
    collective behind the GEMM that does not need it (chapter 07)."""

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
    """The forward of a row-parallel linear: y = sum over ranks of x_r W_r^T, plus b once.

    x [..., in/tp]: this rank's input features (e.g. a column-parallel output).
    weight W_r [out, in/tp]: this rank's columns of the full W. bias [out] (the full bias,
    replicated) or None. gemm: the layer's matrix products (model/linear.py's seam; its
    autograd op `gemm.linear` computes x W_r^T with its backward).
    Returns y [..., out], the same on every rank: the single-device x W^T + b.
    Communication: ONE all-reduce (sum) of the [..., out] partial sums through
    comm.reduce_from_tensor_model_parallel_region (the reduce operator, the paper's g: identity backward, so every rank's x_r gets the
    full dy), and nothing else. The bias is added after the all-reduce; added before, it
    would be summed tp times.
    """
    # BEGIN EXERCISE 2.2: the row-parallel linear's forward | hint: each rank's product holds only its columns' share of y: which of the paper's two operators completes it, and how often would a bias added before it be counted? (Megatron: RowParallelLinear.forward)
    partial = gemm.linear(x, weight)                 # [..., out], a partial sum
    y = reduce_from_tensor_model_parallel_region(partial, group)           # g: all-reduce now, identity later
    return y + bias if bias is not None else y
    # END EXERCISE


def set_tensor_model_parallel_attributes(param: nn.Parameter, partition_dim: int, group, stride: int = 1,
                                         unpadded_size: int | None = None) -> None:
    """Record that `param` is this rank's part of a tensor split over `group` (Megatron's
    function, which sets the attributes tensor_model_parallel, partition_dim and
    partition_stride; here they are fields of the one record, placement.Placement): cut along
    `partition_dim` into stride blocks each cut alike (see shard_rows). unpadded_size: the
    single-device size of that dimension when it was padded first (the vocabulary); otherwise
    it is the local size times the group's size. Gathering full tensors, the gradient norm's
    duplicate filter and the checkpoints read the record; a parameter without a split is
    replicated on every rank of the group."""
    tp, shape = group_size(group), list(param.shape)
    shape[partition_dim] = unpadded_size if unpadded_size is not None else shape[partition_dim] * tp
    set_placement(param, shape=tuple(shape), split=Split(partition_dim, group, tp, group_rank(group), stride))


class _ParallelLinear(nn.Module):
    """Shared set-up: zero parameters of this rank's shapes; set them from the full
    single-device tensors with ``load_full``."""

    def _create(self, weight_shape, bias_shape, params_dtype, skip_weight_param_allocation=False):
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = None if skip_weight_param_allocation else nn.Parameter(torch.zeros(weight_shape, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(bias_shape, dtype=dtype)) if bias_shape else None
        self.gemm = GEMM                                      # its matrix products (model/linear.py)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> None:
        """Set this rank's shard from the full single-device weight [out, in] (and bias [out])."""
        if self.weight is not None:
            self.weight.copy_(self.shard_weight(weight))
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias: pass the full bias too")
            self.bias.copy_(self.shard_bias(bias))


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (the output features) split over ``group``.

    Parameters (this rank r of tp): weight [out/tp, in] = rows r of the full W (with
    ``stride`` k: rows r of each of k stacked blocks, see shard_rows); bias [out/tp].
    Input  x [..., in], the same on every rank of the group; with sequence_parallel
    x [b, s/tp, in], this rank's tokens.
    Output [..., out/tp] (this rank's output features), or [..., out] with gather_output.
    Communication: forward nothing (plus one all-gather of the output with gather_output);
    backward one all-reduce of dx [..., in] (copy), plus the split of dy with gather_output.
    With sequence_parallel: forward one all-gather of x along s, backward one reduce-scatter
    of dx along s instead of the all-reduce, plus a second all-gather of x (only the shard is
    saved: LinearWithSequenceParallelGather); with ``overlap_backward`` set (apply_tensor_parallel's
    overlap_sp_backward, chapter 07) that backward overlaps its two collectives with its GEMMs.
    Invariant: a rank's weight/bias gradients are exactly the rows of the single-device
    gradients, so reassembling them (concatenate in group order) gives the full gradient.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 gather_output: bool = False, stride: int = 1, params_dtype: torch.dtype | None = None,
                 skip_weight_param_allocation: bool = False, unpadded_size: int | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.tp = group, group_size(group)
        self.in_features, self.out_features, self.stride = in_features, out_features, stride
        self.sequence_parallel = sequence_parallel
        self.overlap_backward = False          # sequence_parallel: tp/overlap.py's backward instead
        divide(out_features, self.tp, "ColumnParallelLinear: out_features", stride)
        self.output_size_per_partition = out_features // self.tp
        self.gather_output = gather_output
        self._create((self.output_size_per_partition, in_features),
                     (self.output_size_per_partition,) if bias else None, params_dtype, skip_weight_param_allocation)
        for p in (self.weight, self.bias):
            if p is not None:
                set_tensor_model_parallel_attributes(p, 0, group, stride, unpadded_size)

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        return shard_rows(full, self.group, self.stride)

    def shard_bias(self, full: torch.Tensor) -> torch.Tensor:
        return shard_rows(full, self.group, self.stride)

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
    """y = x W^T + b with W's columns (the input features) split over ``group``.

    Parameters (rank r of tp): weight [out, in/tp] = columns r of the full W;
    bias [out], the full bias, the same on every rank.
    Input  x [..., in/tp] (this rank's input features, e.g. a column-parallel output), or
    x [..., in] with input_is_parallel=False (then split here, no communication).
    Output y [..., out], the same on every rank; with sequence_parallel y [b, s/tp, out],
    this rank's tokens.
    Communication: forward one all-reduce of y [..., out] (reduce); backward nothing (plus an
    all-gather of dx when input_is_parallel=False). With sequence_parallel: forward one
    reduce-scatter along s, backward one all-gather of dy along s; the bias, added to this
    rank's tokens only, is marked `sequence_parallel` (its gradient is a partial sum over
    the group: finalize_model_grads all-reduces it).
    The bias is added once, after the all-reduce: added before it, it would be summed tp
    times. Its gradient is the full dy summed, identical on every rank (so, like any
    replicated parameter, it is never averaged across the tensor-parallel group).
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 input_is_parallel: bool = True, params_dtype: torch.dtype | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.tp = group, group_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self.input_size_per_partition = divide(in_features, self.tp,
                                               "RowParallelLinear: in_features")
        self.input_is_parallel = input_is_parallel
        self._create((out_features, self.input_size_per_partition),
                     (out_features,) if bias else None, params_dtype)
        set_tensor_model_parallel_attributes(self.weight, 1, group)      # the bias is replicated
        if sequence_parallel and self.bias is not None:
            set_placement(self.bias, sequence_parallel=True)

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        return shard_cols(full, self.group)

    def shard_bias(self, full: torch.Tensor) -> torch.Tensor:
        return full.clone()                              # replicated, not split

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
    """tokens [b, s] -> [b, s, h], with the table's rows (vocabulary ids) split over ``group``.

    The vocabulary is padded to Vp = pad_vocab_size(V, tp, make_vocab_size_divisible_by);
    rank r owns ids [start, end) = vocab_range(Vp, r, tp) and holds weight [Vp/tp, h].
    Rows of real ids are cut from the full table given to load_full; the padding
    rows [V, Vp) are initialised to ZERO. They can never matter: no valid token id is >= V
    (the forward rejects one), so the embedding never reads them and they get no gradient;
    a tied output layer produces logits for them, but vocab_parallel_cross_entropy(...,
    vocab_size=V) gives those logits zero probability, so their gradient is zero too.
    Communication: forward one all-reduce of the output [b, s, h] (reduce); backward nothing
    (each rank's rows get the gradient of the tokens it owns, zero for the others). With
    reduce_scatter_embeddings (sequence parallelism without learned positions, Megatron's
    flag): a reduce-scatter along s instead, output [b, s/tp, h]; backward an all-gather.
    """

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

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """The full table [V, h] with zero padding rows appended: [Vp, h]."""
        padding = full.new_zeros(self.padded_vocab_size - full.shape[0], *full.shape[1:])
        return torch.cat([full, padding])

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Set this rank's rows from the full single-device table [V, h]."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"expected the full table [{self.num_embeddings}, "
                             f"{self.embedding_dim}], got {list(weight.shape)}")
        self.weight.copy_(shard_rows(self.pad(weight), self.group))

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
