"""Bucketed data parallelism, its all-reduces overlapped with backward (Megatron's DDP).

  grad_buffer    one flat [N] gradient buffer (dtype grad_dtype), parameters laid out in the
                 reverse of model.parameters() (backward's order), cut into buckets by
                 `assign_buckets`; main_grad[p] is p's [shape] view of it.
  _grad_ready    each parameter's post-accumulate-grad hook: add p.grad into main_grad[p], free
                 p.grad; outside no_sync, when a bucket's last gradient has arrived, scale it by
                 1/dp and launch its async all-reduce (sum).
  finish_grad_sync  launch what is left (in bucket order), wait for every bucket, point p.grad at
                 its view (when the dtypes agree; else read grad_of(p), Megatron's main_grad).
  forward        the first forward with grad after a sync zeroes the buffer (zero_grad_buffer).

Collectives per optimizer step (tag "grads", over the dp group): one all-reduce per bucket,
together sum_p numel(p) * grad element size bytes, none inside no_sync(); with overlap=False the
same calls, in bucket order, inside finish_grad_sync. Experts (allreduce=False) get a buffer and
buckets of their own, reduced over expert_group (tag "expert-grads"). Each step's launches and
waits are timed into `self.timeline` (timeline.BucketTimeline).

Requires one parameter dtype, and every parameter that requires grad to receive a gradient in
the last micro-batch's backward.

Megatron: megatron/core/distributed/{distributed_data_parallel,param_and_grad_buffer}.py.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from .. import comm
from ..placement import placement_of
from ..optim import Segment, parameter_segment
from .buffer import Bucket, make_bucket
from .naive import DataParallel
from .timeline import BucketTimeline, TimelineRecorder


def assign_buckets(numels: Sequence[int], bucket_size: int | None) -> list[list[int]]:
    """Cut a sequence of gradients into buckets: Megatron's rule.

    numels: the element counts of the parameters, in the order backward produces their
      gradients (the reverse of model.parameters()).
    bucket_size: the bucket size in elements, or None for a single bucket holding everything.
    Returns the buckets as lists of indices into `numels`: consecutive, in order, every index
      exactly once, no empty bucket. [] when numels is empty.

    The rule (megatron/core/distributed/param_and_grad_buffer.py): walk the parameters in
    order, adding each one to the current bucket; as soon as the current bucket holds
    >= bucket_size elements, close it, and start the next parameter in a new bucket. The
    parameters left at the end form the last bucket, however small. So a parameter is never
    split, every bucket but the last holds >= bucket_size elements, and it holds fewer than
    bucket_size without its last parameter.

        assign_buckets([4, 4, 4], 6)    == [[0, 1], [2]]
        assign_buckets([4, 4, 4], 4)    == [[0], [1], [2]]
        assign_buckets([1, 100, 2], 10) == [[0, 1], [2]]
        assign_buckets([4, 4, 4], None) == [[0, 1, 2]]

    bucket_size <= 0 raises ValueError.
    """
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"bucket_size={bucket_size} must be a positive number of elements (or None)")
    # BEGIN EXERCISE 1.2: bucket assignment | hint: walk the gradients once, in order: when does the current bucket close, where does the next parameter go, and what becomes of what is left at the end? (Megatron: _compute_default_per_buffer_param_layout)
    buckets, current, filled = [], [], 0
    for i, n in enumerate(numels):
        current.append(i)
        filled += n
        if bucket_size is not None and filled >= bucket_size:
            buckets.append(current)
            current, filled = [], 0
    if current:                   # the remainder, however small, is the last bucket
        buckets.append(current)
    return buckets
    # END EXERCISE


def reduction_groups(params: Sequence[nn.Parameter], dp_group, expert_dp_group
                     ) -> list[tuple[list[nn.Parameter], object]]:
    """Which gradients are reduced where: [(dense parameters, dp_group), (expert parameters,
    expert_dp_group)], always these two entries in this order, each list in the order of
    `params` (an empty list when there is none of its kind). An expert parameter is one whose
    placement record says `allreduce = False` (placement.placement_of(p).allreduce; set by
    moe.apply_expert_parallel, Megatron's attribute); every other parameter is dense. dp_group: the dense data-parallel group (the dp x cp ranks that hold the same dense
    parameters); expert_dp_group: the expert-data-parallel group (the ranks that hold the same
    experts). ValueError if there are experts but expert_dp_group is None.

    Spot the bug (exercise 5.4): a first version of this body, and what it did when checked
    against the single-device run, are in chapters/05_ep_moe/exercises/spot_the_bug.md.
    """
    # BEGIN EXERCISE 5.4: spot the bug in the experts' gradient group | hint: an expert lives on the ranks of one expert-data-parallel group only; which group holds the other copies of its gradient?
    experts = [p for p in params if not placement_of(p).allreduce]
    dense = [p for p in params if placement_of(p).allreduce]
    if experts and expert_dp_group is None:
        raise ValueError(f"{len(experts)} parameter(s) are marked allreduce=False (experts) but no "
                         "expert_dp_group was given: pass the expert-data-parallel group")
    return [(dense, dp_group), (experts, expert_dp_group)]
    # END EXERCISE


def megatron_default_bucket_size(dp_size: int) -> int:
    """Megatron's default bucket size in elements: max(40M, 1M * dp) (tiny models: one bucket)."""
    return max(40_000_000, 1_000_000 * dp_size)


class DistributedDataParallel(DataParallel):
    """Bucketed, overlapped data parallelism (the module docstring has the algorithm).

    module: this rank's full model; group: the dp group. bucket_size_bytes: a bucket closes at >=
    this many bytes (None: megatron_default_bucket_size; 1: one bucket per parameter). overlap:
    launch each bucket from backward (True) or all in finish_grad_sync. expert_group: where experts'
    gradients are summed. grad_dtype: the buffer's dtype (default the parameters').
    Attributes: buckets (buffer order), grad_buffer [N] (each bucket's grad_data a slice),
    expert_grad_buffer or None, main_grad ({param: [shape] view}), timeline (or None)."""

    def __init__(self, module: nn.Module, group, bucket_size_bytes: int | None = None,
                 overlap: bool = True, expert_group=None, grad_dtype: torch.dtype | None = None):
        super().__init__(module, group)
        self.overlap = overlap
        params = [p for p in module.parameters() if p.requires_grad]
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) != 1:
            raise ValueError(f"{type(self).__name__} needs one parameter dtype, found {dtypes} "
                             "(Megatron keeps one buffer per dtype; this book uses one)")
        self.grad_dtype = grad_dtype or params[0].dtype
        if bucket_size_bytes is None:
            bucket_numel = megatron_default_bucket_size(self.dp_size)
        elif bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes={bucket_size_bytes} must be positive (or None)")
        else:   # ">= bucket_size_bytes bytes" is ">= ceil(bytes / element_size) elements"
            bucket_numel = math.ceil(bucket_size_bytes / self.grad_dtype.itemsize)

        # Experts (chapter 05) are marked `allreduce = False` (Megatron's attribute): their
        # gradients are summed over expert_group (the expert-data-parallel ranks holding the same
        # experts), not over `group`, so they get a buffer and buckets of their own. Both are
        # scaled by 1/dp, dp the dense group's size (Megatron's expert_gradient_scaling_factor
        # without average_in_collective): every token's gradient reaches exactly one expert-dp
        # member, and the sum over them, divided by dp, is the single-device gradient.
        (dense, dense_group), (experts, experts_group) = reduction_groups(params, group, expert_group)
        self.expert_group = expert_group
        self.buckets: list[Bucket] = []
        self.grad_buffer = self._make_buckets(dense, dense_group, bucket_numel)
        self.expert_grad_buffer = self._make_buckets(experts, experts_group, bucket_numel, True) if experts else None
        self.main_grad = {p: b.view(b.grad_data, i) for b in self.buckets if b.grad_data is not None
                          for i, p in enumerate(b.params)}
        self._bucket_of = {p: b for b in self.buckets for p in b.params}

        self._synced = False                # finish_grad_sync done: the next forward starts a step
        self.recorder = TimelineRecorder(overlap)   # the times of the timeline (timeline.py)
        self.timeline: BucketTimeline | None = None
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _make_buckets(self, params: list[nn.Parameter], group, bucket_numel: int, experts: bool = False
                      ) -> torch.Tensor:
        """One flat gradient buffer for `params`, cut into buckets reduced over `group`, appended
        to self.buckets; returns the buffer."""
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=self.grad_dtype, device=params[0].device)
        order = params[::-1]                                # backward produces these first
        groups = assign_buckets([p.numel() for p in order], bucket_numel)
        if [i for g in groups for i in g] != list(range(len(order))) or not all(groups):
            raise ValueError(f"assign_buckets returned {groups}: expected non-empty lists of "
                             f"consecutive indices covering 0..{len(order) - 1} in order")
        offset = 0
        for group_indices in groups:
            members = [order[i] for i in group_indices]
            numel = sum(p.numel() for p in members)
            self.buckets.append(make_bucket(len(self.buckets), members, group, experts=experts,
                                            grad_data=buffer[offset:offset + numel]))
            offset += numel
        return buffer

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args, **kwargs):
        if self._synced and torch.is_grad_enabled():
            self.zero_grad_buffer()         # the first forward of a new step
        out = self.module(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # the output's gradient is the first thing backward computes: time 0 of the timeline
            out.register_hook(lambda grad: self.recorder.backward_started())
        return out

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move param.grad into the buffer; launch a full bucket."""
        bucket, view = self._bucket_of[param], self.main_grad[param]
        if bucket.work is not None:
            raise RuntimeError(f"a gradient arrived for bucket {bucket.index} while its all-reduce "
                               "is in flight: run the earlier micro-batches inside no_sync() and "
                               "call finish_grad_sync() after the last one")
        if param.grad.data_ptr() == view.data_ptr():
            raise RuntimeError("param.grad is still the synced buffer view of the last step: "
                               "start a step with a forward through the wrapper, or call "
                               "zero_grad_buffer()")
        view.add_(param.grad)               # accumulate over micro-batches, in the buffer
        param.grad = None                   # the buffer holds it now; free autograd's copy
        self.recorder.grad_arrived()
        if not self.syncing:
            return                          # no_sync: accumulate, never launch
        bucket.ready.add(id(param))
        if self.overlap and len(bucket.ready) == len(bucket.params):
            self._start_grad_sync(bucket)

    def _start_grad_sync(self, bucket: Bucket) -> None:
        """Scale the bucket by 1/dp and launch its asynchronous all-reduce (sum) over its group."""
        bucket.grad_data.mul_(1.0 / self.dp_size)
        tag = "expert-grads" if bucket.experts else "grads"
        bucket.work = comm.all_reduce(bucket.grad_data, bucket.group, op="sum", tag=tag, async_op=True)
        self.recorder.launched(bucket.index, bucket.work, bucket.grad_data)

    # ------------------------------------------------------------------ the interface
    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (bucket order), wait for all, and point every p.grad at
        its buffer view (when the dtypes agree): the DP-averaged gradient."""
        self.check_can_sync()
        self._sync_buckets(self.buckets)
        self._synced = True

    def _sync_buckets(self, buckets: list[Bucket]) -> None:
        """Launch the buckets not launched yet (in order), wait for each, time it into self.timeline,
        and point p.grad at its view."""
        self.recorder.sync_started()
        for bucket in buckets:
            if bucket.work is None:         # overlap=False, or a bucket that never completed
                self._start_grad_sync(bucket)
        for bucket in buckets:
            with self.recorder.waiting(bucket.index):
                bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()
        self.timeline = self.recorder.finish()
        self._point_grads()

    def _point_grads(self) -> None:
        """Every p.grad becomes its view of the buffer, where the dtypes agree (else read grad_of)."""
        for p, view in self.main_grad.items():
            if view.dtype == p.dtype:
                p.grad = view

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """The gradient of `param` as this wrapper holds it: its view of the buffer."""
        return self.main_grad[param]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The module's parameters; the gradients: the buckets' buffers."""
        return {"params": list(self.module.parameters()),
                "grads": [b.grad_data for b in self.buckets if b.grad_data is not None]}

    def optimizer_segments(self) -> list[Segment]:
        return [parameter_segment(p, lambda p=p: self.main_grad[p]) for p in self.module.parameters()
                if p in self.main_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_buffer()

    def zero_grad_buffer(self) -> None:
        """Start a new step: zero the buffer, drop every p.grad (Megatron's zero_grad_buffer)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                raise RuntimeError(f"zero_grad_buffer() while bucket {bucket.index}'s all-reduce "
                                   "is in flight: call finish_grad_sync() first")
            bucket.ready.clear()
        self.grad_buffer.zero_()
        if self.expert_grad_buffer is not None:
            self.expert_grad_buffer.zero_()
        for p in self.main_grad:
            p.grad = None
        self._synced = False
