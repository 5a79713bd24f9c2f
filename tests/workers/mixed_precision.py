"""Rank functions for tests/test_mixed_precision.py: the seams chapter 06 plugs into.

A bfloat16 model whose data-parallel buffer holds float32 gradients (Megatron's
--accumulate-allreduce-grads-in-fp32): the wrapper adds each micro-batch's bf16 .grad into the
float32 view and reduces in float32; the optimizer steps float32 main parameters that read
those float32 gradients in place and copies the result back into the bf16 model.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from minimegatron import comm
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dp import DistributedDataParallel, ZeroDataParallel
from minimegatron.model import GPTModel
from minimegatron.optim import NormGroup, Optimizer

SEQ, MICRO_BATCHES = 16, 2


def bf16_config() -> ModelConfig:
    return ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=SEQ,
                             params_dtype="bfloat16")


def microbatch(rank: int, m: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + m)
    x = torch.randint(0, 257, (2, SEQ + 1), generator=g)
    return {"tokens": x[:, :-1], "labels": x[:, 1:]}


def local_bf16_grads(rank: int) -> dict[str, list[torch.Tensor]]:
    """Each micro-batch's gradient of this rank's loss share, as the bf16 model computes it."""
    model = GPTModel(bf16_config())
    out: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for m in range(MICRO_BATCHES):
        mb = microbatch(rank, m)
        (model(mb["tokens"], labels=mb["labels"]).mean() / MICRO_BATCHES).backward()
        for n, p in model.named_parameters():
            out[n].append(p.grad.clone())
            p.grad = None
    return out


def buffer_run(kind: str, grad_dtype: torch.dtype) -> dict:
    """Two micro-batches (the first inside no_sync) through `kind` ("ddp" or "zero1") of the bf16
    model with gradients held in `grad_dtype`; returns the reduced gradients (the wrapper's view:
    DDP the whole tensor, ZeRO-1 this rank's shard as full-size tensors with the rest zero),
    the dtypes and the gradient ledger, and one optimizer step's outcome."""
    group = dist.group.WORLD
    model = GPTModel(bf16_config())
    if kind == "ddp":
        wrapper = DistributedDataParallel(model, group, grad_dtype=grad_dtype)
    else:
        wrapper = ZeroDataParallel(model, group, stage=1, grad_dtype=grad_dtype)
    with comm.record_communication() as ledger:
        for m in range(MICRO_BATCHES):
            mb = microbatch(dist.get_rank(), m)
            with wrapper.no_sync() if m < MICRO_BATCHES - 1 else nullcontext():
                (wrapper(mb["tokens"], labels=mb["labels"]).mean() / MICRO_BATCHES).backward()
        wrapper.finish_grad_sync()
    names = {p: n for n, p in model.named_parameters()}
    out = {"grads": {names[p]: wrapper.grad_of(p).detach().to(torch.float64) for p in names},
           "grad_dtypes": sorted({str(wrapper.grad_of(p).dtype) for p in names}),
           "param_grads_none": all(p.grad is None for p in names),
           "ledger": [(r.op, str(r.dtype), r.tag) for r in ledger]}
    if kind == "zero1":                     # only this rank's shard of each bucket is reduced
        out["owned"] = {}
        for b in wrapper.buckets:
            for i, r in enumerate(b.records):
                mask = torch.zeros(b.padded_numel, dtype=torch.bool)
                mask[b.start:b.end] = True
                out["owned"][r.name] = b.view(mask, i).clone()

    # one optimizer step over float32 main parameters: they read the float32 buffer in place
    optimizer = Optimizer([wrapper], TrainConfig(lr=1e-2, clip_grad=0.0),
                          [NormGroup(groups=(group,) if kind == "zero1" else ())], main_params_dtype=torch.float32)
    optimizer._main_grads_in()
    out["main_dtypes"] = sorted({str(m.dtype) for m in optimizer.main_params})
    out["grads_in_place"] = all(m.grad.data_ptr() == s.grad().data_ptr()
                                for m, s in zip(optimizer.main_params, optimizer.segments))
    optimizer.step()
    out["copied_back"] = all(torch.equal(s.param, m.to(s.param.dtype))
                             for m, s in zip(optimizer.main_params, optimizer.segments))
    out["params_dtype"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


class FixedLossScale:
    """A loss scaler for the optimizer's slot: a constant scale; it records what it was told."""

    def __init__(self, scale: float):
        self.scale, self.updates = scale, []

    def update(self, found_inf: bool) -> None:
        self.updates.append(found_inf)


def found_inf_run() -> dict:
    """Every rank holds "a part of the model" (its own copy, float64; the norm and the found-inf
    check summed over the world, as over a TP group), the loss scaled by 1024. Step 0 is clean;
    in step 1 only the last rank's gradient holds an inf. Returns, per rank, the parameters after
    each step, the scaler's updates, the returned norms, AdamW's step counts and the ledger's
    found-inf calls."""
    from minimegatron.parallel_state import Layout
    from minimegatron.train import before_optimizer_step, train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPTModel(ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4,
                                       max_position_embeddings=SEQ, params_dtype="float64"))
    scaler = FixedLossScale(1024.0)
    optimizer = Optimizer([model], TrainConfig(lr=1e-2, clip_grad=1.0), [NormGroup(groups=(dist.group.WORLD,))],
                          grad_scaler=scaler)
    params, norms, found = [], [], []
    for step in range(2):
        def on_grads(poison=step == 1 and rank == world - 1):
            if poison:
                next(model.parameters()).grad.view(-1)[0] = float("inf")

        with comm.record_communication() as ledger, before_optimizer_step(optimizer, on_grads):
            _, norm = train_step([model], optimizer, [microbatch(0, step)], Layout(), 1e-2)
        found += [r.op for r in ledger if r.tag == "found-inf"]
        norms.append(norm)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"params": params, "updates": scaler.updates, "norms": norms, "found_inf_calls": found,
            "adam_steps": sorted({int(s["step"]) for s in optimizer.state.values()})}
