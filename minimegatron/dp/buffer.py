"""The flat buffers of data parallelism: parameters laid end to end, cut into buckets.

One `Bucket` is one collective's worth of parameters, for DDP, ZeRO-1/2 and ZeRO-3's units:

    offsets     where each parameter starts in the bucket
    grad_data   [padded_numel] this rank's accumulating gradients, in `grad_dtype`; each
                parameter's gradient is a view of it (`grad_view`)
    param_data  [padded_numel] the parameters, each model parameter's .data a view
                (ZeRO-1/2: all-gathered after every step), or None
    main_grad   [end - start] this rank's part of the REDUCED gradient: grad_data itself
                (DDP), its slice [start, end) (ZeRO-1), or a tensor of its own (ZeRO-2)

A sharded bucket of n elements is padded with zeros to dp * S, S = ceil(n / dp), and rank r owns
[r S, (r+1) S) (`shard_range`): reduce-scatter and all-gather need equal parts. grad_dtype may be
float32 beside 16-bit parameters (Megatron's --accumulate-allreduce-grads-in-fp32): backward
writes .grad in the parameter's dtype and a hook adds it into the float32 view (ddp.py).

Megatron: megatron/core/distributed/param_and_grad_buffer.py (_ParamAndGradBuffer, buckets).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import all_gather_into_tensor
from ..placement import Placement, placement_of

__all__ = ["shard_range", "Bucket", "make_bucket"]


def shard_range(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """The elements [start, end) = [rank * S, (rank + 1) * S), S = ceil(numel / dp), that `rank` of
    `dp` owns of a flat buffer of `numel` elements padded to dp * S; elements >= numel are padding.
    The ranges of ranks 0..dp-1 tile [0, dp * S). ValueError on a bad numel, dp or rank."""
    if dp < 1 or not 0 <= rank < dp or numel < 0:
        raise ValueError(f"shard_range: need numel >= 0, dp >= 1 and 0 <= rank < dp, "
                         f"got numel={numel}, dp={dp}, rank={rank}")
    size = math.ceil(numel / dp)
    return rank * size, (rank + 1) * size


@dataclass
class Bucket:
    """One collective's worth of parameters, laid end to end (module docstring).

    params/records/shapes/offsets: the parameters in buffer order (ZeRO-3 keeps none), their
        placement records, their local shapes, where each starts. numel: real elements;
        padded_numel: numel, or dp * shard_numel when sharded; start, end: this rank's shard.
    group: where its gradients are reduced (dp group, or expert-dp for experts=True).
    decay: every parameter in it takes weight decay. ready, work: the parameters whose gradient
        arrived in this backward; the collective in flight."""
    index: int
    params: list[nn.Parameter]
    records: list[Placement]
    shapes: list[torch.Size]
    offsets: list[int]
    numel: int
    padded_numel: int
    start: int
    end: int
    group: object = None
    experts: bool = False
    decay: bool = True
    grad_data: torch.Tensor | None = None
    param_data: torch.Tensor | None = None
    main_grad: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    work: object = None

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    @property
    def shard_numel(self) -> int:
        return self.end - self.start

    @property
    def real(self) -> int:
        """How many of this rank's shard elements are real (not padding)."""
        return max(0, min(self.end, self.numel) - self.start)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's elements of a flat [padded_numel] tensor, in its shape."""
        return flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])

    def gathered(self, shard: torch.Tensor, group) -> dict[str, tuple[Placement, torch.Tensor]]:
        """{single-device name: (record, tensor)}: every rank's `shard` [shard_numel] of this bucket
        all-gathered over `group` (one all-gather, tag "inspect"), cut into its parameters (copies)."""
        full = shard.new_empty(self.padded_numel)
        all_gather_into_tensor(full, shard.detach(), group, tag="inspect")
        return {r.name: (r, self.view(full, i).clone()) for i, r in enumerate(self.records)}

    def shard_owners(self, lo: int = 0, hi: int | None = None) -> list[tuple[Placement, int, int]]:
        """(record, a, b) for every parameter overlapping this rank's shard elements [lo, hi)
        (default: all of it): elements [a, b) of that stretch are its (padding belongs to none)."""
        return [(r, a, b) for r, a, b, _, _ in self._overlaps(lo, hi)]

    def shard_locations(self, lo: int = 0, hi: int | None = None) -> list[tuple[torch.Size, int]]:
        """For each of shard_owners(lo, hi), in the same order: (the parameter's local shape,
        where the owner's first element sits in the flattened parameter). A checkpoint reads
        them to put a flat shard back in model space (chapter 08)."""
        return [(shape, inside) for _, _, _, shape, inside in self._overlaps(lo, hi)]

    def _overlaps(self, lo: int, hi: int | None):
        first, last = self.start + lo, self.start + (self.shard_numel if hi is None else hi)
        for r, shape, off, n in zip(self.records, self.shapes, self.offsets, self.numels):
            a, b = max(off, first), min(off + n, last)
            if a < b:
                yield r, a - first, b - first, shape, a - off


def make_bucket(index: int, params: list[nn.Parameter], group, dp: int = 1, rank: int = 0, *,
                grad_dtype: torch.dtype | None = None, grad_data: torch.Tensor | None = None,
                hold_params: bool = False, hold_grads: bool = True, experts: bool = False,
                decay: bool = True) -> Bucket:
    """A Bucket of `params` (in this order), reduced over `group`; sharded over dp ranks (this
    one `rank`) when dp > 1, padded to dp * S. grad_data: the gradient buffer to use (a slice of a
    larger one), else a new zero one in grad_dtype (default: the parameters') if hold_grads.
    hold_params: the parameters become views of a new param_data (their values copied in)."""
    offsets = list(itertools.accumulate((p.numel() for p in params), initial=0))
    numel = offsets.pop()                              # [0, n0, n0 + n1, ...]: the last is the total
    start, end = shard_range(numel, dp, rank) if dp > 1 else (0, numel)
    padded = dp * (end - start) if dp > 1 else numel
    first = params[0]
    if grad_data is None and hold_grads:
        grad_data = torch.zeros(padded, dtype=grad_dtype or first.dtype, device=first.device)
    bucket = Bucket(index, list(params), [placement_of(p) for p in params], [p.shape for p in params], offsets,
                    numel, padded, start, end, group, experts, decay, grad_data)
    if hold_params:
        bucket.param_data = torch.zeros(padded, dtype=first.dtype, device=first.device)  # padding stays 0
        with torch.no_grad():
            for i, p in enumerate(params):
                view = bucket.view(bucket.param_data, i)
                view.copy_(p)
                p.data = view                          # the model now reads its weights from the bucket
    if grad_data is not None:
        bucket.main_grad = grad_data[start:end] if dp > 1 else grad_data
    else:
        bucket.main_grad = torch.zeros(end - start, dtype=grad_dtype or first.dtype, device=first.device)
    return bucket
