"""Rank functions for the ZeRO tests and graders (spawn imports them by name).

Each worker trains on this rank's rows of the same global batches that the test gives
`testing.single_device_run`, and returns what the test compares: losses (this rank's
local share; the test averages over ranks), the first step's full gradients and the final
full parameters (rank 0 only), the ledger of every step, the measured memory.

The data split: with dp ranks, M micro-batches of b rows and a global batch of b*M*dp rows,
micro-batch m of rank r is the rows [(m*dp + r)*b, (m*dp + r + 1)*b); the single-device
run's micro-batch m (testing.split_microbatches) is the union over r of them.
"""

from __future__ import annotations

import contextlib
import copy
import time
import weakref

import torch
import torch.distributed as dist

from ..comm import record_communication
from ..config import ModelConfig, TrainConfig
from ..model import GPTModel
from ..testing import make_batches
from ..train import learning_rate
from .fsdp import FullyShardedDataParallel, gather_unit_parameters
from .zero import DistributedOptimizer, ZeroDataParallel, build_zero, measure_memory, zero1_step

SEQ = 16


def tiny_config(style: str, dtype: str = "float64") -> ModelConfig:
    """GPT-2 (tied, learned positions, biases) or LLaMA (untied, GQA, RoPE): hidden 32, 2 layers."""
    make = ModelConfig.gpt2 if style == "gpt2" else ModelConfig.llama
    return make(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=SEQ,
                params_dtype=dtype)


def train_config(steps: int, clip: float, adam_eps: float = 1e-8) -> TrainConfig:
    return TrainConfig(train_iters=steps, lr_warmup_iters=0, clip_grad=clip, adam_eps=adam_eps, progress=False)


def case_batches(case: dict, dp: int) -> list[dict[str, torch.Tensor]]:
    cfg = tiny_config(case["style"], case.get("dtype", "float64"))
    return make_batches(cfg, case["steps"], case["mbs"] * case["M"] * dp, SEQ, seed=case.get("seed", 0))


def local_microbatch(batch: dict, m: int, b: int, dp: int, rank: int) -> dict:
    lo = (m * dp + rank) * b
    return {k: v[lo:lo + b] for k, v in batch.items()}


def _forward_backward(wrapper, batch, case, dp, rank) -> float:
    """This rank's micro-batches; gradients sync on the last one only. Returns the local loss."""
    total, M = 0.0, case["M"]
    for m in range(M):
        mb = local_microbatch(batch, m, case["mbs"], dp, rank)
        with wrapper.no_sync() if m < M - 1 else contextlib.nullcontext():
            loss = wrapper(mb["tokens"], labels=mb["labels"]).mean() / M
            loss.backward()
        total += loss.item()
    return total


def _full_params(wrapper) -> dict[str, torch.Tensor]:
    if isinstance(wrapper, FullyShardedDataParallel):
        return wrapper.gather_parameters()
    return {n: p.detach().clone() for n, p in wrapper.module.named_parameters()}


def _padding_is_zero(wrapper) -> bool:
    if isinstance(wrapper, FullyShardedDataParallel):
        return all(bool((u.shard.detach()[max(0, u.numel - u.start):] == 0).all()) for u in wrapper.units.values())
    return all(bool((b.param_data[b.numel:] == 0).all()) for b in wrapper.buckets)


def _ledger_rows(ledger) -> list[tuple[str, int, str | None]]:
    return [(r.op, r.nbytes, r.tag) for r in ledger if r.tag != "inspect"]


def _train(case: dict, batches, start: int = 0, stop: int | None = None, state: dict | None = None):
    """Train steps [start, stop) of `case`; `state` resumes from a checkpoint of this rank."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    cfg = tiny_config(case["style"], case.get("dtype", "float64"))
    tcfg = train_config(case["steps"], case["clip"], case.get("adam_eps", 1e-8))
    model = GPTModel(cfg)
    wrapper, opt = build_zero(model, None, case["stage"], tcfg, bucket_size=case.get("bucket_size"))
    if state is not None:
        (wrapper if case["stage"] == 3 else model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    out = {"losses": [], "norms": [], "ledger": [], "grads": {}, "synced_grads_freed": True}
    for step in range(start, len(batches) if stop is None else stop):
        profile_ctx = (wrapper.memory_profile() if case["stage"] == 3 and step == start
                       else contextlib.nullcontext())
        with record_communication() as ledger, profile_ctx as events:
            loss = _forward_backward(wrapper, batches[step], case, dp, rank)
            wrapper.finish_grad_sync()
            if case["stage"] == 2:
                out["synced_grads_freed"] &= all(p.grad is None for p in model.parameters())
            if step == 0:
                out["grads"] = wrapper.gather_gradients()
            out["norms"].append(opt.clip_grad_norm(tcfg.clip_grad))
            opt.set_lr(learning_rate(step, tcfg))
            opt.step()
            out["grad_peak"] = getattr(wrapper, "grad_bytes_peak", None)
            opt.zero_grad()
        if events is not None:
            out["profile"] = [(e.label, e.sharded, e.gathered) for e in events]
        out["losses"].append(loss)
        out["ledger"].append(_ledger_rows(ledger))
    out["params"] = _full_params(wrapper)
    out["memory"] = measure_memory(wrapper, opt)
    out["padding_zero"] = _padding_is_zero(wrapper)
    out["state"] = {"model": copy.deepcopy((wrapper if case["stage"] == 3 else model).state_dict()),
                    "optimizer": opt.state_dict()}
    return out


def run_zero_cases(cases: list[dict]) -> list[dict]:
    """Every case of one DP world. Full tensors come back from rank 0 only (pickling is slow)."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for case in cases:
        batches = case_batches(case, dp)
        out = _train(case, batches)
        if case.get("resume_at"):
            first = _train(case, batches, stop=case["resume_at"])
            resumed = _train(case, batches, start=case["resume_at"], state=first["state"])
            out["resume_max_diff"] = max((resumed["params"][n] - out["params"][n]).abs().max().item()
                                         for n in out["params"])
            out["resume_losses"] = first["losses"] + resumed["losses"]
        out.pop("state")
        if rank != 0:
            out["grads"], out["params"] = {}, {}
        results.append(out)
    return results


# --------------------------------------------------------------------------------------
# graders
# --------------------------------------------------------------------------------------

def zero1_step_worker(style: str, steps: int) -> dict:
    """Train with `zero1_step` (exercise 1.3) instead of finish_grad_sync + step; M = 1, no clip."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    case = {"style": style, "steps": steps, "mbs": 1, "M": 1, "clip": 0.0}
    batches = case_batches(case, dp)
    tcfg = train_config(steps, 0.0)
    model = GPTModel(tiny_config(style))
    wrapper = ZeroDataParallel(model, None, stage=1)
    opt = DistributedOptimizer(wrapper, tcfg)
    out = {"losses": [], "ledger": [], "grads": {},
           "buckets": [(b.numel, b.padded_numel, b.shard_numel) for b in wrapper.buckets]}
    for step, batch in enumerate(batches):
        with record_communication() as ledger:
            loss = _forward_backward(wrapper, batch, case, dp, rank)
            opt.set_lr(learning_rate(step, tcfg))
            zero1_step(wrapper.buckets, opt.inner, None)
        if step == 0:
            out["grads"] = wrapper.gather_gradients()    # main_grad still holds the reduced shard
        opt.zero_grad()
        out["losses"].append(loss)
        out["ledger"].append(_ledger_rows(ledger))
    out["params"] = _full_params(wrapper)
    out["params_equal_on_ranks"] = _same_on_all_ranks(out["params"])
    if rank != 0:
        out["grads"], out["params"] = {}, {}
    return out


def _same_on_all_ranks(tensors: dict[str, torch.Tensor]) -> bool:
    flat = torch.cat([t.reshape(-1) for _, t in sorted(tensors.items())])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)    # plain torch.distributed: not part of any ledger
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def _dies(ref: weakref.ref, timeout: float = 0.5) -> bool:
    """True once nothing references the object any more. gloo's worker thread lets go of a
    finished collective's tensors a moment after wait() returns, so give it a little time."""
    deadline = time.monotonic() + timeout
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.001)
    return ref() is None


def fsdp_gather_worker(style: str, steps: int) -> dict:
    """Exercise 1.4: gather every unit directly (values, ledger, memory), then train ZeRO-3
    with the gather plugged in and record the memory profile of the first step."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    cfg = tiny_config(style)
    expected = {n: p.detach().clone() for n, p in GPTModel(cfg).named_parameters()}
    wrapper = FullyShardedDataParallel(GPTModel(cfg), None)
    direct = []
    for unit in wrapper.units.values():
        with record_communication() as ledger:
            got = gather_unit_parameters(unit, None, "probe")
        bases = {t.untyped_storage().data_ptr() for t in got}
        storage_bytes = got[0].untyped_storage().nbytes() if got else 0
        ref = weakref.ref(got[0]._base if got[0]._base is not None else got[0])
        values_ok = len(got) == len(unit.names) and all(
            tuple(t.shape) == tuple(expected[n].shape) and torch.equal(t, expected[n]) for t, n in zip(got, unit.names))
        del got
        direct.append({"unit": unit.name, "values_ok": values_ok, "one_buffer": len(bases) == 1,
                       "buffer_bytes": storage_bytes, "freed": _dies(ref),
                       "ledger": [(r.op, r.nbytes, r.tag) for r in ledger],
                       "shard_bytes": unit.shard_numel * unit.shard.element_size(),
                       "padded_bytes": unit.padded_numel * unit.shard.element_size()})
    case = {"style": style, "steps": steps, "mbs": 1, "M": 2, "clip": 0.0, "stage": 3}
    out = _train(case, case_batches(case, dp))
    out.pop("state")
    out["direct"] = direct
    if rank != 0:
        out["grads"], out["params"] = {}, {}
    return out
