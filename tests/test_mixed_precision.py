"""The seams chapter 06 plugs into (its bf16 / fp16 training comes with chapter 06):

- a bfloat16 model under bucketed DDP and ZeRO-1 with float32 gradient buffers (Megatron's
  --accumulate-allreduce-grads-in-fp32) sums its micro-batches' gradients in float32 and reduces
  them in float32: the result equals the exact (float64) average of the bf16 gradients to float32
  rounding, where bfloat16 buffers are off by bfloat16 rounding; the optimizer's float32 main
  parameters read those gradients in place and are copied back into the bf16 model;
- the loss-scaler slot: a scaled loss steps exactly like an unscaled one, and a non-finite
  gradient on one rank makes every rank of the norm's groups skip the same step.
"""

import torch

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.optim import Optimizer
from minimegatron.parallel_state import Layout
from minimegatron.testing import make_batches
from minimegatron.train import train_step
from workers import mixed_precision as W


def _run_buffers():
    out = {}
    for kind in ("ddp", "zero1"):
        for dtype in (torch.float32, torch.bfloat16):
            out[(kind, str(dtype))] = W.buffer_run(kind, dtype)
    out["exact"] = W.local_bf16_grads(torch.distributed.get_rank())
    return out


def test_bf16_model_with_float32_gradient_buffers_accumulates_and_reduces_in_float32():
    per_rank = spawn(_run_buffers, 2, timeout=240)
    # the exact average over ranks of the sum over micro-batches, in float64 from the bf16 gradients
    exact = {n: sum(g.double() for r in per_rank for g in r["exact"][n]) / len(per_rank) for n in per_rank[0]["exact"]}
    for kind in ("ddp", "zero1"):
        errors = {}
        for dtype in ("torch.float32", "torch.bfloat16"):
            run = per_rank[0][(kind, dtype)]
            assert run["grad_dtypes"] == [dtype]
            assert run["param_grads_none"] is (dtype == "torch.float32")      # p.grad must be bf16: not the view
            grads = {"ddp": "all_reduce", "zero1": "reduce_scatter"}[kind]
            assert {(op, d) for op, d, tag in run["ledger"] if tag == "grads"} == {(grads, dtype)}, run["ledger"]
            owned = run.get("owned")
            errors[dtype] = max(float(((g - exact[n]) * (owned[n] if owned else 1)).abs().max() /
                                      exact[n].abs().max()) for n, g in run["grads"].items())
            assert run["main_dtypes"] == ["torch.float32"] and run["params_dtype"] == ["torch.bfloat16"]
            assert run["copied_back"]
            assert run["grads_in_place"] is (dtype == "torch.float32")   # bf16 buffers: a float32 copy
        assert errors["torch.float32"] < 1e-6, errors            # float32 rounding of an exact sum
        assert errors["torch.bfloat16"] > 1e-4, errors           # a bf16 buffer rounds at 2^-8


def test_a_scaled_loss_steps_exactly_like_an_unscaled_one_and_an_overflow_skips():
    cfg = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16,
                            params_dtype="float64")
    batches = make_batches(cfg, 2, 2, 16)
    runs = []
    for scaler in (None, W.FixedLossScale(1024.0)):
        model = GPTModel(cfg)
        optimizer = Optimizer([model], TrainConfig(clip_grad=1.0), grad_scaler=scaler)
        norms = [train_step([model], optimizer, [b], Layout(), 1e-2)[1] for b in batches]
        runs.append((norms, {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert runs[0][0] == runs[1][0]                              # x 1024 then / 1024: exact in binary
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank():
    per_rank = spawn(W.found_inf_run, 2, timeout=240)
    for r in per_rank:
        assert r["updates"] == [False, True] and r["norms"][0] is not None and r["norms"][1] is None
        assert r["adam_steps"] == [1]                           # AdamW stepped once
        assert all(torch.equal(r["params"][0][n], r["params"][1][n]) for n in r["params"][0])   # unchanged
        assert r["found_inf_calls"] == ["all_reduce", "all_reduce"]      # one per step, over the group
    assert all(torch.equal(per_rank[0]["params"][1][n], per_rank[1]["params"][1][n]) for n in per_rank[0]["params"][1])
