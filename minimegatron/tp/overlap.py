"""Sequence parallelism's backward with its collectives behind the GEMMs (chapter 07 §8).

Shape legend as in model/gpt.py (b batch, s sequence, in/out a linear layer's features, tp
the tensor-parallel size). Chapter 04's sequence_parallel_linear_backward (tp/layers.py,
exercise 4.3) runs its four steps one after the other: gather x, dgrad, reduce-scatter dx,
wgrad. Each collective waits for work it does not depend on:

  dgrad  dx = dy W_r       needs dy and W_r, not the gathered x
  wgrad  dW = dy^T x       needs the gathered x, not the reduced dx

so the order Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication.backward uses
(megatron/core/tensor_parallel/layers.py, always, whenever sequence_parallel is set) hides each
collective behind the GEMM that does not need it:

  launch all-gather x (async)   | dgrad dy W_r          (x travels while dx is computed)
  wait; launch reduce-scatter   | wgrad dy^T x, db      (dx travels while dW is computed)
  wait

The same tensors meet the same operations, so the results are bit-identical to the sequential
form and the ledger records the same two messages in the same order (tests/test_overlap_comm.py).
The book keeps the sequential form as the default, so exercise 4.3 is the code that runs;
`--overlap-sp-backward` (TrainConfig.overlap_sp_backward) selects this one.

gloo on a CPU runs an async collective on its own thread while the GEMM runs on the caller's;
on a GPU, NCCL runs it on its own stream (Megatron sets CUDA_DEVICE_MAX_CONNECTIONS=1 so the
all-gather is scheduled before the dgrad kernel and really overlaps it).
"""

from __future__ import annotations

import torch

from ..comm import all_gather_into_tensor, group_size, reduce_scatter_tensor
from ..model.linear import GEMM, Gemm

__all__ = ["sequence_parallel_linear_backward_overlapped"]


def sequence_parallel_linear_backward_overlapped(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                                 has_bias: bool, group, gemm: Gemm = GEMM, dim: int = 1):
    """The contract of tp/layers.py's sequence_parallel_linear_backward, bit for bit, with the
    all-gather of x overlapped with the dgrad GEMM and the reduce-scatter of dx overlapped with
    the wgrad GEMM.

    grad_output dy [b, s, out/tp]; x (x_r) [b, s/tp, in], this rank's tokens along ``dim`` (the
    sequence dimension, 1); weight W_r [out/tp, in]. Returns (grad_x [b, s/tp, in], grad_weight
    [out/tp, in], grad_bias [out/tp] or None). Communication: one comm.all_gather_into_tensor of
    the [s/tp, b, in] shard (tag "regather") and one comm.reduce_scatter_tensor of [s, b, in]
    (tag "bwd"), both async_op=True and each waited for before its result is read.
    """
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
