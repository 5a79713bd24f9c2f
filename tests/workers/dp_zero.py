"""Rank functions for the ZeRO tests and graders (tests/test_dp_zero.py, tests/graders/test_ch01_zero.py).

Each worker trains with the training loop's own step (`train.train_step`) on this rank's
micro-batches of the same global batches that the test gives `testing.single_device_run`,
and returns what the test compares: losses (this rank's local share; the test averages over
ranks), the global gradient norms, the first step's full gradients and the final full
parameters (rank 0 only), the ledger of every step, the measured memory.

The data split is the training loop's (`testing.local_microbatch`): with dp ranks and M
micro-batches of b rows, micro-batch m of rank r is the rows [(m*dp + r)*b, (m*dp + r + 1)*b)
of the global batch; the single-device run's micro-batch m (testing.split_microbatches) is
the union over r of them.

The data-parallel group is passed as dist.group.WORLD, not as None (which comm reads as the
world too): optim.Optimizer skips None groups when it sums the gradient norm.
"""

from __future__ import annotations

import copy
import weakref
from contextlib import nullcontext

import torch
import torch.distributed as dist

from minimegatron.comm import record_communication
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.dp import FullyShardedDataParallel, ZeroDataParallel, measure_memory
from minimegatron.dp.fsdp import gather_unit_parameters
from minimegatron.model import GPTModel
from minimegatron.optim import NormGroup, Optimizer, learning_rate
from minimegatron.parallel_state import Layout
from minimegatron.testing import local_microbatch, make_batches
from minimegatron.train import before_optimizer_step, train_step
from minimegatron.testing import wait_until

SEQ = 16


def tiny_config(style: str, dtype: str = "float64") -> ModelConfig:
    """GPT-2 (tied, learned positions, biases) or LLaMA (untied, GQA, RoPE): hidden 32, 2 layers."""
    make = ModelConfig.gpt2 if style == "gpt2" else ModelConfig.llama
    return make(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=SEQ,
                params_dtype=dtype)


def train_config(steps: int, clip: float, adam_eps: float = 1e-8, mbs: int = 1, M: int = 1) -> TrainConfig:
    """AdamW, no warm-up; mbs (b) and M say how a rank cuts its rows of the global batch."""
    return TrainConfig(train_iters=steps, lr_warmup_iters=0, clip_grad=clip, adam_eps=adam_eps, progress=False,
                       seq_length=SEQ, micro_batch_size=mbs, grad_accum_steps=M)


def case_train_config(case: dict) -> TrainConfig:
    return train_config(case["steps"], case["clip"], case.get("adam_eps", 1e-8), case["mbs"], case["M"])


def case_batches(case: dict, dp: int) -> list[dict[str, torch.Tensor]]:
    cfg = tiny_config(case["style"], case.get("dtype", "float64"))
    return make_batches(cfg, case["steps"], case["mbs"] * case["M"] * dp, SEQ, seed=case.get("seed", 0))


def dp_layout() -> Layout:
    """The layout of a pure data-parallel world: every rank one data-parallel rank."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    return Layout(world=dp, rank=rank, dp=dp, dp_rank=rank, dp_group=dist.group.WORLD)


def _full_params(wrapper) -> dict[str, torch.Tensor]:
    if isinstance(wrapper, FullyShardedDataParallel):
        return {n: t for n, (_, t) in wrapper.local_tensors().items()}
    return {n: p.detach().clone() for n, p in wrapper.module.named_parameters()}


def _padding_is_zero(wrapper) -> bool:
    if isinstance(wrapper, FullyShardedDataParallel):
        return all(bool((u.shard.detach()[max(0, u.numel - u.start):] == 0).all()) for u in wrapper.units.values())
    return all(bool((b.param_data[b.numel:] == 0).all()) for b in wrapper.buckets)


def _ledger_rows(ledger) -> list[tuple[str, int, str | None]]:
    return [(r.op, r.nbytes, r.tag) for r in ledger if r.tag != "inspect"]


def _train(case: dict, batches, start: int = 0, stop: int | None = None, state: dict | None = None):
    """Train steps [start, stop) of `case` with train.train_step; `state` resumes from a
    checkpoint of this rank."""
    layout = dp_layout()
    cfg = tiny_config(case["style"], case.get("dtype", "float64"))
    tcfg = case_train_config(case)
    model = GPTModel(cfg)
    wrapper = (FullyShardedDataParallel(model, layout.dp_group) if case["stage"] == 3 else
               ZeroDataParallel(model, layout.dp_group, case["stage"], bucket_size=case.get("bucket_size")))
    opt = Optimizer([wrapper], tcfg, [NormGroup(groups=(layout.dp_group,))])      # the shards' norm: over dp
    if state is not None:
        (wrapper if case["stage"] == 3 else model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    out = {"losses": [], "norms": [], "ledger": [], "grads": {}, "synced_grads_freed": True,
           "buckets": [(b.numel, b.padded_numel, b.shard_numel) for b in (wrapper.buckets if case["stage"] < 3 else [])]}
    for step in range(start, len(batches) if stop is None else stop):

        def on_grads(step=step):
            """The gradients are final (finish_grad_sync ran), not yet clipped."""
            if case["stage"] == 2:
                out["synced_grads_freed"] &= all(p.grad is None for p in model.parameters())
            if step == 0:
                out["grads"] = {n: t for n, (_, t) in wrapper.local_tensors(grads=True).items()}  # tag "inspect"
            out["grad_peak"] = wrapper.grad_bytes_peak if case["stage"] < 3 else None   # zero_grad resets it

        microbatches = [local_microbatch(batches[step], tcfg, m, layout.dp_rank, layout.dp) for m in range(case["M"])]
        profile_ctx = (wrapper.memory_profile(settle=wait_until) if case["stage"] == 3 and step == start
                       else nullcontext())
        with record_communication() as ledger, profile_ctx as events, before_optimizer_step(opt, on_grads):
            loss, norm = train_step([wrapper], opt, microbatches, layout, learning_rate(step, tcfg))
        if events is not None:
            out["profile"] = [(e.label, e.sharded, e.gathered) for e in events]
        out["losses"].append(loss)
        out["norms"].append(norm)
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

def zero1_training_worker(style: str, steps: int) -> dict:
    """Exercise 1.3: ZeRO-1 trained by the training loop's step, whose finish_grad_sync runs
    the (plugged-in) reduce_scatter_gradients; M = 1, no clipping. Also whether the ranks
    end with equal parameters (the buckets' sizes come with every _train record)."""
    case = {"style": style, "steps": steps, "mbs": 1, "M": 1, "clip": 0.0, "stage": 1}
    out = _train(case, case_batches(case, dist.get_world_size()))
    out.pop("state")
    out["params_equal_on_ranks"] = _same_on_all_ranks(out["params"])
    if dist.get_rank() != 0:
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
    return wait_until(lambda: ref() is None, timeout)


def fsdp_gather_worker(style: str, steps: int) -> dict:
    """Exercise 1.4: gather every unit directly (values, ledger, memory), then train ZeRO-3
    with the gather plugged in and record the memory profile of the first step."""
    cfg = tiny_config(style)
    expected = {n: p.detach().clone() for n, p in GPTModel(cfg).named_parameters()}
    wrapper = FullyShardedDataParallel(GPTModel(cfg), dist.group.WORLD)
    direct = []
    for unit in wrapper.units.values():
        with record_communication() as ledger:
            got = gather_unit_parameters(unit, dist.group.WORLD, "probe")
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
    out = _train(case, case_batches(case, dist.get_world_size()))
    out.pop("state")
    out["direct"] = direct
    if dist.get_rank() != 0:
        out["grads"], out["params"] = {}, {}
    return out
