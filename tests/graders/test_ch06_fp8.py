"""Graders of chapter 06, low precision: the dynamic loss scaler's update (6.1), an FP8 cast with
its scale and saturation (6.2), delayed scaling's amax-history update (6.3) and the spot-the-bug
FP8 amax (6.4).

The oracles: sequences worked out by hand from Megatron-Core's and Transformer Engine's rules
(each expected value is derived in a comment), FP8 values read off the formats' definitions
(sign, exponent, mantissa), and properties that hold whatever the code (a cast never produces
inf; the inputs are left as they were). 6.1 is also checked inside a real fp16 training step;
6.4 inside FP8 runs on 4 spawned ranks (tensor, sequence and context parallelism), which must
equal the FP8 single device (float64: summation order only; chapters/06_fp8/demo.py's check_run).
"""

from __future__ import annotations

import pytest
import torch

from booktools.demo import import_chapter
from booktools.exercises import implementation, plugged
from minimegatron.grad_scaler import DynamicGradScaler
from minimegatron.launch import spawn

ch06 = import_chapter("06")          # chapters/06_fp8/demo.py


# --------------------------------------------------------------------------------------
# 6.1 the dynamic loss scaler's update
# --------------------------------------------------------------------------------------
def _scales(events: str, **kwargs) -> list[float]:
    update = implementation("6.1")
    scaler = DynamicGradScaler(**kwargs)
    out = []
    for e in events:
        update(scaler, e == "x")
        out.append(scaler.scale)
    return out


@pytest.mark.exercise("6.1")
def test_overflows_back_off_after_the_hysteresis_and_clean_windows_grow():
    # hysteresis 2, window 3, from 1024:
    #  x  1 overflow left, no back-off: 1024      x  0 left: halve: 512     x  still <= 0: 256
    #  . . .  three clean steps in a row: double, both counters refilled: 256 256 512
    #  x  refilled to 2: 1 left, no back-off: 512     . .  512 512     .  third clean in a row: 1024
    got = _scales("xxx...x...", initial_scale=1024.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    assert got == [1024, 512, 256, 256, 256, 512, 512, 512, 512, 1024], got


@pytest.mark.exercise("6.1")
def test_clean_steps_do_not_refill_the_hysteresis():
    # hysteresis 2, window 4: x (1 left) . . (clean, but not 4 in a row) x (0 left: halve) -> 32
    got = _scales("x..x", initial_scale=64.0, min_scale=1.0, growth_interval=4, hysteresis=2)
    assert got == [64, 64, 64, 32], f"{got}: the second overflow, two clean steps after the first, must halve"


@pytest.mark.exercise("6.1")
def test_the_scale_never_drops_below_its_minimum_and_an_overflow_restarts_the_window():
    assert _scales("xxxx", initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=1) == [4, 2, 2, 2]
    # window 2: . x . . -> the overflow restarts the count: growth only after the last two
    assert _scales(".x..", initial_scale=8.0, min_scale=1.0, growth_interval=2, hysteresis=3) == [8, 8, 8, 16]


@pytest.mark.exercise("6.1")
def test_an_fp16_step_with_your_scaler_skips_and_halves_on_overflow():
    """A real fp16 optimizer step: its gradient made infinite, the step skipped, the scale your
    update gives (hysteresis 1: halved at once)."""
    import minimegatron.grad_scaler as grad_scaler
    from minimegatron.config import ModelConfig, TrainConfig
    from minimegatron.model import GPTModel
    from minimegatron.optim import Optimizer
    update = implementation("6.1")
    cfg = TrainConfig(lr_warmup_iters=0, fp16=True, initial_loss_scale=256.0, hysteresis=1)
    model = GPTModel(ModelConfig.llama(hidden_size=32, num_layers=1, num_attention_heads=4, max_position_embeddings=8,
                                       params_dtype="float16"))
    scaler = grad_scaler.build_grad_scaler(cfg)
    scaler.update = lambda found_inf: update(scaler, found_inf)
    optimizer = Optimizer([model], cfg, main_params_dtype=torch.float32, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    assert optimizer.step() is None and scaler.scale == 128.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a skipped step changed a parameter"


# --------------------------------------------------------------------------------------
# 6.2 an FP8 cast with its scale and saturation
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("6.2")
def test_casts_round_to_the_nearest_fp8_number():
    cast = implementation("6.2")
    one = torch.ones(())
    # 0.2 = 1.6 x 2^-3: e4m3's neighbours 1.5, 1.625 -> 0.203125; e5m2's 1.5, 1.75 -> 0.1875
    assert cast(torch.tensor([0.2]), one, "e4m3").float().item() == 0.203125
    assert cast(torch.tensor([0.2]), one, "e5m2").float().item() == 0.1875
    # 3 = 1.5 x 2^1 exactly in both; 100 = 1.5625 x 2^6: e4m3 ties to even (1.5 or 1.625 -> 1.5? 1.5625
    # is the midpoint, the even mantissa is 1.5 = 0b100) -> 96; e5m2 (1.5, 1.75) -> 96
    assert cast(torch.tensor([3.0, 100.0]), one, "e4m3").float().tolist() == [3.0, 96.0]
    assert cast(torch.tensor([3.0, 100.0]), one, "e5m2").float().tolist() == [3.0, 96.0]


@pytest.mark.exercise("6.2")
def test_the_scale_multiplies_before_the_cast_and_the_result_is_an_fp8_tensor():
    cast = implementation("6.2")
    x = torch.tensor([[0.01, -0.02], [0.005, 0.0]], dtype=torch.bfloat16)
    out = cast(x, torch.tensor(22400.0), "e4m3")     # 0.02 x 22400 = 448: the format's top
    assert out.dtype == torch.float8_e4m3fn and out.shape == x.shape
    # bf16 0.01 is 0.010009765625, x 22400 = 224.21875 -> e4m3 spacing 16 at 2^7: 224
    assert out.float().tolist() == [[224.0, -448.0], [112.0, 0.0]], out.float().tolist()
    assert cast(torch.tensor([0.02]), torch.tensor(22400.0), "e5m2").dtype == torch.float8_e5m2


@pytest.mark.exercise("6.2")
def test_values_beyond_the_format_saturate_never_overflow():
    cast = implementation("6.2")
    big = torch.tensor([1e6, -1e6, float("inf")])
    e4m3 = cast(big, torch.ones(()), "e4m3").float()
    e5m2 = cast(big, torch.ones(()), "e5m2").float()
    assert e4m3.tolist() == [448.0, -448.0, 448.0], e4m3.tolist()
    assert e5m2.tolist() == [57344.0, -57344.0, 57344.0], f"{e5m2.tolist()}: e5m2 has an inf; clamp before the cast"


# --------------------------------------------------------------------------------------
# 6.3 delayed scaling's amax-history update
# --------------------------------------------------------------------------------------
@pytest.mark.exercise("6.3")
def test_the_max_algo_reads_the_whole_history_and_the_history_rolls():
    update = implementation("6.3")
    history = torch.tensor([4.0, 0.0, 2.0])        # slot 0 the newest amax, 2 an older one
    scale = torch.tensor(1.0)
    new, rolled = update(history, scale, 448.0, 0, "max")
    assert new.item() == 112.0, f"max(4, 0, 2) = 4: 448 / 4 = 112, got {new.item()}"
    assert rolled.tolist() == [0.0, 2.0, 4.0], f"rolled by one, slot 0 cleared: got {rolled.tolist()}"
    assert history.tolist() == [4.0, 0.0, 2.0] and scale.item() == 1.0, "the inputs must not be modified"
    assert new.dtype == torch.float32


@pytest.mark.exercise("6.3")
def test_most_recent_and_the_margin():
    update = implementation("6.3")
    new, _ = update(torch.tensor([2.0, 8.0]), torch.tensor(1.0), 57344.0, 2, "most_recent")
    assert new.item() == 57344.0 / 2 / 4, f"the latest amax 2, margin 2: 57344 / 2 / 2^2 = 7168, got {new.item()}"


@pytest.mark.exercise("6.3")
@pytest.mark.parametrize("amax", [0.0, float("inf"), float("nan")])
def test_a_zero_or_non_finite_amax_keeps_the_scale(amax):
    update = implementation("6.3")
    new, rolled = update(torch.tensor([amax, 0.0]), torch.tensor(3.5), 448.0, 0, "most_recent")
    assert new.item() == 3.5, f"amax {amax}: the old scale stays, got {new.item()}"
    assert rolled[0].item() == 0.0


# --------------------------------------------------------------------------------------
# 6.4 spot the bug: the FP8 amax
# --------------------------------------------------------------------------------------
def _amaxes(parts: list) -> dict:
    """On each rank: its part of a tensor's amax through the exercise, over the whole world."""
    import torch.distributed as dist
    from minimegatron.comm import record_communication
    tensor_amax = implementation("6.4")
    with record_communication() as ledger:
        amax = tensor_amax(parts[dist.get_rank()], None, "fp8-amax")
    return {"amax": amax, "ledger": [(r.op, r.tag, r.nbytes) for r in ledger]}


@pytest.mark.exercise("6.4")
def test_every_rank_gets_the_whole_tensors_amax():
    parts = [torch.tensor([0.5, -3.0]), torch.tensor([[2.0, -7.5]], dtype=torch.float64)]   # the amax: 7.5
    for r in spawn(_amaxes, 2, parts, timeout=120):
        assert r["amax"].dtype == torch.float32 and r["amax"].dim() == 0, r["amax"]
        assert r["amax"].item() == 7.5, f"rank part amaxes 3.0 and 7.5: every rank needs 7.5, got {r['amax'].item()}"
        assert r["ledger"] == [("all_reduce", "fp8-amax", 4)], r["ledger"]


@pytest.mark.exercise("6.4")
def test_fp8_runs_with_your_amax_equal_the_fp8_single_device():
    model = ch06.tiny_model("fp8")
    runs = [ch06.make_run(model, "fp8", tp=2, sp=True, dp=2, fp8_recipe="tensorwise", steps=2),
            ch06.make_run(model, "fp8", cp=4, fp8_recipe="tensorwise", steps=2),
            ch06.make_run(model, "fp8", tp=2, cp=2, fp8_recipe="tensorwise", steps=2)]
    per_rank = spawn(plugged(_train_runs, "6.4"), 4, runs, timeout=400)
    for i, run in enumerate(runs):
        report = ch06.check_run(run, [r[i] for r in per_rank])
        assert report.ok, f"{run.name()} with your tensor_amax inside:\n" + "\n".join(report.lines + report.problems)


def _train_runs(runs):
    return [ch06.train_run(run) for run in runs]
