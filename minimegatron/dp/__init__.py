"""Chapter 01: data parallelism, from the naive all-reduce to ZeRO-3. Read in this order:

  naive.py     one all-reduce per parameter (and the hook variant that runs it in backward)
  buffer.py    the flat buffer of gradients (and ZeRO's parameters): buckets, padding, shards
  ddp.py       gradients in flat buckets, each bucket all-reduced during backward (Megatron's DDP)
  zero.py      ZeRO-1/2: sharded buckets, reduce-scatter, AdamW on the shard, all-gather
  fsdp.py      ZeRO-3: parameters sharded too, gathered around each unit's forward and backward
  timeline.py  when each bucket's collective ran, relative to backward

Every wrapper has the interface the training loop uses:

    wrapper(tokens, labels=labels)              the model's forward
    with wrapper.no_sync(): loss.backward()     accumulate a micro-batch, no communication
    loss.backward(); wrapper.finish_grad_sync() the last micro-batch: gradients reduced
    optimizer.step(); optimizer.zero_grad()     optim.Optimizer over the wrapper (a GradientSource)
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
    """Wrap `model` for data parallelism over `group` as `cfg` asks (unwrapped when both groups have
    one rank and there is no cfg.main_grads_dtype): zero_stage 0, ddp_impl "naive"
    (NaiveDataParallel) or "bucketed" (DistributedDataParallel, ddp_bucket_size elements); 1, 2
    ZeroDataParallel; 3 FullyShardedDataParallel. expert_group: the expert-dp group where experts
    are reduced (bucketed DDP, ZeRO-1). cfg.main_grads_dtype: the buffers' gradient dtype (float32
    beside bf16, Megatron's main_grad; then wrapped even at dp 1, as Megatron always wraps)."""
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
    element_size = (grad_dtype or next(model.parameters()).dtype).itemsize
    bucket_bytes = None if cfg.ddp_bucket_size is None else cfg.ddp_bucket_size * element_size
    return DistributedDataParallel(model, group, bucket_size_bytes=bucket_bytes, expert_group=expert_group,
                                   grad_dtype=grad_dtype)


__all__ = ["DataParallel", "no_sync", "finish_grad_sync", "grad_of", "local_tensors", "unwrap", "NaiveDataParallel",
           "HookedDataParallel", "DistributedDataParallel", "ZeroDataParallel", "broadcast_parameters",
           "allreduce_gradients", "assign_buckets", "reduction_groups", "Bucket", "make_bucket", "shard_range",
           "apply_data_parallel", "measure_memory", "BucketTimeline", "FullyShardedDataParallel",
           "reduce_scatter_gradients", "storage_bytes"]
