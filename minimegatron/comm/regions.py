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
# members (f) is a fan-out whose transpose is a sum (all-reduce), and summing partial results
# into one replicated tensor (g) is a fan-in whose transpose hands the one gradient to every
# member unchanged (identity). Hence the pairs
#
#     operator                   forward          backward
#     copy_to_region             identity         all-reduce (sum)
#     reduce_from_region         all-reduce       identity
#     scatter_to_region          split            all-gather
#     gather_from_region         all-gather       split
#     reduce_scatter_to_region   reduce-scatter   all-gather
#     gather_to_region           all-gather       reduce-scatter
#     all_to_all_region          all-to-all       the inverse all-to-all
#
# Forward calls are recorded with tag "fwd", backward calls with tag "bwd".

def _identity(x, group, tag):
    return x


def _sum(x, group, tag):
    # all_reduce works in place: never overwrite a tensor that autograd or the caller holds
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group, tag=tag)


def _split(x, group, dim, tag):
    """This member's chunk of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split size {x.shape[dim]} along dim {dim} into {n} equal parts")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _gather(x, group, dim, tag):
    return all_gather(x, group, dim, tag=tag)


def _reduce_scatter(x, group, dim, tag):
    return reduce_scatter(x, group, dim, tag=tag)


def _all_to_all(x, group, scatter_dim, gather_dim, tag):
    return all_to_all(x, group, scatter_dim, gather_dim, tag=tag)


def _inverse_all_to_all(x, group, scatter_dim, gather_dim, tag):
    return all_to_all(x, group, gather_dim, scatter_dim, tag=tag)


def _region(name, forward, backward):
    """An autograd Function computing ``forward(x, group, *dims)``; its backward computes
    ``backward(grad, group, *dims)``."""

    def fwd(ctx, x, group, *dims):
        ctx.group, ctx.dims = group, dims
        return forward(x, group, *dims, tag="fwd")

    def bwd(ctx, grad):
        # one gradient per forward input: x, then None for the group and for each dim
        return (backward(grad, ctx.group, *ctx.dims, tag="bwd"), None) + (None,) * len(ctx.dims)

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_CopyToRegion = _region("_CopyToRegion", _identity, _sum)
_ReduceFromRegion = _region("_ReduceFromRegion", _sum, _identity)
_ScatterToRegion = _region("_ScatterToRegion", _split, _gather)
_GatherFromRegion = _region("_GatherFromRegion", _gather, _split)
_ReduceScatterToRegion = _region("_ReduceScatterToRegion", _reduce_scatter, _gather)
_GatherToRegion = _region("_GatherToRegion", _gather, _reduce_scatter)
_AllToAllRegion = _region("_AllToAllRegion", _all_to_all, _inverse_all_to_all)


def copy_to_region(x, group):
    """Megatron's f: forward identity; backward all-reduce (sum) of the gradient.

    Enters a region where each member uses the same ``x`` for a different part of the work
    (a column-parallel linear): ``x``'s gradient is the sum of every member's contribution.
    """
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    """Megatron's g: forward all-reduce (sum) of the members' partial results; backward
    identity. Leaves a region whose members each hold a partial sum (a row-parallel linear)."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x, group, dim=-1):
    """Forward: keep this member's chunk of ``x`` along ``dim`` (no communication);
    backward: all-gather the chunks' gradients along ``dim``."""
    return _ScatterToRegion.apply(x, group, dim)


def gather_from_region(x, group, dim=-1):
    """Forward: all-gather along ``dim``; backward: keep this member's chunk of the gradient.
    For an output every member then uses identically (each holds the full gradient)."""
    return _GatherFromRegion.apply(x, group, dim)


def reduce_scatter_to_region(x, group, dim=0):
    """Sequence parallelism, leaving a tensor-parallel region: forward reduce-scatter
    along ``dim`` (the sequence); backward all-gather of the gradient along ``dim``."""
    return _ReduceScatterToRegion.apply(x, group, dim)


def gather_to_region(x, group, dim=0):
    """Sequence parallelism, entering a tensor-parallel region: forward all-gather along
    ``dim``; backward reduce-scatter, because each member's gradient for the full tensor
    is only a partial sum (each member computed with its own shard of the weights)."""
    return _GatherToRegion.apply(x, group, dim)


def all_to_all_region(x, group, scatter_dim, gather_dim):
    """Forward :func:`all_to_all` (scatter ``scatter_dim``, gather ``gather_dim``); backward
    the inverse all-to-all (scatter ``gather_dim``, gather ``scatter_dim``). Ulysses swaps
    sequence shards for head shards this way; MoE sends tokens to their experts."""
    return _AllToAllRegion.apply(x, group, scatter_dim, gather_dim)
