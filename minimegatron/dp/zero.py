"""ZeRO-1 and ZeRO-2: the optimizer state (and the reduced gradients) sharded over the dp group.

ddp.py's bucketed wrapper with sharded buckets (buffer.py). Parameters are packed in reverse
order into flat buckets, one per weight-decay group or cut by ddp.assign_buckets (a tied
embedding split between pipeline stages alone, so both stages shard it alike); a bucket of n
elements is padded to dp * S, S = ceil(n / dp), and rank r owns [r S, (r+1) S) (`shard_range`):

    bucket.param_data  [dp*S]  p0 | p1 | p2 ......... | pad     the model's parameters are views
    bucket.grad_data   [dp*S]  same layout (stage 1 only)        each .grad is added into its view
                               rank 0 | rank 1 | ... | rank dp-1  (S elements each)

A step, per bucket: backward accumulates every rank's local gradient of the whole bucket; a
reduce-scatter (avg) leaves rank r the average of its S elements in main_grad [S]; the clip
all-reduces the squared norm; AdamW (optim.Optimizer over `optimizer_segments`) steps this
rank's [r S, r S + real) elements; an all-gather brings every rank's shard into param_data.

Stage 1 keeps grad_data for the whole step and reduce-scatters it in place in finish_grad_sync
(`reduce_scatter_gradients`). Stage 2 keeps no grad_data: when a bucket's last .grad is
accumulated it is packed into a temporary buffer, reduce-scattered into main_grad, and the
.grads are freed (peak: `grad_bytes_peak`).

Collectives per optimizer step (e bytes per element, one call per bucket):

    reduce_scatter   sum_b dp * S_b * e       the padded flat gradients     tag "grads"
    all_reduce       1 * e                    the squared gradient norm     tag "grad-norm"
    all_gather       sum_b S_b * e            this rank's padded shards     tag "params"

Memory per rank (`measure_memory`; analysis.memory.training_memory is the formula):

    params           sum_b dp * S_b * e                  (formula: N e; the difference is padding)
    grads            stage 1: sum_b dp * S_b * e;  stage 2: sum_b S_b * e     (N e; ceil(N/dp) e)
    optimizer state  2 * real_r * e, real_r = this rank's unpadded elements   (2 ceil(N/dp) e)

Megatron: megatron/core/distributed/param_and_grad_buffer.py + optimizer/distrib_optimizer.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import all_gather_into_tensor, group_rank, group_size, reduce_scatter_tensor
from ..optim import Segment, is_expert_parameter
from ..placement import Placement, placement_of
from .buffer import Bucket, make_bucket, shard_range
from .ddp import DistributedDataParallel, assign_buckets


def reduce_scatter_gradients(buckets: list[Bucket], group) -> None:
    """ZeRO-1's gradient sync (what ZeroDataParallel.finish_grad_sync runs at stage 1): from
    every rank's local gradients to this rank's shard of their average, bucket by bucket.

    For each bucket b of `buckets`, in list order (see `buffer.Bucket`; S = b.shard_numel, dp =
    the size of `group`, this rank owns the elements [b.start, b.end) of the bucket):
      before: b.grad_data [dp*S] holds this rank's local gradient of the whole bucket,
              accumulated by backward (the padding is 0);
      after:  b.main_grad [S] holds the average over the ranks of `group` of their
              b.grad_data[b.start:b.end]: the gradient shard the optimizer clips and steps
              with. main_grad IS the view b.grad_data[b.start:b.end], so the result lands in
              place, in the bucket's own buffer (as Megatron's distributed optimizer does);
              the rest of grad_data is not read again before zero_grad.
    Collectives: exactly one comm.reduce_scatter_tensor per bucket, over `group`, op "avg",
    tag "grads", in bucket order (every rank issues the same calls in the same order).
    Ledger: len(buckets) reduce_scatter records of dp*S*e bytes each (e bytes per element).
    An all-reduce of grad_data would leave the same numbers in main_grad, but it moves twice
    the bytes of a reduce-scatter (all-reduce = reduce-scatter + all-gather) to give every
    rank the parts of the average that only other ranks step with.
    """
    # BEGIN EXERCISE 1.3: ZeRO-1's gradient reduce-scatter | hint: which collective leaves each rank only its own slice of the average, and which of the bucket's tensors already is that slice, so that the result lands in place? (Megatron: _ParamAndGradBucketGroup.start_grad_sync)
    for b in buckets:
        # in place: the output is this rank's own slice of the input (as Megatron does)
        reduce_scatter_tensor(b.main_grad, b.grad_data, group, op="avg", tag="grads")
    # END EXERCISE


def build_buckets(params: list[nn.Parameter], dp: int, rank: int, bucket_size: int | None = None, *, group=None,
                  grad_dtype: torch.dtype | None = None, hold_grads: bool = True, experts: bool = False,
                  first_index: int = 0) -> list[Bucket]:
    """ZeRO's buckets of `params` (model order) for `rank` of `dp`, reduced over `group`: reversed, a
    pipeline-split tied embedding alone, the others per weight-decay group cut by assign_buckets
    (bucket_size elements; None: one per group), each padded to dp * S. The parameters become views
    of param_data; with hold_grads (stage 1) a zeroed grad_data in grad_dtype."""
    order = params[::-1]
    runs = [[p] for p in order if placement_of(p).shared_embedding]               # sharded alike on both stages
    for decay in (True, False):
        members = [p for p in order if (p.dim() >= 2) == decay and not placement_of(p).shared_embedding]
        runs += [[members[i] for i in indices] for indices in assign_buckets([p.numel() for p in members], bucket_size)]
    return [make_bucket(first_index + i, run, group, dp, rank, grad_dtype=grad_dtype, hold_params=True,
                        hold_grads=hold_grads, experts=experts, decay=run[0].dim() >= 2) for i, run in enumerate(runs)]


class ZeroDataParallel(DistributedDataParallel):
    """Data parallelism with ZeRO stage 1 (optimizer state sharded) or 2 (and gradients).

    `module` is replicated over `group`; an `optim.Optimizer([wrapper], ...)` steps this rank's
    shards (`optimizer_segments`) and calls `after_optimizer_step` (the all-gather). bucket_size:
    elements per bucket (None: one per weight-decay group). grad_dtype, expert_group as DDP's
    (experts: stage 1 only). overlap_grad_reduce: reduce-scatters launched async from backward,
    waited in finish_grad_sync. overlap_param_gather (needs overlap_grad_reduce): all-gathers
    launched async after the step, each module's forward pre-hook waits for its buckets
    (finish_param_sync waits for all). Same collectives, bytes and order either way."""

    def __init__(self, module: nn.Module, group, stage: int = 1, bucket_size: int | None = None,
                 expert_group=None, grad_dtype: torch.dtype | None = None, overlap_grad_reduce: bool = False,
                 overlap_param_gather: bool = False):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel: stage={stage} must be 1 or 2 (stage 3: FullyShardedDataParallel)")
        has_experts = any(is_expert_parameter(p) for p in module.parameters())
        if has_experts and (expert_group is None or stage != 1):
            raise ValueError("ZeroDataParallel with experts (parameters marked allreduce=False): stage 1 only, "
                             "with the expert-data-parallel group as expert_group")
        if overlap_param_gather and not overlap_grad_reduce:
            raise ValueError("ZeroDataParallel: overlap_param_gather needs overlap_grad_reduce (Megatron's rule)")
        self.stage, self.bucket_size = stage, bucket_size     # (read by _make_buckets while DDP builds)
        super().__init__(module, group, overlap=overlap_grad_reduce,
                         expert_group=expert_group if has_experts else None, grad_dtype=grad_dtype)
        # a mixture's experts (chapter 05): buckets of their own, sharded over expert_group
        self.expert_dp = group_size(expert_group) if has_experts else 1
        self.expert_buckets = [b for b in self.buckets if b.experts]
        self.buckets = [b for b in self.buckets if not b.experts]
        self._reduced: set[int] = set()  # stage 2: buckets reduced since the last finish_grad_sync
        self._in_flight: dict[int, tuple] = {}   # stage 2 with overlap: index -> (bucket, work, its slice)
        self.grad_bytes_peak = 0         # stage 2: most full-gradient bytes held during backward
        self.overlap_param_gather = overlap_param_gather
        self._gathers: dict[int, object] = {}    # bucket index -> its parameter all-gather in flight
        if overlap_param_gather:
            for module_ in self.module.modules():
                mine = {id(p) for p in module_.parameters(recurse=False)}
                held = [b for b in self.buckets + self.expert_buckets if mine & {id(p) for p in b.params}]
                if held:                          # the buckets holding this module's own parameters
                    module_.register_forward_pre_hook(lambda _m, _args, held=held: self._wait_for_params(held))

    def _make_buckets(self, params, group, bucket_numel, experts=False) -> None:
        """build_buckets over `group`, appended to self.buckets (DDP's constructor calls it)."""
        self.buckets += build_buckets(params, group_size(group), group_rank(group), self.bucket_size, group=group,
                                      grad_dtype=self.grad_dtype, hold_grads=self.stage == 1, experts=experts,
                                      first_index=len(self.buckets))

    # ---- stage 2: reduce a bucket as soon as its last gradient is accumulated ------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if self.stage == 1:
            return super()._grad_ready(param)       # into grad_data, as DDP (launched at the sync)
        self.grad_bytes_peak = max(self.grad_bytes_peak, self._full_grad_bytes())
        if not self.syncing:
            return                                  # no_sync: .grad accumulates, full size
        bucket = self._bucket_of[param]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._reduce_bucket(bucket)

    def _full_grad_bytes(self) -> int:
        return sum(p.grad.nbytes for b in self.buckets for p in b.params if p.grad is not None)

    def _reduce_bucket(self, b: Bucket) -> None:
        """Stage 2: pack the bucket's .grad into a temporary flat buffer, free them, and
        reduce-scatter (avg) the buffer; this rank's slice is added to main_grad (with
        overlap_grad_reduce: launched here, added in finish_grad_sync)."""
        flat = b.main_grad.new_zeros(b.padded_numel)
        for i, p in enumerate(b.params):
            if p.grad is not None:
                b.view(flat, i).copy_(p.grad)
                p.grad = None                              # the full gradient is gone
        self.grad_bytes_peak = max(self.grad_bytes_peak, self._full_grad_bytes() + flat.nbytes)
        mine = flat[b.start:b.end]
        work = reduce_scatter_tensor(mine, flat, self.group, op="avg", tag="grads", async_op=self.overlap)
        if self.overlap:
            self._in_flight[b.index] = (b, work, mine)     # flat stays alive until the wait
        else:
            b.main_grad.add_(mine)                         # add: a step may sync more than once
        self._reduced.add(b.index)
        b.ready.clear()

    # ---- stage 1 with overlap_grad_reduce: launched from the backward (DDP's hook) -------
    def _start_grad_sync(self, bucket: Bucket) -> None:
        """Launch the bucket's reduce-scatter (avg) asynchronously, in place into main_grad (the
        experts' scaled first: finish_grad_sync's rule)."""
        if bucket.experts:
            bucket.grad_data.mul_(self.expert_dp / self.dp_size)
        bucket.work = reduce_scatter_tensor(bucket.main_grad, bucket.grad_data, bucket.group, op="avg",
                                            tag="grads", async_op=True)
        self.recorder.launched(bucket.index, bucket.work, bucket.grad_data)

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: every bucket's main_grad holds this rank's
        shard of the gradient averaged over the group (stage 1: one in-place reduce-scatter
        per bucket now; stage 2: the buckets the backward did not complete are reduced now)."""
        self.check_can_sync()
        if self.stage == 1 and self.overlap:
            self._sync_buckets(self.buckets + self.expert_buckets)      # DDP's, with _start_grad_sync's scatter
        elif self.stage == 1:
            reduce_scatter_gradients(self.buckets, self.group)     # exercise 1.3
            # experts: the SUM over expert_group divided by the dense dp (ddp.py's rule), as an
            # average over expert_group of the gradients scaled by expert_dp / dp (Megatron's
            # expert scaling with average_in_collective)
            for b in self.expert_buckets:
                b.grad_data.mul_(self.expert_dp / self.dp_size)
            reduce_scatter_gradients(self.expert_buckets, self.expert_group)
            self._point_grads()                    # (only its shard's elements are reduced)
        else:
            for b in self.buckets:
                if b.index not in self._reduced:
                    self._reduce_bucket(b)
            for b, work, mine in self._in_flight.values():
                work.wait()
                b.main_grad.add_(mine)
            self._in_flight.clear()
        self._reduced.clear()
        self._synced = True

    def grad_of(self, param: nn.Parameter) -> torch.Tensor:
        """Stage 1: its view of grad_data (reduced in this rank's shard only). Stage 2: the
        reduced shard of its bucket, for a parameter alone in one (the tied embedding)."""
        if self.stage == 1:
            return super().grad_of(param)
        bucket = self._bucket_of[param]
        if len(bucket.params) != 1:
            raise RuntimeError(f"ZeRO-2 keeps only this rank's shard of bucket {bucket.index}'s reduced gradient, "
                               f"not {placement_of(param).name}'s")
        return bucket.main_grad

    # ---- what the optimizer asks of a wrapper ---------------------------------------------
    def optimizer_segments(self) -> list[Segment]:
        """One segment per bucket: this rank's shard of the parameters and of the reduced
        gradient (padding excluded)."""
        return [Segment(b.param_data[b.start:b.start + b.real], lambda b=b: b.main_grad[:b.real], b.decay,
                        b.shard_owners(), b.shard_locations()) for b in self.buckets + self.expert_buckets if b.real > 0]

    def _bucket_groups(self):
        return [(self.buckets, self.group), (self.expert_buckets, self.expert_group)]

    def after_optimizer_step(self) -> None:
        """All-gather every bucket's updated shard: all ranks hold the full parameters again.
        With overlap_param_gather: launched asynchronously, the last bucket first (it holds the
        first layers the next forward runs), waited by the forward pre-hooks."""
        for buckets, group in self._bucket_groups():
            for b in (buckets[::-1] if self.overlap_param_gather else buckets):
                work = all_gather_into_tensor(b.param_data, b.param_data[b.start:b.end], group, tag="params",
                                              async_op=self.overlap_param_gather)
                if self.overlap_param_gather:
                    self._gathers[b.index] = work

    def _wait_for_params(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            work = self._gathers.pop(b.index, None)
            if work is not None:
                work.wait()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight (overlap_param_gather): the
        parameters are whole again."""
        self._wait_for_params(self.buckets + self.expert_buckets)

    def zero_grad_buffer(self) -> None:
        for b in self.buckets + self.expert_buckets:
            (b.grad_data if b.grad_data is not None else b.main_grad).zero_()
            b.ready.clear()
            for p in b.params:
                p.grad = None
        self.grad_bytes_peak = 0
        self._synced = False

    # ---- inspection (tests, demos): collective, tag "inspect" ----------------------------
    def local_tensors(self, grads: bool = False) -> dict[str, tuple[Placement, torch.Tensor]]:
        """As DataParallel's; the gradients gathered from every rank's reduced shard (one
        all-gather per bucket, tag "inspect")."""
        self.finish_param_sync()
        if not grads:
            return super().local_tensors()
        out = {}
        for buckets, group in self._bucket_groups():
            for b in buckets:
                out.update(b.gathered(b.main_grad, group))
        return out

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors that hold this rank's parameters and gradients (for measure_memory)."""
        buckets = self.buckets + self.expert_buckets
        grads = [b.grad_data if b.grad_data is not None else b.main_grad for b in buckets]
        grads += [p.grad for b in buckets for p in b.params if p.grad is not None and p.grad.dtype != b.main_grad.dtype]
        return {"params": [b.param_data for b in buckets], "grads": grads}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure_memory(wrapper: nn.Module, optimizer) -> dict:
    """Bytes this rank holds, measured on the real tensors (storage sizes):
    {"params", "grads", "exp_avg", "exp_avg_sq", "optimizer" (= exp_avg + exp_avg_sq),
     "step_counters" (AdamW's scalar step tensors, outside the ZeRO paper's accounting)}."""
    held = wrapper.memory_tensors()
    state = [optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state]
    out = {"params": storage_bytes(held["params"]), "grads": storage_bytes(held["grads"]),
           "exp_avg": storage_bytes(s["exp_avg"] for s in state),
           "exp_avg_sq": storage_bytes(s["exp_avg_sq"] for s in state),
           "step_counters": sum(s["step"].nbytes for s in state)}
    out["optimizer"] = out["exp_avg"] + out["exp_avg_sq"]
    return out


__all__ = ["shard_range", "Bucket", "build_buckets", "reduce_scatter_gradients", "ZeroDataParallel", "storage_bytes",
           "measure_memory"]
