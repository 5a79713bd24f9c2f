"""Sequence parallelism's backward with its collectives behind the GEMMs (chapter 07 §8).

tp/layers.py's sequence_parallel_linear_backward (exercise 4.3, the default) runs gather x,
dgrad, reduce-scatter dx, wgrad in turn. dgrad needs dy and W_r, not the gathered x; wgrad
needs the gathered x, not the reduced dx; so this order hides each collective:

  launch all-gather x (async)   | dgrad dy W_r          (x travels while dx is computed)
  wait; launch reduce-scatter   | wgrad dy^T x, db      (dx travels while dW is computed)
  wait

Bit-identical results and the same two ledger messages in the same order
(tests/test_overlap_comm.py). Selected by `--overlap-sp-backward`.
Megatron-LM: LinearWithGradAccumulationAndAsyncCommunication.backward (tensor_parallel/layers.py)."""

from __future__ import annotations

import torch

from ..comm import all_gather_into_tensor, group_size, reduce_scatter_tensor
from ..model.linear import GEMM, Gemm

__all__ = ["sequence_parallel_linear_backward_overlapped"]


def sequence_parallel_linear_backward_overlapped(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                                 has_bias: bool, group, gemm: Gemm = GEMM, dim: int = 1):
    """tp/layers.py's sequence_parallel_linear_backward, bit for bit, with the all-gather of x behind
    dgrad and the reduce-scatter of dx behind wgrad.

    dy [b, s, out/tp]; x_r [b, s/tp, in] (``dim`` = 1); weight W_r [out/tp, in]. Returns (grad_x
    [b, s/tp, in], grad_weight [out/tp, in], grad_bias [out/tp] or None). Communication: one
    comm.all_gather_into_tensor of the [s/tp, b, in] shard (tag "regather") and one
    comm.reduce_scatter_tensor of [s, b, in] (tag "bwd"), both async_op=True."""
    tp = group_size(group)
    shard = x.movedim(dim, 0).contiguous()                                   # [s/tp, b, in]
    gathered = shard.new_empty((tp * shard.shape[0], *shard.shape[1:]))      # [s, b, in]
    gathering = all_gather_into_tensor(gathered, shard, group, tag="regather", async_op=True)
    grad_total = gemm.dgrad(grad_output, weight)                             # [b, s, in], partial; x in flight
    gathering.wait()

    partial = grad_total.movedim(dim, 0).contiguous()                        # [s, b, in]
    grad_x = partial.new_empty((partial.shape[0] // tp, *partial.shape[1:]))  # [s/tp, b, in]
    scattering = reduce_scatter_tensor(grad_x, partial, group, tag="bwd", async_op=True)
    total = gathered.movedim(0, dim).contiguous()                            # [b, s, in]
    grad_weight = gemm.wgrad(grad_output, total)                             # [out/tp, in]; dx in flight
    grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if has_bias else None   # [out/tp]
    scattering.wait()
    return grad_x.movedim(0, dim).contiguous(), grad_weight, grad_bias       # [b, s/tp, in]
