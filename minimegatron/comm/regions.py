"""Autograd-aware communication regions: Megatron's tensor-parallel "mappings", with the
process group passed in (see comm/__init__.py)."""

from __future__ import annotations

import torch

from .collectives import all_gather, all_reduce, all_to_all, group_rank, group_size, reduce_scatter

# ======================================================================================
# Autograd-aware regions (Megatron's tensor-parallel "mappings")
# ======================================================================================
# Each operator runs a collective forward and the matching backward: if the forward computes
# y = A x across the group, the backward computes dx = A^T dy. Identity and all-reduce pair
# up because a replicated tensor is ONE tensor stored on every member: copying it to the
# members ("copy", the 2019 paper's f) is a fan-out whose transpose is a sum (all-reduce), and summing partial results
# into one replicated tensor ("reduce", the paper's g) is a fan-in whose transpose hands the one gradient to every
# member unchanged (identity). Hence the pairs
#
#     operator (Megatron's names, tensor_parallel/mappings.py)    forward          backward
#     copy_to_tensor_model_parallel_region     (copy, f)           identity         all-reduce (sum)
#     reduce_from_tensor_model_parallel_region (reduce, g)         all-reduce       identity
#     scatter_to_tensor_model_parallel_region                     split            all-gather
#     gather_from_tensor_model_parallel_region                    all-gather       split
#     scatter_to_sequence_parallel_region                         split            all-gather
#     reduce_scatter_to_sequence_parallel_region                  reduce-scatter   all-gather
#     gather_from_sequence_parallel_region                        all-gather       reduce-scatter
#     all_to_all_region                                           all-to-all       the inverse all-to-all
#
# Forward calls are recorded with tag "fwd", backward calls with tag "bwd".

def _sum(x, group, tag):
    # all_reduce works in place: never overwrite a tensor that autograd or the caller holds
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group, tag=tag)


def _split(x, group, dim):
    """This member's chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split size {x.shape[dim]} along dim {dim} into {n} equal parts")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce (sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad, ctx.group, "bwd"), None


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    """g: forward all-reduce (sum), backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _sum(x, group, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    """Forward split along dim (no communication), backward all-gather along dim."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim, tag="bwd"), None, None


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    """Forward all-gather along dim, backward split (this member's chunk of the gradient)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim, tag="fwd")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward reduce-scatter along dim, backward all-gather along dim."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim, tag="fwd")

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, ctx.dim, tag="bwd"), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward all-gather along dim, backward reduce-scatter along dim."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim, tag="fwd")

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, ctx.dim, tag="bwd"), None, None


class _AllToAll(torch.autograd.Function):
    """Forward all-to-all (scatter scatter_dim, gather gather_dim), backward the inverse."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return all_to_all(x, group, scatter_dim, gather_dim, tag="fwd")

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, ctx.group, gather_dim, scatter_dim, tag="bwd"), None, None, None


def copy_to_tensor_model_parallel_region(x, group):
    """The copy operator (the paper's f): forward identity; backward all-reduce (sum) of the gradient.

    Enters a region where each member uses the same ``x`` for a different part of the work
    (a column-parallel linear): ``x``'s gradient is the sum of every member's contribution.
    """
    return _CopyToTensorModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group):
    """The reduce operator (the paper's g): forward all-reduce (sum) of the members' partial results; backward
    identity. Leaves a region whose members each hold a partial sum (a row-parallel linear)."""
    return _ReduceFromTensorModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x, group, dim=-1):
    """Forward: keep this member's chunk of ``x`` along ``dim`` (no communication);
    backward: all-gather the chunks' gradients along ``dim``."""
    return _ScatterToTensorModelParallelRegion.apply(x, group, dim)


def gather_from_tensor_model_parallel_region(x, group, dim=-1):
    """Forward: all-gather along ``dim``; backward: keep this member's chunk of the gradient.
    For an output every member then uses identically (each holds the full gradient)."""
    return _GatherFromTensorModelParallelRegion.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x, group, dim=0):
    """Sequence parallelism, entering a sequence-split region from a replicated tensor (the
    embedding's output): forward keep this member's chunk along ``dim`` (no communication);
    backward all-gather. The same operator as scatter_to_tensor_model_parallel_region, cut
    along the sequence instead of the features."""
    return _ScatterToTensorModelParallelRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x, group, dim=0):
    """Sequence parallelism, leaving a tensor-parallel region: forward reduce-scatter
    along ``dim`` (the sequence); backward all-gather of the gradient along ``dim``."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group, dim)


def gather_from_sequence_parallel_region(x, group, dim=0):
    """Sequence parallelism, entering a tensor-parallel region: forward all-gather along
    ``dim``; backward reduce-scatter, because each member's gradient for the full tensor
    is only a partial sum (each member computed with its own shard of the weights)."""
    return _GatherFromSequenceParallelRegion.apply(x, group, dim)


def all_to_all_region(x, group, scatter_dim, gather_dim):
    """Forward :func:`all_to_all` (scatter ``scatter_dim``, gather ``gather_dim``); backward
    the inverse all-to-all (scatter ``gather_dim``, gather ``scatter_dim``). Ulysses swaps
    sequence shards for head shards this way; MoE sends tokens to their experts."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)
