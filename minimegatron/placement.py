"""Where each parameter lives: one record per parameter, the one source of truth.

Every parameter of the single-device model gets a `Placement` (its single-device name and
shape, model/gpt.py); each transformation that cuts or moves it refines the record
(`set_placement`):

    tp.apply_tensor_parallel     split along partition_dim over the tp group, partition_stride
                                 blocks cut alike (SwiGLU's [gate; up]), a padded vocabulary
                                 cropped back to shape[partition_dim]; sequence_parallel norms
    moe.apply_expert_parallel    an expert: held by one rank of the ep group (allreduce=False),
                                 split over the etp group
    model/gpt.py (pipeline)      a last stage's tied embedding: copy_of; both shared_embedding
    dp/zero.py                   zero_shard: the elements [lo, hi) this rank's optimizer steps

Readers: `gather_full_tensors`, the norm's duplicate filter (optim.py), the dp reductions
(dense or expert group), the resharding checkpoint and the Hugging Face exporter.

Megatron: the same facts as attributes on the parameter (tensor_model_parallel, partition_dim,
partition_stride, allreduce, shared, shared_embedding, sequence_parallel;
megatron/core/tensor_parallel/layers.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_gather, group_size

__all__ = ["Split", "Placement", "placement_of", "set_placement", "name_placements", "local_tensors",
           "gather_full_tensors"]


@dataclass(frozen=True)
class Split:
    """A tensor cut along `dim` into `size` parts over `group`; this rank holds part `rank`. With
    `stride` k the dimension is k stacked blocks, each cut alike: the local tensor is this rank's
    part of block 0, then of block 1, ... (tp.layers.shard_rows)."""
    dim: int
    group: object
    size: int
    rank: int
    stride: int = 1


@dataclass(frozen=True)
class Placement:
    """One parameter of the single-device model, as this rank holds it.

    name, shape:        the single-device name and shape.
    split:              the tensor-parallel cut (tp, or etp for an expert), or None: whole here.
    allreduce:          False for an expert: its gradient is summed over the expert-dp group;
                        `ep_group` holds one copy of each expert per rank (keys: global indices).
    copy_of:            the name of the parameter this one copies (a last stage's tied embedding),
                        or None; a copy (Megatron's `shared`) is counted once by the norm, the
                        gatherer and the checkpoint.
    shared_embedding:   one of the two copies of a tied embedding split between pipeline stages
                        (ZeRO gives it a bucket of its own, so both stages shard it alike).
    sequence_parallel:  replicated over tp, but each rank's gradient covers its own tokens only.
    zero_shard:         (lo, hi) of the flattened local tensor this rank's optimizer steps, or None."""
    name: str
    shape: tuple[int, ...]
    split: Split | None = None
    allreduce: bool = True
    ep_group: object = None
    copy_of: str | None = None
    shared_embedding: bool = False
    sequence_parallel: bool = False
    zero_shard: tuple[int, int] | None = None

    # Megatron's attribute names, read off the record
    @property
    def shared(self) -> bool:
        return self.copy_of is not None

    @property
    def tensor_model_parallel(self) -> bool:
        return self.split is not None

    @property
    def partition_dim(self) -> int | None:
        return None if self.split is None else self.split.dim

    @property
    def partition_stride(self) -> int:
        return 1 if self.split is None else self.split.stride

    def local_pieces(self, local_shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
        """Where this rank's tensor (of `local_shape`) sits in the single-device one: one index
        per stride block, in local order (their concatenation along partition_dim is the local
        tensor, less padding rows past the single-device size, which sit in no piece).
        [all of it] for an unsplit parameter. A checkpoint's global offsets (chapter 08)."""
        whole = [slice(0, n) for n in self.shape]
        if self.split is None:
            return [tuple(whole)]
        s, full = self.split, self.shape[self.split.dim]
        part = local_shape[s.dim] // s.stride                 # this rank's rows of one block
        block = full // s.stride if s.stride > 1 else part * s.size
        pieces = []
        for k in range(s.stride):
            lo = min(k * block + s.rank * part, full)
            pieces.append(tuple(slice(lo, min(lo + part, full)) if d == s.dim else whole[d]
                                for d in range(len(self.shape))))
        return pieces


def placement_of(param: torch.Tensor | Placement) -> Placement:
    """The record of `param`: what model/gpt.py and the transformations wrote, or (for a tensor
    made outside any model, e.g. a layer built alone in a test) whole, replicated, unnamed.
    A record stands for itself (ZeRO-3's shards keep the records of the parameters they hold)."""
    if isinstance(param, Placement):
        return param
    record = getattr(param, "placement", None)
    return record if record is not None else Placement("", tuple(param.shape))


def set_placement(param: torch.Tensor, like: torch.Tensor | None = None, **changes) -> Placement:
    """Replace fields of `param`'s record, or of `like`'s when a new tensor takes an old one's
    place (the transformations' one way to write a record)."""
    param.placement = dataclasses.replace(placement_of(param if like is None else like), **changes)
    return param.placement


def name_placements(model: nn.Module) -> None:
    """Give every parameter of `model` its name in `model`, which is its single-device name
    (every transformation keeps module names). GPTModel calls it when built, the
    transformations after they swap in new parameters."""
    for name, param in model.named_parameters():
        set_placement(param, name=name)


def local_tensors(model: nn.Module, grads: bool = False,
                  grad_of=lambda p: p.grad) -> dict[str, tuple[Placement, torch.Tensor]]:
    """{name: (record, tensor)} of `model`'s parameters as this rank holds them, or their
    gradients (`grad_of(p)`, e.g. a data-parallel buffer's view; zeros where there is none), by
    single-device name."""
    out = {}
    for name, p in model.named_parameters():
        g = grad_of(p) if grads else p
        out[placement_of(p).name or name] = (placement_of(p), torch.zeros_like(p) if g is None else g.view_as(p))
    return out


def gather_full_tensors(local: dict[str, tuple[Placement, torch.Tensor]], tag: str = "full",
                        copies: bool = False) -> dict[str, torch.Tensor]:
    """{name: single-device tensor} from this rank's (record, tensor) pairs: a split one all-gathered
    along its dim over its group (one comm.all_gather each, tag `tag`), stride blocks put back in
    order, padding cut off; experts exchanged over the ep group (all_gather_object, in no ledger);
    a shared copy left out unless `copies`. Collective over every split's group and the ep group."""
    out, experts_group = {}, None
    for name, (record, t) in local.items():
        t, s = t.detach(), record.split
        if record.shared and not copies:
            continue
        if not record.allreduce:
            experts_group = record.ep_group
        if s is None or s.size == 1:
            out[name] = t.clone()
            continue
        gathered = all_gather(t.contiguous(), s.group, dim=s.dim, tag=tag)
        if s.stride > 1:    # rank-major [r0: b0 b1 | r1: b0 b1] -> block-major [b0: r0 r1 | b1: r0 r1]
            per_rank = [part.chunk(s.stride, s.dim) for part in gathered.chunk(s.size, s.dim)]
            gathered = torch.cat([torch.cat([r[k] for r in per_rank], s.dim) for k in range(s.stride)], s.dim)
        out[name] = gathered.narrow(s.dim, 0, record.shape[s.dim]).contiguous()
    if experts_group is not None and group_size(experts_group) > 1:
        parts = [None] * group_size(experts_group)
        dist.all_gather_object(parts, {n: out[n] for n, (r, _) in local.items() if not r.allreduce}, group=experts_group)
        out.update({n: t for part in parts for n, t in part.items()})
    return out
