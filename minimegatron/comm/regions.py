"""Autograd-aware communication regions: Megatron's tensor-parallel "mappings", with the
process group passed in (see comm/__init__.py)."""

from __future__ import annotations

import torch

from .collectives import all_gather, all_reduce, all_to_all, all_to_all_single, group_rank, group_size, reduce_scatter

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
#
# The token dispatchers of a mixture of experts (chapter 05) move a different number of rows
# to and from each member, so they need the uneven forms (Megatron passes split sizes to the
# same mappings); each takes a ledger tag, and its backward records tag + "-bwd":
#
#     all_to_all_uneven_region        all-to-all, in_splits -> out_splits   the reverse splits
#     gather_uneven_region            all-gather of sizes[i] rows           reduce-scatter of them
#     reduce_scatter_uneven_region    reduce-scatter into sizes[i] rows     all-gather of them

def _sum(x, group, tag):
    # all_reduce works in place: never overwrite a tensor that autograd or the caller holds
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group, tag=tag)


def _split(x, group, dim, tag=None):
    """This member's chunk of ``x`` along ``dim`` (no communication, so ``tag`` records nothing)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split size {x.shape[dim]} along dim {dim} into {n} equal parts")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class _Region(torch.autograd.Function):
    """Forward fwd(x), backward bwd(grad): one row of the tables above."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad), None, None


def _along_dim(x, group, dim, fwd, bwd):
    """fwd(x, group, dim, tag="fwd") forward, bwd(grad, group, dim, tag="bwd") backward (split,
    all_gather or reduce_scatter each way)."""
    return _Region.apply(x, lambda x: fwd(x, group, dim, tag="fwd"), lambda grad: bwd(grad, group, dim, tag="bwd"))


def _reduce_scatter_rows(x, group, sizes, tag):
    """Sum x [sum(sizes), ...] over the group and keep this member's rows (sizes[rank] of them,
    after the sizes of the members before it). gloo reduce-scatters equal chunks only, so each
    member's rows are padded to the largest size first (the record counts the padded input)."""
    largest, rank = max(sizes), group_rank(group)
    padded = x.new_zeros(len(sizes) * largest, *x.shape[1:])                 # [n * largest, ...]
    for i, piece in enumerate(x.split(sizes)):
        padded[i * largest:i * largest + sizes[i]] = piece
    return reduce_scatter(padded, group, dim=0, tag=tag)[:sizes[rank]]


def _all_to_all_rows(x, group, in_splits, out_splits, tag):
    """x [sum(in_splits), ...] -> [sum(out_splits), ...]: all_to_all_single with these splits."""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    return all_to_all_single(out, x, group, in_splits, out_splits, tag=tag)


def copy_to_tensor_model_parallel_region(x, group):
    """The copy operator (the paper's f): forward identity; backward all-reduce (sum). Enters a
    region where every member uses the same ``x`` (a column-parallel linear)."""
    return _Region.apply(x, lambda x: x, lambda grad: _sum(grad, group, "bwd"))


def reduce_from_tensor_model_parallel_region(x, group):
    """The reduce operator (the paper's g): forward all-reduce (sum) of partial results; backward
    identity. Leaves a row-parallel linear."""
    return _Region.apply(x, lambda x: _sum(x, group, "fwd"), lambda grad: grad)


def scatter_to_tensor_model_parallel_region(x, group, dim=-1):
    """Forward: keep this member's chunk of ``x`` along ``dim`` (no communication);
    backward: all-gather the chunks' gradients along ``dim``."""
    return _along_dim(x, group, dim, _split, all_gather)


def gather_from_tensor_model_parallel_region(x, group, dim=-1):
    """Forward: all-gather along ``dim``; backward: keep this member's chunk of the gradient."""
    return _along_dim(x, group, dim, all_gather, _split)


def scatter_to_sequence_parallel_region(x, group, dim=0):
    """Sequence parallelism, entering a sequence-split region from a replicated tensor: forward keep
    this member's chunk along ``dim``; backward all-gather."""
    return _along_dim(x, group, dim, _split, all_gather)


def reduce_scatter_to_sequence_parallel_region(x, group, dim=0):
    """Sequence parallelism, leaving a tensor-parallel region: forward reduce-scatter
    along ``dim`` (the sequence); backward all-gather of the gradient along ``dim``."""
    return _along_dim(x, group, dim, reduce_scatter, all_gather)


def gather_from_sequence_parallel_region(x, group, dim=0):
    """Sequence parallelism, entering a tensor-parallel region: forward all-gather along ``dim``;
    backward reduce-scatter (each member's gradient is a partial sum)."""
    return _along_dim(x, group, dim, all_gather, reduce_scatter)


def all_to_all_region(x, group, scatter_dim, gather_dim):
    """Forward :func:`all_to_all` (scatter ``scatter_dim``, gather ``gather_dim``); backward the
    inverse (Ulysses' head/sequence swap; MoE's dispatch)."""
    return _Region.apply(x, lambda x: all_to_all(x, group, scatter_dim, gather_dim, tag="fwd"),
                         lambda grad: all_to_all(grad, group, gather_dim, scatter_dim, tag="bwd"))


def all_to_all_uneven_region(x, group, in_splits: list[int], out_splits: list[int], tag: str):
    """x [sum(in_splits), ...]: rows in_splits[j] go to member j; returns [sum(out_splits), ...],
    out_splits[i] rows from member i, in member order. Backward: the same exchange with the
    splits swapped. (The counts must be known on both sides: exchange them first.)"""
    if group_size(group) == 1:
        return x
    in_splits, out_splits = list(in_splits), list(out_splits)
    return _Region.apply(x, lambda x: _all_to_all_rows(x, group, in_splits, out_splits, tag),
                         lambda grad: _all_to_all_rows(grad, group, out_splits, in_splits, tag + "-bwd"))


def gather_uneven_region(x, group, sizes: list[int], tag: str):
    """x [sizes[rank], ...] -> [sum(sizes), ...], every member's rows in member order; backward
    reduce-scatter (each member's gradient of the gathered rows is a partial sum)."""
    if group_size(group) == 1:
        return x
    sizes = list(sizes)
    return _Region.apply(x, lambda x: all_gather(x, group, dim=0, sizes=sizes, tag=tag),
                         lambda grad: _reduce_scatter_rows(grad, group, sizes, tag + "-bwd"))


def reduce_scatter_uneven_region(x, group, sizes: list[int], tag: str):
    """x [sum(sizes), ...], a partial sum on each member -> this member's sizes[rank] rows of the
    sum; backward all-gather."""
    if group_size(group) == 1:
        return x
    sizes = list(sizes)
    return _Region.apply(x, lambda x: _reduce_scatter_rows(x, group, sizes, tag),
                         lambda grad: all_gather(grad.contiguous(), group, dim=0, sizes=sizes, tag=tag + "-bwd"))
