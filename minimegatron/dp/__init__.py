"""Chapter 01: data parallelism, from the naive all-reduce to ZeRO-3.

Read in this order; each file is one idea, each checked against the one before it:

  naive.py     average every gradient with one all-reduce per parameter (and the hook
               variant that does it during backward)
  ddp.py       Megatron/PyTorch DDP: gradients in flat buckets, each bucket's all-reduce
               launched during backward as soon as it is complete (timeline.py draws it)
  zero.py      ZeRO-1 and ZeRO-2: optimizer state (and gradients) sharded over the group;
               reduce-scatter, AdamW on the shard, all-gather (Megatron's distributed optimizer)
  fsdp.py      ZeRO-3: parameters sharded too, gathered around each layer's forward and backward

Every wrapper has the same interface, which is all the training loop uses:

    wrapper(tokens, labels=labels)              the model's forward
    with wrapper.no_sync(): loss.backward()     accumulate a micro-batch, no communication
    loss.backward(); wrapper.finish_grad_sync() the last micro-batch: gradients reduced
    optimizer.clip_grad_norm(max_norm)          the global norm (clipped in place)
    optimizer.step(); optimizer.zero_grad()

`build_data_parallel` picks the variant from a TrainConfig (zero_stage, ddp_impl,
ddp_bucket_size).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig
from .ddp import DistributedDataParallel, assign_buckets
from .naive import HookedDataParallel, NaiveDataParallel, allreduce_gradients, broadcast_parameters
from .timeline import BucketTimeline, plot_bucket_timeline
from .fsdp import FullyShardedDataParallel, plot_memory_profile
from .zero import DistributedOptimizer, ZeroDataParallel, build_zero, measure_memory, shard_range, zero1_step


class ReplicatedOptimizer:
    """torch AdamW for wrappers that keep full, identical gradients on every rank
    (naive DP and DDP): the local gradient norm already is the global one. With
    `tensor_parallel` (the TensorParallelGPTModel inside the wrapper), the norm sums over its
    TP group instead, counting the replicated parameters once."""

    def __init__(self, inner: torch.optim.Optimizer, wrapper: nn.Module, tensor_parallel=None):
        self.inner, self.wrapper, self.tensor_parallel = inner, wrapper, tensor_parallel

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.tensor_parallel is not None:
            from ..tp.model import clip_tensor_parallel_grad_norm
            return float(clip_tensor_parallel_grad_norm(self.tensor_parallel, max_norm))
        params = [p for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def build_data_parallel(model: nn.Module, cfg: TrainConfig, group,
                        tensor_parallel=None) -> tuple[nn.Module, object]:
    """(wrapper, optimizer) for `model` over the data-parallel `group`, as `cfg` asks:

    zero_stage 0: `ddp_impl` "naive" (NaiveDataParallel) or "bucketed"
                  (DistributedDataParallel, buckets of `ddp_bucket_size` elements), with
                  AdamW on the full replicated parameters;
    zero_stage 1, 2: ZeroDataParallel + DistributedOptimizer (sharded AdamW state; stage 2
                  also shards the gradients);
    zero_stage 3: FullyShardedDataParallel + DistributedOptimizer (parameters sharded too).
    `tensor_parallel`: pass `model` itself when it is a TensorParallelGPTModel (each DP rank is
    a TP group, chapter 02): the optimizer's gradient norm then also sums over the TP group.
    Stages 0, 1 and 2 only.
    """
    from ..train import build_optimizer

    if cfg.zero_stage == 0:
        if cfg.ddp_impl == "naive":
            wrapper = NaiveDataParallel(model, group)
        else:
            element_size = next(model.parameters()).element_size()
            bucket_bytes = None if cfg.ddp_bucket_size is None else cfg.ddp_bucket_size * element_size
            wrapper = DistributedDataParallel(model, group, bucket_size_bytes=bucket_bytes)
        return wrapper, ReplicatedOptimizer(build_optimizer(model, cfg), wrapper, tensor_parallel)
    return build_zero(model, group, cfg.zero_stage, cfg, bucket_size=cfg.ddp_bucket_size,
                      tensor_parallel=tensor_parallel)


__all__ = ["NaiveDataParallel", "HookedDataParallel", "DistributedDataParallel", "ZeroDataParallel",
           "DistributedOptimizer", "ReplicatedOptimizer", "broadcast_parameters", "allreduce_gradients",
           "assign_buckets", "shard_range", "build_zero", "build_data_parallel", "measure_memory",
           "BucketTimeline", "plot_bucket_timeline", "FullyShardedDataParallel", "plot_memory_profile",
           "zero1_step"]
