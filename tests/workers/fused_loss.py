"""Rank function for tests/test_fused_loss.py: the output layer and the loss under TP, fused
(kernels/cross_entropy.linear_cross_entropy with the tp group) and unfused (a
ColumnParallelLinear, then tp/cross_entropy.vocab_parallel_cross_entropy), on the same shards.
The whole world is one tp group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minimegatron import comm
from minimegatron.kernels.cross_entropy import linear_cross_entropy
from minimegatron.tp import ColumnParallelLinear, vocab_parallel_cross_entropy


def output_and_loss_both_ways(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, padded: int,
                              sequence_parallel: bool, chunk: int) -> dict:
    """x [b, s, h], weight [V, h], labels [b, s], the full float64 tensors, the same on every
    rank; grad of the losses: ones. Returns, for "fused" and "unfused": this rank's losses
    [b, s], dx (this rank's tokens under SP), dW (this rank's padded rows) and the ledger's
    (op, tag, shape, nbytes) in call order."""
    tp, rank, vocab = dist.get_world_size(), dist.get_rank(), weight.shape[0]
    full = torch.cat([weight, weight.new_zeros(padded - vocab, weight.shape[1])])       # [Vp, h]
    rows = full.chunk(tp)[rank]                                                          # [Vp/tp, h]
    mine = x.chunk(tp, dim=1)[rank] if sequence_parallel else x                          # [b, s/tp, h]
    out = {}
    for name in ("fused", "unfused"):
        xr, wr = mine.clone().requires_grad_(), rows.clone().requires_grad_()
        with comm.record_communication() as ledger:
            if name == "fused":
                losses = linear_cross_entropy(xr, wr, labels, chunk=chunk, group=None, vocab_size=vocab,
                                              sequence_parallel=sequence_parallel)
            else:
                layer = ColumnParallelLinear(x.shape[-1], padded, None, bias=False, sequence_parallel=sequence_parallel,
                                             skip_weight_param_allocation=True)
                losses = vocab_parallel_cross_entropy(layer(xr, weight=wr), labels, None, vocab_size=vocab)
            losses.backward(torch.ones_like(losses))
        out[name] = {"losses": losses.detach(), "dx": xr.grad, "dw": wr.grad,
                     "calls": [(r.op, r.tag, r.shape, r.nbytes) for r in ledger]}
    return out
