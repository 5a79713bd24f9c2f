"""Chapter 01: data parallelism, from the naive all-reduce to ZeRO-3.

Read in this order; each file is one idea, each checked against the one before it:

  naive.py     average every gradient with one all-reduce per parameter (and the hook
               variant that does it during backward)
  buffer.py    the flat buffer they all keep gradients (and ZeRO parameters) in: buckets,
               padding, this rank's shard, a gradient dtype of its own
  ddp.py       Megatron/PyTorch DDP: gradients in flat buckets, each bucket's all-reduce
               launched during backward as soon as it is complete (timeline.py draws it)
  zero.py      ZeRO-1 and ZeRO-2: DDP with sharded buckets: optimizer state (and gradients)
               sharded over the group; reduce-scatter, AdamW on the shard, all-gather
               (Megatron's distributed optimizer)
  fsdp.py      ZeRO-3: parameters sharded too, gathered around each layer's forward and backward

Every wrapper has the same interface, which is all the training loop uses:

    wrapper(tokens, labels=labels)              the model's forward
    with wrapper.no_sync(): loss.backward()     accumulate a micro-batch, no communication
    loss.backward(); wrapper.finish_grad_sync() the last micro-batch: gradients reduced
    optimizer.step(); optimizer.zero_grad()     optim.Optimizer over the wrapper (a GradientSource:
                                                its segments, zero_grad, after_optimizer_step)

`apply_data_parallel` picks the variant from a TrainConfig (zero_stage, ddp_impl,
ddp_bucket_size).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..config import TrainConfig
from .buffer import Bucket, make_bucket, shard_range
from .ddp import DistributedDataParallel, assign_buckets, reduction_groups
from .naive import (DataParallel, HookedDataParallel, NaiveDataParallel, allreduce_gradients, broadcast_parameters,
                    finish_grad_sync, grad_of, local_tensors, no_sync, unwrap)
from .timeline import BucketTimeline
from .fsdp import FullyShardedDataParallel
from .zero import ZeroDataParallel, measure_memory, reduce_scatter_gradients, storage_bytes


def apply_data_parallel(model: nn.Module, cfg: TrainConfig, group, expert_group=None) -> nn.Module:
    """Wrap `model` for data parallelism over `group`, as `cfg` asks; the model itself when
    there is nothing to average or to shard (the group, and expert_group if given, of one rank):

    zero_stage 0: `ddp_impl` "naive" (NaiveDataParallel) or "bucketed"
                  (DistributedDataParallel, buckets of `ddp_bucket_size` elements);
    zero_stage 1, 2: ZeroDataParallel (its shards are what the optimizer steps; overlap_grad_reduce
                     and overlap_param_gather time its reduce-scatters and all-gathers);
    zero_stage 3: FullyShardedDataParallel (the same).

    A mixture of experts (chapter 05) passes expert_group, the expert-data-parallel group: its
    experts (marked allreduce=False) are reduced there, in buckets of their own; the bucketed DDP
    and ZeRO-1 do that here (parallelize.validate_layout refuses the others with experts).

    Mixed precision (chapter 06): the buffers hold the gradients in cfg.main_grads_dtype
    (float32 beside bf16 parameters: Megatron's main_grad), and the model is wrapped even
    without data parallelism, as Megatron wraps every model in its DDP: the micro-batches'
    16-bit gradients are summed in that buffer, not in a 16-bit .grad.
    """
    grad_dtype = cfg.main_grads_dtype
    if (comm.group_size(group) == 1 and (expert_group is None or comm.group_size(expert_group) == 1)
            and grad_dtype is None):
        return model
    if cfg.zero_stage == 3:
        return FullyShardedDataParallel(model, group, grad_dtype=grad_dtype)
    if cfg.zero_stage in (1, 2):
        return ZeroDataParallel(model, group, stage=cfg.zero_stage, bucket_size=cfg.ddp_bucket_size,
                                expert_group=expert_group, grad_dtype=grad_dtype,
                                overlap_grad_reduce=cfg.overlap_grad_reduce,
                                overlap_param_gather=cfg.overlap_param_gather)
    if cfg.ddp_impl == "naive":
        return NaiveDataParallel(model, group)
    element_size = torch.empty((), dtype=grad_dtype or next(model.parameters()).dtype).element_size()
    bucket_bytes = None if cfg.ddp_bucket_size is None else cfg.ddp_bucket_size * element_size
    return DistributedDataParallel(model, group, bucket_size_bytes=bucket_bytes, expert_group=expert_group,
                                   grad_dtype=grad_dtype)


__all__ = ["DataParallel", "no_sync", "finish_grad_sync", "grad_of", "local_tensors", "unwrap", "NaiveDataParallel",
           "HookedDataParallel", "DistributedDataParallel", "ZeroDataParallel", "broadcast_parameters",
           "allreduce_gradients", "assign_buckets", "reduction_groups", "Bucket", "make_bucket", "shard_range",
           "apply_data_parallel", "measure_memory", "BucketTimeline", "FullyShardedDataParallel",
           "reduce_scatter_gradients", "storage_bytes"]
