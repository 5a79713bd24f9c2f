"""Bucketed data parallelism with communication overlapped with backward (Megatron's DDP).

Naive DP (naive.py) waits for the whole backward, then sends P small all-reduces one after
the other. Two things are wasted: the network idles during backward, and each small message
pays the collective's fixed latency. Megatron-LM and PyTorch DDP fix both the same way:

1. **Buckets.** The gradients live in one flat, contiguous buffer (`grad_buffer`), cut into
   buckets of about `bucket_size` elements. A bucket is one all-reduce: few, large messages.
   Parameters are laid out in the reverse of model.parameters() order, the order in which
   backward produces their gradients (the output layer's first, the embedding's last), so
   that a bucket fills up in one stretch of backward. `assign_buckets` is the rule.
2. **Overlap.** Each parameter has a post-accumulate-grad hook. When autograd has finished a
   gradient, the hook adds it into the parameter's slice of the buffer (`main_grad[p]`, a
   view) and frees p.grad. When the last gradient of a bucket has arrived, the hook launches
   that bucket's all-reduce asynchronously (gloo runs it in its own thread) and backward goes
   on computing the gradients of earlier layers while the bucket travels.
3. **Sync.** `finish_grad_sync()` waits for every bucket and points each p.grad at its slice
   of the buffer, now holding the DP-averaged gradient (a view: no copy).

Why copy into the buffer from a hook instead of making p.grad a view of the buffer from the
start? Autograd decides what p.grad is: when p.grad is None it *installs* a fresh tensor, and
`optimizer.zero_grad(set_to_none=True)` drops whatever was there, so a view would silently
stop being one. Megatron makes the same choice (param.main_grad is the buffer view; a hook
adds param.grad into it). The price is one add per gradient; the gain is that accumulation
across micro-batches happens in the buffer, under our control.

Averaging: before a bucket is all-reduced (a sum), it is scaled by 1/dp (Megatron's
gradient_scaling_factor), so the sum is the mean.

Gradient accumulation: inside `no_sync()` the hooks still add every gradient into the
buffer, but launch nothing; the last micro-batch's backward (outside no_sync) accumulates its
gradients and launches each bucket as it completes. The buffer therefore holds the sum over
all M micro-batches when it is reduced.

A new step: the first forward (with grad enabled) after `finish_grad_sync()` zeroes the
buffer and sets every p.grad to None (`zero_grad_buffer()`, Megatron's name, which the
training loop may also call itself).

Communication per optimizer step (ledger, tag "grads"): one all-reduce per bucket, issued
in the order the buckets complete; together sum_p numel(p) * element_size bytes, the same
bytes as naive DP in fewer calls. None inside no_sync(). With overlap=False the same
all-reduces are issued, in bucket order, inside finish_grad_sync().

Timeline: each step's launches and completions are timed by a timeline.TimelineRecorder (the
algorithm calls it at five points and holds no clock) into `self.timeline`
(timeline.BucketTimeline); chapters/01_dp/make_figures.py draws it (plot_bucket_timeline).

The buffer (buffer.py) holds the gradients in `grad_dtype`: the parameters' dtype by default,
or float32 beside 16-bit parameters (Megatron's --accumulate-allreduce-grads-in-fp32): the
hook adds the 16-bit .grad into the float32 view, so the micro-batches are summed and reduced
in float32; p.grad then cannot be the view (torch wants a parameter's dtype there), so the
gradient is read through `grad_of(p)` (Megatron's param.main_grad), as the optimizer does.

Requirements: all parameters have one dtype (Megatron keeps one buffer per dtype pair), and
every parameter that requires grad receives a gradient in the last micro-batch's backward (a
bucket that never completes is launched by finish_grad_sync, which is correct only if every
rank agrees).

Where this lives in Megatron-LM: megatron/core/distributed/distributed_data_parallel.py
(the wrapper, the hooks, no_sync, finish_grad_sync) and
megatron/core/distributed/param_and_grad_buffer.py (the buffer, the bucket rule, the
scaled all-reduce of a bucket, start_grad_sync / finish_grad_sync). ZeRO-1/2 (zero.py) are
this wrapper with sharded buckets, as Megatron's DDP with use_distributed_optimizer.
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
from .naive import DataParallel, broadcast_parameters
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
    """Bucketed, overlapped data parallelism (see the module docstring).

    DistributedDataParallel(module, group, bucket_size_bytes=None, overlap=True)
      module:            this rank's full model (wrapper.module); its parameters keep their
                         storage, only their gradients move into the buffer.
      group:             the data-parallel process group.
      bucket_size_bytes: a bucket closes once it holds >= this many bytes of gradients
                         (ceil(bytes / element_size) elements, `assign_buckets`); None =
                         Megatron's default (megatron_default_bucket_size); 1 = one bucket
                         per parameter.
      overlap:           launch each bucket from backward as soon as it is complete (True),
                         or all of them in finish_grad_sync (False).
      expert_group:      the expert-data-parallel group, where the gradients of parameters
                         marked allreduce=False (a mixture's experts, chapter 05) are summed,
                         in a buffer and buckets of their own (expert_grad_buffer).
      grad_dtype:        the buffer's dtype (default: the parameters'; float32 beside 16-bit
                         parameters, see the module docstring).

    Attributes: buckets (list[buffer.Bucket], in buffer order), grad_buffer ([N] all
    gradients; each bucket's grad_data is a slice), main_grad (dict param -> its [shape] view
    of the buffer), timeline (BucketTimeline of the last finish_grad_sync, or None).

    Interface (shared by every DP wrapper): forward = module's forward; no_sync();
    finish_grad_sync() (afterwards the buffer holds the DP average; p.grad is its view when
    the dtypes agree); grad_of(p); zero_grad_buffer(); broadcast_params().
    """

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
        element_size = torch.empty((), dtype=self.grad_dtype).element_size()
        if bucket_size_bytes is None:
            bucket_numel = megatron_default_bucket_size(self.dp_size)
        elif bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes={bucket_size_bytes} must be positive (or None)")
        else:   # ">= bucket_size_bytes bytes" is ">= ceil(bytes / element_size) elements"
            bucket_numel = math.ceil(bucket_size_bytes / element_size)

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
        self.recorder.launched(bucket.index, bucket.work, bucket.grad_data.numel(),
                               bucket.grad_data.numel() * bucket.grad_data.element_size())

    # ------------------------------------------------------------------ the interface
    def finish_grad_sync(self) -> None:
        """Launch any bucket not launched yet (in bucket order), wait for all of them, and
        point every p.grad at its buffer view (when the dtypes agree), which now holds the
        DP-averaged gradient. (no_sync, from DataParallel: backward accumulates into the
        buffer, launches nothing.)"""
        self.check_can_sync()
        self.recorder.sync_started()
        for bucket in self.buckets:
            if bucket.work is None:         # overlap=False, or a bucket that never completed
                self._start_grad_sync(bucket)
        for bucket in self.buckets:
            with self.recorder.waiting(bucket.index):
                bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()
        for p, view in self.main_grad.items():
            if view.dtype == p.dtype:
                p.grad = view
        self._synced = True
        self.timeline = self.recorder.finish()

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """The gradient of `param` as this wrapper holds it: its view of the buffer."""
        return self.main_grad[param]

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

    def broadcast_params(self) -> None:
        """Copy the group's first rank's parameters to every rank (naive.broadcast_parameters)."""
        broadcast_parameters(self.module, self.group)
