"""Mixed precision (chapter 06): bf16 and fp16 with float32 main parameters and gradients.

- the dynamic loss scaler follows Megatron-Core's DynamicGradScaler, on sequences worked out by
  hand from its rules;
- --bf16 / --fp16 set the model's dtype, as Megatron's do, and mismatches are refused;
- every layout of the book trains in bf16 like the single device in bf16 (the training loop's
  own wrapper with its float32 main_grad buffer, and float32 main parameters), within the
  bf16 row of testing.TOLERANCES; fp16 with dynamic loss scaling likewise;
- the float32 main parameters step exactly like a float32 optimizer fed the same gradients;
- an fp16 gradient that overflows on ONE rank of a tp x pp x dp run makes every rank skip that
  step together; the run goes on, and equals one device that never saw that batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minimegatron.arguments import parse_command_line
from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from minimegatron.launch import spawn
from minimegatron.testing import RunRecord, compare_runs, make_batches, one_device_config, single_device_run
from workers import precision as W                      # tests/workers/precision.py


# ---------------------------------------------------------------------------------------
# the loss scaler
# ---------------------------------------------------------------------------------------
def _scales(scaler, events: str) -> list[float]:
    """The scale after each event: "x" an overflowing step, "." a clean one."""
    out = []
    for e in events:
        scaler.update(e == "x")
        out.append(scaler.scale)
    return out


def test_the_dynamic_scaler_backs_off_after_hysteresis_overflows_and_grows_after_a_clean_window():
    # hysteresis 2, window 3, from 1024, by hand from the rules:
    #  x   first overflow: 2 -> 1 overflow left, no back-off               1024
    #  x   second: 0 left -> halve                                          512
    #  x   still 0 or below (clean steps do not refill it) -> halve again   256
    #  . . .  three clean steps in a row -> double, both counters refilled  256 256 512
    #  x   refilled to 2 -> 1 left, no back-off                             512
    #  . .  two clean steps (the overflow restarted the count)              512 512
    #  .   the third clean step in a row -> double                          1024
    scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    assert _scales(scaler, "xxx...x...") == [1024, 512, 256, 256, 256, 512, 512, 512, 512, 1024]


def test_the_dynamic_scaler_never_drops_below_its_minimum_and_keeps_its_state():
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=1)
    assert _scales(scaler, "xxxx") == [4, 2, 2, 2]
    again = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=1)
    again.load_state_dict(scaler.state_dict())
    assert _scales(again, "..") == _scales(scaler, "..") == [2, 4]


def test_the_scalers_refuse_what_megatron_asserts():
    for kwargs, words in [(dict(initial_scale=0), "initial_scale=0"), (dict(min_scale=4, initial_scale=2), "min_scale=4"),
                          (dict(hysteresis=0), "hysteresis=0"), (dict(growth_interval=0), "growth_interval=0")]:
        with pytest.raises(ValueError, match=words):
            DynamicGradScaler(**kwargs)
    assert ConstantGradScaler(128).update(True) is None and ConstantGradScaler(128).scale == 128


def test_the_flags_choose_the_scaler_and_the_dtype_as_megatron_does():
    model, cfg, _ = parse_command_line(["--bf16"], 1)
    assert (model.params_dtype, cfg.bf16, build_grad_scaler(cfg), cfg.main_grads_dtype) == \
        ("bfloat16", True, None, torch.float32)
    model, cfg, _ = parse_command_line(["--bf16", "--grad-reduce-in-bf16"], 1)
    assert cfg.main_grads_dtype is None
    model, cfg, _ = parse_command_line(["--fp16", "--initial-loss-scale", "65536", "--hysteresis", "3"], 1)
    scaler = build_grad_scaler(cfg)
    assert model.params_dtype == "float16" and isinstance(scaler, DynamicGradScaler)
    assert (scaler.scale, scaler.hysteresis, scaler.growth_interval, cfg.main_grads_dtype) == (65536, 3, 1000, None)
    _, cfg, _ = parse_command_line(["--fp16", "--loss-scale", "128", "--accumulate-allreduce-grads-in-fp32"], 1)
    assert isinstance(build_grad_scaler(cfg), ConstantGradScaler) and cfg.main_grads_dtype == torch.float32


# ---------------------------------------------------------------------------------------
# every layout against the single device, in the same precision
# ---------------------------------------------------------------------------------------
STEPS = 3


def _model(style="llama", dtype="bfloat16", layers=2, **moe):
    return getattr(ModelConfig, style)(hidden_size=32, num_layers=layers, num_attention_heads=4, num_query_groups=2,
                                       ffn_hidden_size=64, vocab_size=64, max_position_embeddings=32,
                                       params_dtype=dtype, **moe)


def _train(precision="bf16", tp=1, cp=1, pp=1, sp=False, ep=1, zero=0, chunks=1, **extra):
    """adam_eps 1e-3: Adam's first steps move every element by about lr x sign(g) when |g| >>
    eps, so a gradient near zero whose 16-bit rounding differs in sign between two layouts moves
    its parameter 2 lr apart (measured: up to 4.3e-2 with lr 1e-2 and eps 1e-8, chapter 06). A
    larger eps damps the near-zero elements (lr g / eps) and leaves the layouts' own difference."""
    return TrainConfig(seq_length=16, micro_batch_size=2, grad_accum_steps=2, train_iters=STEPS, lr=1e-2,
                       lr_warmup_iters=0, clip_grad=1.0, adam_eps=1e-3, eval_interval=0, progress=False, bf16=precision == "bf16",
                       fp16=precision == "fp16", tensor_model_parallel_size=tp, context_parallel_size=cp,
                       pipeline_model_parallel_size=pp, sequence_parallel=sp, expert_model_parallel_size=ep,
                       zero_stage=zero, num_virtual_stages_per_pipeline_rank=chunks,
                       pipeline_schedule="interleaved" if chunks > 1 else "1f1b", **extra)


def _layout(name, model, cfg, dp):
    batches = make_batches(model, STEPS, cfg.micro_batch_size * cfg.grad_accum_steps * dp, cfg.seq_length)
    return name, model, cfg, dp, batches


FP16 = dict(initial_loss_scale=2.0 ** 12, loss_scale_window=2)     # grows once in the 3 steps
LAYOUTS = [
    _layout("bf16 dp4", _model(), _train(), 4),
    _layout("bf16 dp4 zero1", _model(), _train(zero=1), 4),
    _layout("bf16 dp4 zero2", _model(), _train(zero=2), 4),
    _layout("bf16 tp2 dp2 zero3", _model(), _train(tp=2, zero=3), 2),
    _layout("bf16 tp2 sp cp2", _model(), _train(tp=2, sp=True, cp=2), 1),
    _layout("bf16 pp2 dp2 interleaved, GPT-2 (tied)", _model("gpt2", layers=4), _train(pp=2, chunks=2), 2),
    _layout("bf16 tp2 sp dp2, ep2 experts", _model(num_experts=4, moe_router_topk=2), _train(tp=2, sp=True, ep=2), 2),
    _layout("fp16 tp2 pp2", _model(dtype="float16"), _train("fp16", tp=2, pp=2, **FP16), 1),
    _layout("fp16 dp2 zero1 cp2", _model(dtype="float16"), _train("fp16", cp=2, zero=1, **FP16), 2),
]


@pytest.fixture(scope="module")
def trained():
    return spawn(W.train_layouts, 4, LAYOUTS, timeout=600)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[name for name, *_ in LAYOUTS])
def test_each_layout_trains_like_one_device_in_the_same_precision(trained, index):
    name, model, cfg, dp, batches = LAYOUTS[index]
    one = one_device_config(cfg)
    reference = single_device_run(model, batches, one, grad_accum_steps=cfg.grad_accum_steps * dp)
    run = trained[0][index]
    report = compare_runs(reference, RunRecord(run["losses"], run["grads"], run["params"]), model.dtype)
    assert report.ok, f"{name}\n{report}"
    # the elementwise atol lets a small gradient be off by a factor (a norm's share of the tokens):
    # each tensor as a whole must be within 16-bit rounding of the single device's
    for n, g in run["grads"].items():
        want = reference.grads[n].double()
        relative = float((g.double() - want).norm() / want.norm().clamp(min=1e-30))
        assert relative < 0.03, f"{name}: gradient {n} is {relative:.3f} of its norm away from one device's"
    assert all(r[index]["losses"] == run["losses"] for r in trained), "the ranks report different losses"
    if cfg.fp16:
        assert run["scale"] == 2.0 ** 13, run["scale"]           # 2 clean steps of window 2: doubled once


# ---------------------------------------------------------------------------------------
# the main parameters, and an overflow on one rank
# ---------------------------------------------------------------------------------------
def test_the_float32_main_parameters_step_exactly_like_a_float32_optimizer_fed_the_same_gradients():
    """A bf16 model's optimizer (float32 main copies) against torch's AdamW on float32 tensors
    holding the same starting values and given the same (float32 main) gradients: bit for bit,
    and the model's bf16 parameters are the main ones rounded to bf16."""
    from minimegatron.model import GPTModel
    from minimegatron.optim import Optimizer
    model_cfg = _model()
    cfg = dataclasses.replace(_train(), clip_grad=0.0, weight_decay=0.0)
    model = GPTModel(model_cfg)
    optimizer = Optimizer([model], cfg, main_params_dtype=torch.float32)
    plain = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    adam = torch.optim.AdamW(plain, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=0.0)
    for batch in make_batches(model_cfg, 2, 2, 16):
        model(batch["tokens"], labels=batch["labels"]).mean().backward()
        for p, q in zip(model.parameters(), plain):
            q.grad = p.grad.float()                         # what the optimizer's stage 1 hands AdamW
        optimizer.step()
        adam.step()
        optimizer.zero_grad()
        for main, q, p in zip(optimizer.main_params, plain, model.parameters()):
            assert torch.equal(main, q.detach())
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), q.detach().to(torch.bfloat16))


OVERFLOW_STEP = 1


@pytest.fixture(scope="module")
def overflowed():
    """fp16, tp 2 x pp 2 x dp 2 on 8 ranks, rank 5's gradient made infinite in step 1's backward."""
    model = _model(dtype="float16")
    cfg = dataclasses.replace(_train("fp16", tp=2, pp=2, initial_loss_scale=2.0 ** 12, hysteresis=1, min_lr=1e-2),
                              train_iters=4)
    batches = make_batches(model, 4, cfg.micro_batch_size * cfg.grad_accum_steps * 2, cfg.seq_length)
    return model, cfg, batches, spawn(W.overflow_on_one_rank, 8, model, cfg, 2, batches, 5, OVERFLOW_STEP,
                                      timeout=300)


def test_an_overflow_on_one_rank_makes_every_rank_skip_that_step(overflowed):
    *_, per_rank = overflowed
    seen = per_rank[0]["seen"]
    assert [found for found, _ in seen] == [i == OVERFLOW_STEP for i in range(4)], seen
    assert [scale for _, scale in seen] == [2.0 ** 12, 2.0 ** 11, 2.0 ** 11, 2.0 ** 11], seen   # hysteresis 1: halved
    assert all(r["seen"] == seen for r in per_rank), [r["seen"] for r in per_rank]
    assert all(r["params"].keys() == per_rank[0]["params"].keys() for r in per_rank)


def test_the_run_goes_on_and_equals_one_device_that_never_saw_the_skipped_batch(overflowed):
    """With a constant learning rate (min_lr = lr, no warm-up) a skipped step changes nothing:
    no parameter, no Adam moment, no step count. So the run equals one device trained on the
    other batches (its losses, the skipped step's own loss left out; its final parameters)."""
    model, cfg, batches, per_rank = overflowed
    kept = [b for i, b in enumerate(batches) if i != OVERFLOW_STEP]
    one = one_device_config(dataclasses.replace(cfg, train_iters=len(kept)))
    reference = single_device_run(model, kept, one, grad_accum_steps=cfg.grad_accum_steps * 2)
    run = per_rank[0]
    losses = [x for i, x in enumerate(run["losses"]) if i != OVERFLOW_STEP]
    report = compare_runs(reference, RunRecord(losses, reference.grads, run["params"]), torch.float16)
    assert report.ok, str(report)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in per_rank)
