"""FP8 (chapter 06): the numbers, the four scalings, the GEMMs, and FP8 under parallelism.

- casts worked out by hand (rounding in e4m3 and e5m2, saturation instead of infinity);
- current (tensorwise) scaling equals torchao's Float8Linear bit for bit: forward, input and
  weight gradients (skipped without torchao, an optional peer);
- blockwise and MXFP8 scales are powers of 2 per block, and never saturate;
- delayed scaling's history and scale on a sequence of amaxes worked out by hand;
- the model's transformer-layer GEMMs in FP8, and nothing else;
- every recipe under TP + SP, CP and PP (interleaved) equals the FP8 single device in float64
  (the GEMMs then accumulate in float64, so the layouts differ by summation order only, far
  below one FP8 rounding): each one-scale cast reduces its amax over tp x cp, and the blocked
  recipes' blocks fall inside the shards. Where one device and a layout cannot agree exactly
  (delayed scaling over data-parallel replicas or context parallelism, one scale over experts
  fed by several replicas, blocks that straddle shards), chapter 06 says why.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from minimegatron.config import ModelConfig, TrainConfig
from minimegatron.fp8 import (DelayedScaling, Fp8Gemm, Fp8Recipe, apply_fp8, cast_to_fp8, quantize_blockwise,
                              quantize_mxfp8, quantize_tensorwise, tensorwise_scale)
from minimegatron.launch import spawn
from minimegatron.model import GPTModel
from minimegatron.model.linear import GEMM, Linear
from minimegatron.testing import RunRecord, compare_runs, make_batches, one_device_config, single_device_run
from workers import precision as W                      # tests/workers/precision.py


# ---------------------------------------------------------------------------------------
# the numbers
# ---------------------------------------------------------------------------------------
def test_casts_round_to_the_nearest_fp8_number_and_saturate():
    one = torch.ones(())
    # 0.2 = 1.6 x 2^-3: e4m3 keeps 3 mantissa bits (1.5, 1.625 -> 1.625), e5m2 two (1.5, 1.75 -> 1.5)
    assert cast_to_fp8(torch.tensor([0.2]), one, "e4m3").float().item() == 0.203125
    assert cast_to_fp8(torch.tensor([0.2]), one, "e5m2").float().item() == 0.1875
    # beyond the largest number: clamped to it, never inf (e5m2 would overflow without the clamp)
    assert cast_to_fp8(torch.tensor([1e6, -1e6]), one, "e4m3").float().tolist() == [448.0, -448.0]
    assert cast_to_fp8(torch.tensor([1e6, -1e6]), one, "e5m2").float().tolist() == [57344.0, -57344.0]
    # below e4m3's smallest subnormal 2^-9 (half of it and less): zero
    assert cast_to_fp8(torch.tensor([2.0 ** -11]), one, "e4m3").float().item() == 0.0
    # the scale moves a tensor into range: amax 0.01 -> scale 44800, the amax lands on 448
    assert tensorwise_scale(torch.tensor(0.01), 448.0).item() == pytest.approx(44800.0, rel=1e-7)
    q = quantize_tensorwise(torch.tensor([0.01, -0.005, 1e-9]), "e4m3")
    assert q.data.float().tolist()[:2] == [448.0, -224.0] and q.data.float()[2] == 0.0   # 1e-9 underflows


def test_current_scaling_equals_torchao_float8_linear_bit_for_bit():
    """torchao's Float8Linear (its default "tensorwise" recipe: e4m3 forward, e5m2 gradients,
    torch._scaled_mm) against the book's Linear with an Fp8Gemm of recipe "current"."""
    torchao = pytest.importorskip("torchao.float8", reason="torchao (an optional peer) is not installed")
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao.convert_to_float8_training(reference)
    mine = Linear(64, 32, bias=False)
    mine.weight.data.copy_(reference[0].weight.data)
    mine.gemm = Fp8Gemm(Fp8Recipe("current"))
    x = torch.randn(4, 16, 64) * 3
    dy = torch.randn(4, 16, 32) * 1e-3
    outs = []
    for layer in (reference, mine):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, (reference[0] if layer is reference else mine).weight.grad))
    for a, b, what in zip(*outs, ("y", "dx", "dW")):
        assert torch.equal(a, b), f"{what}: max |diff| {(a - b).abs().max().item():.3e}"


def test_blocked_scales_are_powers_of_two_per_block_and_never_saturate():
    torch.manual_seed(1)
    x = torch.randn(3, 300) * torch.logspace(-6, 3, 300)            # a wide range along the row
    for q, per in ((quantize_blockwise(x, "e4m3"), 128), (quantize_mxfp8(x, "e4m3"), 32)):
        assert q.scale.shape == (3, -(-300 // per))                    # a partial last block
        assert torch.equal(torch.exp2(torch.log2(q.scale).round()), q.scale)      # powers of 2
        assert q.data.float().abs().max() <= 448 and q.dequantize().shape == x.shape
        blocks = torch.nn.functional.pad(x, (0, (-300) % per)).unflatten(-1, (-1, per)).abs().amax(-1)
        assert torch.all(blocks * q.scale <= 448)                      # the block's amax fits
        assert torch.all(blocks * q.scale > 448 / 2 - 1e-3)            # ... within a factor of 2 of the top
    w = torch.randn(256, 200)
    q = quantize_blockwise(w, "e4m3", two_d=True)
    assert q.scale.shape == (2, 2) and q.dequantize().shape == w.shape
    zero = quantize_mxfp8(torch.zeros(1, 32), "e4m3")
    assert zero.scale.item() == 2.0 ** 127 and zero.dequantize().abs().max() == 0


def test_delayed_scaling_uses_the_scale_of_earlier_amaxes():
    """history 2, "max", margin 0, e4m3; the amaxes cast: 2, 4, 1, 1, then 0 and inf; by hand:
    cast 1 uses 1 (the initial scale); before cast 2: max(2) -> 448/2; cast 3: max(4, 2) -> 112;
    cast 4: max(1, 4) -> 112 (the 4 is still in the history); cast 5: max(1, 1) -> 448;
    cast 6: max(0, 1) -> 448; cast 7: inf -> the scale is kept."""
    state = DelayedScaling(Fp8Recipe("delayed", "e4m3", amax_history_len=2, amax_compute_algo="max"), "e4m3")
    used = []
    for amax in (2.0, 4.0, 1.0, 1.0, 0.0, float("inf"), 3.0):
        used.append(state.cast(torch.zeros(1), torch.tensor(amax)).scale.item())
    assert used == [1.0, 224.0, 112.0, 112.0, 448.0, 448.0, 448.0]
    recent = DelayedScaling(Fp8Recipe("delayed", "e4m3", margin=1, amax_history_len=2), "e4m3")
    used = [recent.cast(torch.zeros(1), torch.tensor(a)).scale.item() for a in (2.0, 4.0, 1.0)]
    assert used == [1.0, 448 / 2 / 2, 448 / 4 / 2]                    # most_recent, halved by the margin


def test_apply_fp8_converts_the_transformer_layers_gemms_only():
    cfg = ModelConfig.llama(hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16,
                            num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=32)
    model = apply_fp8(GPTModel(cfg), Fp8Recipe("current"))
    converted = {n for n, m in model.named_modules() if isinstance(getattr(m, "gemm", None), Fp8Gemm)}
    assert converted and all(n.rsplit(".", 1)[-1] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                             for n in converted)
    assert any(".local_experts." in n for n in converted) and any("shared_experts" in n for n in converted)
    assert model.output_layer.gemm is GEMM and all(m.gemm is GEMM for n, m in model.named_modules()
                                                    if n.endswith("router"))
    assert apply_fp8(model, None) is model


# ---------------------------------------------------------------------------------------
# FP8 under parallelism: every layout equals the FP8 single device
# ---------------------------------------------------------------------------------------
STEPS = 2


def _layout(name, recipe, tp=1, cp=1, pp=1, sp=False, dp=1, chunks=1, style="llama", layers=2, h=32, seq=16):
    """h 64 and seq 128 for MXFP8, h 256 for blockwise: every shard's summed dimension, and each
    context-parallel chunk of tokens, then holds whole blocks (32; 128), as TE requires, so a
    rank's blocks are the single device's blocks."""
    heads = 4
    model = getattr(ModelConfig, style)(hidden_size=h, num_layers=layers, num_attention_heads=heads, num_query_groups=2,
                                        ffn_hidden_size=2 * h if h < 256 else h, vocab_size=64,
                                        max_position_embeddings=seq, params_dtype="float64")
    cfg = TrainConfig(seq_length=seq, micro_batch_size=2, grad_accum_steps=2, train_iters=STEPS, lr=1e-2,
                      lr_warmup_iters=0, eval_interval=0, progress=False, fp8_format="hybrid", fp8_recipe=recipe,
                      fp8_amax_history_len=4, fp8_amax_compute_algo="max", tensor_model_parallel_size=tp,
                      context_parallel_size=cp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                      num_virtual_stages_per_pipeline_rank=chunks,
                      pipeline_schedule="interleaved" if chunks > 1 else "1f1b")
    assert tp * cp * pp * dp == 4
    batches = make_batches(model, STEPS, cfg.micro_batch_size * cfg.grad_accum_steps * dp, cfg.seq_length)
    return name, model, cfg, dp, batches


LAYOUTS = [
    _layout("tensorwise tp2 sp dp2", "tensorwise", tp=2, sp=True, dp=2),
    _layout("tensorwise cp4", "tensorwise", cp=4),
    _layout("tensorwise pp2 dp2 interleaved, GPT-2", "tensorwise", pp=2, dp=2, chunks=2, style="gpt2", layers=4),
    _layout("delayed tp2 sp pp2", "delayed", tp=2, sp=True, pp=2),
    _layout("delayed tp2 pp2 interleaved", "delayed", tp=2, pp=2, chunks=2, layers=4),
    _layout("mxfp8 tp2 sp cp2", "mxfp8", tp=2, sp=True, cp=2, h=64, seq=128),
    _layout("blockwise tp2 pp2", "blockwise", tp=2, pp=2, h=256, seq=64),
]


@pytest.fixture(scope="module")
def trained():
    return spawn(W.train_layouts, 4, LAYOUTS, timeout=600)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[name for name, *_ in LAYOUTS])
def test_each_fp8_layout_equals_the_fp8_single_device(trained, index):
    name, model, cfg, dp, batches = LAYOUTS[index]
    one = one_device_config(cfg)
    reference = single_device_run(model, batches, one, grad_accum_steps=cfg.grad_accum_steps * dp)
    run = trained[0][index]
    report = compare_runs(reference, RunRecord(run["losses"], run["grads"], run["params"]), torch.float64)
    assert report.ok, f"{name}\n{report}"
